"""The run dir: everything a run writes and reads back. args.json (the Args, with the script and
this package's version beside them), the checkpoints and --resume (damaged files are refused with
one line), metrics.jsonl's rows, params.msgpack and summary.json."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np

from . import devices, provenance
from .errors import ConfigError, WriteError, flag

# Args that may differ when a run is resumed: they change what is logged, not what is trained.
RESUMABLE_FIELDS = (
    "track", "wandb_project", "wandb_entity", "wandb_group", "wandb_tags", "wandb_run_per_seed", "wandb_mode", "run_dir",
    "log_every_cycles", "checkpoint_every_cycles", "keep_checkpoints", "resume", "exp_name",
    "eval_every_cycles", "eval_episodes", "eval_greedy", "capture_video",  # training is the same with or without them
    "distributed", "coordinator_address", "num_processes", "process_id",  # where it runs: the same devices, the same result
    "compilation_cache_dir",  # where compiled programs are kept: the same programs
)
# What args.json holds beside the Args (script_info).
RUN_INFO_KEYS = ("script", "script_path", "script_sha256", "ppo_support_version", "ppo_support_commit", "ppo_support_sha256")
CODE_DIR = "code"  # RUN_DIR/code/<script>: the script file as the run ran it (a new run's; --resume keeps it)


class DamagedFile(ValueError):
    """A file of a run dir that cannot be read as what it should hold."""


# --- args.json --------------------------------------------------------------------------------


def saved_script(run_dir: Path, run_info: dict[str, Any]) -> Path:
    """Where a run dir keeps the copy of its script (CODE_DIR)."""
    return Path(run_dir) / CODE_DIR / str(run_info.get("script"))


def script_change(run_dir: Path, args_class: type) -> str | None:
    """When the run's args.json records its script's hash (script_sha256) and the script of
    args_class no longer matches it: a sentence that says so and names both files; else None
    (old run dirs, which have no hash, included)."""
    try:
        run_info = read_json_object(Path(run_dir) / "args.json")
    except DamagedFile:
        return None
    path = provenance.script_path(args_class)
    if "script_sha256" not in run_info or run_info["script_sha256"] == provenance.sha256(provenance.script_source(path)):
        return None
    return (f"{path} has changed since the run: it no longer matches the copy the run saved, "
            f"{saved_script(run_dir, run_info)}")


def write_args(run_dir: Path, args: Any) -> None:
    """args.json, and the script as this process ran it in RUN_DIR/code/ (CODE_DIR)."""
    run_info = provenance.script_info(args)
    (run_dir / "args.json").write_text(json.dumps({**run_info, **dataclasses.asdict(args)}, indent=2) + "\n")
    copy = saved_script(run_dir, run_info)
    copy.parent.mkdir(exist_ok=True)
    copy.write_bytes(provenance.script_source(provenance.script_path(args)))


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object from a file of the run dir; a DamagedFile when it is unreadable or not one."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:  # ValueError: not UTF-8, or not JSON
        raise DamagedFile(f"{path} is unreadable ({error})") from None
    if not isinstance(data, dict):
        raise DamagedFile(f"{path} is damaged: not a JSON object")
    return data


def args_from_json(path: Path, args_class: type) -> Any:
    """The Args of a run. An unreadable file, or one written by another script, is a ConfigError."""
    try:
        data = read_json_object(path)
    except DamagedFile as error:
        raise ConfigError(str(error)) from None
    fields = {field.name: field for field in dataclasses.fields(args_class)}
    unknown = sorted(set(data) - set(fields) - set(RUN_INFO_KEYS))
    if unknown:
        raise ConfigError(
            f"{path} was written by {data.get('script', 'another script')}, not {provenance.script_path(args_class).name} "
            f"(it has {', '.join(unknown)})"
        )
    values = {name: value for name, value in data.items() if name in fields}
    for name, value in values.items():  # JSON has no tuples
        if isinstance(fields[name].default, tuple) and isinstance(value, list):
            values[name] = tuple(value)
    provenance.check_env_module_outside_run_dirs(str(values.get("env_id", "")), path)
    return args_class(**values)


def experiment_name(args: Any) -> str:
    """<env>__<exp-name>: the default wandb group."""
    return f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', args.env_id)}__{args.exp_name}"


def run_name(args: Any, seed: int) -> str:
    """<env>__<exp-name>__<seed>__<time>: the default run dir's name, and a per-seed wandb run's."""
    return f"{experiment_name(args)}__{seed}__{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def default_run_dir(args: Any) -> Path:
    return Path("runs") / run_name(args, args.seed)


# --- checkpoints ------------------------------------------------------------------------------


def checksum(arrays: dict[str, np.ndarray]) -> str:
    """SHA-256 of every array's name, dtype, shape and bytes."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        digest.update(f"{name} {array.dtype.str} {array.shape}\n".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def checkpoint_cycle(path: Path) -> int | None:
    """The cycle in a checkpoint's file name (checkpoint-<cycle>.npz); None for other names."""
    number = path.name.removeprefix("checkpoint-").removesuffix(".npz")
    return int(number) if number.isdigit() else None


