"""The tools' library: what the tools in scripts/ share, so that no tool imports another.

- running a training script once per configuration (`run_config`, `run_once`, with --resume);
- loading the training script that wrote a run dir, with the ppo_support package beside it, and
  never one that lies inside the run dir (`load_script_for_run`);
- reading run dirs (with ppo_support.rundir's readers): `read_run`, `read_runs` (a --sweep's run
  dir gives its points), `metric_table` (either name of a metric CleanRL names otherwise), labels
  from differing args;
- statistics over seeds after Agarwal et al. 2021 (IQM, bootstrap intervals, the probability of
  improvement);
- drawing learning curves (`plot_runs`, `draw_curve`, `format_steps` for the x ticks).

Not a tool: run as a script it only prints this text.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import math
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np

ROOT = Path(__file__).resolve().parent.parent  # the repository: the training scripts and ppo_support
sys.path.insert(1, str(ROOT))  # the tools' own ppo_support: the one beside the scripts of this repository
from ppo_support import contract, rundir  # noqa: E402
from ppo_support.errors import flag  # noqa: E402  (num_seeds -> --num-seeds, as the scripts spell it)

PACKAGE = "ppo_support"

# args.json keys that never describe the experiment, left out of labels (`script_path`, the
# package's commit and the files' hashes differ between checkouts of the same script).
NON_EXPERIMENT_ARGS = {
    "run_dir", *(key for key in rundir.RUN_INFO_KEYS if key != "script"), "track", "wandb_project", "wandb_entity",
    "wandb_group", "wandb_tags", "wandb_run_per_seed", "wandb_mode",
}


# ======================================================================================
# The training scripts
# ======================================================================================


def load_module(path: str | Path) -> ModuleType:
    """Imports a Python file as a module, once per resolved path, with the ppo_support package that
    sits beside it (package_beside). The module's name includes a hash of the path, so two files
    with the same name (a copy elsewhere) stay two modules. A tool that works with a loaded
    script uses the script's own namespaces (`module.envs`, `module.cli.ConfigError`)."""
    path = Path(path).resolve()
    name = f"{path.stem}_{hashlib.sha256(str(path).encode()).hexdigest()[:12]}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before running it: dataclasses look their module up
        try:
            with package_beside(path.parent):
                spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


@contextlib.contextmanager
def package_beside(folder: Path) -> Iterator[None]:
    """While a script in `folder` is imported: the folder first on sys.path and, when it holds a
    ppo_support other than the one already imported, that one in sys.modules, so that the
    script's `from ppo_support import ...` gets the package of its own checkout. The modules
    imported before are back afterwards; the script keeps those it imported."""
    beside = folder / PACKAGE / "__init__.py"
    loaded = {name: module for name, module in sys.modules.items() if name == PACKAGE or name.startswith(PACKAGE + ".")}
    current = loaded.get(PACKAGE)
    swap = beside.is_file() and current is not None and Path(current.__file__).resolve() != beside.resolve()
    if swap:
        for name in loaded:
            del sys.modules[name]
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        sys.path.remove(str(folder))
        if swap:
            for name in [name for name in sys.modules if name == PACKAGE or name.startswith(PACKAGE + ".")]:
                del sys.modules[name]
            sys.modules.update(loaded)


def script_file(script: str | Path) -> Path:
    """A tool's --script: the file at that path (a copy anywhere), else the file of that name in the
    repo root (e.g. `ppo_mlp.py` from any folder); FileNotFoundError when neither exists."""
    for path in (Path(script), ROOT / script):
        if path.is_file():
            return path.resolve()
    raise FileNotFoundError(f"--script {script}: no such file (here or in {ROOT})")


def load_script(script: str | Path) -> ModuleType:
    """Imports a training script (see script_file), for tools with --script."""
    return load_module(script_file(script))


class UnsafeScript(ValueError):
    """A run dir names a script inside itself: the tools do not run code a run dir carries."""


