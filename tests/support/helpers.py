"""What several test files share: running a script in a subprocess, reading an offline wandb
run, and reading out the values a jitted train loop used (record_calls, learning_rate_used).

Not a test module: the test files import it (conftest.py puts this folder on sys.path).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import signal
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parents[2]
# The suite spends most of its time compiling small programs, and LLVM at -O1 compiles them about
# 20% faster than XLA's default -O2 and trains as fast (docs/testing.md). conftest.py sets it for
# every test and the processes they start; a test compares runs made under the same flags, so bits
# may differ from an -O2 run's, never within a test.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=1"


def use_the_sessions_compilation_cache() -> None:
    """JAX's persistent compilation cache for this test session: one folder that the xdist workers
    share (and no other session), each program cached however fast it compiled, and a size cap so
    that JAX locks the folder while it writes. Through the environment, so that the scripts the
    tests start use it too (the scripts keep $JAX_COMPILATION_CACHE_DIR when --compilation-cache-dir
    is not given); set before JAX is imported."""
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id is None:  # not an xdist worker: a folder of this process's own
        folder = tempfile.mkdtemp(prefix="ppo-jax-test-compilation-cache-")
    else:
        folder = os.path.join(tempfile.gettempdir(), f"ppo-jax-test-compilation-cache-{run_id}")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = folder
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(16 * 2**30)


def xla_flags(*flags: str) -> str:
    """XLA_FLAGS for a test's process that needs flags of its own (simulated devices): the suite's
    flags and these."""
    return " ".join([TEST_XLA_FLAGS, *flags])


def shared_folder(tmp_path_factory: Any) -> Path:
    """A folder that every xdist worker of this test session sees (and no other session): for
    runs that several tests read and that should be trained once, under `exclusive`."""
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    base = tmp_path_factory.getbasetemp()
    folder = base if run_id is None else base.parent / f"shared-{run_id}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextlib.contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    """Holds an exclusive lock on lock_path (across processes) for the block."""
    with open(lock_path, "w") as lock:  # closing the file releases the lock
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def run_script(
    path_or_name: str | Path,
    *arguments: str,
    timeout: float = 600,
    cwd: str | Path = ROOT,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Runs a script with this Python and returns its exit code and text output. A relative path
    is taken from the repo root ("ppo_mlp.py", "scripts/plot.py"), an absolute one as it is."""
    command = [sys.executable, str(ROOT / path_or_name), *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def run_tool(tool: str, *arguments: str, timeout: float = 600, cwd: str | Path = ROOT) -> subprocess.CompletedProcess:
    """run_script of a tool in scripts/ that starts runs, under tests/support/no_backend.py: it fails (exit
    code 3) if its own process starts a JAX backend, which on a TPU would keep its runs off the chip."""
    return run_script("tests/support/no_backend.py", str(ROOT / tool), *arguments, timeout=timeout, cwd=cwd)


# --- runs of the scripts, stopped by signals ---------------------------------------------------


def start(script: str, *flags: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / script), *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def checkpoints(run_dir: Path) -> list[Path]:
    """The run dir's checkpoints, oldest first."""
    return sorted(run_dir.glob("checkpoint-*.npz"), key=lambda path: int(path.stem.split("-")[1]))


def metrics_without_timing(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        row.pop("charts/SPS")  # host wall-clock: the only field that may differ
    return rows


def start_and_signal(script: str, flags: list[str], after: str, signal_number: int,
                     env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """Starts a run and sends it the signal once it has printed a line that starts with `after`;
    returns the process and what it printed until then."""
    run = start(script, *flags, env=env)
    printed = []
    for line in run.stdout:
        printed.append(line)
        if line.startswith(after):
            run.send_signal(signal_number)
            return run, "".join(printed)
    raise AssertionError(f"no line starting with {after!r}: {''.join(printed)}{run.stderr.read()}")


def check_stopped_run(script: str, run: subprocess.Popen, run_dir: Path, signal_number: int, whole: Path,
                      load_params: bool = True, err_read: str = "") -> int:
    """A run that a signal stopped while training: exit 128 + the signal, one line with the
    --resume command, its checkpoint, metrics rows and params.msgpack up to the cycle it stopped
    at (checked by loading them when load_params), marked unfinished. Returns that cycle.
    err_read: what the caller has already read of the run's stderr."""
    from ppo_support import rundir

    out, err = run.communicate(timeout=600)
    err = err_read + err
    name = signal.Signals(signal_number).name
    assert run.returncode == 128 + signal_number, err[-3000:]
    assert "Traceback" not in err
    marker = json.loads((run_dir / rundir.INTERRUPTED_FILE).read_text())
    cycle = marker["cycle"]
    command = f"python {script} --resume {run_dir}"
    assert marker == {"cycle": cycle, "signal": name, "resume": command}
    lines = err.strip().splitlines()
    assert any(line.startswith(f"{name}: stopping at the end of the segment in flight") for line in lines), err
    assert lines[-1].startswith(f"{name}: stopped at cycle {cycle}/") and lines[-1].endswith(f"Continue with: {command}")
    assert not (run_dir / "summary.json").exists()
    assert checkpoints(run_dir)[-1].name == f"checkpoint-{cycle}.npz"
    assert metrics_without_timing(run_dir) == [row for row in metrics_without_timing(whole) if row["cycle"] <= cycle]
    if load_params:  # (it computes in this process)
        import importlib

        import jax
        import numpy as np

        module = importlib.import_module(Path(script).stem)
        _, params = module.load_params(run_dir)  # the checkpoint's params, as the run had them at that cycle
        checkpoint = rundir.read_checkpoint(run_dir / f"checkpoint-{cycle}.npz")
        for index, leaf in enumerate(jax.tree.leaves(params)):
            np.testing.assert_array_equal(leaf, checkpoint[f"leaf_{index}"])
    sys.path.insert(0, str(ROOT / "scripts"))
    import runlib

    assert not runlib.is_finished(run_dir) and runlib.read_run(run_dir).summary is None
    return cycle


def read_wandb_offline_run(folder: str | Path) -> dict:
    """What an offline wandb run dir (RUN_DIR/wandb/offline-run-*) holds, read from its
    run-<id>.wandb file: {"id", "name", "project", "group", "tags", "config", "history" (one dict per
    logged row), "summary", "artifacts"}, each value decoded from JSON. The file is a LevelDB-style log of
    wandb's protobuf records: a 7-byte header, then 32 KiB blocks of chunks, each with a
    7-byte header (checksum, little-endian length, kind: 1 whole, 2 first, 3 middle, 4 last)."""
    import json

    from wandb.proto import wandb_internal_pb2

    (path,) = Path(folder).glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    block_size, position, pending, records = 32768, 7, b"", []
    while position + 7 <= len(data):
        if block_size - position % block_size < 7:  # a block's zero-filled tail
            position += block_size - position % block_size
            continue
        length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""

    def items(updates) -> dict:
        return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in updates}

    run = {"history": [], "summary": {}, "artifacts": []}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.update(id=record.run.run_id, name=record.run.display_name, project=record.run.project, group=record.run.run_group,
                       tags=list(record.run.tags), config=items(record.run.config.update))
        elif kind == "history":
            run["history"].append(items(record.history.item))
        elif kind == "summary":
            run["summary"].update(items(record.summary.update))
        elif kind == "artifact":  # {"type", "name", "files": {path: its MD5, base64}}
            files = {entry.path: entry.digest for entry in record.artifact.manifest.contents}
            run["artifacts"].append({"type": record.artifact.type, "name": record.artifact.name, "files": files})
    return run


def record_calls(monkeypatch, module: Any, name: str, pick: Callable[[tuple, Any], Any]) -> list:
    """Wraps `module.<name>` so that every call of it inside a jitted program sends
    pick(positional arguments, result) to the host as it runs: the values the algorithm used,
    read out without changing the script. Applies to programs traced afterwards. Returns the
    list the records (numpy pytrees) are appended to, in the order the calls ran."""
    import jax
    import numpy as np

    records = []
    original = getattr(module, name)

    def recording(*args, **kwargs):
        result = original(*args, **kwargs)
        values = pick(args, result)
        jax.debug.callback(lambda values: records.append(jax.tree.map(np.asarray, values)), values, ordered=True)
        return result

    monkeypatch.setattr(module, name, recording)
    return records


def record_two_cycles(monkeypatch, module: Any, args: Any) -> tuple[list, list[dict], Any, Any]:
    """Trains two cycles of one seed (module: ppo_mlp or ppo_lstm_impala) from fresh envs with
    collect_rollout and update_cycle read out. Returns both cycles' transitions, what each
    update_cycle received (params, batch), the state the second cycle started from, and the
    network."""
    import jax

    from ppo_support import envs

    env, env_params = envs.make_env(args.env_id)
    network, optimizer = module.make_network(args, env.action_space(env_params).n), module.make_optimizer(args)
    rollouts = record_calls(monkeypatch, module, "collect_rollout", lambda a, out: out[1])
    updates = record_calls(monkeypatch, module, "update_cycle", lambda a, out: dict(params=a[0], batch=a[2]))
    init, _ = module.make_train(args, env, env_params)
    cycle = jax.jit(lambda state: module.train_cycle(state, network, optimizer, env, env_params, args)[0])
    state = cycle(init(args.seed))
    jax.block_until_ready(cycle(state))
    jax.effects_barrier()
    return rollouts, updates, state, network


def record_second_cycle(monkeypatch, module: Any, args: Any) -> tuple[Any, dict, Any, Any]:
    """record_two_cycles' second cycle: its transitions, what its update_cycle received (params,
    batch), the state it started from, and the network."""
    rollouts, updates, state, network = record_two_cycles(monkeypatch, module, args)
    return rollouts[1], updates[1], state, network


@functools.cache
def jitted_adam_direction() -> Callable:
    """adam_direction(grads, adam_state, max_grad_norm, adam_eps): optax's Adam direction for
    `grads` clipped by global norm, jitted once per process (op by op, each operation compiled
    once per parameter shape: seconds a test)."""
    import jax
    import optax

    def adam_direction(grads: Any, adam_state: Any, max_grad_norm: float, adam_eps: float) -> Any:
        clipped, _ = optax.clip_by_global_norm(max_grad_norm).update(grads, optax.EmptyState())
        return optax.scale_by_adam(eps=adam_eps).update(clipped, adam_state)[0]

    return jax.jit(adam_direction, static_argnums=(2, 3))


def learning_rate_used(params_before: Any, params_after: Any, grads: Any, opt_state: Any, max_grad_norm: float, adam_eps: float) -> float:
    """The learning rate a gradient step applied, measured from the parameters it moved: the
    step (after - before) against the direction optax's own Adam gives for `grads`, clipped by
    global norm, from the Adam state the step started from (found anywhere in `opt_state`); the
    least-squares scalar, so it does not rely on how the script applies its learning rate."""
    import jax
    import numpy as np
    import optax

    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731
    (adam_state,) = [x for x in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(x)]
    direction = jitted_adam_direction()(grads, adam_state, max_grad_norm, adam_eps)
    flat = lambda tree: np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])  # noqa: E731
    step = flat(params_after) - flat(params_before)
    direction = flat(direction)
    return float(-(step @ direction) / (direction @ direction))


# --- run dirs written by hand, for the tools that read them ---------------------------------------


def write_run_dir(run_dir: Path, args: dict, returns: dict[int, list[float | None]], env_steps_per_cycle: int = 1000,
                  more: dict[str, dict[int, list[float]]] | None = None) -> Path:
    """A finished run dir as a training script writes it, with only what the tools read: args.json,
    metrics.jsonl (per seed, one row per cycle: `charts/episodic_return` from `returns[seed]`, and
    each metric of `more` from more[name][seed]) and summary.json."""
    run_dir.mkdir(parents=True)
    (run_dir / "args.json").write_text(json.dumps({"num_seeds": len(returns), **args}))
    rows = []
    for seed, values in returns.items():
        for cycle, value in enumerate(values, start=1):
            row = {"cycle": cycle, "env_steps": cycle * env_steps_per_cycle, "seed": seed, "charts/episodic_return": value}
            row.update({name: per_seed[seed][cycle - 1] for name, per_seed in (more or {}).items()})
            rows.append(row)
    rows.sort(key=lambda row: (row["cycle"], row["seed"]))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (run_dir / "summary.json").write_text(json.dumps({"compile_seconds": 1.0}))
    return run_dir
