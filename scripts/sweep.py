"""Grid sweep, one process per combination: the batch shape (parallel envs, steps per cycle,
minibatches, epochs) and any other flag of the training script, a copy's own flags included.

    python scripts/sweep.py --script ppo_mlp.py --num-parallel-envs 32 64 --num-env-steps-per-cycle 64 128 \\
        --num-minibatches-per-epoch 1 8 --out-dir sweeps/batch -- --num-total-env-steps 200000
    python scripts/sweep.py --script ~/my_ppo.py --logit-l2-coef 0 1e-2 --hidden-sizes 64,64 256,256 --out-dir sweeps/mine

`--FLAG V1 V2 ...` sweeps any flag of the script's `Args` over the values given (a flag of several
values takes each as a comma-separated list, `--hidden-sizes 64,64 256,256`; a switch takes true and
false); the batch-shape axes not given keep the script's defaults. Use it for what one process's
`--sweep` cannot hold (shapes, the network, the env); `--sweep` trains the other values faster.
--script is a name in the repo root or the path of a copy anywhere.

Each combination runs in its own subfolder of --out-dir (e.g. `envs32_steps64_mb8_ep4`, then
`_ent-coef=0.01` for each other flag swept) and counts as finished once it holds summary.json;
--resume skips finished runs. Combinations the script rejects (exit 2, e.g. minibatches that do
not divide the batch) are skipped and reported. Writes DIR/sweep.csv, DIR/sweep.md (env steps/s
over all seeds after compilation, compile seconds, final return, peak memory) and
DIR/return_vs_walltime.png. Flags after `--` go to every run.
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
    AUTO_WINDOW, check_out_dir, flags_for, fmt, format_value, plot_runs, read_run, run_once, script_defaults, script_file,
    split_passthrough, wall_seconds,
)

# (Args field, folder-name prefix) of the batch-shape axes: every run's folder names their values.
AXES = (
    ("num_parallel_envs", "envs"),
    ("num_env_steps_per_cycle", "steps"),
    ("num_minibatches_per_epoch", "mb"),
    ("num_epochs_per_cycle", "ep"),
)
RESULT_COLUMNS = ["status", "sps", "compile_seconds", "total_seconds", "final_return", "peak_rss_mb", "run_dir"]


def sweep_value(name: str, text: str, default):
    """One value of `--NAME`, as flags_for writes it: a switch's true or false, a list's
    comma-separated items, any other value as given (the script checks it). ValueError for a
    switch given anything else."""
    if isinstance(default, bool):
        if text.lower() not in ("true", "false"):
            raise ValueError(f"--{name} is a switch: sweep it over true false, not {text!r}")
        return text.lower() == "true"
    if isinstance(default, (list, tuple)):
        return [item for item in text.split(",") if item]
    return text


def other_axes(tokens: list[str], defaults: dict, script: str) -> list[tuple[str, str, list]]:
    """(field, folder-name prefix, values) of each `--FLAG V1 V2 ...` among the tokens that are not
    sweep.py's own, each a field of the script's Args; ValueError naming the flag otherwise."""
    axes = []
    index = 0
    while index < len(tokens):
        if not tokens[index].startswith("--"):
            raise ValueError(f"unrecognized argument {tokens[index]!r}: give the values after their flag (--FLAG V1 V2 ...)")
        name, has_value, inline = tokens[index][2:].partition("=")
        texts = [inline] if has_value else []
        index += 1
        while index < len(tokens) and not tokens[index].startswith("--"):
            texts.append(tokens[index])
            index += 1
        field = name.replace("-", "_")
        if field not in defaults:
            raise ValueError(f"--{name}: {script} has no such flag (sweep.py takes any field of its Args)")
        if not texts:
            raise ValueError(f"--{name}: give the values to sweep, --{name} V1 V2 ...")
        if any(field == other for other, _, _ in axes):
            raise ValueError(f"--{name} is given twice: give all its values after one --{name}")
        axes.append((field, f"{name}=", [sweep_value(name, text, defaults[field]) for text in texts]))
    return axes


def main(argv: list[str] | None = None) -> int:
    ours, extra = split_passthrough(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
                                     usage="%(prog)s --script SCRIPT --out-dir DIR [--FLAG V1 V2 ...] [--resume] [-- flags for every run]")
    parser.add_argument("--script", default="ppo_mlp.py",
                        help="the training script: a name in the repo root, or the path of a copy anywhere")
    for field, _ in AXES:
        parser.add_argument("--" + field.replace("_", "-"), type=int, nargs="+", metavar="N",
                            help="values to sweep (default: the script's default only)")
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--resume", action="store_true", help="skip runs that already finished in --out-dir")
    options, others = parser.parse_known_args(ours)
    try:
        script = str(script_file(options.script))
    except FileNotFoundError as error:
        parser.error(str(error))
    for field, _ in AXES:
        values = getattr(options, field)
        if values and min(values) <= 0:
            parser.error(f"--{field.replace('_', '-')} values must be positive integers, got {values}")
    defaults = script_defaults(script)
    try:
        more_axes = other_axes(others, defaults, options.script)
    except ValueError as error:
        parser.error(str(error))
    error = check_out_dir(options.out_dir, options.resume)
    if error:
        parser.error(error)

    axes = [(field, prefix, getattr(options, field) or [defaults[field]]) for field, prefix in AXES] + more_axes
    csv_columns = [field for field, _, _ in axes] + RESULT_COLUMNS
    rows = []
    for combination in itertools.product(*[values for _, _, values in axes]):
        setting = {field: value for (field, _, _), value in zip(axes, combination)}
        name = "_".join(f"{prefix}{format_value(value)}" for (_, prefix, _), value in zip(axes, combination)).replace("/", "_")
        flags = [item for field, value in setting.items() for item in flags_for(field, value)]
        result = run_once(script, flags, options.out_dir / name, extra)
        row = {**{field: format_value(value) for field, value in setting.items()}, "status": result.status, "run_dir": name}
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
        writer = csv.DictWriter(file, fieldnames=csv_columns)
        writer.writeheader()
        writer.writerows(rows)

    swept = [(field, values) for field, _, values in axes if len(values) > 1] or [(axes[0][0], axes[0][2])]
    fixed = [f"`--{field.replace('_', '-')} {format_value(values[0])}`" for field, _, values in axes if len(values) == 1]
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
