"""Data parallelism across devices (--num-devices), on CPU devices simulated with XLA_FLAGS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

import ppo_mlp

ROOT = Path(__file__).resolve().parent.parent
TWO_CPU_DEVICES = {
    **os.environ,
    "XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_cpu_enable_concurrency_optimized_scheduler=false",
}


def run_with_two_devices(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "ppo_mlp.py"), *flags], capture_output=True, text=True, timeout=900, env=TWO_CPU_DEVICES
    )


def test_a_one_device_mesh_gives_exactly_the_single_device_result():
    args = ppo_mlp.Args(num_total_env_steps=3 * 512, num_seeds=2)
    env, env_params = ppo_mlp.make_env(args.env_id)
    results = []
    for mesh in [None, jax.make_mesh((1,), (ppo_mlp.DEVICE_AXIS,))]:
        init, train = ppo_mlp.make_train(args, env, env_params, mesh)
        states = ppo_mlp.place_on_mesh(ppo_mlp.stack_seeds([init(seed) for seed in (1, 2)]), mesh)
        _, metrics = jax.jit(lambda s: train(s))(states)
        results.append({name: np.asarray(value) for name, value in metrics.items()})
    for name in results[0]:
        np.testing.assert_array_equal(results[0][name], results[1][name], err_msg=name)


def test_two_devices_learn_cartpole_like_one_with_the_same_global_batch(tmp_path):
    result = run_with_two_devices("--num-devices", "2", "--num-seeds", "2", "--run-dir", str(tmp_path / "two"))
    assert result.returncode == 0, result.stderr
    assert "on 2 devices" in result.stdout
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["final_episodic_return"] >= 475, summary
    rows = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    # the global batch is the 1-device one: 4 envs x 128 steps per cycle, 976 cycles, 4 x 4 updates
    assert sorted({row["env_steps"] for row in rows})[:2] == [512, 1024]
    assert max(row["cycle"] for row in rows) == 976
    assert all(row["losses/epochs_run"] == 4 for row in rows)


def test_envs_that_do_not_split_across_devices_are_refused(tmp_path):
    result = run_with_two_devices("--num-devices", "2", "--num-parallel-envs", "3", "--num-minibatches-per-epoch", "2",
                                  "--run-dir", str(tmp_path / "never"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and "--num-devices" in result.stderr
    assert not (tmp_path / "never").exists()
    result = run_with_two_devices("--num-devices", "3", "--run-dir", str(tmp_path / "never"))
    assert result.returncode == 2 and "only 2 cpu device" in result.stderr
