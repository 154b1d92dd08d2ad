"""Shared helpers of the research scripts (plot, sweep, ablate, evaluate, profile_cycle):
loading the training script that wrote a run dir (with the ppo_support package beside it),
reading run dirs (with ppo_support.rundir's readers), running a configuration once per subfolder
(with --resume), labels from differing args, and the training scripts' own `Args` fields.

Not a script: the tools in this folder import it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import math
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator, NamedTuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark import ROOT, run_config  # noqa: E402
from stats import finite_scores  # noqa: E402

sys.path.insert(1, str(ROOT))  # the tools' own ppo_support: the one beside the scripts of this repository
from ppo_support import rundir  # noqa: E402

PACKAGE = "ppo_support"

# args.json keys that never describe the experiment, left out of labels (`script_path` and the
# package's commit differ between checkouts of the same script).
NON_EXPERIMENT_ARGS = {
    "run_dir", "script_path", "ppo_support_version", "ppo_support_commit", "track", "wandb_project", "wandb_entity",
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


def load_script(script: str) -> ModuleType:
    """Imports a training script of the repo root (e.g. `ppo_mlp.py`), for tools with --script."""
    path = ROOT / script
    if not path.is_file():
        raise FileNotFoundError(f"no script {script} in {ROOT}")
    return load_module(path)


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


def script_defaults(script: str) -> dict[str, Any]:
    """{field name: default} of the script's `Args` dataclass: which flags it has."""
    return {field.name: field.default for field in dataclasses.fields(load_script(script).Args)}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


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


def metric_table(run: Run, metric: str) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(env_steps (C,), values (C, S) with NaN for null, seeds) of one metric over logged cycles."""
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


def format_value(value: Any) -> str:
    if isinstance(value, list):
        return "x".join(str(item) for item in value)
    return str(value)


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:,.{digits}f}"