def read_checkpoint(path: Path) -> dict[str, np.ndarray]:
    """The arrays of a checkpoint that validates: it opens, and holds its cycle (the one in its
    name) and the checksum of its arrays. Otherwise a ValueError says what is wrong."""
    try:
        with np.load(path) as saved:
            arrays = {name: saved[name] for name in saved.files}
    except Exception as error:  # a damaged zip raises many kinds: BadZipFile, EOFError, NotImplementedError...
        raise ValueError(f"unreadable: {type(error).__name__}: {error}") from None
    stored = arrays.pop("checksum", None)
    if stored is None or "cycle" not in arrays:
        raise ValueError("it has no checksum or no cycle")
    if str(stored) != checksum(arrays):
        raise ValueError("its checksum does not match its contents")
    if arrays["cycle"].shape != () or int(arrays["cycle"]) != checkpoint_cycle(path):
        raise ValueError(f"it holds cycle {arrays['cycle']}, not the one in its name")
    return arrays


class Checkpointer:
    """The checkpoints of a run, written on the host thread: the full training state of every seed (params,
    optimizer state, env states, RNG keys, counters) in RUN_DIR/checkpoint-<cycle>.npz, with its
    cycle and a checksum, for the newest `keep` checkpoints. Each write goes to a temporary file
    that is atomically renamed, so a kill mid-write keeps the previous ones; a failed write
    (disk full, no permission) raises a WriteError, which stops the run."""

    def __init__(self, run_dir: Path, keep: int):
        self.run_dir = run_dir
        self.keep = keep
        self.last_saved_cycle = -1
        self.error: WriteError | None = None
        self.restored: tuple[Path, dict[str, np.ndarray]] | None = None  # set by read_newest_valid

    def __call__(self, cycle: Any, host_states: Any) -> None:
        if jax.process_index() != 0 or int(cycle) <= self.last_saved_cycle:  # one writer; never older
            return
        self.last_saved_cycle = int(cycle)
        arrays = {f"leaf_{index}": np.asarray(leaf) for index, leaf in enumerate(jax.tree.leaves(host_states))}
        arrays["cycle"] = np.asarray(cycle, np.int32)  # the state's own counter's type
        path = self.run_dir / f"checkpoint-{int(cycle)}.npz"
        temporary = path.with_suffix(".npz.tmp")
        try:
            with open(temporary, "wb") as file:
                np.savez(file, checksum=np.asarray(checksum(arrays)), **arrays)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
            for old in self.paths()[self.keep :]:
                old.unlink()
        except OSError as error:
            with contextlib.suppress(OSError):
                temporary.unlink()
            self.error = WriteError(f"cannot write {path}: {error}; the run stopped, its earlier checkpoints are intact")
            raise self.error from None

    def paths(self) -> list[Path]:
        """The checkpoints in the run dir, newest first."""
        found = [(checkpoint_cycle(path), path) for path in self.run_dir.glob("checkpoint-*.npz")]
        return [path for cycle, path in sorted(found, reverse=True) if cycle is not None]

    def read_newest_valid(self) -> None:
        """Reads the newest checkpoint that validates, for `load`, with one warning line for each
        newer one that does not. None at all is a ConfigError."""
        damaged = []
        for path in self.paths():
            try:
                self.restored = path, read_checkpoint(path)
            except ValueError as error:
                damaged.append(f"{path} is damaged ({error})")
                continue
            for text in damaged:
                print(f"warning: {text}; resuming from cycle {checkpoint_cycle(path)} ({path.name})", file=sys.stderr)
            return
        if not damaged:
            raise ConfigError(f"--resume {self.run_dir}: no checkpoint was written before it stopped; start it again")
        raise ConfigError(f"--resume {self.run_dir}: no checkpoint validates: {'; '.join(damaged)}")

    def load(self, template: Any) -> tuple[Any, int]:
        """The states read by read_newest_valid, shaped and typed like `template` (freshly
        initialised states)."""
        path, arrays = self.restored
        template_leaves, treedef = jax.tree.flatten(template)
        if len(arrays) != len(template_leaves) + 1:
            raise ConfigError(f"--resume: {path} does not match this script's training state")
        leaves = []
        for index, like in enumerate(template_leaves):
            data = arrays.get(f"leaf_{index}")
            if data is None or data.shape != devices.key_data_or_array(like).shape:
                raise ConfigError(f"--resume: {path} does not match this script's training state")
            if jnp.issubdtype(like.dtype, jax.dtypes.prng_key):
                leaves.append(jax.random.wrap_key_data(data, impl=jax.random.key_impl(like)))
            else:
                leaves.append(jnp.asarray(data, like.dtype))
        return jax.tree.unflatten(treedef, leaves), int(arrays["cycle"])

    def drop_after(self, cycle: int) -> None:
        """On resume: the checkpoints after `cycle` (damaged ones it fell back past) and leftover
        temporary files go, as the metrics rows after it do."""
        for path in self.paths():
            if checkpoint_cycle(path) > cycle:
                path.unlink()
        for path in self.run_dir.glob("checkpoint-*.npz.tmp"):
            path.unlink()


