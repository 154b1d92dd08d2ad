"""Checks that the test suite catches realistic PPO bugs: applies each patch of this folder (one
bug each) to a scratch copy of the repository, runs the tests named on the patch's `Tests:` line
there, and reports whether they failed (caught) or passed (missed). Not part of the default test
command; see docs/testing.md.

    python tests/mutations/run.py                  # every patch
    python tests/mutations/run.py 03 05            # the patches whose names start with these
    python tests/mutations/run.py --clean          # first, the same tests on an unpatched copy

Exit code 0 when every bug was caught (and, with --clean, the unpatched copy passed), else 1.
The copy holds the files git tracks plus untracked, not ignored ones, as they are on disk.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def tests_of(patch: Path) -> list[str]:
    """The pytest arguments on the patch's `Tests:` line."""
    for line in patch.read_text().splitlines():
        if line.startswith("Tests:"):
            return shlex.split(line.removeprefix("Tests:"))
    raise SystemExit(f"error: {patch.name} has no 'Tests:' line")


def scratch_copy(folder: Path) -> Path:
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode().split("\0")
    copy = folder / "repo"
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    return copy


def run_tests(copy: Path, tests: list[str]) -> tuple[bool, list[str], float]:
    """Runs the tests in the copy: (passed, the ids of failed tests, seconds)."""
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *tests],
        cwd=copy, capture_output=True, text=True,
    )
    failed = [line.split()[1] for line in result.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    return result.returncode == 0, failed, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prefixes", nargs="*", help="only the patches whose names start with these")
    parser.add_argument("--clean", action="store_true", help="first run each patch's tests on an unpatched copy")
    options = parser.parse_args()
    patches = sorted(p for p in HERE.glob("*.patch") if not options.prefixes or p.name.startswith(tuple(options.prefixes)))
    if not patches:
        print(f"error: no patch in {HERE} starts with {' or '.join(options.prefixes)}", file=sys.stderr)
        return 2
    rows, ok = [], True
    with tempfile.TemporaryDirectory() as folder:
        clean = scratch_copy(Path(folder) / "clean")
        if options.clean:
            for patch in patches:
                passed, failed, seconds = run_tests(clean, tests_of(patch))
                print(f"unpatched, {patch.name}'s tests: {'pass' if passed else 'FAIL ' + ' '.join(failed)} ({seconds:.0f} s)", flush=True)
                ok &= passed
        for patch in patches:
            copy = Path(folder) / patch.stem
            shutil.copytree(clean, copy)
            applied = subprocess.run(["git", "apply", str(patch)], cwd=copy, capture_output=True, text=True)
            if applied.returncode != 0:
                print(f"error: {patch.name} does not apply: {applied.stderr.strip()}", file=sys.stderr)
                return 2
            passed, failed, seconds = run_tests(copy, tests_of(patch))
            verdict = "MISSED" if passed else "caught"
            ok &= not passed
            rows.append((patch.name, verdict, ", ".join(failed) or "-", seconds))
            print(f"{patch.name}: {verdict} ({seconds:.0f} s)", flush=True)
            shutil.rmtree(copy)
    print("\n| patch | verdict | failing tests | seconds |\n|---|---|---|---|")
    for name, verdict, failed, seconds in rows:
        print(f"| {name} | {verdict} | {failed} | {seconds:.0f} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
