"""One training session of a script, around its compiled train program: the run dir is opened
(new, or resumed from its newest valid checkpoint), the program is compiled (JAX's persistent
compilation cache keeps it for the next run of the same configuration), then run in segments
(segments.py) while a host thread writes what they return (metrics.jsonl, the console, wandb,
checkpoints, videos), and the results are written (params.msgpack, summary.json). Ctrl-C or
SIGTERM stops it at the end of a segment with a checkpoint, the metrics rows up to it and
params.msgpack, for --resume. Bad input and compile errors leave nothing written."""

from __future__ import annotations

import json
import resource
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np

from . import compilation, contract, cpu, devices, evaluation, logs, nan_guard, provenance, rundir, segments, sweeps, videos
from .errors import ConfigError, Interrupted


class Session:
    """Created before anything is compiled: checks --run-dir or --resume (and reads the checkpoint
    to resume), turns on the compilation cache and makes the metrics logger; nothing is written yet."""

    def __init__(self, args: Any, metric_names: tuple[str, ...]):
        contract.check_metric_names(metric_names, args)  # before anything is written
        provenance.script_source(provenance.script_path(args))  # the script as this run reads it, kept for the run dir
        self.args = args
        self.start_time = time.perf_counter()
        self.writes = jax.process_index() == 0  # --distributed: process 0 writes, prints and logs; the others only train
        if self.writes:
            logs.check_wandb_can_log(args)  # --track: wandb's API key, or its offline mode
        self.resumable_names = metric_names  # what every row of a resumed run's metrics.jsonl holds
        self.grid = sweeps.parse(args)  # --sweep: its points; else None
        folders = ["."] if self.grid is None else [sweeps.POINT_DIR.format(index=i) for i in range(len(self.grid.points))]
        if args.resume:
            self.path, self.checkpointer = rundir.prepare_resume(args, metric_names, folders)
        else:
            self.path = Path(args.run_dir) if args.run_dir else rundir.default_run_dir(args)
            if any((self.path / folder / "metrics.jsonl").exists() for folder in folders):
                raise ConfigError(f"--run-dir {self.path} already holds a run; choose another folder, or --resume it")
            self.checkpointer = rundir.Checkpointer(self.path, args.keep_checkpoints)
        compilation.use_cache(args.compilation_cache_dir)
        # Each run of metrics.jsonl and summary.json, as (its args, its folder): the run, or each point of a sweep.
        self.points = [(args, self.path)] if self.grid is None else [
            (sweeps.host_point_args(args, self.grid, index, self.path), sweeps.point_dir(self.path, index))
            for index in range(len(self.grid.points))
        ]
        self.metric_names = metric_names + evaluation.eval_metric_names(args)  # the train program's, in its rows' order
        if self.grid is None:
            self.logger = logs.MetricsLogger(args, self.path, self.metric_names)
        else:
            self.logger = sweeps.PointLoggers(args, self.grid, self.path, self.metric_names)
        self.host = logs.HostQueue()  # a thread of its own writes what the segments return, in order
        self.stop_requests = segments.StopRequests()
        self.start_cycle = 0
        self.kept_rows: list[list[dict[str, Any]]] = [[] for _ in self.points]  # a resumed run's rows up to its checkpoint
        self.wandb_runs: list[list[Any]] = [[] for _ in self.points]
        self.episodic_returns = np.empty((0, 0))  # (cycles, runs): charts/episodic_return of every cycle, for the summary
        self.final_eval_returns: np.ndarray | None = None  # (runs,): eval/episodic_return at the last cycle
        self.program: Callable | None = None  # the train program, compiled (segments.make_program)
        self.video: Callable | None = None  # --capture-video: the compiled program that plays a video's episode
        self.video_recorder: videos.VideoRecorder | None = None
        self.compiling: segments.Background | None = None
        self.initialised = threading.Event()  # the seeds' init has run (restore)
        self.mesh: jax.sharding.Mesh | None = None
        self.max_cycles = 1
        self.training = False  # the program runs
        self.stop_signal = 0  # the signal that stopped training; 0: it ran to the end
        self.compile_seconds = self.train_seconds = 0.0  # from this session's start to a compiled program; training
        self.program_compile_seconds = 0.0  # XLA's compile of the train program, or its load from the cache
        self.program_from_cache = False

    def compile(self, train: Callable, init: Callable, mesh: jax.sharding.Mesh | None = None,
                policy: evaluation.Policy | None = None, env_params: Any = None) -> None:
        """Starts compiling the train program (segments.make_program of the script's make_train
        train) on a thread of its own, at the shapes the seeds' init(seed) gives. On an
        accelerator XLA compiles it while the seeds are initialised on the host's CPU
        (devices.on_host_cpu); on a CPU, once they are (`restore`), with the unrolled threefry
        (cpu.use_unrolled_threefry_on_cpu): there the two compiles would share the same cores, and
        init compiles faster without it (docs/performance.md). policy and env_params: the
        script's (make_evaluation), for --capture-video. From here on Ctrl-C and SIGTERM are the
        run's: before training starts, one ends it with nothing written."""
        args = self.args
        self.video_recorder = videos.make_video_recorder(args, env_params, self.path, self.logger)
        seeds = [args.seed + i for i in range(args.num_seeds)]
        shapes = jax.eval_shape(lambda: self.fresh_states(devices.stack_seeds([init(seed) for seed in seeds])))
        shapes = devices.shapes_on_mesh(shapes, mesh)
        self.max_cycles = segments.max_segment_cycles(args.num_cycles, len(self.metric_names), shapes.cycle.shape[0])
        self.mesh = mesh
        self.stop_requests.install(self.stop_message)
        if self.writes:
            print(f"compiling the train program{'' if mesh is None else f' for {mesh.size} devices'}...", flush=True)

        on_cpu = jax.default_backend() == "cpu"

        def compile_programs() -> None:
            if on_cpu:
                self.initialised.wait()
                cpu.use_unrolled_threefry_on_cpu()
            lowered = segments.make_program(train, self.max_cycles, mesh).lower(*segments.program_inputs(shapes, mesh))
            start, hits = time.perf_counter(), compilation.cache_hits_in_this_thread()
            self.program = lowered.compile()
            self.program_compile_seconds = time.perf_counter() - start
            self.program_from_cache = compilation.cache_hits_in_this_thread() > hits
            if self.video_recorder is not None:
                self.video = jax.jit(lambda states: evaluation.record_video(policy, states, args)).lower(shapes).compile()

        self.compiling = segments.Background(compile_programs)

    def fresh_states(self, states: Any) -> Any:
        """The seeds' freshly initialised states once per point of a --sweep, without weak types."""
        return jax.tree.map(strongly_typed, sweeps.runs_of_points(states, self.grid, self.args.num_seeds))

    def restore(self, states: Any) -> Any:
        """fresh_states of the seeds' `states`; with --resume, the checkpoint's states in their place."""
        self.initialised.set()
        try:
            states = self.fresh_states(states)
            if self.args.resume:
                states, self.start_cycle = self.checkpointer.load(states)
                devices.check_same_on_every_process(self.start_cycle, f"the cycle of the checkpoint in {self.path}")
        except BaseException:
            self.stop_requests.restore()
            raise
        return devices.place_on_mesh(states, self.mesh)

    def train(self, states: Any) -> Any:
        """Once the program has compiled: writes args.json (or, resumed, drops what came after the
        checkpoint), starts wandb and runs the program in segments from the states (restore's).
        Returns the final states (with --distributed, gathered whole in every process)."""
        args, mesh = self.args, self.mesh
        try:
            self.compiling.wait()  # on a lock that a signal interrupts: Ctrl-C is seen at once
            self.compile_seconds = time.perf_counter() - self.start_time
            if self.stop_requests.signal_number and jax.process_count() == 1:  # (--distributed: stopped by every process)
                raise Interrupted(f"{segments.signal_name(self.stop_requests.signal_number)}: stopped before training "
                                  "started; nothing was written", exit_code=128 + self.stop_requests.signal_number)
            devices.wait_for_every_process("compiled")  # --distributed: every process has checked its flags and files
            if self.writes:
                how = "loaded from the compilation cache" if self.program_from_cache else "XLA compiled"
                print(f"compiled in {self.compile_seconds:.1f} s{'' if mesh is None else f' on {mesh.size} devices'} (the train "
                      f"program {how} in {self.program_compile_seconds:.1f} s)", flush=True)
                self.start_writing()
        except BaseException:
            self.stop_requests.restore()
            raise
        self.episodic_returns = np.full((args.num_cycles, states.cycle.shape[0]), np.nan)
        for point_index, rows in enumerate(self.kept_rows):  # a resumed run's, up to its checkpoint
            for row in rows:
                if row["charts/episodic_return"] is not None:
                    run = point_index * args.num_seeds + row["seed"] - args.seed
                    self.episodic_returns[row["cycle"] - 1, run] = row["charts/episodic_return"]
        self.training = True
        train_start = time.perf_counter()
        try:
            states, self.stop_signal = segments.run(self.program, states, self.start_cycle, args.num_cycles, self.must_end,
                                                    self.max_cycles, mesh, self.stop_requests, self.after_segment)
            self.host.wait()
            states = devices.fetch(states)  # --distributed: every process gathers the whole states
        except BaseException as error:
            self.stop_requests.restore()
            if isinstance(error, Exception):  # a failed collective: the program's (JaxRuntimeError) or a gather's (ValueError)
                devices.raise_if_a_process_was_lost(error)
            raise
        finally:
            self.logger.close()
        self.train_seconds = time.perf_counter() - train_start
        return states

    def stop_message(self, signal_number: int) -> str:
        quit_now = "Ctrl-C to quit at once" if signal_number == signal.SIGTERM else "once more to quit at once"
        if not self.training:
            return (f"{segments.signal_name(signal_number)}: stopping once the program has compiled, with nothing written; "
                    f"{quit_now}")
        return (f"{segments.signal_name(signal_number)}: stopping at the end of the segment in flight, with a checkpoint "
                f"for --resume; {quit_now}")

    def must_end(self, cycle: int) -> bool:
        """A segment must end at every checkpoint and video cycle, so that the host sees the states."""
        return cycle % logs.checkpoint_interval(self.args) == 0 or (self.video is not None and self.video_due(cycle))

    def video_due(self, cycle: int) -> bool:
        return bool(evaluation.evaluation_due(cycle, self.args))

    def after_segment(self, segment: segments.Segment) -> None:
        """On the host, while the next segment computes: its metrics rows, its returns for the
        summary, and the checkpoint and video of its last cycle when they are due."""
        self.host.raise_error()  # a write that failed stops the run
        args, first, last = self.args, segment.first_cycle, segment.last_cycle
        self.episodic_returns[first:last] = segment.metrics["charts/episodic_return"]
        if last == args.num_cycles and args.eval_every_cycles:
            self.final_eval_returns = segment.metrics["eval/episodic_return"][-1]
        cycles = [cycle for cycle in range(first + 1, last + 1) if logs.row_due(cycle, args)]
        if cycles:
            values = np.stack([segment.metrics[name] for name in self.metric_names], axis=1)  # (cycles, metrics, runs)
            self.host.submit(self.logger, cycles, values[[cycle - first - 1 for cycle in cycles]], segment.ready_time)
        if last % logs.checkpoint_interval(args) == 0:
            self.checkpoint(segment.states)
        if self.video is not None and self.video_due(last):
            self.host.submit(self.video_recorder, *devices.fetch(self.video(segment.states)))

    def checkpoint(self, states: Any) -> None:
        """Queues a checkpoint of the states, unless a seed has failed (the last good checkpoint
        stays on disk; a --sweep goes on checkpointing its other points)."""
        if self.grid is None and np.any(segments.local_copy(states.non_finite) > 0):
            return
        cycle = int(segments.local_copy(states.cycle)[0])
        self.host.submit(self.checkpointer, cycle, devices.fetch(jax.tree.map(devices.key_data_or_array, states)))

    def start_writing(self) -> None:
        """Once compiled: the first writes to the run dir, the wandb runs, and the metrics logger."""
        args = self.args
        if args.resume:
            self.kept_rows = [rundir.keep_metrics_up_to(folder, self.start_cycle, self.resumable_names) for _, folder in self.points]
            self.checkpointer.drop_after(self.start_cycle)
            rundir.clear_interrupted(self.path)
            print(f"resuming {self.path} from cycle {self.start_cycle}", flush=True)
        else:
            self.path.mkdir(parents=True, exist_ok=True)
            rundir.write_args(self.path, args)
            if self.grid is not None:
                for point_args, folder in self.points:
                    folder.mkdir(exist_ok=True)
                    rundir.write_args(folder, point_args)
        if args.track and self.grid is None:
            self.wandb_runs = [logs.start_wandb_runs(args, self.path)]
        elif args.track:  # a run per point (or per point and seed), named and configured with its values, grouped
            self.wandb_runs = [
                logs.start_wandb_runs(point_args, folder, name=f"{self.path.name}__{sweeps.point_label(point)}",
                                      more_config={"sweep": sweeps.point_values(point)})
                for (point_args, folder), point in zip(self.points, self.grid.points)
            ]
        points = "" if self.grid is None else f" x {len(self.grid.points)} points"
        print(f"run dir: {self.path}  |  {args.num_cycles} cycles x {args.batch_size} env steps x {args.num_seeds} "
              f"seed{'' if args.num_seeds == 1 else 's'}{points}",
              flush=True)
        self.logger.start(self.start_cycle, self.wandb_runs[0] if self.grid is None else self.wandb_runs)

    def finish(self, states: Any, more_results: dict[str, Any] | None = None) -> dict[str, Any]:
        """Writes params.msgpack, each of `more_results` that is not None (file name: tree), and
        summary.json (with --sweep: into each point's folder, and a summary of the points into the
        run dir); finishes wandb; reports every failed seed on stderr. Returns the summary. A run
        that a signal stopped gets its checkpoint and params.msgpack, and raises Interrupted."""
        try:
            self.write_results(states, more_results)
            cycle = int(np.asarray(states.cycle)[0])
            if cycle < self.args.num_cycles:
                self.interrupted(states, cycle)
            summaries = []
            for index, (args, folder) in enumerate(self.points):
                summary = self.summary(args, self.runs_of_point(self.episodic_returns, index, axis=1),
                                       self.runs_of_point(states, index), self.runs_of_point(self.final_eval_returns, index))
                summaries.append(summary)
                if self.writes:
                    (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
                    logs.finish_wandb_runs(args, self.wandb_runs[index], summary)
            summary = summaries[0] if self.grid is None else self.sweep_summary(summaries)
            if not self.writes:
                return summary
            if self.grid is not None:
                (self.path / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            self.report(summary, summaries)
            return summary
        finally:
            self.stop_requests.restore()

    def write_results(self, states: Any, more_results: dict[str, Any] | None) -> None:
        """params.msgpack and each of `more_results` that is not None, in each point's folder."""
        if not self.writes:
            return
        for index, (_, folder) in enumerate(self.points):
            (folder / "params.msgpack").write_bytes(flax.serialization.to_bytes(self.runs_of_point(states.params, index)))
            for name, tree in (more_results or {}).items():
                if tree is not None:
                    (folder / name).write_bytes(flax.serialization.to_bytes(self.runs_of_point(tree, index)))

    def interrupted(self, states: Any, cycle: int) -> None:
        """A run stopped by a signal at `cycle`: its checkpoint (unless a seed has failed: the last
        good one stays), the mark that it is unfinished, and Interrupted with the --resume command."""
        if self.grid is not None or not np.any(np.asarray(states.non_finite) > 0):
            self.checkpointer(cycle, jax.tree.map(devices.key_data_or_array, states))
        signal_name = segments.signal_name(self.stop_signal)
        command = f"python {provenance.script_path(self.args).name} --resume {self.path}"
        if self.writes:
            rundir.mark_interrupted(self.path, cycle, signal_name, command)
            for wandb_runs in self.wandb_runs:
                for wandb_run in wandb_runs:
                    wandb_run.finish(exit_code=128 + self.stop_signal)
        raise Interrupted(
            f"{signal_name}: stopped at cycle {cycle}/{self.args.num_cycles}; {self.path} holds its checkpoint, metrics "
            f"and params.msgpack. Continue with: {command}",
            exit_code=128 + self.stop_signal,
        )

    def runs_of_point(self, tree: Any, index: int, axis: int = 0) -> Any:
        """The runs (seeds) of point `index` of a sweep in a tree with the runs' axis at `axis`; the
        tree itself without --sweep."""
        return tree if self.grid is None or tree is None else sweeps.point_runs(tree, index, self.args.num_seeds, axis)

    def report(self, summary: dict[str, Any], summaries: list[dict[str, Any]]) -> None:
        """The console's last line, and a line on stderr per failed seed."""
        args = self.args
        if self.grid is None:

            def with_seeds(name: str) -> str:  # the mean, then each seed's value when there are several
                per_seed = "" if args.num_seeds == 1 else f" (seeds: {', '.join(map(logs.fmt, summary[name + '_per_seed']))})"
                return logs.fmt(summary[name]) + per_seed

            print(
                f"done: {summary['sps']:,.0f} env steps/s, compile {self.compile_seconds:.1f} s, "
                f"final return {with_seeds('final_episodic_return')}"
                + (f", final eval return {with_seeds('final_eval_return')}" if args.eval_every_cycles else "")
                + f" | run dir: {self.path}",
                flush=True,
            )
        else:
            returns = " | ".join(f"{sweeps.point_label(point)}: {logs.fmt(point_summary['final_episodic_return'])}"
                                 for point, point_summary in zip(self.grid.points, summary["points"]))
            print(f"done: {summary['sps']:,.0f} env steps/s, compile {self.compile_seconds:.1f} s, final return by point: "
                  f"{returns} | run dir: {self.path}", flush=True)
        level = "error" if self.grid is None or summary["every_point_failed"] else "warning"
        for index, ((_, folder), point_summary) in enumerate(zip(self.points, summaries)):
            where = "" if self.grid is None else f"point {index} ({sweeps.point_label(self.grid.points[index])}): "
            for seed, failure in point_summary["failures"].items():
                print(
                    f"{level}: {where}seed {seed}: non-finite {failure['non_finite']} at cycle {failure['cycle']}; no update "
                    f"was applied from then on. {folder}/params.msgpack holds its last good parameters.",
                    file=sys.stderr,
                )

    def summary(self, args: Any, episodic_returns: np.ndarray, states: Any, final_eval_returns: np.ndarray | None) -> dict[str, Any]:
        """summary.json of a run (or of a point of a sweep: its args, returns and seeds): speed, the
        final returns (the last 10% of cycles, a resumed run's earlier rows included), the final
        evaluation, memory, and the seeds the NaN guard stopped. episodic_returns: (cycles, seeds)."""
        returns = rundir.final_returns(args, episodic_returns)
        eval_returns = rundir.final_eval_returns(args, final_eval_returns)
        return {
            "sps": (args.num_cycles - self.start_cycle) * args.batch_size * args.num_seeds / self.train_seconds,
            "compile_seconds": self.compile_seconds,
            "program_compile_seconds": self.program_compile_seconds,
            "program_from_cache": self.program_from_cache,
            "train_seconds": self.train_seconds,
            "total_seconds": time.perf_counter() - self.start_time,
            "env_steps_per_seed": args.num_cycles * args.batch_size,
            "num_seeds": args.num_seeds,
            "resumed_from_cycle": self.start_cycle,
            "final_episodic_return": mean_or_none(returns),
            "final_episodic_return_per_seed": returns,
            "final_eval_return": mean_or_none(eval_returns),  # --eval-every-cycles
            "final_eval_return_per_seed": eval_returns,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
            "peak_device_memory_mb": devices.peak_device_memory_mb(),
            "devices": devices.description(),
            "jax_version": jax.__version__,
            "failures": nan_guard.failures(states, args.seed),
        }

    def sweep_summary(self, summaries: list[dict[str, Any]]) -> dict[str, Any]:
        """The run dir's summary.json of a sweep: the grid, each point's folder, values, final
        returns and failed seeds, and the speed of the whole program. A point failed when one of
        its seeds did; the exit code is 1 only when every point failed."""
        points = [
            {"point": index, "dir": folder.name, "sweep": sweeps.point_values(point),
             **{key: summary[key] for key in ("final_episodic_return", "final_eval_return", "failures")}}
            for index, ((_, folder), point, summary) in enumerate(zip(self.points, self.grid.points, summaries))
        ]
        first = summaries[0]
        return {
            "sweep": list(self.args.sweep),
            "points": points,
            "sps": sum(summary["sps"] for summary in summaries),
            **{key: first[key] for key in ("compile_seconds", "program_compile_seconds", "program_from_cache", "train_seconds",
                                           "total_seconds", "env_steps_per_seed", "num_seeds", "resumed_from_cycle",
                                           "peak_rss_mb", "peak_device_memory_mb", "devices", "jax_version")},
            "failures": {point["dir"]: point["failures"] for point in points if point["failures"]},
            "every_point_failed": all(point["failures"] for point in points),
        }


def strongly_typed(leaf: jax.Array) -> jax.Array:
    """The leaf without JAX's weak type (gymnax's step counters start as weakly typed ints), as a
    checkpoint restores it: a fresh run and its resumption then trace the same program, which the
    compilation cache finds again."""
    return leaf if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key) else jnp.asarray(leaf, leaf.dtype)


def mean_or_none(values: list[float | None]) -> float | None:
    finite = [value for value in values if value is not None]
    return float(np.mean(finite)) if finite else None