def script_path_for_run(args: dict[str, Any], run_dir: Path | None = None, script: Path | None = None) -> Path:
    """The training script that wrote a run, from its args.json: `script` when given (a tool's
    --script), else the recorded `script_path` if that file still exists, else the recorded
    `script` file name in the repo root. Older run dirs record neither: `lstm_size` in args means
    ppo_lstm_impala.py, else ppo_mlp.py (repo root). A recorded path that resolves, with symlinks
    followed, to a file inside `run_dir` is refused (UnsafeScript): a shared run dir must not run
    its own code."""
    if script is not None:
        if not Path(script).is_file():
            raise FileNotFoundError(f"--script {script}: no such file")
        return Path(script).resolve()
    if args.get("script_path") and Path(args["script_path"]).is_file():
        path = Path(args["script_path"]).resolve()
    else:
        name = Path(args.get("script") or ("ppo_lstm_impala.py" if "lstm_size" in args else "ppo_mlp.py")).name
        if not (ROOT / name).is_file():
            recorded = f"{args['script_path']} no longer exists, and " if args.get("script_path") else ""
            raise FileNotFoundError(f"the run was written by {name}, but {recorded}there is no {name} in {ROOT}")
        path = (ROOT / name).resolve()
    if run_dir is not None and path.is_relative_to(Path(run_dir).resolve()):
        raise UnsafeScript(
            f"{run_dir}/args.json names the script {path}, which lies inside the run dir; the tools do not run "
            "a run dir's own code: pass --script with the training script to use"
        )
    return path


def load_script_for_run(args: dict[str, Any], run_dir: Path | None = None, script: Path | None = None) -> ModuleType:
    """Imports the training script that wrote a run (see `script_path_for_run`), and says which."""
    path = script_path_for_run(args, run_dir, script)
    print(f"script: {path}", flush=True)
    return load_module(path)


def script_defaults(script: str | Path) -> dict[str, Any]:
    """{field name: default} of the script's `Args` dataclass: which flags it has."""
    return {field.name: field.default for field in dataclasses.fields(load_script(script).Args)}


def flags_for(name: str, value: Any) -> list[str]:
    """Command-line flags that set one `Args` field, in tyro's spelling."""
    if isinstance(value, bool):
        return [flag(name) if value else "--no-" + name.replace("_", "-")]
    if isinstance(value, (list, tuple)):
        return [flag(name), *[str(item) for item in value]]
    return [flag(name), "None" if value is None else str(value)]


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """argv before the first `--` (ours) and after it (passed to every training run)."""
    if "--" in argv:
        index = argv.index("--")
        return argv[:index], argv[index + 1 :]
    return argv, []


# ======================================================================================
# Running configurations, one subfolder each
# ======================================================================================


