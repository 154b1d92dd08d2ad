"""Throughput benchmark: runs a script on named configurations and prints a markdown table.

    python scripts/benchmark.py --script ppo_mlp.py                 # every ppo_mlp.py config
    python scripts/benchmark.py --script ppo_mlp.py --configs cartpole --repeats 3
    python scripts/benchmark.py --script ppo_lstm_impala.py --out bench.md
    python scripts/benchmark.py --script ppo_lstm_impala.py --configs gpu --out gpu.md   # on a GPU
    python scripts/benchmark.py --script ppo_mlp.py --configs cartpole --repeats 5 --against ../old   # A/B
    python scripts/benchmark.py --script ~/exp/my_ppo.py --configs-of ppo_mlp.py --configs cartpole   # a copy

Each run is a separate process (so compile caches and memory do not leak between runs) and
reports what the script itself wrote in summary.json: env steps/s over all seeds after
compilation, compile seconds, final return, peak resident memory and peak accelerator memory
(none on CPU), and what one seed's default run (--num-total-env-steps) would take at that rate,
compile included. `--configs gpu` is the set prepared for a GPU: the LSTM defaults with 1 and 8
seeds and 1 seed x 2048 envs. Timings are not asserted anywhere: this is for docs/performance.md.

--against DIR compares this checkout with another one (e.g. `git worktree add ../old COMMIT`):
each of --repeats rounds runs the config with DIR's script and with this one, in turn, the order
turning each round, and the table gives the median env steps/s of each, the median of the
per-round ratios (this / DIR) and the lowest and highest round: this VM's speed drifts over
minutes, so only ratios taken within a round can tell a few percent apart.

--script is a script of this repository or the path of a copy anywhere; a copy runs the configs
of the script it was copied from (--configs-of), and with --against DIR, DIR's file of its name.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runlib import machine_description, run_config, script_file  # noqa: E402

# name -> flags. The CartPole config is PureJaxRL's ppo.py default (4 envs x 128 steps,
# 4 epochs x 4 minibatches, 500k steps). The Breakout configs are ppo_lstm_impala.py's defaults
# (256 envs x 128 steps) for one cycle: on a 2-core CPU one cycle takes minutes.
CONFIGS = {
    "ppo_mlp.py": {
        "cartpole": [],
        "cartpole-8-seeds": ["--num-seeds", "8"],
        "cartpole-256x128-8mb-5ep": [
            "--num-parallel-envs", "256", "--num-minibatches-per-epoch", "8", "--num-epochs-per-cycle", "5",
            "--num-total-env-steps", "2000000",
        ],
        "gpu-256-seeds-x-4-envs": ["--num-seeds", "256"],
        "gpu-1-seed-x-2048-envs": ["--num-parallel-envs", "2048", "--num-total-env-steps", "10000000"],
        # 16 learning rates x 16 seeds in one program (--sweep)
        "gpu-sweep-16-lrs-x-16-seeds": ["--num-seeds", "16", "--sweep", "lr=" + ",".join(
            f"{value:g}" for value in [5e-5, 1e-4, 1.5e-4, 2e-4, 2.5e-4, 3e-4, 4e-4, 5e-4, 7e-4, 1e-3, 1.5e-3, 2e-3, 3e-3,
                                       5e-3, 7e-3, 1e-2])],
    },
    "ppo_lstm_impala.py": {
        "breakout-defaults-bptt": ["--num-total-env-steps", "32768"],
        # the same for 3 cycles: its peak RSS against the 1-cycle run's shows memory does not grow with the budget
        "breakout-defaults-bptt-3-cycles": ["--num-total-env-steps", "98304"],
        "breakout-defaults-stored": ["--num-total-env-steps", "32768", "--lstm-training", "stored"],
        "breakout-defaults-ff": ["--num-total-env-steps", "32768", "--lstm-size", "0"],
        "breakout-quarter-bptt": ["--num-total-env-steps", "32768", "--num-parallel-envs", "64"],
        "breakout-quarter-bptt-2-seeds": ["--num-total-env-steps", "16384", "--num-parallel-envs", "64", "--num-seeds", "2"],
        # GPU: 20 cycles of the defaults (655k env steps) is enough for a steady rate
        "gpu-defaults": ["--num-total-env-steps", "655360"],
        "gpu-defaults-8-seeds": ["--num-total-env-steps", "655360", "--num-seeds", "8"],
        "gpu-1-seed-x-2048-envs": ["--num-total-env-steps", "5242880", "--num-parallel-envs", "2048"],
    },
}
GPU_CONFIGS = {
    "ppo_mlp.py": ["gpu-256-seeds-x-4-envs", "gpu-1-seed-x-2048-envs", "gpu-sweep-16-lrs-x-16-seeds"],
    "ppo_lstm_impala.py": ["gpu-defaults", "gpu-defaults-8-seeds", "gpu-1-seed-x-2048-envs"],
}
DEFAULT_RUN_ENV_STEPS = {"ppo_mlp.py": 500_000, "ppo_lstm_impala.py": 20_000_000}  # each script's --num-total-env-steps
CPU_CONFIGS = {
    "ppo_mlp.py": ["cartpole", "cartpole-8-seeds", "cartpole-256x128-8mb-5ep"],
    "ppo_lstm_impala.py": ["breakout-defaults-bptt", "breakout-defaults-stored", "breakout-defaults-ff"],
}


def best_row(script: Path, kind: str, name: str, flags: list[str], repeats: int) -> tuple[str, dict]:
    """The markdown row of a config's best of `repeats` runs, and that run's summary; `kind`: the
    script whose configs these are."""
    summaries = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as folder:
            summaries.append(run_config(str(script), flags, Path(folder) / "run"))
    best = max(summaries, key=lambda summary: summary["sps"])
    final, device_mb = best.get("final_episodic_return"), best.get("peak_device_memory_mb")
    if "points" in best:  # a --sweep: its best point's
        final = max((point["final_episodic_return"] for point in best["points"] if point["final_episodic_return"] is not None),
                    default=None)
    per_seed_sps = best["sps"] / best["num_seeds"]
    default_run_hours = (best["compile_seconds"] + DEFAULT_RUN_ENV_STEPS[kind] / per_seed_sps) / 3600
    return (
        f"| {name} | `{' '.join(flags) or '(defaults)'}` | {best['sps']:,.0f} | {best['compile_seconds']:.1f} | "
        f"{'-' if final is None else f'{final:.1f}'} | {best['peak_rss_mb']:.0f} | "
        f"{'-' if device_mb is None else f'{device_mb:,.0f}'} | {default_run_hours:.2f} h |"
    ), best


def against_row(script: Path, name: str, flags: list[str], repeats: int, other: Path) -> tuple[str, dict]:
    """The markdown row of a config run `repeats` rounds, this script and `other` (another
    checkout's file of the same name) in turn, and the summary of this script's last run."""
    speeds: dict[str, list[float]] = {"this": [], "other": []}
    compiles: dict[str, list[float]] = {"this": [], "other": []}
    summaries: dict[str, dict] = {}
    scripts = [("this", script), ("other", other)]
    for round_ in range(repeats):
        for label, path in scripts[round_ % 2:] + scripts[: round_ % 2]:  # the order turns each round
            with tempfile.TemporaryDirectory() as folder:
                summary = run_config(str(path), flags, Path(folder) / "run")
            speeds[label].append(summary["sps"])
            compiles[label].append(summary["compile_seconds"])
            summaries[label] = summary
        print(f"{name} round {round_ + 1}: this {speeds['this'][-1]:,.0f}, other {speeds['other'][-1]:,.0f} env steps/s",
              file=sys.stderr, flush=True)
    ratios = [this / other for this, other in zip(speeds["this"], speeds["other"])]
    median = {label: statistics.median(values) for label, values in speeds.items()}
    return (
        f"| {name} | `{' '.join(flags) or '(defaults)'}` | {median['this']:,.0f} | {median['other']:,.0f} | "
        f"{statistics.median(ratios):.3f}x | {min(ratios):.3f}x-{max(ratios):.3f}x | "
        f"{statistics.median(compiles['this']):.1f} / {statistics.median(compiles['other']):.1f} |"
    ), summaries["this"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--script", required=True, help="ppo_mlp.py, ppo_lstm_impala.py, or the path of a copy of one")
    parser.add_argument("--configs-of", choices=sorted(CONFIGS),
                        help="whose configs a copy runs (default: the script's own file name)")
    parser.add_argument("--configs", nargs="+", help="names of configs, or `gpu` for the GPU set (default: the CPU set)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per config; the table shows the best SPS")
    parser.add_argument("--against", type=Path, metavar="DIR",
                        help="another checkout: alternate rounds of its script and this one's, and compare")
    parser.add_argument("--out", type=Path, help="also write the markdown table here")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="flags passed to every run, after --")
    options = parser.parse_args()
    try:
        script = script_file(options.script)
    except FileNotFoundError as error:
        parser.error(str(error))
    kind = options.configs_of or script.name
    if kind not in CONFIGS:
        parser.error(f"--configs-of: {script.name} is not {' or '.join(sorted(CONFIGS))}; name the script it was copied from")
    names = options.configs or CPU_CONFIGS[kind]
    if names == ["gpu"]:
        names = GPU_CONFIGS[kind]
    unknown = [name for name in names if name not in CONFIGS[kind]]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; choose from {sorted(CONFIGS[kind])}")
    if options.repeats < 1:
        parser.error("--repeats must be >= 1")
    if options.against is not None and not (options.against / script.name).is_file():
        parser.error(f"--against {options.against}: no {script.name} there")
    extra = [flag for flag in options.extra if flag != "--"]

    command = " ".join(["python scripts/benchmark.py", *sys.argv[1:]])
    if options.against is None:
        lines = [
            f"| config | flags | env steps/s (all seeds) | compile s | final return | peak RSS MB | peak device MB | "
            f"one seed's {DEFAULT_RUN_ENV_STEPS[kind]:,} env steps at this rate |",
            "|---|---|---|---|---|---|---|---|",
        ]
    else:
        lines = [
            f"| config | flags | this checkout, median env steps/s | {options.against}, median env steps/s | "
            "this / that (median of rounds) | lowest-highest round | compile s (this / that) |",
            "|---|---|---|---|---|---|---|",
        ]
    for name in names:
        flags = CONFIGS[kind][name] + extra
        if options.against is None:
            row, summary = best_row(script, kind, name, flags, options.repeats)
        else:
            row, summary = against_row(script, name, flags, options.repeats, options.against / script.name)
        lines.append(row)
        print(row, flush=True)
    lines[:0] = [f"`{script.name}` on {machine_description(summary)}, {datetime.date.today().isoformat()}: `{command}`", ""]
    table = "\n".join(lines)
    print("\n" + table)
    if options.out:
        options.out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
