"""Which code wrote a run, and which code a run may make a tool import: the script's file and its
SHA-256, this package's version, git commit and hash (args.json records them, rundir.write_args),
and the check that a custom env module named by a run dir's args.json lies outside every run dir."""

from __future__ import annotations

import functools
import glob
import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any

from . import __version__
from .errors import ConfigError


def script_path(args: Any) -> Path:
    """The file of the script whose Args `args` is (an instance or the class itself)."""
    args_class = args if isinstance(args, type) else type(args)
    return Path(sys.modules[args_class.__module__].__file__).resolve()


def script_info(args: Any) -> dict[str, Any]:
    """Which code wrote a run: the script (args.json records it, so that the tools in scripts/
    load this file, or a renamed copy of it, to read the run) and the SHA-256 of the file as this
    process read it (script_source; its copy is RUN_DIR/code/<script>), and this package's
    version, the git commit of its checkout ("-dirty" when its tracked files differ; None outside
    one) and the hash of its files (package_sha256), which holds outside git too."""
    path = script_path(args)
    package_git = git_info(Path(__file__).resolve().parent)
    commit = package_git.get("git_commit")
    if commit and package_git.get("git_dirty"):
        commit += "-dirty"
    return {"script": path.name, "script_path": str(path), "script_sha256": sha256(script_source(path)),
            "ppo_support_version": __version__, "ppo_support_commit": commit, "ppo_support_sha256": package_sha256()}


@functools.cache
def script_source(path: Path) -> bytes:
    """The script file's bytes, read once per process: a session reads them before it compiles,
    so an edit made while the run compiles or trains is not what the run dir records."""
    return Path(path).read_bytes()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@functools.cache
def package_sha256() -> str:
    """SHA-256 over this package's .py files, sorted by name: each file's name, a NUL byte, its
    bytes and a NUL byte."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def git_info(path: Path) -> dict[str, Any]:
    """The commit of the git checkout that holds `path` (a file or a folder), and whether its
    tracked files differ from it; empty outside a checkout, or without git."""
    folder = path if path.is_dir() else path.parent

    def git(*words: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *words], cwd=folder, capture_output=True, text=True, timeout=10)

    try:
        commit, status = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):  # no git, or it hangs
        return {}
    if commit.returncode != 0 or status.returncode != 0:
        return {}
    return {"git_commit": commit.stdout.strip(), "git_dirty": bool(status.stdout.strip())}


def check_env_module_outside_run_dirs(env_id: str, args_path: Path) -> None:
    """A custom env id (`module.path:Name`) read from a run's args.json is imported only if its
    module lies outside every run dir: a module file, or a package folder on its way, inside a
    folder that holds an args.json is refused in one line, before anything is imported. The tools
    never run code that a run dir carries."""
    module_name = env_id.partition(":")[0] if ":" in env_id else ""
    for found in module_locations(module_name) if module_name else []:
        folder = found if found.is_dir() else found.parent
        for inside in [folder, *folder.parents]:
            if (inside / "args.json").is_file():
                raise ConfigError(
                    f"{args_path}: --env-id {env_id} names the module {found}, which lies inside the run dir "
                    f"{inside}; the tools do not import a run dir's code: install the env's module, or put its folder "
                    "on PYTHONPATH outside every run dir"
                )


def module_locations(module_name: str) -> list[Path]:
    """Every file or folder that Python's path search could take for `module_name` or for one of
    its parent packages, in every sys.path entry: found without importing anything."""
    parts = module_name.split(".")
    found = []
    for entry in sys.path:
        top = Path(entry or ".").resolve()
        for depth in range(len(parts), 0, -1):  # the module itself first, then its packages
            stem = top.joinpath(*parts[:depth])
            found += [path for path in [stem, *stem.parent.glob(f"{glob.escape(parts[depth - 1])}.*")] if path.exists()]
    return found
