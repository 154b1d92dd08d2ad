"""The values each script's update used, read out of the jitted train loop as it ran (not the
values it logged): the learning rate, measured from the parameters each step moved; the clip
range passed to the loss; the parameters and optimizer state that --target-kl leaves; and the
minibatch metrics, recomputed from each applied step's parameters and minibatch. Both scripts,
at tiny sizes: 3 cycles x 2 epochs x 4 minibatches, with a learning rate high enough that
--target-kl 0.002 skips some minibatches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import learning_rate_used, record_calls

import ppo_lstm_impala
import ppo_mlp
from ppo_support import devices, envs

SIZES = dict(num_parallel_envs=8, num_epochs_per_cycle=2, num_minibatches_per_epoch=4, lr=1e-2, anneal_lr=True, anneal_clip_eps=True)
SCRIPTS = {
    "ppo_mlp": (ppo_mlp, dict(SIZES, num_env_steps_per_cycle=16, num_total_env_steps=3 * 128)),
    "ppo_lstm_impala": (ppo_lstm_impala, dict(SIZES, env_id="probe_envs:ClockImage", impala_channels=(4,), torso_size=32,
                                              lstm_size=32, num_env_steps_per_cycle=8, num_total_env_steps=3 * 64)),
}  # CartPole-v1 and the Clock probe: 2 actions each


def record_updates(monkeypatch, script: str, target_kl: float | None, **flags):
    """Trains one seed with every minibatch_update call read out: the carry it started from, its
    minibatch and clip range, and the parameters, optimizer state and count of applied updates
    it returned. Returns (module, args, calls in run order, metrics (cycles, 1), final states).
    Recorded once per xdist worker for each configuration (RECORDED): three tests read the
    --target-kl 0.002 run, and pytest-xdist's default --dist load hands a worker consecutive tests."""
    key = (script, target_kl, tuple(sorted(flags.items())))
    if key not in RECORDED:
        RECORDED[key] = record_updates_once(monkeypatch, script, target_kl, **flags)
    return RECORDED[key]


RECORDED: dict = {}  # (script, target_kl, flags) -> what record_updates returns


def record_updates_once(monkeypatch, script: str, target_kl: float | None, **flags):
    module, sizes = SCRIPTS[script]
    args = module.Args(**{**sizes, **flags}, target_kl=target_kl)
    calls = record_calls(monkeypatch, module, "minibatch_update", lambda a, out: dict(
        params=a[0].params, opt_state=a[0].opt_state, applied_before=a[0].num_applied, minibatch=a[1],
        clip_eps=jnp.asarray(a[3]), params_after=out.params, opt_state_after=out.opt_state, applied_after=out.num_applied,
    ))
    env, env_params = envs.make_env(args.env_id)
    init, train = module.make_train(args, env, env_params)
    states, metrics = jax.jit(train)(devices.stack_seeds([init(args.seed)]))
    assert len(calls) == args.num_gradient_steps
    for call in calls:
        call["applied"] = bool(call["applied_after"] > call["applied_before"])
    return module, args, calls, {name: np.asarray(value) for name, value in metrics.items()}, states


def loss_metrics_and_grads(module, args, call: dict):
    """The loss's metrics and gradient for a recorded call, recomputed outside the program (with
    the script's loss_fn, jitted once per run: op by op, the LSTM's took minutes per test)."""
    key = (module.__name__, id(args))
    if key not in LOSS_AND_GRADS:
        network = module.make_network(args, 2)
        LOSS_AND_GRADS[key] = (args, jax.jit(lambda params, minibatch, clip_eps: jax.value_and_grad(module.loss_fn, has_aux=True)(
            params, minibatch, clip_eps, network, args, None)))
    (_, metrics), grads = LOSS_AND_GRADS[key][1](call["params"], module.Batch(*call["minibatch"]), jnp.float32(call["clip_eps"]))
    return {name: float(value) for name, value in metrics.items()}, grads


LOSS_AND_GRADS: dict = {}  # (script, id(args)) -> (args, kept alive so its id stays unique; the jitted function)


