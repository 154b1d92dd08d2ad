"""A --sweep in one process against the same points run as one process each, in a row: wall time,
with start-up, compile and training reported separately. Prints a markdown table.

    python scripts/bench_sweep.py --script ppo_mlp.py --sweep lr=1e-4,2e-4,3e-4,5e-4,1e-3,2e-3,3e-3,5e-3
    python scripts/bench_sweep.py --script ppo_lstm_impala.py --sweep lr=1e-4,3e-4,1e-3,3e-3 -- --num-parallel-envs 32

Flags after `--` go to every run. Each run's compile and training seconds are what its
summary.json holds (compile: from the start of its session to a compiled program, init
included); start-up is the rest of its wall time (imports, env construction, writing results).
Timings are not asserted anywhere: this is for docs/performance.md.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed_run(script: str, flags: list[str], run_dir: Path) -> dict:
    """One training process: its wall time and its summary.json's compile and training seconds."""
    command = [sys.executable, str(ROOT / script), *flags, "--run-dir", str(run_dir)]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"error: {' '.join(command)} failed:\n{result.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    compile_seconds, train_seconds = summary["compile_seconds"], summary["train_seconds"]
    return {"wall": wall, "compile": compile_seconds, "train": train_seconds, "startup": wall - compile_seconds - train_seconds}


def point_flags(sweep: list[str]) -> list[list[str]]:
    """Each point of the grid as the flags of a run of its own."""
    keys, values = [], []
    for entry in sweep:
        key, _, text = entry.partition("=")
        keys.append(key)
        values.append(text.split(","))
    points = []
    for combination in itertools.product(*values):
        flags = []
        for key, value in zip(keys, combination):
            if value.lower() in ("true", "false"):
                flags.append(f"--{key}" if value.lower() == "true" else f"--no-{key}")
            else:
                flags += [f"--{key}", value]
        points.append(flags)
    return points


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--script", default="ppo_mlp.py")
    parser.add_argument("--sweep", nargs="+", required=True, help="KEY=V1,V2,... as the script's --sweep takes it")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    options = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as folder:
        swept = timed_run(options.script, [*extra, "--sweep", *options.sweep], Path(folder) / "sweep")
        alone = [timed_run(options.script, [*extra, *flags], Path(folder) / f"point-{index}")
                 for index, flags in enumerate(point_flags(options.sweep))]
    total = {part: sum(run[part] for run in alone) for part in ("wall", "startup", "compile", "train")}
    command = " ".join(["python scripts/bench_sweep.py --script", options.script, "--sweep", *options.sweep,
                        *(["--", *extra] if extra else [])])
    lines = [
        f"`{command}` ({datetime.date.today()}, {platform.node()}, {platform.processor() or platform.machine()})",
        "",
        "| | wall s | start-up s | compile s | training s |",
        "|---|---:|---:|---:|---:|",
        f"| `--sweep`, one process | {swept['wall']:.1f} | {swept['startup']:.1f} | {swept['compile']:.1f} | {swept['train']:.1f} |",
        f"| {len(alone)} processes in a row | {total['wall']:.1f} | {total['startup']:.1f} | {total['compile']:.1f} | {total['train']:.1f} |",
        f"| ratio | **{swept['wall'] / total['wall']:.2f}** | | | |",
    ]
    table = "\n".join(lines)
    print(table)
    if options.out:
        options.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
