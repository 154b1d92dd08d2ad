"""Grid sweep over the batch shape: one run per combination of parallel envs, steps per cycle and
minibatches per epoch.

    python scripts/sweep.py --script ppo_mlp.py --num-parallel-envs 32 64 --num-env-steps-per-cycle 64 128 \\
        --num-minibatches-per-epoch 1 8 --out-dir sweeps/batch -- --num-total-env-steps 200000

Each combination runs in its own subfolder of --out-dir (e.g. `envs32_steps64_mb8`) and counts as
finished once it holds summary.json; --resume skips finished runs. Combinations the script
rejects (exit 2, e.g. minibatches that do not divide the batch) are skipped and reported.
Writes DIR/sweep.csv, DIR/sweep.md (env steps/s over all seeds after compilation, compile
seconds, final return, peak memory) and DIR/return_vs_walltime.png. Flags after `--` go to
every run.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runlib import (  # noqa: E402
    AUTO_WINDOW, ROOT, check_out_dir, fmt, plot_runs, read_run, run_once, script_defaults, split_passthrough, wall_seconds,
)

# (Args field, folder-name prefix) of each swept axis.
AXES = (
    ("num_parallel_envs", "envs"),
    ("num_env_steps_per_cycle", "steps"),
    ("num_minibatches_per_epoch", "mb"),
    ("num_epochs_per_cycle", "ep"),
)
CSV_COLUMNS = [field for field, _ in AXES] + [
    "status", "sps", "compile_seconds", "total_seconds", "final_return", "peak_rss_mb", "run_dir",
]


def main(argv: list[str] | None = None) -> int:
    ours, extra = split_passthrough(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     usage="%(prog)s --script SCRIPT --out-dir DIR [axes] [--resume] [-- flags for every run]")
    parser.add_argument("--script", default="ppo_mlp.py", help="training script in the repo root")
    for field, _ in AXES:
        parser.add_argument("--" + field.replace("_", "-"), type=int, nargs="+", metavar="N",
                            help="values to sweep (default: the script's default only)")
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--resume", action="store_true", help="skip runs that already finished in --out-dir")
    options = parser.parse_args(ours)
    if not (ROOT / options.script).is_file():
        parser.error(f"--script {options.script}: no such file in {ROOT}")
    for field, _ in AXES:
        values = getattr(options, field)
        if values and min(values) <= 0:
            parser.error(f"--{field.replace('_', '-')} values must be positive integers, got {values}")
    error = check_out_dir(options.out_dir, options.resume)
    if error:
        parser.error(error)

    defaults = script_defaults(options.script)
    axes = [(field, prefix, getattr(options, field) or [defaults[field]]) for field, prefix in AXES]
    rows = []
    for combination in itertools.product(*[values for _, _, values in axes]):
        setting = {field: value for (field, _, _), value in zip(axes, combination)}
        name = "_".join(f"{prefix}{value}" for (_, prefix, _), value in zip(axes, combination))
        flags = [item for field, value in setting.items() for item in ("--" + field.replace("_", "-"), str(value))]
        result = run_once(options.script, flags, options.out_dir / name, extra)
        row = {**setting, "status": result.status, "run_dir": name}
        if result.status == "rejected":
            row["status"] = f"rejected: {result.message}"
            print(f"{name}: skipped, {options.script} rejects it: {result.message}", flush=True)
        else:
            summary = result.summary
            row.update(sps=summary["sps"], compile_seconds=summary["compile_seconds"], total_seconds=summary["total_seconds"],
                       final_return=summary["final_episodic_return"], peak_rss_mb=summary["peak_rss_mb"])
            print(f"{name} ({result.status}): {summary['sps']:,.0f} env steps/s, compile {summary['compile_seconds']:.1f} s, "
                  f"final return {fmt(summary['final_episodic_return'])}", flush=True)
        rows.append(row)

    options.out_dir.mkdir(parents=True, exist_ok=True)
    with open(options.out_dir / "sweep.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)

    swept = [(field, values) for field, _, values in axes if len(values) > 1] or [(axes[0][0], axes[0][2])]
    fixed = [f"`--{field.replace('_', '-')} {values[0]}`" for field, _, values in axes if len(values) == 1]
    lines = [
        f"Sweep of `{options.script}`, {datetime.date.today().isoformat()}; fixed: {', '.join(fixed) or 'nothing'}"
        f"{'; extra flags `' + ' '.join(extra) + '`' if extra else ''}. env steps/s counts all seeds, after compilation.",
        "",
        "| " + " | ".join(field.replace("_", " ") for field, _ in swept)
        + " | env steps/s | compile s | total s | final return | peak RSS MB |",
        "|" + "---|" * (len(swept) + 5),
    ]
    skipped = []
    for row in rows:
        if row["status"].startswith("rejected"):
            skipped.append(f"- {', '.join(f'{field}={row[field]}' for field, _ in swept)}: {row['status']}")
            continue
        lines.append(
            "| " + " | ".join(str(row[field]) for field, _ in swept)
            + f" | {fmt(row['sps'], 0)} | {fmt(row['compile_seconds'])} | {fmt(row['total_seconds'])} | "
            f"{fmt(row['final_return'])} | {fmt(row['peak_rss_mb'], 0)} |"
        )
    if skipped:
        lines += ["", "Skipped (rejected by the script, exit 2):", "", *skipped]
    (options.out_dir / "sweep.md").write_text("\n".join(lines) + "\n")

    finished = [row for row in rows if not row["status"].startswith("rejected")]
    if finished:
        runs = [read_run(options.out_dir / row["run_dir"]) for row in finished]
        plot_runs(runs, options.out_dir / "return_vs_walltime.png", labels=[row["run_dir"] for row in finished],
                  x_of=wall_seconds, x_label="wall-clock seconds (compilation included)",
                  window=AUTO_WINDOW)
    print("\n" + (options.out_dir / "sweep.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