# --- resume -----------------------------------------------------------------------------------


def prepare_resume(args: Any, metric_names: tuple[str, ...], folders: list[str] = (".",)) -> tuple[Path, Checkpointer]:
    """Checks that --resume can continue the run in that folder, and reads its newest checkpoint
    that validates. `folders`: where its metrics.jsonl files are (a --sweep's point folders).
    Nothing in the folder changes here."""
    run_dir = Path(args.resume)
    if not (run_dir / "args.json").exists():
        raise ConfigError(f"--resume {run_dir}: no args.json there, so no run to resume")
    saved = args_from_json(run_dir / "args.json", type(args))
    for field in dataclasses.fields(args):
        if field.name not in RESUMABLE_FIELDS and getattr(args, field.name) != getattr(saved, field.name):
            raise ConfigError(
                f"--resume {run_dir}: {flag(field.name)} is {getattr(args, field.name)!r} here but "
                f"{getattr(saved, field.name)!r} in the run; only flags that leave training as it was may change (rundir.RESUMABLE_FIELDS)"
            )
    if (run_dir / "summary.json").exists():
        raise ConfigError(f"--resume {run_dir}: that run already finished")
    change = script_change(run_dir, type(args))
    if change:  # resuming with a fixed script is allowed; the saved copy stays the one the run started with
        print(f"warning: {change}; resuming with the script as it is now", file=sys.stderr)
    # An interrupted run (INTERRUPTED_FILE) resumes like a killed one, from its newest checkpoint.
    for folder in folders:
        read_resumable_rows(run_dir / folder / "metrics.jsonl", metric_names)
    checkpointer = Checkpointer(run_dir, args.keep_checkpoints)
    checkpointer.read_newest_valid()
    return run_dir, checkpointer


