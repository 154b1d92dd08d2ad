"""What the host writes of a run's metrics, on a thread of its own (HostQueue) while the device
trains: MetricsLogger writes metrics.jsonl, the console line and wandb, from the rows each
segment of the train program returns (segments.py); rundir.Checkpointer, on the same thread,
writes the checkpoints. The metric names are the script's: its run_metric_names, passed in."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from . import contract, envs, evaluation, provenance, rundir
from .errors import ConfigError, WriteError

class HostQueue:
    """Runs the host's writes (the metrics logger, the checkpointer, the video recorder) on one
    thread of its own, in the order they were submitted, while the main thread keeps the device
    busy. The first error stops the queue: raise_error and wait raise it, which stops the run."""

    def __init__(self):
        self.jobs: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        threading.Thread(target=self.work, daemon=True).start()

    def submit(self, host_fn: Callable, *arrays: Any) -> None:
        """host_fn(*arrays) on the thread, with every JAX array in `arrays` as a NumPy array. Their
        copies to the host start now, all at once, while the device goes on."""
        for leaf in jax.tree.leaves(arrays):
            if isinstance(leaf, jax.Array):
                leaf.copy_to_host_async()
        self.jobs.put((host_fn, arrays))

    def work(self) -> None:
        while True:
            host_fn, arrays = self.jobs.get()
            try:
                if self.error is None:
                    host_fn(*jax.device_get(arrays))
            except BaseException as error:  # kept for raise_error() and wait()
                self.error = error
            finally:
                self.jobs.task_done()

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def wait(self) -> None:
        """Waits for every job submitted; raises the first error."""
        self.jobs.join()
        self.raise_error()


def row_due(cycle: int, args: Any) -> bool:
    """Whether metrics.jsonl gets a row of this cycle: every --log-every-cycles, every evaluation and the last."""
    return cycle % args.log_every_cycles == 0 or bool(evaluation.evaluation_due(cycle, args))


def checkpoint_interval(args: Any) -> int:
    return args.checkpoint_every_cycles or max(1, args.num_cycles // 10)


class MetricsLogger:
    """The metrics rows of a run: metrics.jsonl, a console line and wandb. A failed write (disk
    full, no permission) raises a WriteError, which stops the run."""

    def __init__(self, args: Any, run_dir: Path, metric_names: tuple[str, ...], tags: dict[str, Any] | None = None,
                 console: bool = True):
        self.args = args
        self.tags = tags or {}  # added to every row of metrics.jsonl (a --sweep point's values)
        self.console = console  # print the console line (a --sweep prints one line for its points)
        self.metric_names = metric_names  # the order of the rows' values: the script's run_metric_names
        # CleanRL's names for three of ours (contract.CLEANRL_NAMES), logged again under them after
        # ours in every row and wandb step: (CleanRL's name, the index of ours).
        self.aliases = [(name, metric_names.index(ours)) for name, ours in contract.CLEANRL_NAMES.items() if ours in metric_names]
        self.logged_names = metric_names + tuple(name for name, _ in self.aliases)  # the names of a row's values, in order
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

    def __call__(self, cycles: list[int], values: Any, now: float | None = None) -> None:
        """The rows of `cycles`, values (rows, len(metric_names), num_seeds), computed by time `now`
        (time.perf_counter(); by default, this call's)."""
        if jax.process_index() != 0:  # multi-host: one writer
            return
        now = time.perf_counter() if now is None else float(now)
        sps = (cycles[-1] - self.last_cycle) * self.args.batch_size * self.args.num_seeds / max(now - self.last_time, 1e-9)
        self.last_time, self.last_cycle = now, cycles[-1]
        values = np.asarray(values, dtype=np.float64)
        values = np.concatenate([values, values[:, [index for _, index in self.aliases]]], axis=1)  # + CleanRL's names
        # Plain Python floats, NaN -> None: per-value NumPy calls would cost more than the device's
        # time for a small cycle (docs/performance.md).
        rows = values.transpose(0, 2, 1).tolist()  # (rows, seeds, logged_names)
        self.write_rows(cycles, rows, sps)
        if self.wandb_runs:
            self.log_to_wandb(cycles, rows, sps)
        if self.console and (now - self.last_print >= 1.0 or cycles[-1] == self.args.num_cycles):
            self.last_print = now
            self.print_line(cycles[-1], rows[-1], sps, now)

    def write_rows(self, cycles: list[int], rows: list[list[list[float]]], sps: float) -> None:
        """metrics.jsonl: one line per cycle and seed, the line json.dumps gives of {"cycle",
        "env_steps", "seed", the tags, "charts/SPS", the metrics, CleanRL's names; NaN as null}, formatted directly:
        json.dumps of each row was 1.5x slower, and its tail held a TPU run back (docs/accelerators.md)."""
        keys = [json.dumps(name) + ": " for name in self.logged_names]
        fixed = "".join(f", {json.dumps(key)}: {json.dumps(value)}" for key, value in {**self.tags, "charts/SPS": sps}.items())
        lines = []
        for row_cycle, row in zip(cycles, rows):
            env_steps = row_cycle * self.args.batch_size
            for seed, seed_values in zip(self.seeds, row):
                values = ", ".join(key + (repr(value) if math.isfinite(value) else "null") for key, value in zip(keys, seed_values))
                lines.append(f'{{"cycle": {row_cycle}, "env_steps": {env_steps}, "seed": {seed}{fixed}, {values}}}')
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
        middle = (
            f"return {'-' if episodic_return is None else f'{episodic_return:.2f}'} | "
            f"policy loss {fmt(mean['losses/policy_loss'])} | value loss {fmt(mean['losses/value_loss'])} | "
            f"entropy {fmt(mean['losses/entropy'])} | approxkl3 {fmt(mean['losses/actor_approxkl3'])}"
            + "".join(f" | {name} {fmt(mean[name])}" for name in envs.console_env_metrics(self.metric_names))
            + (f" | eval return {fmt(mean['eval/episodic_return'])}" if mean.get("eval/episodic_return") is not None else "")
        )
        print(console_line(middle, cycle, sps, self.args, now - self.start_time, self.start_cycle), flush=True)

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
        return {prefix + name: value for name, value in zip(self.logged_names, values) if math.isfinite(value)}

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
        return {name: sum(column) / len(column) if column else None for name, column in zip(self.logged_names, columns)}

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


def console_line(middle: str, cycle: int, sps: float, args: Any, elapsed: float, start_cycle: int) -> str:
    """The console line of a run and of a sweep: progress, `middle`, the time so far and what is
    left at the rate since training started (at start_cycle)."""
    cycles_done = cycle - start_cycle
    eta = elapsed / cycles_done * (args.num_cycles - cycle) if cycles_done > 0 else None
    return (f"cycle {cycle}/{args.num_cycles} | env steps {cycle * args.batch_size:,} | SPS {sps:,.0f} | {middle} | "
            f"elapsed {clock(elapsed)} | ETA {'-' if eta is None else clock(eta)}")


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def clock(seconds: float) -> str:
    """h:mm:ss."""
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{seconds:02d}"


DEFAULT_WANDB_PROJECT = "ppo-jax"  # without --wandb-project and WANDB_PROJECT
OFFLINE_WANDB_MODES = ("offline", "dryrun", "disabled")  # wandb's modes that need no API key ("dryrun": offline)


def wandb_project(args: Any) -> str:
    """--wandb-project, else wandb's WANDB_PROJECT, else DEFAULT_WANDB_PROJECT."""
    return args.wandb_project or os.environ.get("WANDB_PROJECT") or DEFAULT_WANDB_PROJECT


def check_wandb_can_log(args: Any) -> None:
    """--track: before anything is compiled, that wandb can log in the mode the run asks for
    (--wandb-mode, else wandb's WANDB_MODE, else online): online, it needs an API key, which wandb
    looks up itself (WANDB_API_KEY, ~/.netrc, its settings) without the network. A ConfigError
    says what to do."""
    if not args.track:
        return
    from wandb.sdk import wandb_setup
    from wandb.sdk.lib.wbauth import authenticate

    try:
        settings = wandb_setup.singleton().settings  # reads WANDB_MODE, WANDB_BASE_URL, ...
        if (args.wandb_mode or settings.mode) in OFFLINE_WANDB_MODES:
            return
        found = authenticate.authenticate_session(host=settings.base_url, source="--track", prompt=False, update_session=False)
    except Exception as error:  # wandb refuses a malformed WANDB_MODE or WANDB_API_KEY (pydantic's errors span lines)
        raise ConfigError(f"--track: wandb cannot start: {' '.join(str(error).split())}") from None
    if found is None:
        raise ConfigError(
            "--track: wandb has no API key, so it cannot log online: run `wandb login` (or set WANDB_API_KEY), "
            "or log offline with WANDB_MODE=offline (or --wandb-mode offline) and upload later with `wandb sync`"
        )


def start_wandb_runs(args: Any, run_dir: Path, name: str | None = None, more_config: dict[str, Any] | None = None) -> list[Any]:
    """The wandb runs, seed 0's first: one per seed with --wandb-run-per-seed (named run_name,
    its seed in the config), else one named after the run dir. Each config holds every arg,
    the script (provenance.script_info) and its git commit, and its code is the script's copy in
    RUN_DIR/code; the group defaults to rundir.experiment_name. Each run's id is kept in
    RUN_DIR (wandb_id.txt, or wandb_id_seed_<seed>.txt), so that --resume continues it. name and
    more_config: a --sweep point's run name (in place of the run dir's) and its swept values."""
    import wandb

    config = {**dataclasses.asdict(args), **provenance.script_info(args), **provenance.git_info(provenance.script_path(args)),
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
            project=wandb_project(args),
            entity=args.wandb_entity,  # None: wandb's WANDB_ENTITY, else the user's default entity
            group=args.wandb_group or os.environ.get("WANDB_RUN_GROUP") or rundir.experiment_name(args),
            tags=list(args.wandb_tags) or None,  # None: wandb's WANDB_TAGS
            name=None if resumed_id and seed is not None else run_name,  # a resumed seed's run keeps its first name
            mode=args.wandb_mode,  # None: wandb's WANDB_MODE, else online
            dir=str(run_dir),
            config=config if seed is None else {**config, "seed": seed},
            id=resumed_id,
            resume="allow",
            reinit="create_new",  # several runs at once in this process
        )
        id_file.write_text(wandb_run.id)
        if (run_dir / rundir.CODE_DIR).is_dir():  # the script as the run ran it (rundir.write_args), as the run's code
            wandb_run.log_code(root=str(run_dir / rundir.CODE_DIR), name=f"source-{provenance.script_path(args).stem}")
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
