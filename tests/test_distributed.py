"""The multi-host path (--distributed) with real processes: two processes on 127.0.0.1, one CPU
device each, joined by jax.distributed (gloo collectives), train as one 2-device mesh.

The multi-process machinery (a lost process, which process writes, signals, the checkpoint's
gather across processes) is the package's, the same for both scripts; it is run with ppo_mlp.py.
ppo_lstm_impala.py's states on a mesh (its LSTM carries split across devices, checkpointed and
resumed) are tested on 2 simulated devices in one process (test_fault_tolerance.py,
test_multi_device.py).

The first test runs the script three ways: in one process on 2 simulated devices (the reference),
in two processes until the worker (process 1) is killed with SIGKILL after the first checkpoint,
and in two processes resumed from that checkpoint, stopped by Ctrl-C sent to one of them, and
resumed again. The second kills the coordinator (process 0) instead and checks that the worker
stops. Each process runs under tests/support/audit_writes.py, which reports every write under
the test's folder."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from helpers import ROOT, xla_flags

SCRIPT = "ppo_mlp.py"
FLAGS = ["--num-parallel-envs", "4", "--num-env-steps-per-cycle", "16", "--num-minibatches-per-epoch", "2",
         "--num-total-env-steps", str(64 * 40), "--checkpoint-every-cycles", "4"]
LOST_WITHIN_SECONDS = 60


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_processes(script: str, flags: list[str], audited: Path) -> list[subprocess.Popen]:
    """Processes 0 and 1 of one --distributed run, each with one CPU device."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(), "JAX_PLATFORMS": "cpu", "AUDIT_DIR": str(audited)}
    address = f"127.0.0.1:{free_port()}"
    return [
        subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "support" / "audit_writes.py"), str(ROOT / script), *flags, "--distributed",
             "--num-devices", "0", "--coordinator-address", address, "--num-processes", "2", "--process-id", str(index)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        )
        for index in range(2)
    ]


def finish(processes: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    return [(process.wait(timeout=600), *process.communicate()) for process in processes]


def written(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("WRITE ")]


def metrics_without_timing(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        row.pop("charts/SPS")
    return rows


def checkpoints(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("checkpoint-*.npz"), key=lambda path: int(path.stem.split("-")[1]))


def kill_after_the_first_checkpoint(run_dir: Path, victim: int, audited: Path) -> None:
    """Two processes, one of them (victim) killed by SIGKILL after the first checkpoint: the other
    stops too, soon, with one line that names the lost process; the run is not finished."""
    processes = start_processes(SCRIPT, [*FLAGS, "--run-dir", str(run_dir)], audited)
    deadline = time.time() + 600
    while not checkpoints(run_dir):
        assert all(process.poll() is None for process in processes) and time.time() < deadline, "ended before a checkpoint"
        time.sleep(0.005)
    processes[victim].send_signal(signal.SIGKILL)
    killed_at = time.time()
    survivor = processes[1 - victim]
    survivor.wait(timeout=LOST_WITHIN_SECONDS + 30)
    assert time.time() - killed_at < LOST_WITHIN_SECONDS
    out, err = survivor.communicate()
    assert survivor.returncode != 0
    assert f"error: --distributed: lost process {victim} of 2" in err, err[-3000:]
    processes[victim].wait()
    assert not (run_dir / "summary.json").exists(), "killed too late: make the run longer"
    if victim == 1:  # the survivor is process 0, which wrote; process 1 wrote nothing
        assert written(err) and not written(processes[1].stderr.read())


def test_two_processes_train_as_two_devices_survive_a_lost_process_and_resume(tmp_path):
    reference_dir, run_dir = tmp_path / "reference", tmp_path / "two-processes"
    two_devices = {**os.environ, "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=2"), "JAX_PLATFORMS": "cpu"}
    reference = subprocess.run([sys.executable, str(ROOT / SCRIPT), *FLAGS, "--num-devices", "2", "--run-dir",
                                str(reference_dir)], capture_output=True, text=True, timeout=600, env=two_devices, cwd=ROOT)
    assert reference.returncode == 0, reference.stderr[-3000:]

    kill_after_the_first_checkpoint(run_dir, victim=1, audited=tmp_path)

    # Both resume from the checkpoint they wrote; as training starts, Ctrl-C reaches process 1
    # alone: both stop at the same cycle, process 0 saves the run, both exit 130 (SIGINT's).
    processes = start_processes(SCRIPT, ["--resume", str(run_dir)], tmp_path)
    for line in processes[0].stdout:  # process 0 prints; both have compiled, and their signals are the run's
        if line.startswith("run dir:"):
            break
    processes[1].send_signal(signal.SIGINT)
    stopped = finish(processes)
    assert [code for code, _, _ in stopped] == [130, 130], [err[-2000:] for _, _, err in stopped]
    cycle = json.loads((run_dir / "interrupted.json").read_text())["cycle"]
    assert checkpoints(run_dir)[-1].name == f"checkpoint-{cycle}.npz" and not (run_dir / "summary.json").exists()
    assert all(stopped_err.strip().splitlines()[-1].startswith(f"SIGINT: stopped at cycle {cycle}/")
               for _, _, stopped_err in stopped)

    # Resumed again, they end as the 2-device run did.
    resumed = finish(start_processes(SCRIPT, ["--resume", str(run_dir)], tmp_path))
    for code, out, err in resumed:
        assert code == 0, err[-3000:]
    (_, out_0, err_0), (_, out_1, err_1) = resumed
    assert "resuming" in out_0 and "on 2 devices" in out_0
    printed_1 = [line for line in out_1.splitlines() if not line.startswith("[Gloo]")]  # gloo's own line
    assert printed_1 == [] and not written(err_1), (printed_1, written(err_1))  # only process 0 prints and writes
    assert written(err_0)
    assert (run_dir / "params.msgpack").read_bytes() == (reference_dir / "params.msgpack").read_bytes()
    assert metrics_without_timing(run_dir) == metrics_without_timing(reference_dir)  # the global metrics
    assert [path.name for path in checkpoints(run_dir)] == [path.name for path in checkpoints(reference_dir)]
    for resumed_checkpoint, reference_checkpoint in zip(checkpoints(run_dir), checkpoints(reference_dir)):
        assert resumed_checkpoint.read_bytes() == reference_checkpoint.read_bytes()


def test_a_worker_stops_with_one_line_when_the_coordinator_is_lost(tmp_path):
    kill_after_the_first_checkpoint(tmp_path / "two-processes", victim=0, audited=tmp_path)


def test_distributed_refuses_a_device_count_that_leaves_out_a_process(tmp_path):
    """--distributed spans every device of every process: --num-devices must be 0 (or that count)."""
    env = {**os.environ, "XLA_FLAGS": xla_flags()}
    result = subprocess.run(
        [sys.executable, str(ROOT / "ppo_mlp.py"), "--distributed", "--coordinator-address", f"127.0.0.1:{free_port()}",
         "--num-processes", "1", "--process-id", "0", "--num-devices", "2", "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300, env={**env, "JAX_PLATFORMS": "cpu"}, cwd=ROOT,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith("error: --num-devices 2 with --distributed") and len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "run").exists()
