"""Checkpoint / resume, damaged and unwritable run dirs, and the NaN guard, for both scripts
(ppo_mlp.py and ppo_lstm_impala.py, the latter with a tiny network).

One uninterrupted run per script (the `finished` fixture) is the reference that killed, damaged
and resumed copies must equal bit for bit."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import ppo_mlp
from helpers import (check_stopped_run, checkpoints, exclusive, metrics_without_timing, shared_folder, start,
                     start_and_signal, xla_flags)
from ppo_support import errors, logs, rundir

SMALL = {
    "ppo_mlp.py": ["--num-parallel-envs", "4", "--num-env-steps-per-cycle", "16", "--num-total-env-steps", "32000",
                   "--num-seeds", "2", "--checkpoint-every-cycles", "100"],
    # Memory: 6-step episodes with random cues, so the checkpoint must hold the LSTM carries,
    # frame stacks, episode starts and previous actions and rewards (--prev-action-reward) of
    # episodes that span cycles: a checkpoint every 5 cycles of 10 steps falls 2 steps into an
    # episode (every 6 cycles fell between two). The 2-device test below resumes without the flag.
    "ppo_lstm_impala.py": ["--env-id", "probe_envs:Memory", "--impala-channels", "4", "--torso-size", "32",
                           "--lstm-size", "32", "--num-parallel-envs", "4", "--num-env-steps-per-cycle", "10",
                           "--num-minibatches-per-epoch", "2", "--num-total-env-steps", "2400", "--num-seeds", "2",
                           "--checkpoint-every-cycles", "5", "--prev-action-reward"],
}
# The NaN probe: reward NaN with probability 1/5000 per step.
NON_FINITE = {
    "ppo_mlp.py": ["--env-id", "probe_envs:NonFiniteReward", "--num-total-env-steps", "51200"],
    "ppo_lstm_impala.py": ["--env-id", "probe_envs:NonFiniteRewardImage", "--impala-channels", "4",
                           "--torso-size", "32", "--lstm-size", "32", "--num-parallel-envs", "16",
                           "--num-env-steps-per-cycle", "16", "--num-minibatches-per-epoch", "2",
                           "--num-total-env-steps", str(16 * 16 * 80)],
}


@pytest.fixture(scope="session")
def finished(tmp_path_factory):
    """finished(script) -> the run dir of one uninterrupted SMALL run of that script, made once per
    test session and shared by the xdist workers (helpers.shared_folder); copy it before changing
    anything."""
    folder = shared_folder(tmp_path_factory)

    def finished_run(script: str) -> Path:
        run_dir = folder / f"finished-{Path(script).stem}"
        with exclusive(folder / f"finished-{Path(script).stem}.lock"):
            if not (run_dir / "summary.json").exists():
                shutil.rmtree(run_dir, ignore_errors=True)
                run = start(script, *SMALL[script], "--run-dir", str(run_dir))
                assert run.wait(timeout=600) == 0, run.stderr.read()
        return run_dir

    return finished_run


def wait_for_checkpoints(run: subprocess.Popen, run_dir: Path, count: int = 1) -> None:
    deadline = time.time() + 600
    while len(checkpoints(run_dir)) < count:
        assert run.poll() is None and time.time() < deadline, f"the run ended before checkpoint {count}"
        time.sleep(0.005)


def unfinished_copy(run_dir: Path, to: Path) -> Path:
    """A copy of a finished run as if killed after its last checkpoint: no params, no summary."""
    shutil.copytree(run_dir, to)
    (to / "params.msgpack").unlink()
    (to / "summary.json").unlink()
    return to


def unfinished_copy_without_checkpoints(run_dir: Path, to: Path) -> Path:
    shutil.copytree(run_dir, to)
    for path in checkpoints(to):
        path.unlink()
    return to


def file_hashes(run_dir: Path) -> dict[str, str]:
    return {str(path.relative_to(run_dir)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(run_dir.rglob("*")) if path.is_file()}  # the files of code/ too


@pytest.mark.parametrize("script", sorted(SMALL))
def test_resume_after_sigkill_is_bit_identical_to_an_uninterrupted_run(tmp_path, script, finished):
    """One killed run, resumed once (a compile each, so the refusals and damage that cost no
    compile are checked on it too): a changed argument and a run dir without checkpoints are
    refused; a torn newest checkpoint and a torn metrics line are passed over."""
    whole = finished(script)
    killed_dir = tmp_path / "killed"
    killed = start(script, *SMALL[script], "--run-dir", str(killed_dir))
    wait_for_checkpoints(killed, killed_dir, 2)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert not (killed_dir / "summary.json").exists(), "killed too late: make the run longer"

    # a changed argument that matters, and a copy without its checkpoints, are refused, and nothing is written
    before = file_hashes(killed_dir)
    changed = start(script, "--resume", str(killed_dir), "--lr", "0.1")
    err = changed.communicate(timeout=120)[1]
    assert changed.returncode == 2 and "--lr" in err and len(err.strip().splitlines()) == 1
    assert file_hashes(killed_dir) == before
    no_checkpoints = unfinished_copy_without_checkpoints(killed_dir, tmp_path / "no-checkpoints")
    missing = start(script, "--resume", str(no_checkpoints))
    err = missing.communicate(timeout=120)[1]
    assert missing.returncode == 2 and "no checkpoint" in err

    # A kill mid-write leaves a torn newest checkpoint (played by truncating it) and a torn last
    # line of metrics.jsonl: resume warns once, falls back to the previous checkpoint and goes on.
    *_, older, newest = checkpoints(killed_dir)  # (a kill mid-rotation may leave a third)
    with open(newest, "r+b") as file:
        file.truncate(500)
    with open(killed_dir / "metrics.jsonl", "a") as metrics:
        metrics.write('{"cycle": 9999, "env_steps": 12')
    resumed = start(script, "--resume", str(killed_dir))
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err
    warnings = [line for line in err.splitlines() if line.strip()]
    older_cycle = older.stem.split("-")[1]
    assert len(warnings) == 1 and warnings[0].startswith("warning:"), err
    assert str(newest) in warnings[0] and f"cycle {older_cycle}" in warnings[0]
    assert f"resuming {killed_dir} from cycle {older_cycle}" in out
    assert (killed_dir / "params.msgpack").read_bytes() == (whole / "params.msgpack").read_bytes()
    assert metrics_without_timing(killed_dir) == metrics_without_timing(whole)
    assert not list(killed_dir.glob("*.tmp"))
    for path, reference in zip(checkpoints(killed_dir), checkpoints(whole), strict=True):  # the torn one rewritten
        arrays, expected = rundir.read_checkpoint(path), rundir.read_checkpoint(reference)
        assert path.name == reference.name and all(np.array_equal(arrays[key], expected[key]) for key in expected)

    # a finished run cannot be resumed
    again = start(script, "--resume", str(killed_dir))
    assert again.wait(timeout=120) == 2 and "already finished" in again.stderr.read()


# --- Ctrl-C and SIGTERM ----------------------------------------------------------------------


@pytest.mark.parametrize("script, signal_number", [("ppo_mlp.py", signal.SIGINT), ("ppo_lstm_impala.py", signal.SIGTERM)])
def test_a_signal_while_training_saves_the_run_and_resume_ends_bit_for_bit(tmp_path, script, signal_number, finished):
    """Ctrl-C (SIGINT) or SIGTERM once training has begun: the run stops at the end of the segment
    in flight and saves itself (check_stopped_run); --resume then ends bit for bit as the run
    that was never stopped. SIGTERM comes twice, as `timeout` sends it (to the process, then to
    its process group): the repeat must not kill the run while it saves itself."""
    whole = finished(script)
    run_dir = tmp_path / "stopped"
    run, _ = start_and_signal(script, [*SMALL[script], "--run-dir", str(run_dir)], "cycle ", signal_number)
    err_read = ""
    if signal_number == signal.SIGTERM:  # again once the first one's handler has run
        for line in run.stderr:
            err_read += line
            if line.startswith("SIGTERM: stopping"):
                break
        run.send_signal(signal_number)
    cycle = check_stopped_run(script, run, run_dir, signal_number, whole, err_read=err_read)
    resumed = start(script, "--resume", str(run_dir))
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    assert f"resuming {run_dir} from cycle {cycle}" in out
    assert not (run_dir / rundir.INTERRUPTED_FILE).exists()
    assert (run_dir / "params.msgpack").read_bytes() == (whole / "params.msgpack").read_bytes()
    assert metrics_without_timing(run_dir) == metrics_without_timing(whole)
    for path, reference in zip(checkpoints(run_dir), checkpoints(whole), strict=True):
        assert path.read_bytes() == reference.read_bytes()


def test_a_signal_while_compiling_writes_nothing_and_a_second_one_ends_the_process_at_once(tmp_path):
    run_dir = tmp_path / "run"
    flags = ["--num-total-env-steps", "2048", "--compilation-cache-dir", "off", "--run-dir", str(run_dir)]  # a real compile
    run, _ = start_and_signal("ppo_mlp.py", flags, "compiling", signal.SIGINT)
    out, err = run.communicate(timeout=600)
    assert run.returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == "SIGINT: stopped before training started; nothing was written"
    assert not run_dir.exists() and "Traceback" not in err

    run, _ = start_and_signal("ppo_mlp.py", flags, "compiling", signal.SIGTERM)
    assert any("stopping once the program has compiled" in line for line in run.stderr)  # the first one is seen...
    run.send_signal(signal.SIGINT)
    assert run.wait(timeout=600) == -signal.SIGINT  # ...and the second ends the process at once, by its own action
    assert not run_dir.exists()


# Breakout-MinAtar on 2 simulated CPU devices, ppo_lstm_impala.py at its default LSTM size: the
# configurations whose first checkpoint used to abort the process (an all-reduce timeout).
TWO_DEVICES = {
    "ppo_mlp.py": ["--env-id", "Breakout-MinAtar", "--num-devices", "2", "--num-parallel-envs", "8",
                   "--num-env-steps-per-cycle", "32", "--num-total-env-steps", str(8 * 32 * 160), "--checkpoint-every-cycles", "20"],
    "ppo_lstm_impala.py": ["--env-id", "Breakout-MinAtar", "--impala-channels", "4", "--torso-size", "32",
                           "--lstm-size", "32", "--num-devices", "2", "--num-parallel-envs", "8",
                           "--num-env-steps-per-cycle", "16", "--num-minibatches-per-epoch", "2",
                           "--num-total-env-steps", str(8 * 16 * 48), "--checkpoint-every-cycles", "4"],
}
TWO_CPU_DEVICES = {**os.environ, "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=2")}
TWO_DEVICES_SIGNAL = {"ppo_mlp.py": signal.SIGTERM, "ppo_lstm_impala.py": signal.SIGINT}  # the other one of each, above


@pytest.mark.parametrize("script", sorted(TWO_DEVICES))
def test_two_devices_checkpoint_resume_after_sigkill_and_a_stop_by_a_signal_bit_identically(tmp_path, script):
    whole_dir, killed_dir = tmp_path / "whole", tmp_path / "killed"
    whole = start(script, *TWO_DEVICES[script], "--run-dir", str(whole_dir), env=TWO_CPU_DEVICES)
    out, err = whole.communicate(timeout=600)
    assert whole.returncode == 0, err[-3000:]
    assert "on 2 devices" in out
    assert len(checkpoints(whole_dir)) == 2
    killed = start(script, *TWO_DEVICES[script], "--run-dir", str(killed_dir), env=TWO_CPU_DEVICES)
    wait_for_checkpoints(killed, killed_dir)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert not (killed_dir / "summary.json").exists(), "killed too late: make the run longer"
    # resumed, then stopped by a signal once it trains, and resumed again
    signal_number = TWO_DEVICES_SIGNAL[script]
    stopped, printed = start_and_signal(script, ["--resume", str(killed_dir)], "cycle ", signal_number, env=TWO_CPU_DEVICES)
    assert "resuming" in printed
    check_stopped_run(script, stopped, killed_dir, signal_number, whole_dir)
    resumed = start(script, "--resume", str(killed_dir), env=TWO_CPU_DEVICES)
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    assert "resuming" in out
    assert (killed_dir / "params.msgpack").read_bytes() == (whole_dir / "params.msgpack").read_bytes()
    assert metrics_without_timing(killed_dir) == metrics_without_timing(whole_dir)
    for resumed_checkpoint, whole_checkpoint in zip(checkpoints(killed_dir), checkpoints(whole_dir), strict=True):
        assert resumed_checkpoint.read_bytes() == whole_checkpoint.read_bytes()


@pytest.mark.parametrize("script", sorted(NON_FINITE))
def test_non_finite_reward_stops_updates_keeps_good_params_and_exits_non_zero(tmp_path, script):
    run_dir = tmp_path / "nan"
    run = start(script, *NON_FINITE[script], "--checkpoint-every-cycles", "2", "--run-dir", str(run_dir))
    out, err = run.communicate(timeout=600)
    assert run.returncode == 1, err
    summary = json.loads((run_dir / "summary.json").read_text())
    failure = summary["failures"]["1"]
    assert failure["non_finite"] == "loss" and failure["cycle"] > 2
    assert f"non-finite loss at cycle {failure['cycle']}" in err
    # the last good checkpoints are from before the failure, and the params are finite
    module = importlib.import_module(Path(script).stem)
    assert checkpoints(run_dir)
    for path in checkpoints(run_dir):
        checkpoint = rundir.read_checkpoint(path)
        assert int(checkpoint["cycle"]) < failure["cycle"]
        assert all(np.all(np.isfinite(array)) for array in checkpoint.values() if array.dtype.kind == "f")
    _, params = module.load_params(run_dir)
    assert all(np.all(np.isfinite(np.asarray(leaf))) for leaf in jax.tree.leaves(params))
    # from the failure on, no minibatch is applied
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    after = [row for row in rows if row["cycle"] > failure["cycle"]]
    assert after and all(row["losses/epochs_run"] in (0, None) for row in after)


# --- damaged run dirs -----------------------------------------------------------------------


def call_main(module, argv: list[str]) -> int:
    """The exit code of the script's main, run in this process."""
    try:
        return module.main(argv)
    except SystemExit as exit_request:
        return exit_request.code


