"""Run by tests/test_multi_device.py in a process that has 2 simulated CPU devices (XLA_FLAGS),
so that it can compare one device with two inside one program:

    python tests/two_devices.py update SCRIPT CONFIG OUT.npz
        one update_cycle on the same global batch (a real rollout's, recorded from a 1-device
        train_cycle), on one device and split across two; writes both results
    python tests/two_devices.py rollout SCRIPT CONFIG OUT.npz
        one train_cycle on 2 devices; writes each device's rollout key and actions

CONFIG names an entry of CONFIGS. Both sides use XLA's convolution (under shard_map
cpu.conv3x3_for_cpu hands over to it), so that they differ by float rounding only."""

from __future__ import annotations

import sys

import jax
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
        "cartpole": dict(UPDATE, num_env_steps_per_cycle=16),
        "clock": dict(UPDATE, env_id="probe_envs:Clock", num_env_steps_per_cycle=16),  # every env resets to the same obs
    },
    "ppo_lstm_impala": {
        "bptt": IMAGE,
        "stored": dict(IMAGE, lstm_training="stored"),
        "feed-forward": dict(IMAGE, lstm_size=0),
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


def update(module, args, out: str) -> None:
    env, env_params = envs.make_env(args.env_id)
    network, optimizer = module.make_network(args, env.action_space(env_params).n), module.make_optimizer(args)
    monkeypatch = pytest.MonkeyPatch()
    inputs = record_calls(monkeypatch, module, "update_cycle", lambda a, result: a[:6])  # params .. non_finite
    init, _ = module.make_train(args, env, env_params)
    state = init(args.seed)
    state = jax.jit(lambda s: module.train_cycle(s, network, optimizer, env, env_params, args)[0])(state)
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
    np.savez(out, **results)


def rollout(module, args, out: str) -> None:
    env, env_params = envs.make_env(args.env_id)
    records = []
    monkeypatch = pytest.MonkeyPatch()
    original = module.collect_rollout

    def recording(params, env_carry, key, *rest, **kwargs):
        result = original(params, env_carry, key, *rest, **kwargs)
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
    what, script, config, out = sys.argv[1:]
    module = MODULES[script]
    sizes = CONFIGS[script][config]
    if what == "rollout":
        sizes = dict(sizes, num_total_env_steps=sizes["num_parallel_envs"] * sizes["num_env_steps_per_cycle"])
    {"update": update, "rollout": rollout}[what](module, module.Args(**sizes), out)
