"""--sweep KEY=V1,V2,... : a grid of hyper-parameters trained in one compiled program.

The grid is the cartesian product of its axes (an axis: one key and its values, or keys that
change together, lr,ent-coef=1e-3:0.01,...), and every point trains --num-seeds seeds. The points'
seeds are stacked on the scripts' seed axis, vmapped (or in turn: cpu.seeds_in_turn_on_cpu), as
runs point-major: run = point * num_seeds + seed index. Each run carries its point's values in its state, one
small dict (the state's `sweep` field, None without --sweep); the script's train_cycle swaps
them into its Args (point_args), so the algorithm reads `args.lr` as always, a traced scalar
here. Only what changes no array shape and no program structure can be swept: the script's
`Args.sweepable` names those flags (a bool among them is a switch: both branches run, one is kept).

On the host, each point is also a run of its own: RUN_DIR/point-<i>/ holds its args.json (the
point's values in place of the grid), metrics.jsonl (rows tagged with "sweep"), summary.json
and params.msgpack, so that every tool reads a point as a run. RUN_DIR itself holds the grid
(args.json), the checkpoints of every run and a summary.json of the points."""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import logs
from .errors import ConfigError, flag

POINT_DIR = "point-{index}"


class Grid(NamedTuple):
    keys: tuple[str, ...]  # Args field names, in the order given
    points: tuple[dict[str, Any], ...]  # {field: value} per point; the last axis varies fastest
    switches: tuple[str, ...] = ()  # the keys that are bools


def sweepable(args: Any) -> tuple[str, ...]:
    """The flags --sweep may vary: the script's `Args.sweepable` (contract.py)."""
    return tuple(getattr(type(args), "sweepable", ()))


def is_switch(args: Any, name: str) -> bool:
    return isinstance(next(field.default for field in dataclasses.fields(args) if field.name == name), bool)


def sweep_flag(name: str) -> str:
    return flag(name).removeprefix("--")


def parse(args: Any) -> Grid | None:
    """The grid of args.sweep (None without --sweep): the cartesian product of its axes. An axis
    is one key and its values (lr=1e-3,3e-4), or keys that change together, a point's values
    joined by colons (lr,ent-coef=1e-3:0.01,3e-4:0), as scripts/ablate.py uses it. A ConfigError
    names what is wrong."""
    if not args.sweep:
        return None
    fields = {field.name for field in dataclasses.fields(args)}
    axes: list[tuple[list[str], list[tuple[Any, ...]]]] = []
    for entry in args.sweep:
        key, equals, text = entry.partition("=")
        names = [part.strip().replace("-", "_") for part in key.split(",")]
        if not equals or not all(names):
            raise ConfigError(f"--sweep takes KEY=V1,V2,..., got {entry!r}")
        for name in names:
            check_key(name, key, fields, sweepable(args), [name for axis_names, _ in axes for name in axis_names])
        if len(set(names)) < len(names):
            raise ConfigError(f"--sweep {key}: a key given twice")
        items = [item.strip() for item in text.split(",")]
        if not all(items):
            raise ConfigError(f"--sweep {key}: empty value in {text!r}; give V1,V2,...")
        parsed = []
        for item in items:
            parts = item.split(":") if len(names) > 1 else [item]
            if len(parts) != len(names):
                raise ConfigError(f"--sweep {key}: {item!r} gives {len(parts)} values for {len(names)} keys; join a point's "
                                  "values with colons")
            parsed.append(tuple(parse_value(name, key, part.strip(), is_switch(args, name)) for name, part in zip(names, parts)))
        repeated = [item for item, value in zip(items, parsed) if parsed.count(value) > 1]
        if repeated:
            raise ConfigError(f"--sweep {key}: {' and '.join(repeated)} are the same value")
        axes.append((names, parsed))
    keys = tuple(name for names, _ in axes for name in names)
    points = tuple(
        dict(zip(keys, itertools.chain.from_iterable(combination))) for combination in itertools.product(*(v for _, v in axes))
    )
    return Grid(keys, points, tuple(name for name in keys if is_switch(args, name)))


def check_key(name: str, key: str, fields: set[str], keys: tuple[str, ...], earlier: list[str]) -> None:
    if name not in fields:
        raise ConfigError(f"--sweep {key}: no such flag; sweepable: {', '.join(map(sweep_flag, keys))}")
    if name not in keys:
        raise ConfigError(
            f"--sweep {key}: {flag(name)} is not in the script's Args.sweepable, the flags one program can vary (values "
            "only: no array shape and no Python `if` depends on them); add it there if that holds for it, or sweep it "
            "with scripts/sweep.py, one process per value"
        )
    if name in earlier:
        raise ConfigError(f"--sweep {key}: given twice")


def parse_value(name: str, key: str, text: str, switch: bool) -> Any:
    if switch:
        if text.lower() not in ("true", "false"):
            raise ConfigError(f"--sweep {key}: {text!r} is not true or false")
        return text.lower() == "true"
    if name == "target_kl" and text.lower() == "none":
        raise ConfigError(
            f"--sweep {key}: none (off) cannot be swept with numbers inside one program; use a large number "
            "for off, or run --target-kl none on its own"
        )
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"--sweep {key}: {text!r} is not a number") from None
    if not math.isfinite(value):
        raise ConfigError(f"--sweep {key}: {text!r} is not a finite number")
    return value


