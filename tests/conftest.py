"""Puts the repo root (the scripts) and this folder (probe_envs) on the import path."""

import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
for path in (str(ROOT), str(TESTS)):
    if path not in sys.path:
        sys.path.insert(0, path)
# Subprocess runs of the scripts find probe_envs the same way.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), str(ROOT), os.environ.get("PYTHONPATH")]))

# In-process tests get the CPU setting that run() applies, before JAX starts its backend.
import ppo_mlp  # noqa: E402

ppo_mlp.avoid_cpu_qr_deadlock()
