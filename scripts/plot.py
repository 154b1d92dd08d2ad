"""Learning curves of one or more run dirs: the mean over seeds with a shaded band.

    python scripts/plot.py runs/a runs/b --out curves.png
    python scripts/plot.py runs/a runs/b --out kl.png --metric losses/actor_approxkl3 --band minmax
    python scripts/plot.py runs/a --out debug.png --debug-grid --smooth 20
    python scripts/plot.py runs/a runs/b --out curves.png --ci bootstrap

One curve per run dir (a --sweep's run dir: one per point), labelled by the args that differ
between the run dirs' args.json (e.g. `clip_eps=0.1`). Cycles in which no episode finished have a null return: they are skipped, never
plotted as 0. The band is ±1 std over seeds (default), min-max over seeds (--band minmax), or
with --ci bootstrap the 95% percentile bootstrap confidence interval of the mean over seeds
(2000 resamples of the seeds, fixed RNG seed; see stats.py).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runs import Run, UnsafeScript, differing_labels, load_script_for_run, metric_table, read_run, rundir  # noqa: E402
from stats import bootstrap_mean_ci_per_row  # noqa: E402

BAND_NAMES = {"std": "±1 std over seeds", "minmax": "min-max over seeds",
              "bootstrap": "95% bootstrap CI of the mean over seeds"}


def debug_metric_names(runs: list[Run], script: Path | None = None) -> tuple[str, ...]:
    """The metrics of the debug grid: every per-cycle metric (`METRIC_NAMES`) of the training
    script that wrote the first run, or of `script` (--script)."""
    return tuple(load_script_for_run(runs[0].args, runs[0].path, script).METRIC_NAMES)


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average over the last `window` logged cycles, per seed, of the non-null
    values only (NaN where the window holds none)."""
    if window <= 1:
        return values
    present = ~np.isnan(values)
    sums = np.cumsum(np.where(present, values, 0.0), axis=0)
    counts = np.cumsum(present, axis=0)
    sums[window:] = sums[window:] - sums[:-window]
    counts[window:] = counts[window:] - counts[:-window]
    return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def default_window(runs: list[Run]) -> int:
    """A moving-average window of about 1% of the longest run's logged cycles."""
    return max(1, max(len({row["cycle"] for row in run.rows}) for run in runs) // 100)


AUTO_WINDOW = 0  # a window per run: default_window([run])


def draw_curve(ax, x: np.ndarray, values: np.ndarray, label: str, band: str, window: int = 1, **line_style) -> None:
    """values (C, S): the mean over seeds, and a band (`BAND_NAMES`): std, min-max or the bootstrap
    CI of the mean over seeds; cycles where every seed is null are left out."""
    values = smooth(values, window)
    keep = np.any(~np.isnan(values), axis=1)
    x, values = x[keep], values[keep]
    if x.size == 0:
        return
    mean = np.nanmean(values, axis=1)
    if band == "std":
        spread = np.nanstd(values, axis=1)
        low, high = mean - spread, mean + spread
    elif band == "bootstrap":
        low, high = bootstrap_mean_ci_per_row(values)
    else:
        low, high = np.nanmin(values, axis=1), np.nanmax(values, axis=1)
    (line,) = ax.plot(x, mean, label=label, linewidth=1.2, **line_style)
    ax.fill_between(x, low, high, color=line.get_color(), alpha=0.2, linewidth=0)


def plot_metric(ax, runs: list[Run], labels: list[str], metric: str, band: str, x_of=None, window: int = 1) -> None:
    """x_of(run) -> x values per logged cycle; default env steps."""
    if len(runs) > 10:
        ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)
    for run, label in zip(runs, labels):
        env_steps, values, seeds = metric_table(run, metric)
        x = env_steps if x_of is None else x_of(run)
        run_window = default_window([run]) if window == AUTO_WINDOW else window
        draw_curve(ax, x, values, f"{label} ({len(seeds)} seeds)" if len(seeds) > 1 else label, band, run_window)
    ax.set_title(metric, fontsize=9)
    ax.grid(alpha=0.3)