def check_not_also_flags(grid: Grid | None, argv: list[str]) -> None:
    """A swept key may not also be set by its own flag (which value would win?)."""
    if grid is None:
        return
    given = {word.partition("=")[0] for word in argv if word.startswith("--")}
    for name in grid.keys:
        for spelling in (flag(name), flag(name).replace("--", "--no-", 1)):
            if spelling in given:
                raise ConfigError(f"{spelling} is also swept by --sweep {sweep_flag(name)}=...; give it in one place")


def point_args(args: Any, values: dict[str, Any]) -> Any:
    """args with a point's values: Python values on the host (a point's args.json), traced
    scalars inside the jit (train_cycle, from the run's state)."""
    return dataclasses.replace(args, **values)


def runs_of_points(states: Any, grid: Grid | None, num_seeds: int) -> Any:
    """The initial states of every run: the seeds' states once per point (every point starts
    from the same seeds), each with its point's values in `sweep`. Without a grid: `states`."""
    if grid is None:
        return states
    runs = jax.tree.map(lambda leaf: jnp.concatenate([leaf] * len(grid.points)), states)
    dtypes = {name: jnp.bool_ if name in grid.switches else jnp.float32 for name in grid.keys}
    sweep = {
        name: jnp.asarray([point[name] for point in grid.points for _ in range(num_seeds)], dtypes[name])
        for name in grid.keys
    }
    return runs._replace(sweep=sweep)


def point_dir(run_dir: Path, index: int) -> Path:
    return run_dir / POINT_DIR.format(index=index)


def point_values(point: dict[str, Any]) -> dict[str, Any]:
    """{"lr": 0.001, "clip-eps": 0.1}: a point's values by their flag names (its rows, summaries, wandb config)."""
    return {sweep_flag(name): value for name, value in point.items()}


def point_label(point: dict[str, Any]) -> str:
    """lr=0.001,clip-eps=0.1: a point in names and on the console."""
    return ",".join(f"{sweep_flag(name)}={value:g}" if isinstance(value, float) else f"{sweep_flag(name)}={value}"
                    for name, value in point.items())


def host_point_args(args: Any, grid: Grid, index: int, run_dir: Path) -> Any:
    """A point as a run of its own, for its args.json and its logger: the point's values in
    place of the grid, its folder, and the sweep's wandb group (by default the run dir's name),
    so that wandb groups the points."""
    return dataclasses.replace(point_args(args, grid.points[index]), sweep=(), run_dir=str(point_dir(run_dir, index)),
                               resume=None, wandb_group=args.wandb_group or run_dir.name)


def point_runs(tree: Any, index: int, num_seeds: int, axis: int = 0) -> Any:
    """The runs of point `index` (its seeds) of a tree whose leaves have the runs' axis at `axis`."""
    runs = slice(index * num_seeds, (index + 1) * num_seeds)
    return jax.tree.map(lambda leaf: leaf[(slice(None),) * axis + (runs,)], tree)


class PointLoggers:
    """The metrics logger of a sweep: each point's columns of a row go to a MetricsLogger of its
    own (point-<i>/metrics.jsonl, its rows tagged with its values, and its wandb runs); the
    console gets one line for the whole grid."""

    def __init__(self, args: Any, grid: Grid, run_dir: Path, metric_names: tuple[str, ...]):
        self.args, self.grid, self.metric_names = args, grid, metric_names
        self.loggers = [
            logs.MetricsLogger(host_point_args(args, grid, index, run_dir), point_dir(run_dir, index), metric_names,
                               tags={"sweep": point_values(point)}, console=False)
            for index, point in enumerate(grid.points)
        ]
        self.last_print = 0.0
        self.start_time = self.last_time = 0.0
        self.start_cycle = self.last_cycle = 0

    @property
    def error(self) -> Any:
        return next((logger.error for logger in self.loggers if logger.error is not None), None)

    def start(self, cycle: int, wandb_runs: list[list[Any]]) -> None:
        for logger, point_wandb_runs in zip(self.loggers, wandb_runs or [[] for _ in self.loggers]):
            logger.start(cycle, point_wandb_runs)
        self.start_time = self.last_time = time.perf_counter()
        self.start_cycle = self.last_cycle = cycle

    def __call__(self, cycles: list[int], values: Any, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else float(now)
        num_seeds = self.args.num_seeds
        for index, logger in enumerate(self.loggers):
            logger(cycles, np.asarray(values)[..., index * num_seeds:(index + 1) * num_seeds], now)
        if jax.process_index() != 0:
            return
        if now - self.last_print >= 1.0 or cycles[-1] == self.args.num_cycles:
            self.print_line(cycles[-1], np.asarray(values, np.float64)[-1], now)

    def print_line(self, cycle: int, row: np.ndarray, now: float) -> None:
        """The console line with each point's return (mean over its seeds), named by its values."""
        steps = (cycle - self.last_cycle) * self.args.batch_size * row.shape[-1]
        sps = steps / max(now - self.last_time, 1e-9)
        self.last_print, self.last_time, self.last_cycle = now, now, cycle
        returns = row[self.metric_names.index("charts/episodic_return")].reshape(len(self.grid.points), -1)
        by_point = " | ".join(
            f"{point_label(point)}: {np.nanmean(point_returns):.2f}" if np.isfinite(point_returns).any()
            else f"{point_label(point)}: -"
            for point, point_returns in zip(self.grid.points, returns)
        )
        print(logs.console_line(f"return by point: {by_point}", cycle, sps, self.args, now - self.start_time, self.start_cycle),
              flush=True)

    def log_video(self, path: Path, cycle: int) -> None:  # videos show point 0's first seed
        self.loggers[0].log_video(path, cycle)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()
