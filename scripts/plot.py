"""Learning curves of one or more run dirs: the mean over seeds with a shaded band.

    python scripts/plot.py runs/a runs/b --out curves.png
    python scripts/plot.py runs/a runs/b --out kl.png --metric losses/actor_approxkl3 --band minmax
    python scripts/plot.py runs/a --out debug.png --debug-grid --smooth 20
    python scripts/plot.py runs/a runs/b --out curves.png --ci bootstrap
    python scripts/plot.py runs/a runs/b --out fig.pdf --title "CartPole-v1, 5 seeds" --labels PPO "PPO, no clip"

One curve per run dir (a --sweep's run dir: one per point), labelled by the args that differ
between the run dirs' args.json (e.g. `clip_eps=0.1`), or by --labels. The title is the env id
(or --title), the x ticks read 100k, 1M, ..., and the legend sits below the axes. Cycles in which no episode finished have a null return: they are skipped, never
plotted as 0. The band is ±1 std over seeds (default), min-max over seeds (--band minmax), or
with --ci bootstrap the 95% percentile bootstrap confidence interval of the mean over seeds
(2000 resamples of the seeds, fixed RNG seed; see runlib.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runlib import (  # noqa: E402
    IMAGE_SUFFIXES, Run, UnsafeScript, has_metric, load_script_for_run, logged_metrics, plot_runs, read_run_dirs, run_labels,
)


def debug_metric_names(runs: list[Run], script: Path | None = None) -> tuple[str, ...]:
    """The metrics of the debug grid: every per-cycle metric (`METRIC_NAMES`) of the training
    script that wrote the first run, or of `script` (--script)."""
    return tuple(load_script_for_run(runs[0].args, runs[0].path, script).METRIC_NAMES)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument("--out", type=Path, required=True, help="the image to write, e.g. curves.png")
    parser.add_argument("--metric", default="charts/episodic_return",
                        help="a metrics.jsonl key; CleanRL's name of one of ours is taken too, on run dirs that lack it "
                             "(losses/approx_kl for losses/actor_approxkl3, ...)")
    parser.add_argument("--band", choices=["std", "minmax"], help="band over seeds (default std)")
    parser.add_argument("--ci", choices=["bootstrap"],
                        help="shade the 95%% bootstrap confidence interval of the mean over seeds instead of --band")
    parser.add_argument("--debug-grid", action="store_true", help="a grid of every metric the training script logs (its METRIC_NAMES) instead")
    parser.add_argument("--script", type=Path,
                        help="--debug-grid: the training script to read METRIC_NAMES from (default: the one args.json records)")
    parser.add_argument("--smooth", type=int, default=1, metavar="CYCLES",
                        help="moving average over this many logged cycles, per seed (default 1: none; 0: 1%% of each run's cycles)")
    parser.add_argument("--title", help="the figure's title (default: the env ids)")
    parser.add_argument("--labels", nargs="+", metavar="LABEL",
                        help="one legend label per run dir, in order (a --sweep's run dir: one per point; default: the "
                             "args that differ between the runs)")
    options = parser.parse_args(argv)
    if options.ci and options.band:
        parser.error(f"--ci {options.ci} and --band {options.band} are two bands: give one")
    if options.smooth < 0:
        parser.error(f"--smooth must be >= 0, got {options.smooth}")
    if options.out.suffix.lower() not in IMAGE_SUFFIXES:
        parser.error(f"--out {options.out}: use a .png, .pdf or .svg file name")
    runs = read_run_dirs(options.run_dirs, parser)
    debug_metrics = ()
    if options.debug_grid:
        try:
            debug_metrics = debug_metric_names(runs, options.script)
        except (FileNotFoundError, UnsafeScript) as error:
            parser.error(f"--debug-grid: {runs[0].path}: {error}")
    elif not any(has_metric(run, options.metric) for run in runs):
        parser.error(f"--metric {options.metric} is not in metrics.jsonl; choose from {', '.join(logged_metrics(runs))}")
    try:
        labels = run_labels(runs, options.labels)
    except ValueError as error:
        parser.error(str(error))
    band = options.ci or options.band or "std"
    plot_runs(runs, options.out, metric=options.metric, band=band, labels=labels, debug_metrics=debug_metrics,
              window=options.smooth, title=options.title)
    print(f"wrote {options.out}: {'; '.join(labels)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
