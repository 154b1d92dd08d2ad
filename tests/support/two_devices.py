"""Run by tests/test_multi_device.py in a process that has 2 simulated CPU devices (XLA_FLAGS),
so that it can compare one device with two inside one program:

    python tests/support/two_devices.py update SCRIPT CONFIG OUT.npz [--cycle]
        one update_cycle on the same global batch (a real rollout's, recorded from a 1-device
        train_cycle), on one device and split across two; writes both results. With --cycle
        also that whole 1-device cycle and one on two devices, each handed its half of the
        recorded rollout (cycle_on_two_devices): their new states and every metric
    python tests/support/two_devices.py rollout SCRIPT CONFIG OUT.npz
        one train_cycle on 2 devices; writes each device's rollout key and actions

CONFIG names an entry of CONFIGS. Both sides use XLA's convolution (under shard_map
cpu.conv3x3_for_cpu hands over to it), so that they differ by float rounding only."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import record_calls
from jax.sharding import PartitionSpec as P

import ppo_lstm_impala
import ppo_mlp
from ppo_support import cpu, devices, envs

AXIS = devices.DEVICE_AXIS
# One minibatch per epoch, two epochs: each device's minibatch is its half of the batch, so two
# devices take the gradient of the same global minibatch as one device does.
UPDATE = dict(num_parallel_envs=8, num_minibatches_per_epoch=1, num_epochs_per_cycle=2, lr=1e-2, num_total_env_steps=4096)
IMAGE = dict(UPDATE, env_id="probe_envs:ClockImage", impala_channels=(4,), torso_size=32, lstm_size=32, num_env_steps_per_cycle=8)
CONFIGS = {
    "ppo_mlp": {
        "cartpole": dict(UPDATE, num_env_steps_per_cycle=16, norm_obs=True),
        "clock": dict(UPDATE, env_id="probe_envs:Clock", num_env_steps_per_cycle=16),  # every env resets to the same obs
    },
    "ppo_lstm_impala": {
        "bptt": IMAGE,
        "stored": dict(IMAGE, lstm_training="stored"),
        "feed-forward": dict(IMAGE, lstm_size=0, norm_reward=True),
        "mlp-torso": dict(IMAGE, env_id="probe_envs:Clock", hidden_sizes=(16,)),  # vector observations: --torso auto is mlp
    },
}
MODULES = {"ppo_mlp": ppo_mlp, "ppo_lstm_impala": ppo_lstm_impala}


def batch_specs(module, batch):
    """Splits the batch's transitions (ppo_mlp.py) or sequences (ppo_lstm_impala.py) across devices."""
    if module is ppo_mlp:
        return jax.tree.map(lambda _: P(AXIS), batch)
    axes = module.sequence_axes(batch)
    return module.Batch(*(None if x is None else P(*[None] * axis, AXIS) for x, axis in zip(batch, axes)))


def update(module, args, out: str, with_cycle: bool = False) -> None:
    env, env_params = envs.make_env(args.env_id)
    network, optimizer = module.make_network(args, env.action_space(env_params).n), module.make_optimizer(args)
    monkeypatch = pytest.MonkeyPatch()
    inputs = record_calls(monkeypatch, module, "update_cycle", lambda a, result: a[:6])  # params .. non_finite
    rollouts = record_calls(monkeypatch, module, "collect_rollout", lambda a, result: result)
    init, train = module.make_train(args, env, env_params)
    start = devices.stack_seeds([init(args.seed)])  # one seed
    cycle_on_one = jax.jit(lambda states: train(states, 1))(start)  # the script's own train path
    monkeypatch.undo()
    params, opt_state, batch, key, cycle, non_finite = inputs[0]
    batch = module.Batch(*batch)

    def update_cycle(params, opt_state, batch, key, cycle, non_finite, axis_name=None):
        params, opt_state, metrics, _ = module.update_cycle(
            params, opt_state, batch, key, cycle, non_finite, network, optimizer, args, axis_name
        )
        return params, metrics

    one = jax.jit(update_cycle)(params, opt_state, batch, key, cycle, non_finite)
    mesh = jax.make_mesh((2,), (AXIS,))
    specs = (P(), P(), batch_specs(module, batch), P(), P(), P())
    inputs = (params, opt_state, batch, key, cycle, non_finite)
    placed = jax.tree.map(lambda spec, x: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec)), specs, inputs,
                          is_leaf=lambda node: isinstance(node, P))
    two = jax.jit(jax.shard_map(lambda *a: update_cycle(*a, axis_name=AXIS), mesh=mesh, in_specs=specs, out_specs=P()))(*placed)
    results = {}
    for name, (new_params, metrics) in {"one": one, "two": two}.items():
        for i, leaf in enumerate(jax.tree.leaves(new_params)):
            results[f"{name}/param{i}"] = np.asarray(leaf)
        for metric, value in metrics.items():
            results[f"{name}/{metric}"] = np.asarray(value)
    results["before/grad_step"] = np.concatenate([np.asarray(leaf - new).ravel() for leaf, new in
                                                  zip(jax.tree.leaves(params), jax.tree.leaves(one[0]))])
    if with_cycle:
        results.update(cycles(module, args, env, env_params, start, cycle_on_one, rollouts[0], batch))
    np.savez(out, **results)


