"""Puts the repo root (the scripts and ppo_support) and tests/support (the helpers, the reference
code and probe_envs) on the import path."""

import os
import sys
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent / "support"
ROOT = SUPPORT.parent.parent
for path in (str(ROOT), str(SUPPORT)):
    if path not in sys.path:
        sys.path.insert(0, path)
# Subprocess runs of the scripts find probe_envs and ppo_support the same way.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SUPPORT), str(ROOT), os.environ.get("PYTHONPATH")]))

# Every test of this session, in this process and in the processes it starts, shares one JAX
# compilation cache (helpers.py): what one test compiled, the next one loads. Before JAX is imported.
from helpers import TEST_XLA_FLAGS, use_the_sessions_compilation_cache  # noqa: E402

use_the_sessions_compilation_cache()

# In-process tests get the CPU setting that run() applies, before JAX starts its backend; every
# test, in this process and in the processes it starts, compiles at LLVM -O1 (helpers.py).
from ppo_support import cpu  # noqa: E402

cpu.avoid_cpu_qr_deadlock()
cpu.add_xla_flag(*TEST_XLA_FLAGS.split("="))
