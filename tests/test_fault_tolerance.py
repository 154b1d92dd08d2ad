"""Checkpoint / resume and the NaN guard, for both scripts (ppo_mlp.py here; the LSTM script's
equivalents run the same checks through the same helpers)."""

from __future__ import annotations

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

ROOT = Path(__file__).resolve().parent.parent
SMALL = {
    "ppo_mlp.py": ["--num-parallel-envs", "4", "--num-env-steps-per-cycle", "16", "--num-total-env-steps", "32000",
                   "--num-seeds", "2", "--checkpoint-every-cycles", "100"],
}


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


def test_resume_refuses_a_changed_argument_and_a_missing_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    run = start("ppo_mlp.py", *SMALL["ppo_mlp.py"], "--run-dir", str(run_dir))
    deadline = time.time() + 600
    while not (run_dir / "checkpoint.npz").exists():
        assert run.poll() is None and time.time() < deadline
        time.sleep(0.005)
    run.send_signal(signal.SIGKILL)
    run.wait()
    changed = start("ppo_mlp.py", "--resume", str(run_dir), "--lr", "0.1")
    err = changed.communicate(timeout=120)[1]
    assert changed.returncode == 2 and "--lr" in err and len(err.strip().splitlines()) == 1
    os.remove(run_dir / "checkpoint.npz")
    missing = start("ppo_mlp.py", "--resume", str(run_dir))
    err = missing.communicate(timeout=120)[1]
    assert missing.returncode == 2 and "no checkpoint" in err


def test_non_finite_reward_stops_updates_keeps_good_params_and_exits_non_zero(tmp_path):
    run_dir = tmp_path / "nan"
    run = start("ppo_mlp.py", "--env-id", "probe_envs:NonFiniteReward", "--num-total-env-steps", "51200",
                "--checkpoint-every-cycles", "2", "--run-dir", str(run_dir))
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
    import ppo_mlp

    _, params = ppo_mlp.load_params(run_dir)
    assert all(np.all(np.isfinite(np.asarray(leaf))) for leaf in jax.tree.leaves(params))
    # from the failure on, no minibatch is applied
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    after = [row for row in rows if row["cycle"] > failure["cycle"]]
    assert after and all(row["losses/epochs_run"] in (0, None) for row in after)
