"""Runs a script as `python tests/support/audit_writes.py SCRIPT ARGS...` would run `python SCRIPT ARGS...`,
with an audit hook that prints `WRITE <event> <path>` on stderr for every file or folder it
creates, opens for writing, renames or deletes under the folder $AUDIT_DIR. test_distributed.py
uses it to check that only process 0 writes the run dir."""

import os
import runpy
import sys

ROOT = os.path.realpath(os.environ["AUDIT_DIR"])
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
PATH_EVENTS = ("os.rename", "os.replace", "os.remove", "os.unlink", "os.mkdir", "os.rmdir", "shutil.rmtree", "os.truncate")


def under_root(path) -> bool:
    if not isinstance(path, (str, bytes, os.PathLike)):
        return False  # a file descriptor
    return os.path.realpath(os.fsdecode(path)).startswith(ROOT)


def report_writes(event: str, args: tuple) -> None:
    if event == "open":
        path, mode, flags = args
        writes = any(char in (mode or "") for char in "wax+") or bool((flags or 0) & WRITE_FLAGS)
        paths = [path] if writes else []
    elif event in PATH_EVENTS:
        paths = [arg for arg in args[:2] if isinstance(arg, (str, bytes, os.PathLike))]
    else:
        return
    for path in paths:
        if under_root(path):
            sys.stderr.write(f"WRITE {event} {os.fsdecode(path)}\n")


sys.addaudithook(report_writes)
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.realpath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
