"""One training session of a script, around its compiled train loop: the run dir is opened (new,
or resumed from its newest valid checkpoint), the program is compiled, then trained with its host
callbacks (metrics.jsonl, the console, wandb, checkpoints, videos), and the results are written
(params.msgpack, summary.json). Bad input and compile errors leave nothing written."""

from __future__ import annotations

import json
import logging
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable

import flax.serialization
import jax
import numpy as np

from . import devices, evaluation, logs, nan_guard, rundir, sweeps, videos
from .errors import ConfigError


class Session:
    """Created before anything is compiled: checks --run-dir or --resume (and reads the checkpoint
    to resume), and makes the metrics logger; nothing is written yet."""

    def __init__(self, args: Any, metric_names: tuple[str, ...]):
        self.args = args
        self.start_time = time.perf_counter()
        self.writes = jax.process_index() == 0  # --distributed: process 0 writes, prints and logs; the others only train
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
        # Each run of metrics.jsonl and summary.json, as (its args, its folder): the run, or each point of a sweep.
        self.points = [(args, self.path)] if self.grid is None else [
            (sweeps.host_point_args(args, self.grid, index, self.path), sweeps.point_dir(self.path, index))
            for index in range(len(self.grid.points))
        ]
        names = metric_names + evaluation.eval_metric_names(args)
        if self.grid is None:
            self.logger = logs.MetricsLogger(args, self.path, names)
        else:
            self.logger = sweeps.PointLoggers(args, self.grid, self.path, names)
        self.host = logs.HostQueue()  # the loop's callbacks only queue their arrays; its thread runs them, in order
        self.start_cycle = 0
        self.kept_rows: list[list[dict[str, Any]]] = [[] for _ in self.points]  # a resumed run's rows up to its checkpoint
        self.wandb_runs: list[list[Any]] = [[] for _ in self.points]
        self.compile_seconds = self.train_seconds = 0.0

    def video_recorder(self, env_params: Any) -> Callable | None:
        """The video callback (--capture-video), or None."""
        recorder = videos.make_video_recorder(self.args, env_params, self.path, self.logger)
        return None if recorder is None else self.host.wrap(recorder)

    def restore(self, states: Any) -> Any:
        """The freshly initialised seeds' `states` once per point of a --sweep; with --resume, the
        checkpoint's states in their place."""
        states = sweeps.runs_of_points(states, self.grid, self.args.num_seeds)
        if self.args.resume:
            states, self.start_cycle = self.checkpointer.load(states)
            devices.check_same_on_every_process(self.start_cycle, f"the cycle of the checkpoint in {self.path}")
        return states

    def train(self, train: Callable, states: Any, mesh: jax.sharding.Mesh | None = None) -> tuple[Any, dict[str, Any]]:
        """Compiles train(states, log_fn, checkpoint_fn, start_cycle) (the script's make_train),
        then writes args.json (or, resumed, drops what came after the checkpoint), starts wandb
        and runs it. Returns the final states and the metrics of the cycles run."""
        log_fn, checkpoint_fn = self.host.wrap(self.logger, timed=True), self.host.wrap(self.checkpointer)
        program = jax.jit(lambda states: train(states, log_fn, checkpoint_fn, self.start_cycle), donate_argnums=0)
        compiled = program.lower(states).compile()
        self.compile_seconds = time.perf_counter() - self.start_time
        devices.wait_for_every_process("compiled")  # --distributed: every process has checked its flags and files
        if self.writes:
            print(f"compiled in {self.compile_seconds:.1f} s{'' if mesh is None else f' on {mesh.size} devices'}", flush=True)
            self.start_writing()
        logging.getLogger("jax._src.debugging").addFilter(rundir.without_write_error_tracebacks)
        train_start = time.perf_counter()
        try:
            states, metrics = devices.fetch(compiled(states))  # fetch: --distributed's arrays span processes
            jax.block_until_ready((states, metrics))
            self.host.wait()
        except jax.errors.JaxRuntimeError as error:
            write_error = self.checkpointer.error or self.logger.error
            if write_error is None:
                devices.raise_if_a_process_was_lost(error)
                raise
            raise write_error from None
        finally:
            self.logger.close()
        self.train_seconds = time.perf_counter() - train_start
        return states, metrics

    def start_writing(self) -> None:
        """Once compiled: the first writes to the run dir, the wandb runs, and the metrics logger."""
        args = self.args
        if args.resume:
            self.kept_rows = [rundir.keep_metrics_up_to(folder, self.start_cycle, self.resumable_names) for _, folder in self.points]
            self.checkpointer.drop_after(self.start_cycle)
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
        print(f"run dir: {self.path}  |  {args.num_cycles} cycles x {args.batch_size} env steps x {args.num_seeds} seeds{points}",
              flush=True)
        self.logger.start(self.start_cycle, self.wandb_runs[0] if self.grid is None else self.wandb_runs)

    def finish(self, states: Any, metrics: dict[str, Any], more_results: dict[str, Any] | None = None) -> dict[str, Any]:
        """Writes params.msgpack, each of `more_results` that is not None (file name: tree), and
        summary.json (with --sweep: into each point's folder, and a summary of the points into the
        run dir); finishes wandb; reports every failed seed on stderr. Returns the summary."""
        summaries = []
        for index, (args, folder) in enumerate(self.points):
            point_states = self.runs_of_point(states, index)
            summary = self.summary(args, self.kept_rows[index], point_states, self.runs_of_point(metrics, index, axis=1))
            summaries.append(summary)
            if self.writes:
                (folder / "params.msgpack").write_bytes(flax.serialization.to_bytes(point_states.params))
                for name, tree in (more_results or {}).items():
                    if tree is not None:
                        (folder / name).write_bytes(flax.serialization.to_bytes(self.runs_of_point(tree, index)))
                (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
                logs.finish_wandb_runs(args, self.wandb_runs[index], summary)
        summary = summaries[0] if self.grid is None else self.sweep_summary(summaries)
        if not self.writes:
            return summary
        if self.grid is not None:
            (self.path / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.report(summary, summaries)
        return summary

    def runs_of_point(self, tree: Any, index: int, axis: int = 0) -> Any:
        """The runs (seeds) of point `index` of a sweep in a tree with the runs' axis at `axis`; the
        tree itself without --sweep."""
        return tree if self.grid is None else sweeps.point_runs(tree, index, self.args.num_seeds, axis)

    def report(self, summary: dict[str, Any], summaries: list[dict[str, Any]]) -> None:
        """The console's last line, and a line on stderr per failed seed."""
        args = self.args
        if self.grid is None:
            print(
                f"done: {summary['sps']:,.0f} env steps/s, compile {self.compile_seconds:.1f} s, "
                f"final return {logs.fmt(summary['final_episodic_return'])}"
                + (f", final eval return {logs.fmt(summary['final_eval_return'])}" if args.eval_every_cycles else ""),
                flush=True,
            )
        else:
            returns = " | ".join(f"{point['point']}: {logs.fmt(point['final_episodic_return'])}" for point in summary["points"])
            print(f"done: {summary['sps']:,.0f} env steps/s, compile {self.compile_seconds:.1f} s, final return by point "
                  f"{returns}", flush=True)
        level = "error" if self.grid is None or summary["every_point_failed"] else "warning"
        for index, ((_, folder), point_summary) in enumerate(zip(self.points, summaries)):
            where = "" if self.grid is None else f"point {index} ({sweeps.point_label(self.grid.points[index])}): "
            for seed, failure in point_summary["failures"].items():
                print(
                    f"{level}: {where}seed {seed}: non-finite {failure['non_finite']} at cycle {failure['cycle']}; no update "
                    f"was applied from then on. {folder}/params.msgpack holds its last good parameters.",
                    file=sys.stderr,
                )

    def summary(self, args: Any, kept_rows: list[dict[str, Any]], states: Any, metrics: dict[str, Any]) -> dict[str, Any]:
        """summary.json of a run (or of a point of a sweep: its args, rows and seeds): speed, the
        final returns (the last 10% of cycles, a resumed run's earlier rows included), the final
        evaluation, memory, and the seeds the NaN guard stopped."""
        episodic_return = np.full((args.num_cycles, args.num_seeds), np.nan)
        seed_index = {args.seed + i: i for i in range(args.num_seeds)}
        for row in kept_rows:
            if row["charts/episodic_return"] is not None:
                episodic_return[row["cycle"] - 1, seed_index[row["seed"]]] = row["charts/episodic_return"]
        episodic_return[self.start_cycle:] = np.asarray(metrics["charts/episodic_return"])
        returns = rundir.final_returns(args, episodic_return)
        eval_returns = rundir.final_eval_returns(args, metrics)
        return {
            "sps": (args.num_cycles - self.start_cycle) * args.batch_size * args.num_seeds / self.train_seconds,
            "compile_seconds": self.compile_seconds,
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
            **{key: first[key] for key in ("compile_seconds", "train_seconds", "total_seconds", "env_steps_per_seed",
                                           "num_seeds", "resumed_from_cycle", "peak_rss_mb", "peak_device_memory_mb")},
            "failures": {point["dir"]: point["failures"] for point in points if point["failures"]},
            "every_point_failed": all(point["failures"] for point in points),
        }


def mean_or_none(values: list[float | None]) -> float | None:
    finite = [value for value in values if value is not None]
    return float(np.mean(finite)) if finite else None