def damage(run_dir: Path, how: str) -> list[str]:
    """Damages a copy of a run as `how` says; returns what the error line must name."""
    if how == "every checkpoint truncated":
        for path in checkpoints(run_dir):
            with open(path, "r+b") as file:
                file.truncate(500)
        return ["no checkpoint validates", *[f"{path} is damaged" for path in checkpoints(run_dir)]]
    if how == "args.json garbage":
        (run_dir / "args.json").write_text("{not json")
        return [f"{run_dir / 'args.json'} is unreadable"]
    if how == "metrics.jsonl damaged mid-file":
        lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
        lines[2] = lines[2][: len(lines[2]) // 2] + "\n"
        (run_dir / "metrics.jsonl").write_text("".join(lines))
        return [f"{run_dir / 'metrics.jsonl'} line 3 is damaged"]
    if how == "metrics.jsonl missing":
        (run_dir / "metrics.jsonl").unlink()
        return [f"{run_dir / 'metrics.jsonl'} is unreadable"]
    raise ValueError(how)


DAMAGE = ["every checkpoint truncated", "args.json garbage", "metrics.jsonl damaged mid-file", "metrics.jsonl missing"]


@pytest.mark.parametrize("script", sorted(SMALL))
@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_run_dir_gives_one_line_exit_2_and_stays_unchanged(tmp_path, script, how, finished, capsys, monkeypatch):
    module = importlib.import_module(Path(script).stem)
    monkeypatch.setattr(module, "make_train", lambda *_: pytest.fail("compiled a damaged run"))
    run_dir = unfinished_copy(finished(script), tmp_path / "run")
    must_name = damage(run_dir, how)
    before = file_hashes(run_dir)
    capsys.readouterr()
    assert call_main(module, ["--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and all(text in err for text in must_name), err
    assert file_hashes(run_dir) == before


@pytest.mark.parametrize("script, other", [("ppo_mlp.py", "ppo_lstm_impala.py"), ("ppo_lstm_impala.py", "ppo_mlp.py")])
def test_resuming_the_other_scripts_run_names_its_args_json(tmp_path, script, other, finished, capsys):
    module = importlib.import_module(Path(script).stem)
    run_dir = unfinished_copy(finished(other), tmp_path / "run")
    before = file_hashes(run_dir)
    capsys.readouterr()
    assert call_main(module, ["--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run_dir / 'args.json'} was written by {other}, not {script} (it has ")
    assert len(err.splitlines()) == 1 and file_hashes(run_dir) == before


def test_checkpoint_reader_refuses_every_truncation_and_bit_flip_or_returns_the_exact_arrays(tmp_path):
    """A fuzz of the validation: no damaged file is read as anything but what was saved."""
    states = {"params": np.arange(40, dtype=np.float32).reshape(8, 5), "step": np.int32(7), "done": np.ones(3, bool)}
    rundir.Checkpointer(tmp_path, keep=2)(np.int32(12), states)
    path = tmp_path / "checkpoint-12.npz"
    saved = rundir.read_checkpoint(path)
    data = path.read_bytes()
    rng = np.random.default_rng(0)
    damaged = [data[:length] for length in range(0, len(data), 7)]
    for position in rng.integers(0, len(data), 600):
        flipped = bytearray(data)
        flipped[position] ^= 1 << int(rng.integers(8))
        damaged.append(bytes(flipped))
    refused = 0
    for variant in damaged:
        path.write_bytes(variant)
        try:
            arrays = rundir.read_checkpoint(path)
        except ValueError:
            refused += 1
            continue
        assert arrays.keys() == saved.keys() and all(np.array_equal(arrays[key], saved[key]) for key in saved)
    assert refused > 0.8 * len(damaged)


# --- unwritable run dirs (tests run as root: a symlink to /dev/full plays a full disk) ---------


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_while_checkpointing_stops_the_run_with_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    script = "ppo_mlp.py"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.symlink("/dev/full", run_dir / "checkpoint-20.npz.tmp")  # the second checkpoint's temporary file
    run = start(script, *SMALL[script], "--checkpoint-every-cycles", "10", "--run-dir", str(run_dir))
    out, err = run.communicate(timeout=600)
    assert run.returncode == 1
    assert err == f"error: cannot write {run_dir / 'checkpoint-20.npz'}: [Errno 28] No space left on device; the run stopped, its earlier checkpoints are intact\n"
    assert [path.name for path in checkpoints(run_dir)] == ["checkpoint-10.npz"]
    assert int(rundir.read_checkpoint(run_dir / "checkpoint-10.npz")["cycle"]) == 10
    assert not (run_dir / "checkpoint-20.npz.tmp").exists() and not (run_dir / "summary.json").exists()


def test_checkpoint_and_metrics_write_errors_are_kept_and_leave_earlier_checkpoints_intact(tmp_path):
    checkpointer = rundir.Checkpointer(tmp_path, keep=2)
    for cycle in (1, 2, 3):
        checkpointer(np.int32(cycle), {"params": np.full(4, cycle, np.float32)})
    assert [path.name for path in checkpoints(tmp_path)] == ["checkpoint-2.npz", "checkpoint-3.npz"]
    (tmp_path / "checkpoint-4.npz.tmp").mkdir()  # where the temporary file goes
    with pytest.raises(errors.WriteError, match="cannot write .*checkpoint-4.npz: .*Is a directory"):
        checkpointer(np.int32(4), {"params": np.full(4, 4, np.float32)})
    assert checkpointer.error is not None
    assert [int(rundir.read_checkpoint(path)["cycle"]) for path in checkpoints(tmp_path)] == [2, 3]

    if os.path.exists("/dev/full"):
        args = ppo_mlp.Args(num_seeds=2)
        os.symlink("/dev/full", tmp_path / "metrics.jsonl")
        logger = logs.MetricsLogger(args, tmp_path, ppo_mlp.METRIC_NAMES)
        logger.start(0, None)
        rows = np.zeros((1, len(ppo_mlp.METRIC_NAMES), 2), np.float32)
        with pytest.raises(errors.WriteError, match="No space left on device"):
            logger([1], rows)
        assert logger.error is not None
        logger.close()  # the failed rows were reported; closing does not raise again


def test_the_host_queue_runs_its_jobs_in_order_and_stops_at_the_first_error():
    # The metrics logger and the checkpointer run on the queue's thread (logs.HostQueue) while the
    # main thread dispatches segments; their first error stops the run at the next segment.
    host = logs.HostQueue()
    seen = []
    record = lambda value, label: seen.append((value, label))  # noqa: E731
    fail = lambda value: (_ for _ in ()).throw(errors.WriteError(f"cannot write {int(value)}"))  # noqa: E731
    for value in range(1, 4):
        host.submit(record, jax.numpy.int32(value), f"row {value}")
    host.wait()
    assert [(int(value), label) for value, label in seen] == [(1, "row 1"), (2, "row 2"), (3, "row 3")]
    assert all(type(value) is np.ndarray for value, _ in seen)  # JAX arrays arrive as NumPy arrays, the rest as they are
    host.raise_error()  # nothing failed
    host.submit(fail, np.int32(4))
    host.submit(record, np.int32(5), "after the error")
    with pytest.raises(errors.WriteError, match="cannot write 4"):
        host.wait()
    with pytest.raises(errors.WriteError, match="cannot write 4"):  # the next segment stops the run
        host.raise_error()
    assert [label for _, label in seen] == ["row 1", "row 2", "row 3"]  # nothing runs after the first error


def test_the_host_queue_has_one_worker_that_keeps_the_order_of_jobs_of_different_lengths():
    # One thread: a job never starts before the one submitted ahead of it has returned, however
    # long that one takes (a second worker would let a short job overtake a long one).
    import threading

    before = set(threading.enumerate())
    host = logs.HostQueue()
    assert len(set(threading.enumerate()) - before) == 1
    events, running = [], []

    def job(index: int, seconds: float) -> None:
        running.append(index)
        events.append(("start", index, len(running), threading.get_ident()))
        time.sleep(seconds)
        running.remove(index)
        events.append(("end", index))

    for index in range(8):
        host.submit(job, index, 0.08 if index % 2 == 0 else 0.0)
    host.wait()
    assert [event[:2] for event in events] == [(kind, index) for index in range(8) for kind in ("start", "end")]
    assert all(event[2] == 1 for event in events if event[0] == "start")  # never two at once
    assert len({event[3] for event in events if event[0] == "start"}) == 1  # all on the same thread


def test_a_checkpoint_is_written_after_the_rows_of_every_cycle_it_holds(tmp_path, monkeypatch):
    """What the host queue writes, in a real run: the metrics rows of cycles 1..c always reach
    metrics.jsonl before checkpoint-c.npz, so a run killed between two writes never holds a
    checkpoint ahead of its rows. Recorded in the order the writes ran, so no timing decides it."""
    writes = []
    logger_call, checkpointer_call = logs.MetricsLogger.__call__, rundir.Checkpointer.__call__

    def log_rows(self, cycles, *rest, **kwargs):
        logger_call(self, cycles, *rest, **kwargs)
        writes.append(("rows", list(cycles)))

    def write_checkpoint(self, cycle, *rest, **kwargs):
        time.sleep(0.05)  # a slow disk: a later job must still wait for it
        checkpointer_call(self, cycle, *rest, **kwargs)
        writes.append(("checkpoint", int(cycle)))

    monkeypatch.setattr(logs.MetricsLogger, "__call__", log_rows)
    monkeypatch.setattr(rundir.Checkpointer, "__call__", write_checkpoint)
    argv = ["--num-parallel-envs", "4", "--num-env-steps-per-cycle", "32", "--num-total-env-steps", str(128 * 8),
            "--checkpoint-every-cycles", "2", "--keep-checkpoints", "8", "--run-dir", str(tmp_path / "run")]
    assert ppo_mlp.main(argv) == 0
    logged, checkpointed = [], []
    for kind, value in writes:
        if kind == "rows":
            logged += value
        else:
            assert set(range(1, value + 1)) <= set(logged), (value, writes)
            checkpointed.append(value)
    assert logged == list(range(1, 9)) and checkpointed == [2, 4, 6, 8]