def cycles(module, args, env, env_params, start, cycle_on_one, rollout, batch) -> dict[str, np.ndarray]:
    """The 1-device cycle's and the 2-device one's states and metrics, the run's metric names,
    and what each device's share alone gives (shares)."""
    results = {}
    cycle_on_two = cycle_on_two_devices(module, args, env, env_params, start, rollout)
    for name, (states, metrics) in {"cycle_one": cycle_on_one, "cycle_two": cycle_on_two}.items():
        for path, leaf in jax.tree.leaves_with_path(states):
            results[f"{name}/state{jax.tree_util.keystr(path)}"] = np.asarray(devices.key_data_or_array(leaf))
        for metric, value in metrics.items():
            results[f"{name}/{metric}"] = np.asarray(value)
    results["run_metric_names"] = np.array(module.run_metric_names(env, env_params))
    return results | shares(module, batch, rollout, args)


def cycle_on_two_devices(module, args, env, env_params, start, rollout):
    """One cycle of the script's own train path on 2 devices (make_train with a mesh) from the
    states `start`, with collect_rollout replaced by this device's share of `rollout`, the
    outputs of the 1-device cycle's collect_rollout: the envs split along the env axis (axis 0
    of the env carry, axis 1 of the (T, N) transitions and finished episodes), in device order,
    as shard_map splits the states' envs. Everything after the rollout runs as the script has it."""
    rollout_state, transitions, finished = rollout

    def this_devices_share(*unused, **unused_keywords):
        share = args.num_parallel_envs // jax.lax.axis_size(AXIS)
        first = jax.lax.axis_index(AXIS) * share
        take = lambda axis: lambda x: jax.lax.dynamic_slice_in_dim(jnp.asarray(x), first, share, axis)  # noqa: E731
        return jax.tree.map(take(0), rollout_state), jax.tree.map(take(1), transitions), jax.tree.map(take(1), finished)

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(module, "collect_rollout", this_devices_share)
    mesh = jax.make_mesh((2,), (AXIS,))
    _, train = module.make_train(args, env, env_params, mesh)
    result = jax.jit(lambda states: train(states, 1))(devices.place_on_mesh(start, mesh))
    monkeypatch.undo()
    return result


def shares(module, batch, rollout, args) -> dict[str, np.ndarray]:
    """What each device's half of the envs alone gives for the metrics computed after the rollout
    (explained variance, the finished episodes' means), device 0's as share0/<name>: a test that
    these differ from the whole batch's shows that a metric taken over one device's share, or
    averaged over the devices' shares, would be caught."""
    def share(x, device):  # (T, N) -> the device's (T, N / 2); the batch's rows run over the envs within each step
        return np.split(np.asarray(x).reshape(args.num_env_steps_per_cycle, args.num_parallel_envs), 2, axis=1)[device]

    results = {}
    for device in range(2):
        ev = module.explained_variance(share(batch.value, device), share(batch.target, device))
        results[f"share{device}/losses/explained_variance"] = ev
        for name, values in rollout[2].items():
            results[f"share{device}/{name}"] = devices.nanmean_or_nan(share(values, device))
    return {name: np.asarray(value) for name, value in results.items()}


def rollout(module, args, out: str) -> None:
    env, env_params = envs.make_env(args.env_id)
    records = []
    monkeypatch = pytest.MonkeyPatch()
    original = module.collect_rollout

    def recording(params, rollout_state, key, *rest, **kwargs):
        result = original(params, rollout_state, key, *rest, **kwargs)
        device = jax.lax.axis_index(AXIS)
        jax.debug.callback(lambda *values: records.append(values), device, jax.random.key_data(key), result[1].action)
        return result

    monkeypatch.setattr(module, "collect_rollout", recording)
    mesh = jax.make_mesh((2,), (AXIS,))
    init, train = module.make_train(args, env, env_params, mesh)
    states = devices.place_on_mesh(devices.stack_seeds([init(args.seed)]), mesh)
    jax.block_until_ready(jax.jit(train)(states))
    by_device = {int(device): (key_data, action) for device, key_data, action in records}
    np.savez(out, **{f"key{d}": by_device[d][0] for d in by_device}, **{f"action{d}": by_device[d][1] for d in by_device})


def xla_convolution(lhs, rhs, window_strides, padding, **unused):
    return jax.lax.conv_general_dilated(lhs, rhs, window_strides, padding, dimension_numbers=cpu.NHWC_HWIO)


if __name__ == "__main__":
    cpu.conv3x3_for_cpu = xla_convolution
    what, script, config, out, *options = sys.argv[1:]
    module = MODULES[script]
    sizes = CONFIGS[script][config]
    if what == "rollout":
        sizes = dict(sizes, num_total_env_steps=sizes["num_parallel_envs"] * sizes["num_env_steps_per_cycle"])
    if what == "update":
        update(module, module.Args(**sizes), out, with_cycle=options == ["--cycle"])
    else:
        rollout(module, module.Args(**sizes), out)