def same_tree(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


@pytest.mark.parametrize("target_kl", [None, 0.002])
@pytest.mark.parametrize("script", SCRIPTS)
def test_the_learning_rate_and_clip_range_used_follow_the_nominal_step_to_zero(monkeypatch, script, target_kl):
    # Both schedules count every nominal gradient step, the ones --target-kl skips too, and reach
    # exactly 0 at the run's last step. The learning rate is measured from the parameters each
    # step moved, the clip range is the one passed to the loss, and charts/* log the values the
    # cycle's last applied update used.
    module, args, calls, metrics, _ = record_updates(monkeypatch, script, target_kl)
    num_steps = args.num_gradient_steps
    fraction = 1.0 - np.arange(num_steps) / (num_steps - 1)
    expected_lr, expected_clip = args.lr * fraction, args.clip_eps * fraction
    clipped = 0  # steps whose gradient the global-norm clip shortened: the measurement's reference clips it too
    for step, call in enumerate(calls):
        assert float(call["clip_eps"]) == pytest.approx(expected_clip[step], rel=1e-6, abs=0.0), step
        if not call["applied"] or step == num_steps - 1:  # skipped, or a learning rate of exactly 0
            assert same_tree(call["params_after"], call["params"]), step
        else:
            _, grads = loss_metrics_and_grads(module, args, call)
            used = learning_rate_used(call["params"], call["params_after"], grads, call["opt_state"], args.max_grad_norm, args.adam_eps)
            assert used == pytest.approx(expected_lr[step], rel=1e-3), step
            clipped += float(optax.tree.norm(grads)) > args.max_grad_norm
    assert clipped > 0
    assert float(calls[-1]["clip_eps"]) == 0.0
    per_cycle = args.num_epochs_per_cycle * args.num_minibatches_per_epoch
    for cycle in range(args.num_cycles):
        last = max(step for step in range(cycle * per_cycle, (cycle + 1) * per_cycle) if calls[step]["applied"])
        assert metrics["charts/learning_rate"][cycle, 0] == pytest.approx(expected_lr[last], rel=1e-6, abs=0.0)
        assert metrics["charts/clip_eps"][cycle, 0] == pytest.approx(expected_clip[last], rel=1e-6, abs=0.0)
    if target_kl is not None:  # a step applied after skipped ones: there a count of applied steps would differ
        applied = [call["applied"] for call in calls]
        assert any(applied[step] and not all(applied[:step]) for step in range(num_steps - 1))


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_clip_range_anneals_with_its_own_flag_and_the_learning_rate_stays_without_its_own(monkeypatch, script):
    # --anneal-clip-eps alone: the clip range passed to the loss falls to exactly 0 while the
    # learning rate stays at --lr (a schedule read from the other switch would fail one of them).
    _, args, calls, metrics, _ = record_updates(monkeypatch, script, None, anneal_lr=False, anneal_clip_eps=True)
    fraction = 1.0 - np.arange(args.num_gradient_steps) / (args.num_gradient_steps - 1)
    assert [float(call["clip_eps"]) for call in calls] == pytest.approx(list(args.clip_eps * fraction), rel=1e-6, abs=0.0)
    assert np.all(metrics["charts/learning_rate"] == np.float32(args.lr))
    assert metrics["charts/clip_eps"][-1, 0] == 0.0


@pytest.mark.parametrize("script", SCRIPTS)
def test_target_kl_leaves_the_parameters_of_the_last_update_it_applied(monkeypatch, script):
    # The minibatch whose approxkl3 exceeds the target is not applied, nor any after it in the
    # cycle: parameters and optimizer state come out of each skipped call exactly as they went in.
    _, _, calls, _, states = record_updates(monkeypatch, script, 0.002)
    skipped = [call for call in calls if not call["applied"]]
    assert skipped and len(skipped) < len(calls)
    for call in skipped:
        assert same_tree(call["params_after"], call["params"])
        assert same_tree(call["opt_state_after"], call["opt_state"])
    assert same_tree(jax.tree.map(lambda x: x[0], states.params), calls[-1]["params_after"])


SIX_CYCLES = {"ppo_mlp": dict(num_total_env_steps=6 * 128), "ppo_lstm_impala": dict(num_total_env_steps=6 * 64, num_minibatches_per_epoch=8)}


@pytest.mark.parametrize("script", SCRIPTS)
def test_target_kl_applies_a_cycles_minibatches_up_to_the_first_over_the_target_and_none_after(monkeypatch, script):
    # The rule (docs/flags.md, SB3's per minibatch): a minibatch is applied unless its approxkl3,
    # measured before its step on its own minibatch, exceeds the target, or one before it in the
    # cycle did; the stop lasts to the end of the cycle, across epochs. Each cycle's applied
    # minibatches, in order, against a Python loop of that rule over the approxkl3 recomputed from
    # each call's parameters and minibatch; the parameters move at exactly the applied steps, and
    # losses/epochs_run counts them. At 0.003, over 6 cycles (the LSTM's in minibatches of one
    # sequence), some cycle stops in its first epoch and leaves later minibatches whose approxkl3
    # at the stopped parameters is under the target: a stop that ended with its epoch would apply them.
    module, args, calls, metrics, _ = record_updates(monkeypatch, script, 0.003, **SIX_CYCLES[script])
    per_cycle = args.num_epochs_per_cycle * args.num_minibatches_per_epoch
    stopped_in_first_epoch_before_one_under_the_target = 0
    for cycle in range(args.num_cycles):
        cycle_calls = calls[cycle * per_cycle : (cycle + 1) * per_cycle]
        approxkl3 = [loss_metrics_and_grads(module, args, call)[0]["losses/actor_approxkl3"] for call in cycle_calls]
        expected, stopped = [], False
        for index, (call, kl) in enumerate(zip(cycle_calls, approxkl3)):
            if abs(kl - args.target_kl) > 1e-4 * args.target_kl:  # (a float-rounding tie: the program's decision)
                stopped = stopped or kl > args.target_kl
            else:
                stopped = stopped or not call["applied"]
            expected.append(not stopped)
        assert [call["applied"] for call in cycle_calls] == expected, (cycle, approxkl3)
        for step, call in enumerate(cycle_calls, start=cycle * per_cycle):
            if step < args.num_gradient_steps - 1:  # the run's last step has a learning rate of 0
                assert same_tree(call["params_after"], call["params"]) == (not call["applied"]), step
        assert metrics["losses/epochs_run"][cycle, 0] == pytest.approx(sum(expected) / args.num_minibatches_per_epoch)
        first_skipped = expected.index(False) if False in expected else per_cycle
        stopped_in_first_epoch_before_one_under_the_target += first_skipped < args.num_minibatches_per_epoch and any(
            kl <= args.target_kl for kl in approxkl3[args.num_minibatches_per_epoch :])
    assert stopped_in_first_epoch_before_one_under_the_target > 0


@pytest.mark.parametrize("script", SCRIPTS)
def test_minibatch_metrics_are_the_mean_over_the_updates_applied(monkeypatch, script):
    # Each cycle's losses/* are the mean over the minibatches it applied (recomputed here from
    # each applied call's parameters and minibatch), and losses/epochs_run counts them.
    module, args, calls, metrics, _ = record_updates(monkeypatch, script, 0.002)
    per_cycle = args.num_epochs_per_cycle * args.num_minibatches_per_epoch
    partial_cycles = 0
    for cycle in range(args.num_cycles):
        applied = [call for call in calls[cycle * per_cycle : (cycle + 1) * per_cycle] if call["applied"]]
        partial_cycles += len(applied) < per_cycle
        recomputed = [loss_metrics_and_grads(module, args, call) for call in applied]
        expected = {name: np.mean([m[name] for m, _ in recomputed]) for name in recomputed[0][0]}
        expected["losses/grad_norm"] = np.mean([float(optax.tree.norm(grads)) for _, grads in recomputed])
        for name, value in expected.items():
            assert metrics[name][cycle, 0] == pytest.approx(value, rel=1e-4, abs=1e-6), (cycle, name)
        assert metrics["losses/epochs_run"][cycle, 0] == pytest.approx(len(applied) / args.num_minibatches_per_epoch)
    assert partial_cycles > 0
