"""Both scripts on a TPU or GPU: several seeds, a --sweep, evaluation, checkpoints, Ctrl-C and
SIGTERM, and --resume bit for bit. Skipped without an accelerator (CI has none). Run them alone,
in one pytest process and not under xdist, as only one process at a time may hold a TPU:

    python -m pytest -m accelerator tests/test_accelerator.py

This process never starts a JAX backend itself: each run is a process of its own, one after the
other. Every comparison is of two runs on the same chip, with the same compiled program (the
session's compilation cache), so they are exact: no tolerance for the chip's bfloat16 passes of
float32 matrix products is needed."""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import check_stopped_run, checkpoints, metrics_without_timing, start, start_and_signal

pytestmark = pytest.mark.accelerator


@functools.cache
def accelerator() -> str | None:
    """The default JAX backend when it is not the CPU (asked in a process of its own, which then
    lets the chip go)."""
    result = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"], capture_output=True,
                            text=True, timeout=300)
    backend = result.stdout.strip().splitlines()[-1] if result.returncode == 0 and result.stdout.strip() else "cpu"
    return None if backend == "cpu" else backend


@pytest.fixture(autouse=True)
def on_an_accelerator():
    if accelerator() is None:
        pytest.skip("no TPU or GPU here")


RUNS = {
    # 4 seeds x 2 learning rates, evaluated every 5 cycles, checkpointed every 10, 60 cycles
    "ppo_mlp.py": ["--env-id", "CartPole-v1", "--num-seeds", "4", "--sweep", "lr=2.5e-4,1e-3", "--num-parallel-envs", "8",
                   "--num-total-env-steps", str(60 * 8 * 128), "--eval-every-cycles", "5", "--checkpoint-every-cycles", "10"],
    # a small IMPALA-LSTM on Breakout-MinAtar, 2 seeds, bptt, evaluated and checkpointed every 4 of 16 cycles
    "ppo_lstm_impala.py": ["--env-id", "Breakout-MinAtar", "--num-seeds", "2", "--num-parallel-envs", "16",
                           "--num-env-steps-per-cycle", "32", "--impala-channels", "8", "16", "--torso-size", "64",
                           "--lstm-size", "64", "--num-total-env-steps", str(16 * 16 * 32), "--eval-every-cycles", "4",
                           "--checkpoint-every-cycles", "4"],
}
SIGNALS = {"ppo_mlp.py": signal.SIGINT, "ppo_lstm_impala.py": signal.SIGTERM}


@pytest.mark.parametrize("script", sorted(RUNS))
def test_a_run_on_the_accelerator_stopped_by_a_signal_and_resumed_ends_bit_for_bit(tmp_path, script):
    whole = tmp_path / "whole"
    run = start(script, *RUNS[script], "--run-dir", str(whole))
    out, err = run.communicate(timeout=900)
    assert run.returncode == 0, err[-3000:]
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["devices"].split(" x ", 1)[1].lower() != "cpu", summary["devices"]  # it trained on the chip
    if script == "ppo_mlp.py":  # two sweep points, each a run with its evaluation
        points = [whole / f"point-{index}" for index in range(2)]
        assert all(json.loads((point / "summary.json").read_text())["final_eval_return"] is not None for point in points)
    else:
        assert summary["final_eval_return"] is not None and len(checkpoints(whole)) == 2

    stopped = tmp_path / "stopped"
    run, _ = start_and_signal(script, [*RUNS[script], "--run-dir", str(stopped)], "cycle ", SIGNALS[script])
    if script == "ppo_mlp.py":  # a sweep's rows are its points'
        out, err = run.communicate(timeout=900)
        assert run.returncode == 128 + SIGNALS[script], err[-3000:]
        cycle = json.loads((stopped / "interrupted.json").read_text())["cycle"]
        assert checkpoints(stopped)[-1].name == f"checkpoint-{cycle}.npz" and not (stopped / "summary.json").exists()
    else:
        check_stopped_run(script, run, stopped, SIGNALS[script], whole, load_params=False)  # computing here would take the chip
    resumed = start(script, "--resume", str(stopped))
    out, err = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, err[-3000:]
    folders = [Path(".")] if script != "ppo_mlp.py" else [Path(f"point-{index}") for index in range(2)]
    for folder in folders:
        assert (stopped / folder / "params.msgpack").read_bytes() == (whole / folder / "params.msgpack").read_bytes()
        assert metrics_without_timing(stopped / folder) == metrics_without_timing(whole / folder)
    for path, reference in zip(checkpoints(stopped), checkpoints(whole), strict=True):
        assert path.read_bytes() == reference.read_bytes()


def test_the_chip_is_free_for_the_runs():
    """This process never took the chip (each run above needed it)."""
    from jax._src import xla_bridge

    assert not xla_bridge._backends
