"""Tests for ppo_lstm_impala.py: pure functions against slow references, the LSTM carry
conventions, probe environments, the memory task, the CLI and a short Breakout learning check.

Every run uses a tiny network (one IMPALA stage of 4 channels, 32-wide torso and LSTM) so the file
fits in a few minutes on a 2-core CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import distrax
import flax
import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import record_calls, record_second_cycle, record_two_cycles, run_script
from reference import gae_reference, ppo_loss_reference, prev_action_reward_reference

import ppo_lstm_impala as ppo
from ppo_support import cpu, envs, evaluation

SCRIPT = Path(ppo.__file__)
TINY = dict(impala_channels=(4,), torso_size=32, lstm_size=32)


MEMORY_ENV_ID = "probe_envs:Memory"


def tiny_args(tmp_path: Path, name: str = "run", **overrides) -> ppo.Args:
    fields = dict(
        TINY,
        num_parallel_envs=8,
        num_env_steps_per_cycle=12,
        num_minibatches_per_epoch=2,
        num_epochs_per_cycle=2,
        num_total_env_steps=8 * 12 * 3,
        run_dir=str(tmp_path / name),
    )
    fields.update(overrides)
    env, env_params = envs.make_env(fields.get("env_id", ppo.Args.env_id))
    if len(env.observation_space(env_params).shape) != 3:  # the MLP torso, which the IMPALA sizes are not flags of
        fields = {name: value for name, value in fields.items() if name not in ("impala_channels", "torso_size")}
    return ppo.Args(**fields)


def read_metrics(run_dir: str | Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def make_network_and_params(obs_shape, num_actions=3, seed=0, **overrides):
    args = ppo.Args(**{**TINY, **overrides})
    network = ppo.make_network(args, num_actions)
    return args, network, ppo.init_params(network, jax.random.key(seed), args, obs_shape)


# ======================================================================================
# Pure functions against the references
# ======================================================================================


@pytest.mark.parametrize("bootstrap_truncated", [True, False])
def test_compute_gae_matches_reference(bootstrap_truncated):
    rng = np.random.default_rng(0)
    num_steps, num_envs = 9, 4
    reward = rng.normal(size=(num_steps, num_envs)).astype(np.float32)
    value = rng.normal(size=(num_steps, num_envs)).astype(np.float32)
    next_value = rng.normal(size=(num_steps, num_envs)).astype(np.float32)
    terminated = rng.random((num_steps, num_envs)) < 0.15
    truncated = (rng.random((num_steps, num_envs)) < 0.15) & ~terminated
    terminated[-1, 0], truncated[-1, 1] = True, True  # last-step termination and truncation
    terminated[-1, 2] = truncated[-1, 2] = False  # last step of env 2 bootstraps from next_value
    done = terminated | truncated
    stops = terminated if bootstrap_truncated else done
    advantage, target = ppo.compute_gae(
        jnp.asarray(reward), jnp.asarray(value), jnp.asarray(next_value),
        jnp.asarray(stops, jnp.float32), jnp.asarray(done), 0.97, 0.9,
    )
    expected_advantage, expected_target = gae_reference(
        reward, value, next_value, terminated, truncated, 0.97, 0.9, bootstrap_truncated
    )
    np.testing.assert_allclose(advantage, expected_advantage, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(target, expected_target, rtol=1e-5, atol=1e-5)


def test_log_prob_and_entropy_match_distrax():
    # (T, B, A) logits, as the recurrent forward returns them; invalid actions masked.
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(0.0, 3.0, (8, 6, 4)), jnp.float32)
    mask = jnp.asarray(rng.random((8, 6, 4)) < 0.7).at[..., 0].set(True)
    masked_logits = ppo.masked(logits, mask)
    action = jnp.asarray([[rng.choice(np.flatnonzero(row)) for row in step] for step in np.asarray(mask)])
    log_prob, entropy = ppo.log_prob_and_entropy(masked_logits, action)
    reference = distrax.Categorical(logits=masked_logits)
    np.testing.assert_allclose(log_prob, reference.log_prob(action), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(entropy, reference.entropy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("clip_vloss", [True, False])
@pytest.mark.parametrize("norm_adv", [True, False])
def test_ppo_loss_terms_match_reference(clip_vloss, norm_adv):
    rng = np.random.default_rng(1)
    size = 32
    old_logp = np.log(rng.uniform(0.1, 0.9, size)).astype(np.float32)
    new_logp = (old_logp + rng.normal(0, 0.3, size)).astype(np.float32)
    old_value = rng.normal(size=size).astype(np.float32)
    new_value = (old_value + rng.normal(0, 0.3, size)).astype(np.float32)
    advantage = rng.normal(size=size).astype(np.float32)
    target = rng.normal(size=size).astype(np.float32)
    entropy = rng.uniform(0, 1, size).astype(np.float32)
    # The loss sees (L, S) arrays; the reference the same numbers flattened.
    shaped = lambda x: jnp.asarray(x).reshape(4, 8)  # noqa: E731
    batch = ppo.Batch(
        obs=None, episode_start=None, carry=None, action=None, logp=shaped(old_logp),
        value=shaped(old_value), advantage=shaped(advantage), target=shaped(target), action_mask=None,
    )
    policy_loss, value_loss, metrics = ppo.ppo_loss_terms(
        shaped(new_logp), shaped(entropy), shaped(new_value), batch, jnp.float32(0.2), clip_vloss, norm_adv
    )
    expected = ppo_loss_reference(
        new_logp, entropy, new_value, old_logp, old_value, advantage, target, 0.2, clip_vloss, norm_adv
    )
    assert float(policy_loss) == pytest.approx(expected["losses/policy_loss"], abs=1e-5)
    assert float(value_loss) == pytest.approx(expected["losses/value_loss"], abs=1e-5)
    for name, value in expected.items():
        assert float(metrics[name]) == pytest.approx(value, abs=1e-5), name


# ======================================================================================
# Network and carry conventions
# ======================================================================================


@pytest.mark.parametrize("obs_shape", [(10, 10, 4), (7, 5, 2), (3, 3, 1)])
def test_impala_output_shapes(obs_shape):
    # shapes only (jax.eval_shape): nothing is computed
    channels = (4, 6)
    torso = ppo.ImpalaTorso(channels, 32, True)
    params = jax.eval_shape(torso.init, jax.random.key(0), jnp.zeros((2, *obs_shape)))
    assert jax.eval_shape(torso.apply, params, jnp.ones((5, *obs_shape))).shape == (5, 32)
    # two stride-2 SAME max-pools: ceil(ceil(H / 2) / 2) x ceil(ceil(W / 2) / 2) x last channels
    height, width = (int(np.ceil(np.ceil(size / 2) / 2)) for size in obs_shape[:2])
    dense_kernel = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params) if "Dense" in str(path) and "kernel" in str(path)]
    assert dense_kernel[0].shape == (height * width * channels[-1], 32)

    args = ppo.Args(**TINY)
    network = ppo.make_network(args, 5)
    network_params = jax.eval_shape(lambda key: ppo.init_params(network, key, args, obs_shape), jax.random.key(0))
    carries, logits, value = jax.eval_shape(
        network.apply, network_params, jnp.zeros((3, args.carry_size)), jnp.ones((4, 3, *obs_shape)), jnp.zeros((4, 3), bool)
    )
    assert carries.shape == (4, 3, 2 * 32) and logits.shape == (4, 3, 5) and value.shape == (4, 3)


def test_orthogonal_init_gains_and_zero_biases():
    _, _, params = make_network_and_params((5, 5, 2))
    leaves = {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
    for name, leaf in leaves.items():
        if "bias" in name:  # zero, but the LSTM's forget gate: 1.0 (--lstm-forget-bias's default)
            assert np.all(np.asarray(leaf) == (1.0 if "['hf']" in name else 0.0)), name
    actor_head = next(leaf for name, leaf in leaves.items() if "actor_head" in name and "kernel" in name)
    critic_head = next(leaf for name, leaf in leaves.items() if "critic_head" in name and "kernel" in name)
    # orthogonal columns (A <= rows): kernel^T kernel = gain^2 I
    np.testing.assert_allclose(actor_head.T @ actor_head, 0.01**2 * np.eye(3), atol=1e-7)
    np.testing.assert_allclose(critic_head.T @ critic_head, np.eye(1), atol=1e-5)


@pytest.mark.parametrize("separate_critic", [False, True])
def test_head_hidden_sizes_put_relu_layers_in_both_heads_and_none_keeps_them_linear(separate_critic):
    """--head-hidden-sizes 16 8: each head is dense 16, ReLU, dense 8, ReLU, then its output layer,
    checked against a NumPy forward pass of the LSTM's output through the head's own kernels; the
    hidden layers have orthogonal columns of gain sqrt(2), the output layers keep 0.01 and 1. The
    default () is one dense layer per head, on the same LSTM output."""
    obs_shape = (3, 3, 2)
    obs = jax.random.uniform(jax.random.key(1), (4, 2, *obs_shape))
    starts = jnp.zeros((4, 2), bool)
    _, linear_network, linear_params = make_network_and_params(obs_shape, separate_critic=separate_critic)
    args, network, params = make_network_and_params(obs_shape, separate_critic=separate_critic, head_hidden_sizes=(16, 8))
    carry = jnp.zeros((2, args.carry_size))
    linear = flax.traverse_util.flatten_dict(linear_params["params"])
    assert {path[1:] for path in linear if path[0] == "actor_head"} == {("kernel",), ("bias",)}

    _, logits, value = network.apply(params, carry, obs, starts)
    tree = params["params"]
    for name, core, output, gain in [("actor_head", "actor_core", logits, 0.01), ("critic_head", "critic_core", value[..., None], 1.0)]:
        layers = [tree[name][f"layers_{index}"] for index in (0, 2, 4)]
        assert [layer["kernel"].shape for layer in layers] == [(32, 16), (16, 8), (8, output.shape[-1])]
        for layer in layers[:2]:
            kernel = np.asarray(layer["kernel"])  # orthogonal columns: kernel^T kernel = 2 I
            np.testing.assert_allclose(kernel.T @ kernel, 2.0 * np.eye(kernel.shape[1]), atol=1e-5)
        last = np.asarray(layers[2]["kernel"])
        np.testing.assert_allclose(last.T @ last, gain**2 * np.eye(last.shape[1]), atol=1e-5)
        core = core if separate_critic else "actor_core"
        _, features = ppo.Core(args.torso, args.impala_channels, args.torso_size, args.hidden_sizes, args.activation,
                               args.lstm_size, args.orthogonal_init).apply({"params": tree[core]}, carry[:, :64], obs, starts)
        x = np.asarray(features, np.float64)
        for layer in layers[:2]:
            x = np.maximum(x @ np.asarray(layer["kernel"]) + np.asarray(layer["bias"]), 0.0)
        expected = x @ last + np.asarray(layers[2]["bias"])
        np.testing.assert_allclose(np.asarray(output), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("forget_bias, added", [(None, 1.0), (1.0, 1.0), (2.5, 2.5)])
def test_lstm_forget_bias_is_in_the_params_training_starts_from(forget_bias, added):
    """--lstm-forget-bias (1.0 by default): the initial TrainState (make_train's init) has it in
    every forget-gate bias, of the actor's LSTM and the critic's; every other parameter is the one
    it has with --lstm-forget-bias 0 (flax's init)."""
    env, env_params = envs.make_env(MEMORY_ENV_ID)
    flags = {**TINY, "env_id": MEMORY_ENV_ID, "separate_critic": True}
    init, _ = ppo.make_train(ppo.Args(**flags, **({} if forget_bias is None else {"lstm_forget_bias": forget_bias})), env, env_params)
    init_without, _ = ppo.make_train(ppo.Args(**flags, lstm_forget_bias=0.0), env, env_params)
    params = flax.traverse_util.flatten_dict(init(0).params)
    params_without = flax.traverse_util.flatten_dict(init_without(0).params)
    forget = [path for path in params if path[-2:] == ("hf", "bias")]
    assert len(forget) == 2 and {path[1] for path in forget} == {"actor_core", "critic_core"}
    assert all(np.all(params_without[path] == 0.0) for path in forget)
    for path, value in params.items():
        np.testing.assert_array_equal(value, params_without[path] + (added if path in forget else 0.0))


def test_a_network_without_an_lstm_trains_without_a_forget_bias_flag():
    """The default forget bias needs no LSTM: --lstm-size 0 initialises as flax does, with no
    forget gate to set."""
    env, env_params = envs.make_env(MEMORY_ENV_ID)
    init, _ = ppo.make_train(ppo.Args(**{**TINY, "lstm_size": 0}, env_id=MEMORY_ENV_ID), env, env_params)
    params = flax.traverse_util.flatten_dict(init(0).params)
    assert not [path for path in params if "hf" in path]

@pytest.mark.parametrize("separate_critic", [False, True])
def test_carry_is_zero_at_episode_start(separate_critic):
    """A replayed sequence with a reset at t = 3 gives, from t = 3 on, exactly what a fresh
    zero-carry forward of the new episode gives; without the flag it does not."""
    obs_shape = (3, 3, 2)
    args, network, params = make_network_and_params(obs_shape, separate_critic=separate_critic)
    obs = jax.random.uniform(jax.random.key(1), (7, 2, *obs_shape))
    start = np.zeros((7, 2), bool)
    start[3, 0] = True  # env 0: obs[3] starts a new episode
    carry = jax.random.normal(jax.random.key(2), (2, args.carry_size))  # a non-zero carry
    _, logits, value = network.apply(params, carry, obs, jnp.asarray(start))
    _, fresh_logits, fresh_value = network.apply(params, jnp.zeros((1, args.carry_size)), obs[3:, :1], jnp.zeros((4, 1), bool))
    np.testing.assert_allclose(logits[3:, 0], fresh_logits[:, 0], atol=1e-6)
    np.testing.assert_allclose(value[3:, 0], fresh_value[:, 0], atol=1e-6)
    _, _, unreset_value = network.apply(params, carry, obs, jnp.zeros((7, 2), bool))
    assert not np.allclose(unreset_value[3:, 0], fresh_value[:, 0], atol=1e-4)
    np.testing.assert_array_equal(unreset_value[:, 1], value[:, 1])  # env 1 is untouched


def test_prev_action_reward_is_the_last_steps_and_zero_where_an_episode_starts():
    """--prev-action-reward: in a rollout, the extra LSTM input with obs[t] (what the network was
    given, kept in the Transition) is step t-1's action one-hot and raw reward, and zeros where
    obs[t] starts an episode; the final observation's is step t's own."""
    args = ppo.Args(env_id="probe_envs:HiddenArm", hidden_sizes=(8,), lstm_size=8, num_parallel_envs=4,
                    num_env_steps_per_cycle=20, prev_action_reward=True)
    env, env_params = envs.make_env(args.env_id)
    network = ppo.make_network(args, 2)
    params = ppo.init_params(network, jax.random.key(0), args, ppo.stacked_obs_shape(env, env_params, 1))
    rollout_state = ppo.reset_envs(jax.random.key(1), env, env_params, 4, args)
    _, transitions, _ = ppo.collect_rollout(params, rollout_state, jax.random.key(2), network, env, env_params, 20, False, False)
    prev = np.asarray(transitions.prev_action_reward)  # (T, N, 3)
    action, reward = np.asarray(transitions.action), np.asarray(transitions.reward)
    start = np.asarray(transitions.episode_start)
    assert start[8].all() and start.sum() == 2 * 4 + 4  # episodes of 8 steps: starts at 0, 8, 16
    for t in range(20):
        for n in range(4):
            expected = np.zeros(3) if start[t, n] else np.array([action[t - 1, n] == 0, action[t - 1, n] == 1, reward[t - 1, n]])
            np.testing.assert_array_equal(prev[t, n], expected, err_msg=f"t={t} n={n}")
    assert reward.sum() > 0 and (reward == 0).any()
    final = np.asarray(ppo.final_prev_action_reward(transitions)).reshape(20, 4, 3)
    np.testing.assert_array_equal(final[..., 2], reward)
    np.testing.assert_array_equal(final[..., 1], action == 1)


# RandomEnds: episodes that terminate at random or are truncated after 4 steps; the MLP torso.
ENDS_BOTH_WAYS = dict(env_id="probe_envs:RandomEnds", hidden_sizes=(8,), lstm_size=8, num_parallel_envs=8,
                      num_env_steps_per_cycle=8, num_total_env_steps=128, num_minibatches_per_epoch=2,
                      num_epochs_per_cycle=1, prev_action_reward=True)


def assert_episodes_end_both_ways(terminated, truncated) -> None:
    """Before the last step, some episodes end by a truncation alone and some by a termination alone."""
    terminated, truncated = np.asarray(terminated)[:-1], np.asarray(truncated)[:-1]
    assert (truncated & ~terminated).sum() >= 2 and (terminated & ~truncated).sum() >= 2


def one_hot_and_reward(action, reward, num_actions: int) -> np.ndarray:
    return np.concatenate([np.eye(num_actions)[np.asarray(action)], np.asarray(reward, np.float64)[..., None]], axis=-1)


@pytest.mark.parametrize("lstm_training", ["bptt", "stored"])
def test_prev_action_reward_is_reset_where_episodes_terminate_or_are_truncated(monkeypatch, lstm_training):
    """--prev-action-reward on RandomEnds, two cycles from fresh envs: the input the rollout gave
    the LSTM with each observation equals a Python loop over the steps taken (zeros at every
    episode start, whether the episode before it terminated or was truncated). The second cycle's
    update replays the rollout with those inputs: its batch holds them, and its values, log-probs
    and value targets equal a step-by-step rerun from the cycle's first carry with the loop's
    inputs, where V(final_obs[t]) gets step t's own action and reward (a truncated episode's final
    observation continues it), in both replays (bptt: whole sequences; stored: single steps)."""
    args = ppo.Args(**ENDS_BOTH_WAYS, lstm_training=lstm_training, gamma=0.9, gae_lambda=0.8)
    rollouts, updates, state, network = record_two_cycles(monkeypatch, ppo, args)
    steps = jax.tree.map(lambda *cycles: np.concatenate(cycles), *rollouts)  # (2T, N, ...) from fresh envs
    num_actions = steps.prev_action_reward.shape[-1] - 1
    expected = prev_action_reward_reference(steps.action, steps.reward, steps.terminated, steps.truncated, num_actions)
    num_steps, num_envs = args.num_env_steps_per_cycle, args.num_parallel_envs
    for cycle in range(2):
        assert_episodes_end_both_ways(*(x[cycle * num_steps : (cycle + 1) * num_steps] for x in (steps.terminated, steps.truncated)))
    np.testing.assert_array_equal(steps.prev_action_reward, expected)

    second, expected = rollouts[1], expected[num_steps:]
    batch, params = updates[1]["batch"], updates[1]["params"]
    np.testing.assert_array_equal(batch.prev_action_reward.reshape(num_steps, num_envs, -1), expected)
    done = np.logical_or(steps.terminated, steps.truncated)
    episode_start = done[num_steps - 1 : -1]  # obs[t] of the second cycle starts an episode where step t - 1 ended one
    apply = jax.jit(network.apply)
    value, logp, next_value = (np.zeros((num_steps, num_envs)) for _ in range(3))
    carry = jnp.asarray(state.env.lstm_carry)  # after the first cycle's last step, before any reset
    for t in range(num_steps):
        carries, logits, step_value = apply(params, carry, second.obs[t][None], episode_start[t][None],
                                            jnp.asarray(expected[t][None], jnp.float32))
        carry = carries[0]
        final_input = one_hot_and_reward(second.action[t], second.reward[t], num_actions)  # never reset
        _, _, final_value = apply(params, carry, second.final_obs[t][None], np.zeros((1, num_envs), bool),
                                  jnp.asarray(final_input[None], jnp.float32))
        value[t], next_value[t] = step_value[0], final_value[0]
        logp[t] = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits[0])), second.action[t][:, None], axis=-1)[:, 0]
    _, target = gae_reference(second.reward, value, next_value, second.terminated, second.truncated, args.gamma, args.gae_lambda)
    np.testing.assert_allclose(batch.value.reshape(num_steps, num_envs), value, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(batch.logp.reshape(num_steps, num_envs), logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(batch.target.reshape(num_steps, num_envs), target, rtol=1e-5, atol=1e-5)


def test_eval_step_resets_prev_action_reward_where_episodes_terminate_or_are_truncated(monkeypatch):
    """--prev-action-reward in evaluation, on RandomEnds: at each step of eval_step, the input the
    policy gets with the observation equals a Python loop over the steps the envs took (zeros at
    every episode start, whether the episode before it terminated or was truncated)."""
    args = ppo.Args(**ENDS_BOTH_WAYS, eval_greedy=False)
    env, env_params = envs.make_env(args.env_id)
    num_actions = env.action_space(env_params).n
    network = ppo.make_network(args, num_actions)
    params = ppo.init_params(network, jax.random.key(0), args, ppo.stacked_obs_shape(env, env_params, 1))
    taken = record_calls(monkeypatch, envs, "step_envs", lambda a, out: dict(
        action=a[3], reward=out[2], terminated=out[3], truncated=out[4]))
    policy = ppo.make_evaluation(network, env, env_params, args)
    step = jax.jit(lambda params, carry: ppo.eval_step(params, carry, network, env, env_params, args))
    carry = evaluation.start_evaluation(jax.random.key(1), policy, 8)
    inputs = []
    for _ in range(16):
        inputs.append(np.asarray(carry.env.prev_action_reward))  # what the policy gets with this step's observation
        carry = step(params, carry)
    jax.effects_barrier()
    steps = {name: np.stack([record[name] for record in taken]) for name in taken[0]}  # (16, 8) each
    assert_episodes_end_both_ways(steps["terminated"], steps["truncated"])
    expected = prev_action_reward_reference(steps["action"], steps["reward"], steps["terminated"], steps["truncated"], num_actions)
    np.testing.assert_array_equal(np.stack(inputs), expected)


def test_prev_action_reward_lets_the_lstm_find_the_hidden_arm(tmp_path):
    """The hidden-arm bandit: with the previous action and reward the LSTM learns to stay after
    a 1 and switch after a 0 (7.5 of 8 at best); without them it stays at chance (4 of 8)."""
    task = dict(env_id="probe_envs:HiddenArm", hidden_sizes=(16,), lstm_size=32, num_parallel_envs=16,
                num_env_steps_per_cycle=32, num_minibatches_per_epoch=2, num_epochs_per_cycle=4,
                num_total_env_steps=16 * 32 * 60, lr=3e-3, ent_coef=0.01)
    with_inputs = ppo.run(tiny_args(tmp_path, "with", **task, prev_action_reward=True, eval_every_cycles=30))
    stored = ppo.run(tiny_args(tmp_path, "stored", **task, prev_action_reward=True, lstm_training="stored",
                               separate_critic=True))  # both LSTMs get the inputs
    without = ppo.run(tiny_args(tmp_path, "without", **task))
    assert with_inputs["final_episodic_return"] >= 6.5 and with_inputs["final_eval_return"] >= 6.5
    assert stored["final_episodic_return"] >= 6.5
    assert without["final_episodic_return"] < 4.8


def test_lstm_size_zero_is_feed_forward():
    obs_shape = (4, 4, 1)
    args, network, params = make_network_and_params(obs_shape, lstm_size=0)
    assert args.carry_size == 0
    obs = jax.random.uniform(jax.random.key(3), (5, 2, *obs_shape))
    carries, logits, value = network.apply(params, jnp.zeros((2, 0)), obs, jnp.zeros((5, 2), bool))
    assert carries.shape == (5, 2, 0)
    _, one_step_logits, _ = network.apply(params, jnp.zeros((2, 0)), obs[4:], jnp.zeros((1, 2), bool))
    np.testing.assert_allclose(logits[4], one_step_logits[0], atol=1e-6)  # no memory of obs[:4]


def test_push_frame_resets_stack_at_episode_start():
    stack = jnp.arange(2 * 2 * 2 * 3, dtype=jnp.float32).reshape(2, 2, 2, 3) + 1  # K = 3, C = 1
    frame = jnp.full((2, 2, 2, 1), -1.0)
    new = ppo.push_frame(stack, frame, jnp.array([False, True]))
    np.testing.assert_array_equal(new[0, ..., :2], stack[0, ..., 1:])  # older frames shift
    np.testing.assert_array_equal(new[1, ..., :2], 0.0)  # new episode: zeros ...
    np.testing.assert_array_equal(new[..., 2], -1.0)  # ... except the newest frame


def test_rollout_frame_stack_and_final_obs_at_episode_boundaries(tmp_path):
    args = tiny_args(tmp_path, env_id=MEMORY_ENV_ID, frame_stack=2, num_env_steps_per_cycle=14)
    env, env_params = envs.make_env(args.env_id)
    channels = env.observation_space(env_params).shape[-1]
    network = ppo.make_network(args, 2)
    obs_shape = ppo.stacked_obs_shape(env, env_params, args.frame_stack)
    params = ppo.init_params(network, jax.random.key(0), args, obs_shape)
    rollout_state = ppo.reset_envs(jax.random.key(1), env, env_params, args.num_parallel_envs, args)
    _, transitions, _ = ppo.collect_rollout(params, rollout_state, jax.random.key(2), network, env, env_params, 14, False, True)
    obs, final_obs, start = (np.asarray(x) for x in (transitions.obs, transitions.final_obs, transitions.episode_start))
    done = np.asarray(transitions.terminated | transitions.truncated)
    assert done.any() and start[1:].any()  # Memory episodes last 6 steps
    for t in range(14):
        for n in range(args.num_parallel_envs):
            older, newest = obs[t, n, ..., :channels], obs[t, n, ..., channels:]
            if start[t, n]:
                assert np.all(older == 0)
                assert np.all(newest[..., :2].sum() > 0)  # the cue frame
            else:
                np.testing.assert_array_equal(older, obs[t - 1, n, ..., channels:])
            np.testing.assert_array_equal(final_obs[t, n, ..., :channels], newest)  # same history
            if t + 1 < 14:
                assert start[t + 1, n] == done[t, n]
                if not done[t, n]:
                    np.testing.assert_array_equal(final_obs[t, n], obs[t + 1, n])
    # stored carries: zero wherever an episode starts
    assert np.all(np.asarray(transitions.carry)[start] == 0)
    assert np.any(np.asarray(transitions.carry)[~start] != 0)


def test_invalid_actions_are_never_taken_when_the_env_masks_them(tmp_path):
    args = tiny_args(tmp_path, env_id="probe_envs:MaskedActionsImage")
    env, env_params = envs.make_env(args.env_id)
    assert ppo.uses_action_mask(args, env) and not ppo.uses_action_mask(tiny_args(tmp_path, mask_invalid_actions=False), env)
    network = ppo.make_network(args, 3)
    params = ppo.init_params(network, jax.random.key(0), args, (3, 3, 1))
    rollout_state = ppo.reset_envs(jax.random.key(1), env, env_params, args.num_parallel_envs, args)
    _, transitions, _ = ppo.collect_rollout(params, rollout_state, jax.random.key(2), network, env, env_params, 12, True, False)
    assert transitions.action_mask.shape == (12, args.num_parallel_envs, 3)
    assert np.all(np.asarray(transitions.action) != 0) and np.any(np.asarray(transitions.action) == 2)
    batch, _ = ppo.batch_from_rollout(params, rollout_state.lstm_carry, transitions, network, args)
    logp = batch.logp
    assert np.all(np.isfinite(logp)) and np.all(np.asarray(logp) > np.log(0.4))  # 2 valid actions, ~1/2 each


@pytest.mark.parametrize("lstm_training", ["bptt", "stored"])
def test_next_value_uses_pre_reset_carry(tmp_path, lstm_training):
    """V(final_obs[t]) comes from the carry after obs[t] of the same episode; checked against an
    independent per-episode forward pass, and shown to differ from a reset (zero) carry."""
    args = tiny_args(tmp_path, env_id="probe_envs:TimeLimitImage", lstm_training=lstm_training, num_env_steps_per_cycle=12)
    env, env_params = envs.make_env(args.env_id)
    network = ppo.make_network(args, 2)
    params = ppo.init_params(network, jax.random.key(0), args, (3, 3, 1))
    rollout_state = ppo.reset_envs(jax.random.key(1), env, env_params, args.num_parallel_envs, args)
    _, transitions, _ = ppo.collect_rollout(
        params, rollout_state, jax.random.key(2), network, env, env_params, 12, False, lstm_training == "stored"
    )
    # The observation is constant, so values differ only through the carry.
    obs = jax.random.uniform(jax.random.key(3), transitions.obs.shape)
    final_obs = jax.random.uniform(jax.random.key(4), transitions.final_obs.shape)
    transitions = transitions._replace(obs=obs, final_obs=final_obs)
    if lstm_training == "stored":  # re-store the carries for the new observations
        carries, _, _ = network.apply(params, rollout_state.lstm_carry, obs, transitions.episode_start)
        before = jnp.concatenate([rollout_state.lstm_carry[None], carries[:-1]])
        stored = jnp.where(transitions.episode_start[..., None], 0.0, before)
        transitions = transitions._replace(carry=stored)
    _, next_value = ppo.batch_from_rollout(params, rollout_state.lstm_carry, transitions, network, args)

    truncated = np.asarray(transitions.truncated)
    start = np.asarray(transitions.episode_start)
    assert truncated[:-1].any()
    apply = jax.jit(network.apply)  # two sequence lengths, two compiles
    checked = 0
    for n in range(args.num_parallel_envs):
        for t in np.flatnonzero(truncated[:, n]):
            first = max(t0 for t0 in range(t + 1) if start[t0, n])
            sequence = jnp.concatenate([obs[first : t + 1, n], final_obs[t : t + 1, n]])[:, None]
            _, _, values = apply(params, jnp.zeros((1, args.carry_size)), sequence, jnp.zeros((len(sequence), 1), bool))
            assert float(next_value[t, n]) == pytest.approx(float(values[-1, 0]), abs=1e-5)
            _, _, reset_value = apply(params, jnp.zeros((1, args.carry_size)), final_obs[t : t + 1, n][:, None], jnp.zeros((1, 1), bool))
            assert abs(float(next_value[t, n]) - float(reset_value[0, 0])) > 1e-4
            checked += 1
    assert checked > 0


# ======================================================================================
# The value targets the update used (its learning rate, clip range and metrics: test_update_values.py)
# ======================================================================================

@pytest.mark.parametrize("lstm_training, bootstrap_truncated", [("bptt", True), ("bptt", False), ("stored", True)])
def test_the_value_targets_the_update_used_match_a_python_loop_gae(monkeypatch, lstm_training, bootstrap_truncated):
    """The second cycle's batch, as update_cycle received it, against gae_reference over values
    from a step-by-step rerun of the rollout: from the carry the cycle started with (not zero:
    Clock's 5-step episodes end mid-rollout), reset at episode starts, and V(final_obs) from the
    carry after obs[t] (a time limit ends on observation 1.0, the reset shows 0.0), or no
    bootstrap at all without --bootstrap-truncated."""
    args = ppo.Args(**TINY, env_id="probe_envs:ClockImage", num_parallel_envs=8, num_env_steps_per_cycle=8, num_total_env_steps=128,
                    num_minibatches_per_epoch=2, num_epochs_per_cycle=1, gamma=0.9, gae_lambda=0.8, lstm_training=lstm_training,
                    bootstrap_truncated=bootstrap_truncated)
    transitions, used, state, network = record_second_cycle(monkeypatch, ppo, args)
    assert transitions.truncated.any() and transitions.terminated.any()
    first_carry = np.asarray(state.env.lstm_carry)
    assert np.abs(first_carry[~np.asarray(state.env.episode_start)]).max() > 1e-3  # a carry to replay from

    apply = jax.jit(network.apply)
    num_steps, num_envs = transitions.reward.shape
    value, next_value = np.zeros((num_steps, num_envs)), np.zeros((num_steps, num_envs))
    carry = jnp.asarray(first_carry)
    for t in range(num_steps):
        carries, _, step_value = apply(used["params"], carry, transitions.obs[t][None], transitions.episode_start[t][None])
        carry = carries[0]
        _, _, final_value = apply(used["params"], carry, transitions.final_obs[t][None], np.zeros((1, num_envs), bool))
        value[t], next_value[t] = step_value[0], final_value[0]
    _, target = gae_reference(transitions.reward, value, next_value, transitions.terminated, transitions.truncated,
                              args.gamma, args.gae_lambda, bootstrap_truncated)
    batch = used["batch"]
    np.testing.assert_allclose(batch.value.reshape(num_steps, num_envs), value, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(batch.target.reshape(num_steps, num_envs), target, rtol=1e-5, atol=1e-5)


# ======================================================================================
# Whole runs
# ======================================================================================


@pytest.mark.parametrize(
    "lstm_training, extra",
    [("stored", {}), ("bptt", {"separate_critic": True, "frame_stack": 2}),
     ("stored", {"env_id": "probe_envs:MemoryVector"}),  # the MLP torso (--torso auto on vectors)
     ("bptt", {"env_id": "probe_envs:MemoryVector", "prev_action_reward": True})],
)
def test_first_minibatch_has_ratio_one_and_tiny_target_kl_stops_after_it(tmp_path, lstm_training, extra):
    """A tiny target KL stops each cycle after its first minibatch, so the logged approxkl and
    clipfrac are the first minibatch's: exactly 0, as in ppo_mlp.py (ratio exactly 1), with
    episodes ending mid-rollout (Memory: 6 steps, rollout: 12), on images and on vectors. Plain
    bptt, with two vmapped seeds, is checked in test_determinism_and_seeds_differ."""
    args = tiny_args(tmp_path, lstm_training=lstm_training, target_kl=1e-12, **{"env_id": MEMORY_ENV_ID, **extra})
    ppo.run(args)
    assert_first_minibatch_exact(args)


def assert_first_minibatch_exact(args: ppo.Args) -> None:
    rows = read_metrics(args.run_dir)
    assert len(rows) == args.num_cycles * args.num_seeds
    for row in rows:
        assert row["losses/actor_approxkl1"] == 0.0
        assert row["losses/actor_approxkl3"] == 0.0
        assert row["losses/actor_clipfrac"] == 0.0
        assert row["losses/epochs_run"] == pytest.approx(1 / args.num_minibatches_per_epoch)
        assert row["charts/episodic_length"] == 6.0


def test_same_seed_gives_identical_metrics_and_different_seeds_differ(tmp_path):
    def metrics(name, seed):
        args = tiny_args(tmp_path, name, env_id=MEMORY_ENV_ID, seed=seed, num_seeds=2, target_kl=1e-12)
        ppo.run(args)
        assert_first_minibatch_exact(args)
        return [{k: v for k, v in row.items() if k != "charts/SPS"} for row in read_metrics(args.run_dir)]

    first, again = metrics("a", 1), metrics("b", 1)
    assert first == again
    by_seed = lambda rows, seed: [r["losses/value_loss"] for r in rows if r["seed"] == seed]  # noqa: E731
    assert by_seed(first, 1) != by_seed(first, 2)


def probe_run(tmp_path, env_id, **overrides):
    args = tiny_args(
        tmp_path, env_id=env_id, num_parallel_envs=16, num_env_steps_per_cycle=8,
        num_total_env_steps=16 * 8 * 40, lr=3e-3, gamma=0.99, **overrides,
    )
    summary = ppo.run(args)
    for name in ["args.json", "metrics.jsonl", "summary.json", "params.msgpack"]:
        assert (Path(args.run_dir) / name).exists(), name
    loaded_args, params = ppo.load_params(args.run_dir)
    assert loaded_args == args
    env, env_params = envs.make_env(env_id)
    network = ppo.make_network(args, env.action_space(env_params).n)
    obs, _ = env.reset(jax.random.key(0), env_params)
    seed_params = jax.tree.map(lambda x: x[0], params)
    _, logits, value = network.apply(seed_params, jnp.zeros((1, args.carry_size)), obs[None, None], jnp.ones((1, 1), bool))
    return summary, jax.nn.softmax(logits[0, 0]), float(value[0, 0])


def test_probe_constant_reward_value_learns_one(tmp_path):
    _, _, value = probe_run(tmp_path, "probe_envs:ConstantRewardImage")
    assert value == pytest.approx(1.0, abs=0.1)


def test_probe_action_dependent_reward_policy_picks_the_best_action(tmp_path):
    summary, probs, value = probe_run(tmp_path, "probe_envs:ActionDependentRewardImage", ent_coef=0.0)
    assert float(probs[0]) > 0.9
    assert summary["final_episodic_return"] > 0.6  # = 2 p(action 0) - 1 while still exploring


MEMORY_TASK = dict(
    env_id=MEMORY_ENV_ID, num_parallel_envs=16, num_env_steps_per_cycle=24, num_minibatches_per_epoch=2,
    num_epochs_per_cycle=4, num_total_env_steps=16 * 24 * 78, lr=3e-3, gamma=0.99, ent_coef=0.01, clip_eps=0.2,
)


def test_memory_task_needs_the_lstm(tmp_path):
    """Cue, 4 blank frames, query: bptt solves it; the feed-forward network stays at chance 0.5."""
    bptt = ppo.run(tiny_args(tmp_path, "bptt", **MEMORY_TASK))
    feed_forward = ppo.run(tiny_args(tmp_path, "ff", **{**MEMORY_TASK, "lstm_size": 0}))
    assert bptt["final_episodic_return"] >= 0.9
    assert feed_forward["final_episodic_return"] < 0.65


def test_vector_observations_get_the_mlp_torso_and_the_lstm_remembers(tmp_path):
    """The same task with vector observations: --torso auto picks the MLP torso (its parameters
    are dense layers only); bptt and stored solve it (the feed-forward network's chance level is
    test_memory_task_needs_the_lstm's)."""
    task = {**MEMORY_TASK, "env_id": "probe_envs:MemoryVector", "hidden_sizes": (32,)}
    env, env_params = envs.make_env(task["env_id"])
    params = ppo.init_params(ppo.make_network(tiny_args(tmp_path, **task), 2), jax.random.key(0), tiny_args(tmp_path, **task),
                             ppo.stacked_obs_shape(env, env_params, 1))
    layer_names = {name for path in jax.tree_util.tree_flatten_with_path(params)[0] for name in map(str, path[0])}
    assert any("MLP" in name for name in layer_names) and not any("Impala" in name for name in layer_names)
    bptt = ppo.run(tiny_args(tmp_path, "bptt", **task, eval_every_cycles=39))
    stored = ppo.run(tiny_args(tmp_path, "stored", **task, lstm_training="stored", frame_stack=2))
    assert bptt["final_episodic_return"] >= 0.9 and bptt["final_eval_return"] >= 0.9
    assert stored["final_episodic_return"] >= 0.9


# ======================================================================================
# CLI
# ======================================================================================


def test_bad_input_exits_2_with_one_line(tmp_path):
    """A whole process, refused once the env is made: the fuzz of bad values (test_bad_flags.py)
    runs the scripts' main in-process."""
    result = run_script(SCRIPT, "--env-id", "probe_envs:ContinuousActions", "--run-dir", str(tmp_path / "run"), timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "discrete actions only" in lines[0], result.stderr
    assert not (tmp_path / "run").exists()


def test_multi_seed_image_env_does_not_deadlock(tmp_path):
    """Two seeds of Breakout-MinAtar in one vmapped program (orthogonal init per seed, outside the
    vmap; the batched-QR deadlock of jaxlib 0.10 on CPU would hang here)."""
    result = run_script(
        SCRIPT, "--env-id", "Breakout-MinAtar", "--num-seeds", "2", "--impala-channels", "4", "--torso-size", "16",
        "--lstm-size", "16", "--num-parallel-envs", "4", "--num-env-steps-per-cycle", "8",
        "--num-minibatches-per-epoch", "2", "--num-total-env-steps", "64", "--run-dir", str(tmp_path / "run"),
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["num_seeds"] == 2
    assert {row["seed"] for row in read_metrics(tmp_path / "run")} == {1, 2}


def random_policy_return(env_id: str, num_envs: int = 64, num_steps: int = 1000) -> float:
    env, env_params = gymnax.make(env_id)
    num_actions = env.action_space(env_params).n

    def step(carry, key):
        state, running = carry
        action_key, step_key = jax.random.split(key)
        actions = jax.random.randint(action_key, (num_envs,), 0, num_actions)
        _, state, reward, terminated, truncated, _ = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
            jax.random.split(step_key, num_envs), state, actions, env_params
        )
        done = terminated | truncated
        running = running + reward
        return (state, jnp.where(done, 0.0, running)), jnp.where(done, running, jnp.nan)

    _, state = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(jax.random.key(0), num_envs), env_params)
    _, finished = jax.lax.scan(step, (state, jnp.zeros(num_envs)), jax.random.split(jax.random.key(1), num_steps))
    return float(np.nanmean(np.asarray(finished)))


def test_breakout_learns(tmp_path):
    """~40k steps of a reduced network: measured final return ~3 against ~0.5 for random play."""
    random_return = random_policy_return("Breakout-MinAtar")
    summary = ppo.run(
        ppo.Args(
            env_id="Breakout-MinAtar", impala_channels=(8,), torso_size=64, lstm_size=64, num_parallel_envs=32,
            num_env_steps_per_cycle=32, num_minibatches_per_epoch=4, num_epochs_per_cycle=4,
            num_total_env_steps=32 * 32 * 40, lr=1e-3, gamma=0.99, ent_coef=0.01, clip_eps=0.2,
            run_dir=str(tmp_path / "run"),
        )
    )
    print(f"random policy {random_return:.2f}, trained {summary['final_episodic_return']:.2f}")
    assert summary["final_episodic_return"] > max(3 * random_return, random_return + 1.0)


GRU_EDIT = {  # the README's "change the LSTM to a GRU" walkthrough, edit for edit
    "        cell_carry = jnp.split(reset_carry(carry, episode_start), 2, axis=-1)\n":
        "        cell_carry = reset_carry(carry, episode_start)\n",
    "        (c, h), output = nn.OptimizedLSTMCell(self.lstm_size, **init)(cell_carry, features)\n"
    "        new_carry = jnp.concatenate([c, h], axis=-1)\n":
        "        new_carry, output = nn.GRUCell(self.lstm_size, **init)(cell_carry, features)\n",
    "        return (2 if self.separate_critic else 1) * 2 * self.lstm_size\n":
        "        return (2 if self.separate_critic else 1) * self.lstm_size\n",
}


@pytest.mark.parametrize("lstm_training", ["bptt", "stored"])
def test_a_gru_copy_trains(tmp_path, lstm_training):
    source = Path(ppo.__file__).read_text()
    for old, new in GRU_EDIT.items():
        assert source.count(old) == 1, f"the README's GRU edit no longer matches: {old!r}"
        source = source.replace(old, new)
    copy = tmp_path / "ppo_gru.py"
    copy.write_text(source)
    run_dir = tmp_path / "run"
    result = run_script(
        copy, "--env-id", "probe_envs:Memory", "--impala-channels", "4", "--torso-size", "16", "--lstm-size", "16",
        "--num-parallel-envs", "4", "--num-env-steps-per-cycle", "12", "--num-minibatches-per-epoch", "2",
        "--num-total-env-steps", "480", "--lstm-training", lstm_training, "--separate-critic", "--run-dir", str(run_dir),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads((run_dir / "args.json").read_text())["script"] == "ppo_gru.py"
    params = (run_dir / "params.msgpack").read_bytes()
    assert b"GRUCell" in params and b"OptimizedLSTMCell" not in params
    assert all(row["losses/value_loss"] is not None for row in read_metrics(run_dir))


@pytest.mark.parametrize("shape", [(3, 10, 10, 4), (3, 5, 5, 16), (3, 2, 2, 8), (3, 1, 1, 32)])
def test_the_cpu_convolution_equals_xla_s_inside_a_scan(shape):
    """conv3x3_for_cpu (what nn.Conv uses on CPU) against lax.conv_general_dilated: the same value,
    input gradient and kernel gradient, inside a lax.scan as the update runs it."""
    x = jax.random.normal(jax.random.key(0), shape)
    kernel = jax.random.normal(jax.random.key(1), (3, 3, shape[-1], 6))

    def in_a_scan(convolution):
        def loss(x, kernel):
            return (jnp.tanh(convolution(x, kernel, (1, 1), "SAME")) ** 2).sum()

        def body(carry, _):
            return carry, jax.value_and_grad(loss, argnums=(0, 1))(x, kernel)

        return jax.jit(lambda: jax.lax.scan(body, 0.0, None, length=2)[1])()

    xla = in_a_scan(lambda x, k, s, p: jax.lax.conv_general_dilated(x, k, s, p, dimension_numbers=cpu.NHWC_HWIO))
    ours = in_a_scan(cpu.conv3x3_for_cpu)
    for expected, actual in zip(jax.tree.leaves(xla), jax.tree.leaves(ours)):
        np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4)
