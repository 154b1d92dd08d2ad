"""Compares finished run dirs: each run's final score per seed, its IQM with a bootstrap confidence
interval, and the probability that it improves on the first run.

    python scripts/compare.py runs/baseline runs/my_idea --out compare.png
    python scripts/compare.py runs/a runs/b runs/c --metric losses/approx_kl --labels PPO "PPO+aux" "PPO+aux, lr/2"
    python scripts/compare.py runs/lr_sweep                       # a --sweep's run dir: its points

Any number of seeds per run. A --sweep's run dir counts as its points, in order; the first run
(the first point of a first --sweep) is the baseline. Final score: per seed, the mean of --metric
over the last 10% of logged cycles (as summary.json's final return; cycles without a value left
out). Then, as Agarwal et al. (2021) recommend (the statistics in runlib.py): the interquartile mean
(IQM) over seeds with a 95% percentile bootstrap CI (2000 resamples of the seeds, fixed RNG seed),
and P(run > first), the chance that a random seed of the run beats a random seed of the first
(ties count half), with its bootstrap CI. A run is marked `higher` or `lower` only when its IQM's
CI excludes the first run's IQM. Prints a markdown table; --out also draws it (learning curves, the
IQMs and the probabilities).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runlib import (  # noqa: E402
    IMAGE_SUFFIXES,
    Comparison,
    Run,
    compare_scores,
    env_ids,
    final_scores,
    format_probability,
    has_metric,
    label_axes,
    legend_below,
    logged_metrics,
    mean_std,
    plot_metric,
    pyplot,
    read_run_dirs,
    run_labels,
    save_figure,
)

STATISTICS_NOTE = (
    "Final: per seed, the mean over the last 10% of logged cycles. IQM: the mean of the middle 50% of seeds (int(n/4) "
    "cut from each end), with a 95% percentile bootstrap CI over seeds; P(> first): the probability that a random "
    "seed of the run beats one of the first run (ties count half), with its 95% bootstrap CI (Agarwal et al. 2021). "
    "higher / lower: the IQM's CI excludes the first run's IQM."
)


class Row(NamedTuple):
    run: Run
    label: str
    scores: np.ndarray  # final score per seed, seeds without one left out
    comparison: Comparison


def compare_runs(runs: list[Run], labels: list[str], metric: str) -> list[Row]:
    """One row per run: its final scores and their statistics against the first run's."""
    scores = [final_scores(run, metric) for run in runs]
    return [Row(run, label, run_scores, compare_scores(run_scores, scores[0], index == 0))
            for index, (run, label, run_scores) in enumerate(zip(runs, labels, scores))]


def number(value: float) -> str:
    return "-" if not math.isfinite(value) else f"{value:.4g}"


def table(rows: list[Row], metric: str) -> str:
    lines = [f"{metric} of {len(rows)} runs on {env_ids([row.run for row in rows]) or 'an unnamed env'}; "
             f"the first, {rows[0].label}, is the baseline.", "",
             "| run | label | seeds | final (mean ± std) | IQM [95% CI] | P(> first) [95% CI] | finding |",
             "|---|---|---|---|---|---|---|"]
    for index, row in enumerate(rows):
        mean, std = mean_std(row.scores)
        comparison = row.comparison
        cells = [str(row.run.path), row.label, str(row.scores.size), f"{number(mean)} ± {number(std)}",
                 f"{number(comparison.iqm)} [{number(comparison.iqm_ci[0])}, {number(comparison.iqm_ci[1])}]",
                 "-" if index == 0 else format_probability(comparison.p_improve, comparison.p_improve_ci),
                 "-" if index == 0 else comparison.finding]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", STATISTICS_NOTE])


