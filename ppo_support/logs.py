"""Metrics and checkpoints leave the jit through host callbacks (send_to_host); on the host,
HostQueue hands them to one thread of their own, where MetricsLogger writes metrics.jsonl, the
console line and wandb, and rundir.Checkpointer the checkpoints. The metric names are the
script's: its run_metric_names, passed in."""

from __future__ import annotations

import dataclasses
import json
import math
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import envs, evaluation, rundir
from .errors import WriteError

LOG_ROWS_ENV_STEPS = 8192  # metrics rows leave the jit together, once per this many env steps


class Outbox(NamedTuple):
    """Metrics rows waiting inside the jit for the next host callback (one callback costs more
    than a small cycle on CPU)."""

    rows: jax.Array  # (rows_per_callback, metrics (the run's metric names), seeds)
    row_cycles: jax.Array  # (rows_per_callback,) int
    num_rows: jax.Array  # rows filled


def empty_outbox(args: Any, num_seeds: int, num_metrics: int) -> Outbox:
    rows_per_callback = max(1, LOG_ROWS_ENV_STEPS // args.batch_size)
    return Outbox(
        rows=jnp.zeros((rows_per_callback, num_metrics, num_seeds), jnp.float32),
        row_cycles=jnp.zeros(rows_per_callback, jnp.int32),
        num_rows=jnp.int32(0),
    )


def send_to_host(
    outbox: Outbox,
    states: Any,
    metrics: dict[str, jax.Array],
    metric_names: tuple[str, ...],
    args: Any,
    log_fn: Callable | None,
    checkpoint_fn: Callable | None,
    ordered: bool,
) -> Outbox:
    """After each cycle: buffers its metrics row (every --log-every-cycles, every evaluation and
    the last cycle), sends the buffered rows to log_fn(cycles, num_rows, rows) when the buffer is
    full and at the end, and every checkpoint interval, in one callback, first the rows and then
    the states to checkpoint_fn(cycle, states), unless a seed has failed (the last good checkpoint
    stays on disk; a --sweep goes on checkpointing its other points). One callback, so that a
    checkpoint never reaches the host before the rows up to it: JAX orders callbacks on one device
    only (`ordered`). On several, each row and checkpoint carries its cycle number, and the
    checkpointer never goes back in time."""
    cycle = states.cycle[0]
    should_save = jnp.bool_(False)
    if checkpoint_fn is not None:
        should_save = cycle % checkpoint_interval(args) == 0
        if getattr(states, "sweep", None) is None:  # a --sweep checkpoints on: its failed runs stay frozen
            should_save = should_save & ~jnp.any(states.non_finite > 0)
    sent = outbox
    if log_fn is not None:
        last = cycle == args.num_cycles
        should_log = (cycle % args.log_every_cycles == 0) | evaluation.evaluation_due(cycle, args)  # the last cycle is due
        values = jnp.stack([metrics[name] for name in metric_names])  # (metrics, seeds)
        sent = Outbox(
            rows=jnp.where(should_log, outbox.rows.at[outbox.num_rows].set(values), outbox.rows),
            row_cycles=jnp.where(should_log, outbox.row_cycles.at[outbox.num_rows].set(cycle), outbox.row_cycles),
            num_rows=outbox.num_rows + should_log,
        )
        flush = (sent.num_rows > 0) & ((sent.num_rows == sent.rows.shape[0]) | last | should_save)
        jax.lax.cond(
            flush & ~should_save,
            lambda: jax.debug.callback(log_fn, sent.row_cycles, sent.num_rows, sent.rows, ordered=ordered),
            lambda: None,
        )
        outbox = sent._replace(num_rows=jnp.where(flush, 0, sent.num_rows))
    if checkpoint_fn is not None:
        host_states = jax.tree.map(rundir.key_data_or_array, states)  # callbacks take no PRNG keys

        def rows_then_checkpoint(row_cycles, num_rows, rows, cycle, host_states):
            if log_fn is not None:
                log_fn(row_cycles, num_rows, rows)
            checkpoint_fn(cycle, host_states)

        jax.lax.cond(
            should_save,
            lambda: jax.debug.callback(rows_then_checkpoint, sent.row_cycles, sent.num_rows, sent.rows, cycle, host_states,
                                       ordered=ordered),
            lambda: None,
        )
    return outbox


class HostQueue:
    """Runs the host side of the train loop's callbacks (the metrics logger, the checkpointer, the
    video recorder) on one thread of its own, in the order the callbacks came. A callback only queues its arrays and
    returns: reading them inside the callback can deadlock several devices. (On 2 simulated CPU
    devices, np.asarray on a callback's checkpoint arrays waited for as long as the callback held
    its device, while the other device waited for it in an all-reduce, until XLA aborted the
    process; see docs/scaling.md.) The first error stops the queue: the next callback raises it,
    which stops the compiled run, and so does `wait`."""

    def __init__(self):
        self.jobs: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        threading.Thread(target=self.work, daemon=True).start()

    def wrap(self, host_fn: Callable, timed: bool = False) -> Callable:
        """The callback to pass into the jit. timed: host_fn also gets the time of the call, last."""

        def queued(*arrays: Any) -> None:
            if self.error is not None:
                raise self.error
            self.jobs.put((host_fn, (*arrays, time.perf_counter()) if timed else arrays))

        return queued

    def work(self) -> None:
        while True:
            host_fn, arrays = self.jobs.get()
            try:
                if self.error is None:
                    host_fn(*jax.tree.map(np.asarray, arrays))
            except BaseException as error:  # kept for the next callback and for wait()
                self.error = error
            finally:
                self.jobs.task_done()

    def wait(self) -> None:
        """Once the compiled run has returned: waits for every queued job; raises the first error."""
        self.jobs.join()
        if self.error is not None:
            raise self.error


def checkpoint_interval(args: Any) -> int:
    return args.checkpoint_every_cycles or max(1, args.num_cycles // 10)


class MetricsLogger:
    """Host side of the metrics callback: metrics.jsonl, a console line and wandb. A failed write
    (disk full, no permission) raises a WriteError, which stops the run."""

    def __init__(self, args: Any, run_dir: Path, metric_names: tuple[str, ...], tags: dict[str, Any] | None = None,
                 console: bool = True):
        self.args = args
        self.tags = tags or {}  # added to every row of metrics.jsonl (a --sweep point's values)
        self.console = console  # print the console line (a --sweep prints one line for its points)
        self.metric_names = metric_names  # the order of the rows' values: the script's run_metric_names
        self.seeds = [args.seed + i for i in range(args.num_seeds)]
        self.path = run_dir / "metrics.jsonl"
        self.file: Any = None
        self.wandb_runs: list[Any] = []  # start_wandb_runs: seed 0's first (the only one without --wandb-run-per-seed)
        self.start_time = self.last_time = 0.0
        self.start_cycle = self.last_cycle = 0
        self.last_print = 0.0
        self.error: WriteError | None = None
        self.videos: dict[int, dict[str, Any]] = {}  # wandb videos by cycle, waiting for that cycle's row
        self.last_wandb_cycle = 0

    def start(self, cycle: int, wandb_runs: list[Any]) -> None:
        """Called once compiled, just before training: nothing is written before that."""
        self.file = open(self.path, "a")
        self.wandb_runs = wandb_runs
        self.start_time = self.last_time = time.perf_counter()
        self.start_cycle = self.last_cycle = self.last_wandb_cycle = cycle

    def __call__(self, cycles: Any, num_rows: Any, values: Any, now: float | None = None) -> None:
        """The first num_rows of cycles (rows,) and values (rows, len(metric_names), num_seeds),
        sent at time `now` (time.perf_counter(); by default, this call's)."""
        if jax.process_index() != 0:  # multi-host: one writer
            return
        now = time.perf_counter() if now is None else float(now)
        cycles = [int(cycle) for cycle in np.asarray(cycles)[: int(num_rows)]]
        if not cycles:  # a checkpoint with no rows waiting
            return
        sps = (cycles[-1] - self.last_cycle) * self.args.batch_size * self.args.num_seeds / max(now - self.last_time, 1e-9)
        self.last_time, self.last_cycle = now, cycles[-1]
        # Plain Python floats, NaN -> None: this runs while the device waits, so it avoids
        # per-value NumPy calls (docs/performance.md).
        rows = np.asarray(values, dtype=np.float64)[: len(cycles)].transpose(0, 2, 1).tolist()  # (rows, seeds, metrics)
        self.write_rows(cycles, rows, sps)
        if self.wandb_runs:
            self.log_to_wandb(cycles, rows, sps)
        if self.console and (now - self.last_print >= 1.0 or cycles[-1] == self.args.num_cycles):
            self.last_print = now
            self.print_line(cycles[-1], rows[-1], sps, now)

    def write_rows(self, cycles: list[int], rows: list[list[list[float]]], sps: float) -> None:
        """metrics.jsonl: one line per cycle and seed."""
        lines = []
        for row_cycle, row in zip(cycles, rows):
            for seed, seed_values in zip(self.seeds, row):
                line = {"cycle": row_cycle, "env_steps": row_cycle * self.args.batch_size, "seed": seed, **self.tags,
                        "charts/SPS": sps}
                line.update((name, value if math.isfinite(value) else None) for name, value in zip(self.metric_names, seed_values))
                lines.append(json.dumps(line))
        try:
            self.file.write("\n".join(lines) + "\n")
            self.file.flush()
        except OSError as error:
            self.error = WriteError(f"cannot write {self.path}: {error}; the run stopped")
            raise self.error from None

    def log_to_wandb(self, cycles: list[int], rows: list[list[list[float]]], sps: float) -> None:
        """Every row, against its env steps, with the videos of its cycle and before."""
        for row_cycle, row in zip(cycles, rows):
            row_env_steps = row_cycle * self.args.batch_size
            logs = self.wandb_logs(row, row_env_steps, sps)
            for video_cycle in [video_cycle for video_cycle in self.videos if video_cycle <= row_cycle]:
                logs[0].update(self.videos.pop(video_cycle))  # to seed 0's run
            for wandb_run, log in zip(self.wandb_runs, logs):
                wandb_run.log(log, step=row_env_steps)
            self.last_wandb_cycle = row_cycle

    def print_line(self, cycle: int, row: list[list[float]], sps: float, now: float) -> None:
        """The console line: progress, the seeds' mean return and losses, the time so far and
        what is left at the rate since training started."""
        mean = self.seed_means(row)
        episodic_return = mean["charts/episodic_return"]
        elapsed = now - self.start_time
        cycles_done = cycle - self.start_cycle
        eta = elapsed / cycles_done * (self.args.num_cycles - cycle) if cycles_done > 0 else None
        print(
            f"cycle {cycle}/{self.args.num_cycles} | env steps {cycle * self.args.batch_size:,} | SPS {sps:,.0f} | "
            f"return {'-' if episodic_return is None else f'{episodic_return:.2f}'} | "
            f"policy loss {fmt(mean['losses/policy_loss'])} | value loss {fmt(mean['losses/value_loss'])} | "
            f"entropy {fmt(mean['losses/entropy'])} | approxkl3 {fmt(mean['losses/actor_approxkl3'])}"
            + "".join(f" | {name} {fmt(mean[name])}" for name in envs.console_env_metrics(self.metric_names))
            + (f" | eval return {fmt(mean['eval/episodic_return'])}" if mean.get("eval/episodic_return") is not None else "")
            + f" | elapsed {clock(elapsed)} | ETA {'-' if eta is None else clock(eta)}",
            flush=True,
        )

    def wandb_logs(self, row: list[list[float]], env_steps: int, sps: float) -> list[dict[str, float]]:
        """What each wandb run logs of one row (seeds, metrics), finite values only. Per seed
        (--wandb-run-per-seed): the seed's values under the plain names. One run: the mean over
        seeds under the plain names and, with several seeds, each seed's under seed_<seed>/.
        `global_step` (env steps per seed) is the x-axis that CleanRL's runs, and so
        openrlbenchmark, use; charts/SPS counts every seed's steps, as in metrics.jsonl."""
        common = {"global_step": env_steps, "charts/SPS": sps}
        if self.args.wandb_run_per_seed:
            return [{**common, **self.finite(seed_values)} for seed_values in row]
        log = {**common, **{name: value for name, value in self.seed_means(row).items() if value is not None}}
        if self.args.num_seeds > 1:
            for seed, seed_values in zip(self.seeds, row):
                log.update(self.finite(seed_values, prefix=f"seed_{seed}/"))
        return [log]

    def finite(self, values: list[float], prefix: str = "") -> dict[str, float]:
        return {prefix + name: value for name, value in zip(self.metric_names, values) if math.isfinite(value)}

    def log_video(self, path: Path, cycle: int) -> None:
        """A video (--capture-video) to wandb, with --track, in seed 0's run: at the env steps of its
        cycle, with that cycle's metrics row when the row is still to come, else at once (wandb's
        steps only grow)."""
        if not self.wandb_runs:
            return
        import wandb

        video = {"media/video": wandb.Video(str(path), format="gif")}
        if cycle > self.last_wandb_cycle:
            self.videos[cycle] = video
        else:
            self.wandb_runs[0].log(video)

    def seed_means(self, row: list[list[float]]) -> dict[str, float | None]:
        """Each metric's mean over the seeds where it is finite; None where it is nowhere."""
        columns = [[value for value in column if math.isfinite(value)] for column in zip(*row)]
        return {name: sum(column) / len(column) if column else None for name, column in zip(self.metric_names, columns)}

    def close(self) -> None:
        if self.file is None:  # never started: a process other than --distributed's process 0
            return
        for cycle, video in sorted(self.videos.items()):  # a video whose row never came
            self.wandb_runs[0].log(video, step=cycle * self.args.batch_size)
        self.videos = {}
        try:
            self.file.close()
        except OSError:
            if self.error is None:  # else: the rows that failed to write, already reported
                raise


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def clock(seconds: float) -> str:
    """h:mm:ss."""
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{seconds:02d}"


def start_wandb_runs(args: Any, run_dir: Path, name: str | None = None, more_config: dict[str, Any] | None = None) -> list[Any]:
    """The wandb runs, seed 0's first: one per seed with --wandb-run-per-seed (named run_name,
    its seed in the config), else one named after the run dir. Each config holds every arg,
    the script (rundir.script_info) and its git commit; the group defaults to rundir.experiment_name. Each run's id is kept in
    RUN_DIR (wandb_id.txt, or wandb_id_seed_<seed>.txt), so that --resume continues it. name and
    more_config: a --sweep point's run name (in place of the run dir's) and its swept values."""
    import wandb

    config = {**dataclasses.asdict(args), **rundir.script_info(args), **rundir.git_info(rundir.script_path(args)),
              **(more_config or {})}
    seeds = [args.seed + i for i in range(args.num_seeds)] if args.wandb_run_per_seed else [None]
    wandb_runs = []
    for seed in seeds:
        id_file = run_dir / ("wandb_id.txt" if seed is None else f"wandb_id_seed_{seed}.txt")
        resumed_id = id_file.read_text().strip() if id_file.exists() else None
        if seed is None:
            run_name = name or run_dir.name
        else:
            run_name = rundir.run_name(args, seed) + ("" if name is None else f"__{name}")
        wandb_run = wandb.init(
            project=args.wandb_project,
            entity=args.wandb_entity,
            group=args.wandb_group or rundir.experiment_name(args),
            tags=list(args.wandb_tags),
            name=None if resumed_id and seed is not None else run_name,  # a resumed seed's run keeps its first name
            mode=args.wandb_mode,
            dir=str(run_dir),
            config=config if seed is None else {**config, "seed": seed},
            id=resumed_id,
            resume="allow",
            reinit="create_new",  # several runs at once in this process
        )
        id_file.write_text(wandb_run.id)
        wandb_runs.append(wandb_run)
    return wandb_runs


def finish_wandb_runs(args: Any, wandb_runs: list[Any], summary: dict[str, Any]) -> None:
    """The run summary into each wandb run (a per-seed run gets its seed's final return and
    failure), then finish them."""
    for index, wandb_run in enumerate(wandb_runs):
        values = dict(summary)
        if args.wandb_run_per_seed:
            values["final_episodic_return"] = values.pop("final_episodic_return_per_seed")[index]
            values["failure"] = values.pop("failures").get(args.seed + index)
            values["final_eval_return"] = values.pop("final_eval_return_per_seed")[index]
        wandb_run.summary.update({key: value for key, value in values.items() if value is not None})
        wandb_run.finish()
