"""The ppo_support package beside the scripts: its layering (it never imports a script or a tool
of scripts/), and what a copy of a script needs to find it (the repository folder, or
`pip install -e`). Its modules' behaviour is tested once each, in the files of their subject:
envs in test_env_suites.py, rundir and nan_guard in test_fault_tolerance.py, evaluation and
videos in test_evaluation.py, logs in test_wandb.py and test_ppo_mlp.py, devices in
test_multi_device.py, cpu in test_ppo_lstm_impala.py and test_normalization.py."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

PACKAGE = ROOT / "ppo_support"
SCRIPTS = sorted(path.stem for path in ROOT.glob("*.py"))  # ppo_mlp, ppo_lstm_impala
TOOLS = sorted(path.stem for path in (ROOT / "scripts").glob("*.py"))


def imported_modules(path: Path) -> set[str]:
    """The top-level names of every module a file imports (relative imports as `.`)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." if node.level else node.module.partition(".")[0])
    return names


def test_the_package_imports_no_script_and_no_tool():
    assert SCRIPTS == ["ppo_lstm_impala", "ppo_mlp"] and "runlib" in TOOLS
    modules = sorted(PACKAGE.glob("*.py"))
    assert len(modules) >= 8
    for path in modules:
        forbidden = imported_modules(path) & {*SCRIPTS, *TOOLS, "ppo_support", "probe_envs", "helpers"}
        assert not forbidden, f"{path.name} imports {sorted(forbidden)}"
    # and at run time: importing every module loads no script and no tool
    code = (
        "import importlib, json, pkgutil, sys, ppo_support\n"
        "for module in pkgutil.iter_modules(ppo_support.__path__): importlib.import_module('ppo_support.' + module.name)\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # not tests/, not scripts/
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=PACKAGE)
    assert result.returncode == 0, result.stderr
    loaded = set(json.loads(result.stdout.splitlines()[-1]))
    assert {f"ppo_support.{path.stem}" for path in modules if path.stem != "__init__"} <= loaded
    assert not loaded & {*SCRIPTS, *TOOLS}


def test_each_package_module_stays_short():
    """One concern per module, each readable in a sitting (the package issue asked for about 400
    lines at most)."""
    for path in PACKAGE.glob("*.py"):
        assert len(path.read_text().splitlines()) <= 420, path.name


def without_the_repository(env: dict[str, str]) -> dict[str, str]:
    """The environment of a shell outside the repository: no PYTHONPATH (conftest.py adds the
    repository and tests/ to it)."""
    return {name: value for name, value in env.items() if name != "PYTHONPATH"}


@pytest.mark.parametrize("script", ["ppo_mlp.py", "ppo_lstm_impala.py"])
def test_a_copy_elsewhere_says_how_to_install_the_package_and_runs_once_it_can_import_it(script, tmp_path):
    copy = tmp_path / "my_ppo.py"
    copy.write_text((ROOT / script).read_text())
    bare = without_the_repository(os.environ)
    installed = subprocess.run([sys.executable, "-c", "import ppo_support"], capture_output=True, cwd=tmp_path, env=bare)
    if installed.returncode == 0:
        pytest.skip("ppo_support is installed in this Python (pip install -e): a copy finds it anywhere")
    result = subprocess.run([sys.executable, str(copy), "--help"], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path, env=bare)
    assert result.returncode == 2 and result.stdout == "" and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: my_ppo.py imports ppo_support") and "pip install -e" in lines[0]
    # what `pip install -e <repository>` provides: the package on the import path
    result = subprocess.run([sys.executable, str(copy), "--help"], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path, env={**bare, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0 and "--num-parallel-envs" in result.stdout, result.stderr


def test_a_copy_in_the_repository_folder_needs_no_install(tmp_path):
    """`python my_ppo.py` beside ppo_mlp.py and ppo_support/ (here a copy of the repository's
    folder): Python puts the script's folder on the import path."""
    import shutil

    folder = tmp_path / "repository"
    shutil.copytree(PACKAGE, folder / "ppo_support", ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "my_ppo.py").write_text((ROOT / "ppo_mlp.py").read_text())
    result = subprocess.run([sys.executable, str(folder / "my_ppo.py"), "--help"], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path, env=without_the_repository(os.environ))
    assert result.returncode == 0 and "--num-parallel-envs" in result.stdout, result.stderr


def test_pyproject_installs_the_package_with_its_version():
    """pip install -e <repository> installs ppo_support, versioned by ppo_support.__version__."""
    import tomllib

    import ppo_support

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["tool"]["setuptools"]["packages"] == ["ppo_support"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "ppo_support.__version__"}
    assert ppo_support.__version__.count(".") == 2