def draw(rows: list[Row], metric: str, out: Path, title: str | None) -> None:
    """Three panels: the learning curves (mean ± std over seeds), each run's IQM with its CI, and
    each run's P(> first) with its CI."""
    plt = pyplot()
    figure, (curves, iqms, improvements) = plt.subplots(1, 3, figsize=(13, 3.6 + 0.15 * len(rows)),
                                                        gridspec_kw={"width_ratios": [2, 1, 1]})
    plot_metric(curves, [row.run for row in rows], [row.label for row in rows], metric, "std")
    label_axes(curves, "env steps (per seed)", metric)
    positions = np.arange(len(rows))[::-1]
    colors = [line.get_color() for line in curves.get_lines()]
    colors = colors if len(colors) == len(rows) else [None] * len(rows)  # a run without a value draws no curve
    for position, row, color in zip(positions, rows, colors):
        comparison = row.comparison
        iqms.errorbar(comparison.iqm, position, xerr=[[comparison.iqm - comparison.iqm_ci[0]], [comparison.iqm_ci[1] - comparison.iqm]],
                      fmt="o", color=color, capsize=3)
        if row is not rows[0]:
            improvements.errorbar(comparison.p_improve, position, fmt="o", color=color, capsize=3,
                                  xerr=[[comparison.p_improve - comparison.p_improve_ci[0]],
                                        [comparison.p_improve_ci[1] - comparison.p_improve]])
    iqms.axvline(rows[0].comparison.iqm, color="gray", linestyle="--", linewidth=0.8)
    improvements.axvline(0.5, color="gray", linestyle="--", linewidth=0.8)
    improvements.set_xlim(0, 1)
    for ax, x_label in [(iqms, f"IQM of the final {metric} [95% CI]"), (improvements, "P(run > first) [95% CI]")]:
        ax.set_yticks(positions, [row.label for row in rows], fontsize=7)
        ax.set_ylim(-0.5, len(rows) - 0.5)
        ax.set_xlabel(x_label, fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(axis="x", alpha=0.3)
    improvements.tick_params(axis="y", labelleft=False)
    figure.suptitle(env_ids([row.run for row in rows]) if title is None else title, fontsize=10)
    figure.tight_layout()
    handles, labels = curves.get_legend_handles_labels()
    if handles:
        legend_below(figure, handles, labels, "mean, band: ±1 std over seeds; dashed: the first run's IQM, and P = 0.5")
    save_figure(figure, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="finished run dirs; the first is the baseline")
    parser.add_argument("--metric", default="charts/episodic_return",
                        help="a metrics.jsonl key (default: the episodic return); CleanRL's name of one of ours is taken "
                             "too, on run dirs that lack it (losses/approx_kl for losses/actor_approxkl3, ...)")
    parser.add_argument("--labels", nargs="+", metavar="LABEL",
                        help="one label per run dir, in order (a --sweep's run dir: one per point; default: the args that differ)")
    parser.add_argument("--out", type=Path, help="also draw the comparison into this .png, .pdf or .svg file")
    parser.add_argument("--title", help="the plot's title (default: the env ids)")
    options = parser.parse_args(argv)
    if options.out is not None and options.out.suffix.lower() not in IMAGE_SUFFIXES:
        parser.error(f"--out {options.out}: use a .png, .pdf or .svg file name")
    runs = read_run_dirs(options.run_dirs, parser)
    unfinished = [run.path for run in runs if run.summary is None]
    if unfinished:
        parser.error(f"{unfinished[0]} is unfinished (no summary.json): compare finished runs, or --resume it first")
    if len(runs) < 2:
        parser.error(f"{runs[0].path} is one run: give two or more run dirs (or a --sweep's run dir, whose points are runs)")
    missing = [run.path for run in runs if not has_metric(run, options.metric)]
    if missing:
        parser.error(f"--metric {options.metric} is not in {missing[0]}/metrics.jsonl; choose from "
                     f"{', '.join(logged_metrics(runs))}")
    try:
        labels = run_labels(runs, options.labels)
    except ValueError as error:
        parser.error(str(error))
    rows = compare_runs(runs, labels, options.metric)
    print(table(rows, options.metric))
    if options.out is not None:
        draw(rows, options.metric, options.out, options.title)
        print(f"wrote {options.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