def plot_runs(
    runs: list[Run],
    out: Path,
    metric: str = "charts/episodic_return",
    band: str = "std",
    labels: list[str] | None = None,
    debug_metrics: tuple[str, ...] = (),
    x_of=None,
    x_label: str = "env steps (per seed)",
    window: int = 1,
) -> None:
    """One panel of `metric`, or with debug_metrics (--debug-grid) one panel of each."""
    labels = labels or differing_labels([run.args for run in runs], [run.path.name for run in runs])
    metrics = debug_metrics or (metric,)
    num_columns = min(len(metrics), 4)
    num_rows = math.ceil(len(metrics) / num_columns)
    figure, axes = plt.subplots(num_rows, num_columns, figsize=(4.2 * num_columns + 1, 3.2 * num_rows + 0.6), squeeze=False)
    for ax, name in zip(axes.flat, metrics):
        plot_metric(ax, runs, labels, name, band, x_of, window)
        ax.set_xlabel(x_label, fontsize=8)
    for ax in list(axes.flat)[len(metrics) :]:
        ax.axis("off")
    figure.tight_layout()
    handles, legend_labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        band_name = BAND_NAMES[band]
        smoothing = {AUTO_WINDOW: ", moving average of 1% of each run's cycles", 1: ""}.get(
            window, f", moving average of {window} logged cycles")
        figure.legend(handles, legend_labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8,
                      title=f"mean, band: {band_name}{smoothing}", title_fontsize=8)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument("--out", type=Path, required=True, help="the image to write, e.g. curves.png")
    parser.add_argument("--metric", default="charts/episodic_return", help="a metrics.jsonl key")
    parser.add_argument("--band", choices=["std", "minmax"], help="band over seeds (default std)")
    parser.add_argument("--ci", choices=["bootstrap"],
                        help="shade the 95%% bootstrap confidence interval of the mean over seeds instead of --band")
    parser.add_argument("--debug-grid", action="store_true", help="a grid of every metric the training script logs (its METRIC_NAMES) instead")
    parser.add_argument("--script", type=Path,
                        help="--debug-grid: the training script to read METRIC_NAMES from (default: the one args.json records)")
    parser.add_argument("--smooth", type=int, default=1, metavar="CYCLES",
                        help="moving average over this many logged cycles, per seed (default 1: none; 0: 1%% of each run's cycles)")
    options = parser.parse_args(argv)
    if options.ci and options.band:
        parser.error(f"--ci {options.ci} and --band {options.band} are two bands: give one")
    if options.smooth < 0:
        parser.error(f"--smooth must be >= 0, got {options.smooth}")
    if options.out.suffix.lower() not in {".png", ".pdf", ".svg"}:
        parser.error(f"--out {options.out}: use a .png, .pdf or .svg file name")
    runs = []
    for run_dir in options.run_dirs:
        points = sorted(Path(run_dir).glob("point-*"), key=lambda path: int(path.name.split("-")[1]))
        for one_run in points if points and not (Path(run_dir) / "metrics.jsonl").exists() else [run_dir]:  # a --sweep: its points
            try:
                runs.append(read_run(one_run))
            except (FileNotFoundError, rundir.DamagedFile) as error:
                parser.error(str(error))
    debug_metrics = ()
    if options.debug_grid:
        try:
            debug_metrics = debug_metric_names(runs, options.script)
        except (FileNotFoundError, UnsafeScript) as error:
            parser.error(f"--debug-grid: {runs[0].path}: {error}")
    elif not any(options.metric in row for run in runs for row in run.rows):
        known = sorted({key for run in runs for row in run.rows for key in row} - {"cycle", "env_steps", "seed"})
        parser.error(f"--metric {options.metric} is not in metrics.jsonl; choose from {', '.join(known)}")
    labels = differing_labels([run.args for run in runs], [run.path.name for run in runs])
    band = options.ci or options.band or "std"
    plot_runs(runs, options.out, options.metric, band, labels=labels, debug_metrics=debug_metrics, window=options.smooth)
    print(f"wrote {options.out}: {'; '.join(labels)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