def run_config(script: str, flags: list[str], run_dir: Path, extra_flags: list[str] = (), root: Path = ROOT) -> dict:
    """Runs one training process of `root`'s script; returns its summary.json, or raises with its stderr."""
    command = [sys.executable, str(root / script), *flags, *extra_flags, "--run-dir", str(run_dir)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def machine_description(summary: dict) -> str:
    """This machine, with the devices and JAX a run's summary.json names. This process never starts
    a JAX backend itself: on a TPU only one process may hold the chip, and the runs need it."""
    return f"{platform.node()} | {platform.processor() or platform.machine()} | {summary['devices']} | jax {summary['jax_version']}"


class RunResult(NamedTuple):
    status: str  # "ran", "resumed" (finished earlier, skipped) or "rejected" (exit 2)
    summary: dict | None
    message: str = ""


def is_finished(run_dir: Path) -> bool:
    return (run_dir / "summary.json").is_file()


def check_out_dir(out_dir: Path, resume: bool) -> str | None:
    """An error message when out_dir already holds runs and --resume was not given."""
    if not resume and out_dir.is_dir() and any(path.is_dir() for path in out_dir.iterdir()):
        return f"--out-dir {out_dir} already holds runs; pass --resume to keep them, or choose another folder"
    return None


def run_once(script: str, flags: list[str], run_dir: Path, extra_flags: list[str]) -> RunResult:
    """Runs one configuration into run_dir unless a finished run is already there.

    A run dir without summary.json is an interrupted run: it is removed and run again. A script
    that rejects its flags (exit 2, one `error: ...` line on stderr) gives status "rejected".
    """
    if is_finished(run_dir):
        return RunResult("resumed", json.loads((run_dir / "summary.json").read_text()))
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        return RunResult("ran", run_config(script, flags, run_dir, extra_flags))
    except RuntimeError as failure:
        lines = [line for line in str(failure).splitlines() if line.strip()]
        if lines and lines[-1].startswith("error:") and not run_dir.exists():
            return RunResult("rejected", None, lines[-1][len("error:") :].strip())
        raise


# ======================================================================================
# Reading run dirs
# ======================================================================================


class Run(NamedTuple):
    path: Path
    args: dict[str, Any]
    rows: list[dict[str, Any]]  # metrics.jsonl
    summary: dict[str, Any] | None


def read_run(run_dir: str | Path) -> Run:
    run_dir = Path(run_dir)
    if not (run_dir / "args.json").is_file() or not (run_dir / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run dir (needs args.json and metrics.jsonl)")
    args = rundir.read_json_object(run_dir / "args.json")
    rows = rundir.read_metrics_rows(run_dir / "metrics.jsonl")
    summary = rundir.read_json_object(run_dir / "summary.json") if is_finished(run_dir) else None
    return Run(run_dir, args, rows, summary)


def read_runs(run_dir: str | Path) -> list[Run]:
    """The runs of a run dir: itself, or for a --sweep's run dir (point-<i>/ folders and no
    metrics.jsonl of its own) its points in order."""
    run_dir = Path(run_dir)
    points = sorted(run_dir.glob("point-*"), key=lambda path: int(path.name.split("-")[1]))
    if points and not (run_dir / "metrics.jsonl").exists():
        return [read_run(point) for point in points]
    return [read_run(run_dir)]


# Each of our metrics that CleanRL names otherwise, to its other name, both ways (CleanRL's
# `losses/approx_kl` is our `losses/actor_approxkl3`, ...): the tools take either name.
METRIC_ALIASES = {**contract.CLEANRL_NAMES, **{ours: cleanrl for cleanrl, ours in contract.CLEANRL_NAMES.items()}}


def logged_name(run: Run, metric: str) -> str:
    """The name under which a run logged `metric`: the name itself, else its other name
    (METRIC_ALIASES; run dirs written before CleanRL's names were logged have only ours), else
    the name itself (not logged)."""
    if any(metric in row for row in run.rows):
        return metric
    alias = METRIC_ALIASES.get(metric)
    return alias if alias is not None and any(alias in row for row in run.rows) else metric


def has_metric(run: Run, metric: str) -> bool:
    """Whether the run logged `metric` under either of its names."""
    name = logged_name(run, metric)
    return any(name in row for row in run.rows)


def logged_metrics(runs: list[Run]) -> list[str]:
    """Every metric name the runs' rows hold, sorted (for an error that lists them)."""
    return sorted({key for run in runs for row in run.rows for key in row} - {"cycle", "env_steps", "seed", "sweep"})


def read_run_dirs(run_dirs: list[Path], parser) -> list[Run]:
    """The runs of every run dir a tool was given (read_runs), in order; a missing or damaged one
    ends the tool with the argparse parser's one error line (exit 2)."""
    runs = []
    for run_dir in run_dirs:
        try:
            runs += read_runs(run_dir)
        except (FileNotFoundError, rundir.DamagedFile) as error:
            parser.error(str(error))
    return runs


IMAGE_SUFFIXES = {".png", ".pdf", ".svg"}  # what a tool's --out may be


def metric_table(run: Run, metric: str) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(env_steps (C,), values (C, S) with NaN for null, seeds) of one metric over logged cycles,
    under either of its names (logged_name)."""
    metric = logged_name(run, metric)
    seeds = sorted({row["seed"] for row in run.rows})
    cycles = sorted({row["cycle"] for row in run.rows})
    cycle_index = {cycle: index for index, cycle in enumerate(cycles)}
    seed_index = {seed: index for index, seed in enumerate(seeds)}
    env_steps = np.zeros(len(cycles))
    values = np.full((len(cycles), len(seeds)), np.nan)
    for row in run.rows:
        env_steps[cycle_index[row["cycle"]]] = row["env_steps"]
        value = row.get(metric)
        if value is not None:
            values[cycle_index[row["cycle"]], seed_index[row["seed"]]] = value
    return env_steps, values, seeds


def final_scores(run: Run, metric: str = "charts/episodic_return") -> np.ndarray:
    """Per seed, the mean of the metric over the last 10% of logged cycles (cycles without a value
    left out; rundir.final_returns, which writes summary.json's final return over every cycle),
    seeds without any value left out."""
    _, values, _ = metric_table(run, metric)
    cycles = SimpleNamespace(num_cycles=values.shape[0])
    return finite_scores(rundir.final_returns(cycles, values))


def wall_seconds(run: Run) -> np.ndarray:
    """Seconds from the start of the run (compilation included) at each logged cycle, rebuilt
    from the per-interval charts/SPS (env steps of all seeds per second)."""
    env_steps, sps, _ = metric_table(run, "charts/SPS")
    num_seeds = run.args.get("num_seeds", 1)
    steps_done = np.diff(np.concatenate([[0.0], env_steps])) * num_seeds
    rate = np.nanmean(sps, axis=1)
    compile_seconds = (run.summary or {}).get("compile_seconds", 0.0)
    return compile_seconds + np.cumsum(steps_done / np.maximum(rate, 1e-9))


def area_under_curve(run: Run, metric: str = "charts/episodic_return") -> np.ndarray:
    """Per seed, the mean of the metric over all logged cycles (cycles without a value skipped)."""
    _, values, _ = metric_table(run, metric)
    return np.array([np.nanmean(column) if np.any(~np.isnan(column)) else np.nan for column in values.T])


def mean_std(values: Any) -> tuple[float, float]:
    """Mean and sample std (ddof 1; 0 for one value) of the finite values; NaN when none."""
    values = finite_scores(values)
    if values.size == 0:
        return math.nan, math.nan
    return float(values.mean()), float(values.std(ddof=1)) if values.size > 1 else 0.0


def differing_labels(all_args: list[dict[str, Any]], fallback: list[str]) -> list[str]:
    """One label per run: `key=value` for each arg that differs between the runs (e.g.
    `clip_eps=0.1`); the fallback (e.g. the folder name) when nothing differs or labels collide.
    Keys missing from some args.json (written by another script or version) are not compared."""
    keys = sorted(set.intersection(*[set(args) for args in all_args]) - NON_EXPERIMENT_ARGS)
    differing = [key for key in keys if len({json.dumps(args.get(key)) for args in all_args}) > 1]
    labels = [", ".join(f"{key}={format_value(args.get(key))}" for key in differing) for args in all_args]
    if not differing or len(set(labels)) < len(labels):
        return list(fallback)
    return labels


def run_labels(runs: list[Run], given: list[str] | None = None) -> list[str]:
    """The labels of a tool's --labels, one per run (a --sweep's run dir has one per point), or
    without it the args that differ (differing_labels). ValueError for the wrong number."""
    if given is None:
        return differing_labels([run.args for run in runs], [run.path.name for run in runs])
    if len(given) != len(runs):
        raise ValueError(f"--labels: {len(given)} labels for {len(runs)} runs; give one per run dir, and for a --sweep's "
                         "run dir one per point")
    return list(given)


def format_value(value: Any) -> str:
    if isinstance(value, list):
        return "x".join(str(item) for item in value)
    return str(value)


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:,.{digits}f}"


# ======================================================================================
# Statistics over seeds
# ======================================================================================
# After Agarwal et al. 2021, "Deep reinforcement learning at the edge of the statistical
# precipice" (https://arxiv.org/abs/2108.13264, the rliable library): the interquartile mean
# (IQM), percentile bootstrap confidence intervals and the probability of improvement, written
# with numpy. Their bootstrap is stratified: it resamples runs within each task. A run dir of ours
# holds one task (one env), so the strata are a single one and the bootstrap resamples seeds with
# replacement. Every function takes a fixed `seed`, so the same scores give the same interval.

NUM_RESAMPLES = 2000  # bootstrap draws per interval
CONFIDENCE = 0.95
SEED = 0  # of the resampling RNG: intervals are reproducible


def finite_scores(values) -> np.ndarray:
    """The finite values as a float array: None (a seed without a finished episode), NaN and inf
    left out."""
    values = np.array([np.nan if value is None else value for value in values], dtype=float)
    return values[np.isfinite(values)]


def interquartile_mean(scores: np.ndarray, axis: int = -1) -> np.ndarray:
    """The mean of the middle 50% of the scores along `axis`, as scipy.stats.trim_mean(scores, 0.25)
    and rliable compute it: sort, cut int(0.25 * n) scores from each end, average the rest. So
    n = 1-3 cuts none (the plain mean), 4-7 cut one from each end (n = 5 averages the middle three),
    8-11 cut two, and so on."""
    scores = np.sort(np.asarray(scores, dtype=float), axis=axis)
    num_cut = int(0.25 * scores.shape[axis])
    kept = np.take(scores, np.arange(num_cut, scores.shape[axis] - num_cut), axis=axis)
    return kept.mean(axis=axis)


def probability_of_improvement(scores: np.ndarray, baseline_scores: np.ndarray) -> np.ndarray:
    """P(X > Y): the chance that a random seed of `scores` beats a random seed of the baseline, ties
    counting half. The Mann-Whitney U statistic divided by n * m: the mean over all pairs (x_i, y_j)
    of [x_i > y_j] + 0.5 [x_i == y_j]. Scores are along the last axis; leading axes broadcast
    (e.g. bootstrap draws)."""
    x = np.asarray(scores, dtype=float)[..., :, None]  # (..., n, 1)
    y = np.asarray(baseline_scores, dtype=float)[..., None, :]  # (..., 1, m)
    return ((x > y) + 0.5 * (x == y)).mean(axis=(-2, -1))


def resample_indices(num_seeds: int, num_resamples: int = NUM_RESAMPLES, rng: np.random.Generator | None = None) -> np.ndarray:
    """(num_resamples, num_seeds) seed indices, drawn with replacement: one bootstrap resample per row."""
    rng = np.random.default_rng(SEED) if rng is None else rng
    return rng.integers(0, num_seeds, size=(num_resamples, num_seeds))


def percentile_interval(draws: np.ndarray, confidence: float = CONFIDENCE, axis: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """The percentile interval of bootstrap draws: their (1 - c) / 2 and (1 + c) / 2 quantiles along
    `axis` (numpy's linear interpolation), NaN draws left out."""
    tail = 100 * (1 - confidence) / 2
    draws = np.moveaxis(np.asarray(draws, dtype=float), axis, -1)
    flat = draws.reshape(-1, draws.shape[-1])
    bounds = np.percentile(flat, [tail, 100 - tail], axis=-1)  # (2, rows)
    with_nan = np.isnan(flat).any(axis=-1)
    if with_nan.any():  # np.nanpercentile loops over rows in Python: only where needed
        bounds[:, with_nan] = np.nanpercentile(flat[with_nan], [tail, 100 - tail], axis=-1)
    low, high = bounds.reshape(2, *draws.shape[:-1])
    return low, high


def bootstrap_draws(
    statistic: Callable[..., np.ndarray],
    *samples: np.ndarray,
    num_resamples: int = NUM_RESAMPLES,
    seed: int = SEED,
) -> np.ndarray:
    """(num_resamples,) values of statistic(*resampled), each sample (1-D, over seeds) resampled
    with replacement, independently of the others. The statistic gets arrays of shape
    (num_resamples, len(sample)) and reduces the last axis, as interquartile_mean and
    probability_of_improvement do."""
    rng = np.random.default_rng(seed)
    resampled = [np.asarray(sample, dtype=float)[resample_indices(len(sample), num_resamples, rng)] for sample in samples]
    return statistic(*resampled)


def bootstrap_ci(
    statistic: Callable[..., np.ndarray],
    *samples: np.ndarray,
    num_resamples: int = NUM_RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = SEED,
) -> tuple[float, float]:
    """The percentile bootstrap confidence interval (low, high) of statistic(*samples), e.g.
    bootstrap_ci(interquartile_mean, scores) or
    bootstrap_ci(probability_of_improvement, scores, baseline_scores). NaN when a sample is empty."""
    if any(len(sample) == 0 for sample in samples):
        return np.nan, np.nan
    low, high = percentile_interval(bootstrap_draws(statistic, *samples, num_resamples=num_resamples, seed=seed), confidence)
    return float(low), float(high)


def bootstrap_mean_ci_per_row(
    values: np.ndarray,
    num_resamples: int = NUM_RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = SEED,
) -> tuple[np.ndarray, np.ndarray]:
    """values (C, S) with NaN where a seed has no value (a cycle without a finished episode): per
    row, the percentile bootstrap CI of the mean over seeds. Each draw resamples the seed axis once
    for all rows; a row's draw averages the drawn seeds that have a value (as np.nanmean does), and
    draws that hold none are left out. Computed as (values @ counts) / (present @ counts), with
    counts (S, num_resamples) how often each seed was drawn: no (C, num_resamples, S) array."""
    values = np.asarray(values, dtype=float)
    num_seeds = values.shape[1]
    indices = resample_indices(num_seeds, num_resamples, np.random.default_rng(seed))
    counts = np.zeros((num_resamples, num_seeds))
    np.add.at(counts, (np.arange(num_resamples)[:, None], indices), 1.0)
    present = ~np.isnan(values)
    sums = np.where(present, values, 0.0) @ counts.T  # (C, num_resamples)
    num_drawn = present.astype(float) @ counts.T
    with np.errstate(invalid="ignore", divide="ignore"):
        means = np.where(num_drawn > 0, sums / num_drawn, np.nan)
    return percentile_interval(means, confidence, axis=1)


STAT_CSV_COLUMNS = ["iqm", "iqm_ci_low", "iqm_ci_high", "p_improve", "p_improve_ci_low", "p_improve_ci_high"]


class Comparison(NamedTuple):
    """One metric of one row against the baseline's (NaN where there are no scores, or for P on
    the baseline itself)."""

    iqm: float
    iqm_ci: tuple[float, float]
    p_improve: float
    p_improve_ci: tuple[float, float]
    finding: str  # "higher" or "lower" when the IQM's CI excludes the baseline's IQM, else ""

    def csv_record(self, key: str) -> dict[str, str]:
        """`{key}_iqm`, `{key}_iqm_ci_low`, ..., `{key}_p_improve_ci_high`; empty for NaN."""
        values = [self.iqm, *self.iqm_ci, self.p_improve, *self.p_improve_ci]
        return {f"{key}_{name}": "" if math.isnan(value) else f"{value:.{3 if name.startswith('p_') else 2}f}"
                for name, value in zip(STAT_CSV_COLUMNS, values)}


def compare_scores(scores: np.ndarray, baseline_scores: np.ndarray, is_baseline: bool) -> Comparison:
    """The IQM of the scores (per seed) with its bootstrap CI and, unless these are the baseline's,
    the probability of improvement over the baseline's scores with its CI, and the finding."""
    if scores.size == 0 or baseline_scores.size == 0:
        return Comparison(math.nan, (math.nan, math.nan), math.nan, (math.nan, math.nan), "")
    iqm = float(interquartile_mean(scores))
    low, high = bootstrap_ci(interquartile_mean, scores)
    if is_baseline:
        return Comparison(iqm, (low, high), math.nan, (math.nan, math.nan), "")
    baseline_iqm = float(interquartile_mean(baseline_scores))
    finding = "higher" if baseline_iqm < low else "lower" if baseline_iqm > high else ""
    p_improve = float(probability_of_improvement(scores, baseline_scores))
    return Comparison(iqm, (low, high), p_improve, bootstrap_ci(probability_of_improvement, scores, baseline_scores), finding)


def format_probability(value: float, interval: tuple[float, float]) -> str:
    return "-" if math.isnan(value) else f"{value:.2f} [{interval[0]:.2f}, {interval[1]:.2f}]"



# ======================================================================================
# Drawing learning curves
# ======================================================================================


def pyplot() -> ModuleType:
    """matplotlib.pyplot with the Agg backend (files only, no display), imported on first use: the
    tools that draw nothing do not pay for it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


BAND_NAMES = {"std": "±1 std over seeds", "minmax": "min-max over seeds",
              "bootstrap": "95% bootstrap CI of the mean over seeds"}


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


def format_steps(value: float, _position: int | None = None) -> str:
    """A tick label that stays short: 0, 500, 2.5k, 200k, 1M, 1.5M, 2B (a matplotlib
    FuncFormatter's function, hence the unused tick position)."""
    for size, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= size:
            return f"{value / size:.3g}{suffix}"
    return f"{value:.3g}"


def label_axes(ax, x_label: str, y_label: str | None = None) -> None:
    """Axis labels, x ticks as format_steps writes them, and a light grid."""
    from matplotlib.ticker import FuncFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(format_steps))
    ax.set_xlabel(x_label, fontsize=8)
    if y_label:
        ax.set_ylabel(y_label, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)


def env_ids(runs: list[Run]) -> str:
    """The env ids of the runs (args.json's env_id), for a title: `CartPole-v1`, or several."""
    return ", ".join(sorted({str(run.args["env_id"]) for run in runs if run.args.get("env_id")}))


def legend_below(figure, handles: list, labels: list[str], title: str) -> None:
    """The legend under the axes, in up to 3 columns, so that it covers no curve and leaves the
    axes their width (savefig's bbox_inches="tight" keeps it in the image)."""
    figure.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=min(len(labels), 3), fontsize=8,
                  title=title, title_fontsize=8, frameon=False)


def plot_metric(ax, runs: list[Run], labels: list[str], metric: str, band: str, x_of=None, window: int = 1) -> None:
    """x_of(run) -> x values per logged cycle; default env steps."""
    if len(runs) > 10:
        ax.set_prop_cycle(color=pyplot().get_cmap("tab20").colors)
    for run, label in zip(runs, labels):
        env_steps, values, seeds = metric_table(run, metric)
        x = env_steps if x_of is None else x_of(run)
        run_window = default_window([run]) if window == AUTO_WINDOW else window
        draw_curve(ax, x, values, f"{label} ({len(seeds)} seeds)" if len(seeds) > 1 else label, band, run_window)


def runs_figure(
    runs: list[Run],
    metric: str = "charts/episodic_return",
    band: str = "std",
    labels: list[str] | None = None,
    debug_metrics: tuple[str, ...] = (),
    x_of=None,
    x_label: str = "env steps (per seed)",
    window: int = 1,
    title: str | None = None,
):
    """One panel of `metric` (its name the y label), or with debug_metrics (--debug-grid) one
    panel of each (its name the panel's title); the title (default: the env ids) above, the legend
    below. Returns the matplotlib figure."""
    plt = pyplot()
    labels = labels or differing_labels([run.args for run in runs], [run.path.name for run in runs])
    metrics = debug_metrics or (metric,)
    num_columns = min(len(metrics), 4)
    num_rows = math.ceil(len(metrics) / num_columns)
    figure, axes = plt.subplots(num_rows, num_columns, figsize=(4.2 * num_columns + 1, 3.2 * num_rows + 0.6), squeeze=False)
    for ax, name in zip(axes.flat, metrics):
        plot_metric(ax, runs, labels, name, band, x_of, window)
        label_axes(ax, x_label, None if debug_metrics else name)
        if debug_metrics:
            ax.set_title(name, fontsize=9)
    for ax in list(axes.flat)[len(metrics) :]:
        ax.axis("off")
    figure.suptitle(env_ids(runs) if title is None else title, fontsize=10)
    figure.tight_layout()
    handles, legend_labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        smoothing = {AUTO_WINDOW: ", moving average of 1% of each run's cycles", 1: ""}.get(
            window, f", moving average of {window} logged cycles")
        legend_below(figure, handles, legend_labels, f"mean, band: {BAND_NAMES[band]}{smoothing}")
    return figure


def save_figure(figure, out: Path) -> None:
    """Writes the figure (with its legend outside the axes) and closes it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110, bbox_inches="tight")
    pyplot().close(figure)


def plot_runs(runs: list[Run], out: Path, **options) -> None:
    """runs_figure(runs, **options) written to `out`."""
    save_figure(runs_figure(runs, **options), out)


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(prog="runlib.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                            usage="import runlib (from a tool in scripts/); not a command").parse_args()
    print(__doc__)
