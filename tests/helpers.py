"""What several test files share: running a script in a subprocess.

Not a test module: the test files import it (conftest.py puts this folder on sys.path).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_script(
    path_or_name: str | Path,
    *arguments: str,
    timeout: float = 600,
    cwd: str | Path = ROOT,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Runs a script with this Python and returns its exit code and text output. A relative path
    is taken from the repo root ("ppo_mlp.py", "scripts/plot.py"), an absolute one as it is."""
    command = [sys.executable, str(ROOT / path_or_name), *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
