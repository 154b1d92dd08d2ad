"""Checkpoint / resume and the NaN guard, for both scripts (ppo_mlp.py and ppo_lstm_impala.py,
the latter with a tiny network)."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import probe_envs
from helpers import ROOT

SMALL = {
    "ppo_mlp.py": ["--num-parallel-envs", "4", "--num-env-steps-per-cycle", "16", "--num-total-env-steps", "32000",
                   "--num-seeds", "2", "--checkpoint-every-cycles", "100"],
    # Memory: 6-step episodes with random cues, so the checkpoint must hold the LSTM carries,
    # frame stacks and episode starts of episodes that span cycles.
    "ppo_lstm_impala.py": ["--env-id", "probe_envs:Memory", "--impala-channels", "4", "--torso-size", "32",
                           "--lstm-size", "32", "--num-parallel-envs", "4", "--num-env-steps-per-cycle", "10",
                           "--num-minibatches-per-epoch", "2", "--num-total-env-steps", "2400", "--num-seeds", "2",
                           "--checkpoint-every-cycles", "6"],
}
# The NaN probe: reward NaN with probability 1/5000 per step.
NON_FINITE = {
    "ppo_mlp.py": ["--env-id", "probe_envs:NonFiniteReward", "--num-total-env-steps", "51200"],
    "ppo_lstm_impala.py": ["--env-id", "test_fault_tolerance:NonFiniteRewardImage", "--impala-channels", "4",
                           "--torso-size", "32", "--lstm-size", "32", "--num-parallel-envs", "16",
                           "--num-env-steps-per-cycle", "16", "--num-minibatches-per-epoch", "2",
                           "--num-total-env-steps", str(16 * 16 * 80)],
}


class NonFiniteRewardImage(probe_envs.NonFiniteReward):
    """The NaN probe with image observations, for ppo_lstm_impala.py (loaded from this module)."""

    obs_shape = (3, 3, 1)


def start(script: str, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / script), *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def metrics_without_timing(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        row.pop("charts/SPS")  # host wall-clock: the only field that may differ
    return rows


@pytest.mark.parametrize("script", sorted(SMALL))
def test_resume_after_sigkill_is_bit_identical_to_an_uninterrupted_run(tmp_path, script):
    flags = SMALL[script]
    whole = start(script, *flags, "--run-dir", str(tmp_path / "whole"))
    assert whole.wait(timeout=600) == 0, whole.stderr.read()

    killed_dir = tmp_path / "killed"
    killed = start(script, *flags, "--run-dir", str(killed_dir))
    deadline = time.time() + 600
    while not (killed_dir / "checkpoint.npz").exists():
        assert killed.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.005)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert not (killed_dir / "summary.json").exists(), "killed too late: make the run longer"

    resumed = start(script, "--resume", str(killed_dir))
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err
    assert "resuming" in out
    assert (killed_dir / "params.msgpack").read_bytes() == (tmp_path / "whole" / "params.msgpack").read_bytes()
    assert metrics_without_timing(killed_dir) == metrics_without_timing(tmp_path / "whole")
    assert not list(killed_dir.glob("*.tmp"))

    # a finished run cannot be resumed; a changed argument that matters is refused
    again = start(script, "--resume", str(killed_dir))
    assert again.wait(timeout=120) == 2 and "already finished" in again.stderr.read()


@pytest.mark.parametrize("script", sorted(SMALL))
def test_resume_refuses_a_changed_argument_and_a_missing_checkpoint(tmp_path, script):
    run_dir = tmp_path / "run"
    run = start(script, *SMALL[script], "--run-dir", str(run_dir))
    deadline = time.time() + 600
    while not (run_dir / "checkpoint.npz").exists():
        assert run.poll() is None and time.time() < deadline
        time.sleep(0.005)
    run.send_signal(signal.SIGKILL)
    run.wait()
    changed = start(script, "--resume", str(run_dir), "--lr", "0.1")
    err = changed.communicate(timeout=120)[1]
    assert changed.returncode == 2 and "--lr" in err and len(err.strip().splitlines()) == 1
    os.remove(run_dir / "checkpoint.npz")
    missing = start(script, "--resume", str(run_dir))
    err = missing.communicate(timeout=120)[1]
    assert missing.returncode == 2 and "no checkpoint" in err


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
    # the last good checkpoint is from before the failure, and the params are finite
    with np.load(run_dir / "checkpoint.npz") as checkpoint:
        assert int(checkpoint["cycle"]) < failure["cycle"]
        assert all(np.all(np.isfinite(checkpoint[name])) for name in checkpoint.files if checkpoint[name].dtype.kind == "f")
    module = importlib.import_module(Path(script).stem)
    _, params = module.load_params(run_dir)
    assert all(np.all(np.isfinite(np.asarray(leaf))) for leaf in jax.tree.leaves(params))
    # from the failure on, no minibatch is applied
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    after = [row for row in rows if row["cycle"] > failure["cycle"]]
    assert after and all(row["losses/epochs_run"] in (0, None) for row in after)
