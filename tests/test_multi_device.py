"""Data parallelism across devices (--num-devices), on CPU devices simulated with XLA_FLAGS."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import exclusive, run_script, shared_folder, xla_flags

import ppo_lstm_impala
import ppo_mlp
from ppo_support import cpu, devices, envs

TWO_CPU_DEVICES = {
    **os.environ,
    "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=2", "--xla_cpu_enable_concurrency_optimized_scheduler=false"),
}


TINY_LSTM = ["--impala-channels", "4", "--torso-size", "32", "--lstm-size", "32"]


def run_with_two_devices(*flags: str, script: str = "ppo_mlp.py"):
    return run_script(script, *flags, timeout=900, env=TWO_CPU_DEVICES)


ONE_DEVICE_ARGS = {
    "ppo_mlp": lambda: ppo_mlp.Args(num_total_env_steps=3 * 512, num_seeds=2),
    "ppo_lstm_impala": lambda: ppo_lstm_impala.Args(
        env_id="probe_envs:Memory", impala_channels=(4,), torso_size=32, lstm_size=32, num_parallel_envs=4,
        num_env_steps_per_cycle=12, num_minibatches_per_epoch=2, num_epochs_per_cycle=2, num_total_env_steps=3 * 48,
        num_seeds=2,
    ),
}


@pytest.mark.parametrize("name", sorted(ONE_DEVICE_ARGS))
def test_a_one_device_mesh_gives_the_single_device_result(name, monkeypatch):
    """The shard_map path on one device trains as no mesh does: the same states and metrics up to
    float rounding. Not bit for bit: with vmapped seeds inside shard_map XLA may order a
    reduction differently (on an AMD EPYC VM, 2026-12-05, the LSTM's states and policy loss
    differed in their last bits after one cycle, on the code of 74431a3 too)."""
    module = {"ppo_mlp": ppo_mlp, "ppo_lstm_impala": ppo_lstm_impala}[name]
    # Under shard_map conv3x3_for_cpu hands over to XLA's own convolution; this test is about the
    # mesh, so both runs use XLA's convolution.
    monkeypatch.setattr(
        cpu, "conv3x3_for_cpu",
        lambda lhs, rhs, window_strides, padding, **unused: jax.lax.conv_general_dilated(
            lhs, rhs, window_strides, padding, dimension_numbers=cpu.NHWC_HWIO
        ),
    )
    args = ONE_DEVICE_ARGS[name]()
    env, env_params = envs.make_env(args.env_id)
    results, final_states = [], []
    for mesh in [None, jax.make_mesh((1,), (devices.DEVICE_AXIS,))]:
        init, train = module.make_train(args, env, env_params, mesh)
        states = devices.place_on_mesh(devices.stack_seeds([init(seed) for seed in (1, 2)]), mesh)
        states, metrics = jax.jit(lambda s: train(s))(states)
        results.append({name: np.asarray(value) for name, value in metrics.items()})
        final_states.append(jax.tree.leaves(states.params) + jax.tree.leaves(states.env.obs))
    assert results[0].keys() == results[1].keys()
    for name in results[0]:
        np.testing.assert_allclose(results[0][name], results[1][name], rtol=1e-5, atol=1e-6, err_msg=name)
    for alone, meshed in zip(*final_states, strict=True):
        np.testing.assert_allclose(alone, meshed, rtol=1e-5, atol=1e-6)


def test_two_devices_learn_cartpole_like_one_with_the_same_global_batch(tmp_path):
    """Also evaluates (outside shard_map, replicated) and writes videos (recorded inside the jit;
    a callback that ran JAX itself would deadlock the devices' collectives)."""
    result = run_with_two_devices("--num-devices", "2", "--num-seeds", "2", "--run-dir", str(tmp_path / "two"),
                                  "--eval-every-cycles", "488", "--eval-episodes", "4", "--capture-video")
    assert result.returncode == 0, result.stderr
    assert "on 2 devices" in result.stdout
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["final_episodic_return"] >= 475, summary
    assert summary["final_eval_return"] >= 475, summary
    assert sorted(path.name for path in (tmp_path / "two" / "videos").iterdir()) == ["cycle-488.gif", "cycle-976.gif"]
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


@pytest.mark.parametrize("lstm_training", ["bptt", "stored"])
def test_two_devices_train_the_lstm_with_the_same_global_batch(tmp_path, lstm_training):
    """Each device steps 8 of the 16 envs and their LSTM carries; the probe is learned, and the
    logged batch, cycles and updates are the 1-device ones."""
    run_dir = tmp_path / lstm_training
    result = run_with_two_devices(
        *TINY_LSTM, "--env-id", "probe_envs:ActionDependentRewardImage", "--lstm-training", lstm_training,
        "--num-parallel-envs", "16", "--num-env-steps-per-cycle", "8", "--num-minibatches-per-epoch", "2",
        "--num-total-env-steps", str(16 * 8 * 40), "--lr", "3e-3", "--gamma", "0.99", "--num-devices", "2",
        "--run-dir", str(run_dir), script="ppo_lstm_impala.py",
    )
    assert result.returncode == 0, result.stderr
    assert "on 2 devices" in result.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted({row["env_steps"] for row in rows})[:2] == [128, 256]
    assert max(row["cycle"] for row in rows) == 40
    assert all(row["losses/epochs_run"] == 5 for row in rows)  # the default 5 epochs x 2 minibatches, all applied
    assert all(row["charts/episodic_length"] == 1.0 for row in rows)  # both devices' episodes are counted
    assert np.mean([row["charts/episodic_return"] for row in rows[-5:]]) > 0.9


def test_lstm_envs_that_do_not_split_into_whole_sequences_per_device_are_refused(tmp_path):
    # 4 envs on 2 devices: 2 sequences per device cannot make 4 bptt minibatches (fine on 1 device)
    result = run_with_two_devices(*TINY_LSTM, "--num-devices", "2", "--num-parallel-envs", "4",
                                  "--num-minibatches-per-epoch", "4", "--run-dir", str(tmp_path / "never"),
                                  script="ppo_lstm_impala.py")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr
    assert "--num-devices" in result.stderr and "--num-minibatches-per-epoch" in result.stderr
    result = run_with_two_devices(*TINY_LSTM, "--num-devices", "2", "--num-parallel-envs", "3",
                                  "--num-minibatches-per-epoch", "1", "--run-dir", str(tmp_path / "never"),
                                  script="ppo_lstm_impala.py")
    assert result.returncode == 2 and "--num-devices" in result.stderr
    assert not (tmp_path / "never").exists()


# One update_cycle on one device and on two, in one process with 2 simulated devices: see
# tests/support/two_devices.py. The ppo_lstm_impala.py configs are its three networks (the torso does
# not change how the batch splits; its MLP torso is split across devices in the random-numbers test).
UPDATE_CASES = [("ppo_mlp", "cartpole"), ("ppo_lstm_impala", "bptt"), ("ppo_lstm_impala", "stored"), ("ppo_lstm_impala", "feed-forward")]
# The cases whose process also runs a whole cycle on both (two_devices.py update --cycle): their
# statistics, and the metrics for which device 0's share alone and the mean of the two shares'
# values both differ from the whole batch's. CartPole's shares end one episode each (the mean of
# their means is the whole's); under --norm-reward the Clock probe's first scaled rewards dwarf
# every value, and explained variance is about 0 on any share.
EV, RETURN, LENGTH = "losses/explained_variance", "charts/episodic_return", "charts/episodic_length"
CYCLE_CASES = {("ppo_mlp", "cartpole"): ("obs_stats", {EV}), ("ppo_lstm_impala", "bptt"): (None, {EV, RETURN, LENGTH}),
               ("ppo_lstm_impala", "feed-forward"): ("reward_stats", {RETURN, LENGTH})}


def two_devices_update(tmp_path_factory, script: str, config: str):
    """tests/support/two_devices.py update's results for a case, computed once per test session: the
    update and the cycle tests read the same process's results."""
    folder = shared_folder(tmp_path_factory)
    out = folder / f"two-devices-update-{script}-{config}.npz"
    with exclusive(folder / f"{out.name}.lock"):
        if not out.exists():
            cycle = ["--cycle"] if (script, config) in CYCLE_CASES else []
            result = run_script("tests/support/two_devices.py", "update", script, config, str(out.with_suffix(".part.npz")), *cycle,
                                timeout=600, env=TWO_CPU_DEVICES)
            assert result.returncode == 0, result.stderr[-3000:]
            out.with_suffix(".part.npz").rename(out)
    return np.load(out)


@pytest.mark.parametrize("script, config", UPDATE_CASES)
def test_two_devices_update_as_one_device_does_on_the_same_global_batch(tmp_path_factory, script, config):
    """A real rollout's batch, updated with one minibatch per epoch and 2 epochs, on one device
    and split in halves across two: the same parameters, losses/grad_norm and every other update
    metric, up to float rounding. A gradient summed over devices instead of averaged doubles
    grad_norm; advantages normalised per device change the gradient."""
    results = two_devices_update(tmp_path_factory, script, config)
    names = [name.removeprefix("one/") for name in results.files if name.startswith("one/")]
    assert "losses/grad_norm" in names and sum(name.startswith("param") for name in names) >= 6
    assert np.abs(results["before/grad_step"]).max() > 1e-3  # the update moved the parameters
    for name in names:
        np.testing.assert_allclose(results[f"two/{name}"], results[f"one/{name}"], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("script, config", list(CYCLE_CASES))
def test_two_devices_log_every_metric_of_a_cycle_as_one_device_does_on_the_same_global_rollout(tmp_path_factory, script, config):
    """One whole cycle of the script's train path (make_train) on one device, and on two with
    each device handed its half of that cycle's rollout (collect_rollout replaced): every metric
    the run logs (its run_metric_names, all of them, so a new metric is compared as it is added:
    the episodes' return and length, the charts, the losses, explained variance) and the new
    state (parameters, optimizer state, env carry and, with --norm-obs (ppo_mlp.py) or
    --norm-reward (ppo_lstm_impala.py feed-forward), the statistics) are the same up to float
    rounding. The two devices' own rollouts draw different random numbers, so only a shared
    rollout shows this. The cases are chosen so that device 0's share alone gives other episode
    means than the whole batch, and it and the mean of the two shares' values another explained
    variance (ppo_mlp.py, bptt) and episode means (the LSTM cases), so that a metric computed on
    one device's share, or each device's averaged, fails here."""
    results = two_devices_update(tmp_path_factory, script, config)
    one = {name.removeprefix("cycle_one/"): results[name] for name in results.files if name.startswith("cycle_one/")}
    metrics = {name for name in one if not name.startswith("state")}
    assert metrics == set(results["run_metric_names"])
    states = [name for name in one if name.startswith("state")]
    assert sum(".params[" in name for name in states) >= 6 and any(".opt_state" in name for name in states)
    statistics, told_apart = CYCLE_CASES[script, config]
    assert statistics is None or any(f".{statistics}." in name for name in states)
    for name in one:
        np.testing.assert_allclose(results[f"cycle_two/{name}"], one[name], rtol=1e-5, atol=1e-6, err_msg=name)

    def differs(a, b):  # by 10 times the float rounding allowed above, or more
        return abs(float(a) - float(b)) > 10 * (1e-6 + 1e-5 * abs(float(b)))

    for name in [RETURN, LENGTH, EV]:
        whole, share0, share1 = one[name].item(), results[f"share0/{name}"], results[f"share1/{name}"]
        assert np.isfinite([whole, share0, share1]).all(), name  # both shares finished episodes
        if name != EV or name in told_apart:
            assert differs(share0, whole), (name, share0, whole)
        if name in told_apart:
            assert differs((share0 + share1) / 2, whole), (name, share0, share1, whole)
    assert np.abs(results["before/grad_step"]).max() > 1e-3  # the cycle's update moved the parameters


@pytest.mark.parametrize("script, config", [("ppo_mlp", "clock"), ("ppo_lstm_impala", "feed-forward"),
                ("ppo_lstm_impala", "mlp-torso")])
def test_the_two_devices_halves_of_a_rollout_draw_different_random_numbers(tmp_path, script, config):
    # Every env of the Clock probe resets to the same observation, so devices that drew the same
    # sampling noise would take the same actions.
    out = tmp_path / "rollout.npz"
    result = run_script("tests/support/two_devices.py", "rollout", script, config, str(out), timeout=600, env=TWO_CPU_DEVICES)
    assert result.returncode == 0, result.stderr[-3000:]
    keys_and_actions = np.load(out)
    assert sorted(keys_and_actions.files) == ["action0", "action1", "key0", "key1"]
    assert not np.array_equal(keys_and_actions["key0"], keys_and_actions["key1"])
    assert keys_and_actions["action0"].shape == keys_and_actions["action1"].shape == (16 if script == "ppo_mlp" else 8, 4)
    assert not np.array_equal(keys_and_actions["action0"], keys_and_actions["action1"])


def test_the_feed_forward_network_learns_on_two_devices_what_it_learns_on_one(tmp_path):
    """--lstm-size 0 on a probe a feed-forward network solves from its observation (the image
    memory probe would not show it: no feed-forward network beats chance there)."""
    for num_devices in ["1", "2"]:
        run_dir = tmp_path / num_devices
        result = run_with_two_devices(
            *TINY_LSTM[:-2], "--lstm-size", "0", "--env-id", "probe_envs:MatchTheObservationImage",
            "--num-parallel-envs", "16", "--num-env-steps-per-cycle", "8", "--num-minibatches-per-epoch", "2",
            "--num-total-env-steps", str(16 * 8 * 40), "--lr", "3e-3", "--num-devices", num_devices,
            "--run-dir", str(run_dir), script="ppo_lstm_impala.py",
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert ("on 2 devices" in result.stdout) == (num_devices == "2")
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert np.mean([row["charts/episodic_return"] for row in rows[:3]]) < 0.7  # it starts near chance (0.5)
        assert np.mean([row["charts/episodic_return"] for row in rows[-5:]]) > 0.9, num_devices


def test_permute_rows_moves_the_rows_a_gather_would_on_a_tpu_and_elsewhere(monkeypatch):
    """The minibatch shuffle's rows: on a TPU devices.permute_rows sorts them (its gather is slow);
    both ways give x[permutation] exactly, for every leaf of a batch, under vmap over seeds."""
    key = jax.random.key(0)
    batch = {
        "obs": jax.random.normal(key, (2, 512, 4)), "action": jax.random.randint(key, (2, 512), 0, 9),
        "mask": jax.random.bernoulli(key, 0.5, (2, 512, 6)), "frames": jax.random.normal(key, (2, 512, 3, 5)),
    }
    permutations = jax.vmap(lambda k: jax.random.permutation(k, 512))(jax.random.split(jax.random.key(1), 2))
    expected = jax.tree.map(lambda x: jax.vmap(lambda x, p: x[p])(x, permutations), batch)
    for backend in ("cpu", "tpu"):  # "tpu": the sort, traced and run here on the CPU
        monkeypatch.setattr(devices.jax, "default_backend", lambda: backend)
        permute = jax.jit(jax.vmap(lambda batch, p: jax.tree.map(lambda x: devices.permute_rows(x, p), batch)))
        got = permute(batch, permutations)
        for name in batch:
            assert got[name].dtype == batch[name].dtype and np.array_equal(got[name], expected[name]), (backend, name)


def test_take_along_last_axis_picks_what_take_along_axis_does_with_its_gradient_on_a_tpu_and_elsewhere(monkeypatch):
    """The taken action's log-probability: on a TPU a masked sum (its gather is slow), elsewhere
    take_along_axis; both give the same values and gradients, exactly, under vmap over seeds."""
    log_probs = jax.nn.log_softmax(jax.random.normal(jax.random.key(0), (2, 64, 7)))
    actions = jax.random.randint(jax.random.key(1), (2, 64), 0, 7)
    weights = jax.random.normal(jax.random.key(2), (2, 64))

    def reference(log_probs):
        return (jnp.take_along_axis(log_probs, actions[..., None], axis=-1)[..., 0] * weights).sum()

    for backend in ("cpu", "tpu"):  # "tpu": the masked sum, traced and run here on the CPU
        monkeypatch.setattr(devices.jax, "default_backend", lambda: backend)
        picked = jax.jit(jax.vmap(devices.take_along_last_axis))(log_probs, actions)
        assert np.array_equal(picked, jnp.take_along_axis(log_probs, actions[..., None], axis=-1)[..., 0]), backend
        grad = jax.jit(jax.grad(lambda lp: (jax.vmap(devices.take_along_last_axis)(lp, actions) * weights).sum()))(log_probs)
        assert np.array_equal(grad, jax.grad(reference)(log_probs)), backend