def read_metrics_rows(path: Path, required: tuple[str, ...] = ("cycle", "env_steps", "seed")) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl, each with the `required` keys. A last line without its newline
    was torn by a kill mid-write: it is left out (a resumed run logs it again). Any other line
    that is not a row is a DamagedFile. The one reader of metrics.jsonl, for --resume and the tools."""
    try:
        text = Path(path).read_text()
    except (OSError, ValueError) as error:  # ValueError: not UTF-8
        raise DamagedFile(f"{path} is unreadable ({error})") from None
    rows = []
    for number, line in enumerate(text.split("\n")[:-1], start=1):  # [-1]: after the last newline
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not (isinstance(row, dict) and all(name in row for name in required)):
            raise DamagedFile(f"{path} line {number} is damaged: {line[:40]!r}")
        rows.append(row)
    return rows


def read_resumable_rows(path: Path, metric_names: tuple[str, ...]) -> list[dict[str, Any]]:
    """read_metrics_rows for --resume: every row must hold the run's metrics; a damaged file is a
    ConfigError."""
    try:
        return read_metrics_rows(path, ("cycle", "env_steps", "seed", *metric_names))
    except DamagedFile as error:
        raise ConfigError(f"--resume: {error}") from None


def keep_metrics_up_to(run_dir: Path, last_cycle: int, metric_names: tuple[str, ...]) -> list[dict[str, Any]]:
    """Drops metrics.jsonl rows logged after the checkpoint (they are logged again on resume)
    and returns the rows kept."""
    path = run_dir / "metrics.jsonl"
    kept = [row for row in read_resumable_rows(path, metric_names) if row["cycle"] <= last_cycle]
    temporary = path.with_suffix(".jsonl.tmp")
    temporary.write_text("".join(json.dumps(row) + "\n" for row in kept))
    os.replace(temporary, path)
    return kept


# --- results: params.msgpack, summary.json ----------------------------------------------------


def read_msgpack(path: Path, template: Any) -> Any:
    """A tree written with flax.serialization (params.msgpack, ...) shaped like `template`; a
    ConfigError when it is missing, damaged or of other shapes."""
    if not path.exists():
        raise ConfigError(f"{path} is missing")
    try:
        tree = flax.serialization.from_bytes(template, path.read_bytes())
    except Exception as error:  # msgpack and flax raise several kinds for a damaged file
        raise ConfigError(f"{path} is damaged ({type(error).__name__}: {error})") from None
    if jax.tree.map(np.shape, tree) != jax.tree.map(np.shape, template):
        raise ConfigError(f"{path} is damaged: its shapes do not match {path.parent / 'args.json'}")
    return tree


def load_params(run_dir: Path, args_class: type, template: Callable[[Any], Any]) -> tuple[Any, Any]:
    """The run's Args and the final parameters of every seed (leading seed axis), from RUN_DIR
    alone; template(args) gives one seed's parameters, shaped as the run's."""
    args = args_from_json(run_dir / "args.json", args_class)
    one_seed = template(args)
    path = run_dir / "params.msgpack"
    try:
        return args, read_msgpack(path, jax.tree.map(lambda x: jnp.stack([x] * args.num_seeds), one_seed))
    except ConfigError:
        change = path.exists() and script_change(run_dir, args_class)
        if change:  # the file is fine: the network it is read into is not the run's
            raise ConfigError(f"{path} does not load: {change}") from None
        raise


def final_returns(args: Any, episodic_return: np.ndarray) -> list[float | None]:
    """Per seed: mean of the per-cycle episodic returns over the last 10% of cycles (cycles in
    which no episode finished are left out)."""
    num_last = max(1, math.ceil(0.1 * args.num_cycles))
    last = episodic_return[-num_last:]  # (cycles, seeds)
    result = []
    for seed_index in range(last.shape[1]):
        values = last[:, seed_index]
        values = values[~np.isnan(values)]
        result.append(float(values.mean()) if values.size else None)
    return result


def final_eval_returns(args: Any, last_eval: np.ndarray | None) -> list[float | None]:
    """Per seed: eval/episodic_return at the last cycle (always an evaluation), from last_eval
    (seeds,); None per seed without --eval-every-cycles or when no eval episode finished."""
    if not args.eval_every_cycles or last_eval is None:
        return [None] * args.num_seeds
    return [float(value) if np.isfinite(value) else None for value in np.asarray(last_eval)]


# --- interrupted runs -------------------------------------------------------------------------

INTERRUPTED_FILE = "interrupted.json"  # a run a signal stopped: unfinished, resumable; gone once resumed


def mark_interrupted(run_dir: Path, cycle: int, signal_name: str, command: str) -> None:
    """Records in the run dir that a signal stopped the run at `cycle`, and how to continue it.
    Without summary.json the run is unfinished to --resume and to the tools (scripts/runlib.py)."""
    (run_dir / INTERRUPTED_FILE).write_text(json.dumps({"cycle": cycle, "signal": signal_name, "resume": command}) + "\n")


def clear_interrupted(run_dir: Path) -> None:
    (run_dir / INTERRUPTED_FILE).unlink(missing_ok=True)
