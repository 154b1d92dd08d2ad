"""--norm-obs (ppo_mlp.py), --norm-reward and --sticky-action-prob (both scripts) and
ppo_lstm_impala.py's --torso nature: against numpy loops written here, probe environments, and
tiny runs (a resume from a checkpoint must reproduce the uninterrupted run bit for bit)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT, run_script, xla_flags

import ppo_lstm_impala
import ppo_mlp
import probe_envs
from ppo_support import cpu, devices, envs

SCRIPTS = {"ppo_mlp": ppo_mlp, "ppo_lstm_impala": ppo_lstm_impala}


# --- numpy references: gym 0.21's RunningMeanStd and NormalizeReward, step by step ---------


class NumpyRunningMeanStd:
    """gym.wrappers.normalize.RunningMeanStd (gym 0.21), in float64."""

    def __init__(self, shape=()):
        self.mean, self.var, self.count = np.zeros(shape), np.ones(shape), 1e-4

    def update(self, x):
        batch_mean, batch_var, batch_count = np.mean(x, axis=0), np.var(x, axis=0), x.shape[0]
        delta = batch_mean - self.mean
        total = self.count + batch_count
        new_mean = self.mean + delta * batch_count / total
        m2 = self.var * self.count + batch_var * batch_count + np.square(delta) * self.count * batch_count / total
        self.mean, self.var, self.count = new_mean, m2 / total, total


class NumpyNormalizeReward:
    """gym.wrappers.NormalizeReward (gym 0.21) on a vector env: `dones` = terminated | truncated."""

    def __init__(self, num_envs, gamma, epsilon=1e-8):
        self.return_rms = NumpyRunningMeanStd(())
        self.returns = np.zeros(num_envs)
        self.gamma, self.epsilon = gamma, epsilon

    def step(self, rews, dones):
        self.returns = self.returns * self.gamma + rews
        self.return_rms.update(self.returns)
        rews = rews / np.sqrt(self.return_rms.var + self.epsilon)
        self.returns[dones] = 0.0
        return rews


def reward_transitions(module, reward, terminated, truncated):
    """A Transition holding only what normalize_rewards reads."""
    fields = dict.fromkeys(module.Transition._fields)
    fields.update(reward=jnp.asarray(reward, jnp.float32), terminated=jnp.asarray(terminated),
                  truncated=jnp.asarray(truncated))
    return module.Transition(**fields)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_reward_scaling_matches_gym_s_normalize_reward_over_several_cycles(name):
    module = SCRIPTS[name]
    num_steps, num_envs, gamma, num_cycles = 7, 3, 0.9, 4
    rng = np.random.default_rng(0)
    stats = module.running_mean_std(())
    rollout_state = module.RolloutState(**dict.fromkeys(module.RolloutState._fields))._replace(discounted_return=jnp.zeros(num_envs))
    reference = NumpyNormalizeReward(num_envs, gamma)
    scale = jax.jit(lambda stats, carry, transitions: module.normalize_rewards(stats, carry, transitions, gamma, None))
    for _ in range(num_cycles):  # the accumulator and the statistics carry over between cycles
        reward = rng.normal(2.0, 3.0, (num_steps, num_envs))
        terminated = rng.random((num_steps, num_envs)) < 0.15
        truncated = ~terminated & (rng.random((num_steps, num_envs)) < 0.1)
        stats, rollout_state, scaled = scale(stats, rollout_state, reward_transitions(module, reward, terminated, truncated))
        expected = np.stack([reference.step(reward[t], terminated[t] | truncated[t]) for t in range(num_steps)])
        np.testing.assert_allclose(scaled, expected, rtol=2e-5)
        np.testing.assert_allclose(rollout_state.discounted_return, reference.returns, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(stats.var, reference.return_rms.var, rtol=1e-5)
        np.testing.assert_allclose(stats.count, reference.return_rms.count, rtol=1e-6)
    # off: the raw rewards, and nothing changes
    transitions = reward_transitions(module, reward, terminated, truncated)
    off_stats, off_carry, raw = module.normalize_rewards(None, rollout_state, transitions, gamma, None)
    assert off_stats is None and off_carry is rollout_state
    np.testing.assert_array_equal(raw, np.float32(reward))


def test_observation_statistics_and_normalisation_match_gym_s():
    rng = np.random.default_rng(1)
    stats = ppo_mlp.running_mean_std((2, 3))
    reference = NumpyRunningMeanStd((2, 3))
    update = jax.jit(lambda stats, obs: ppo_mlp.update_obs_stats(stats, obs, None))
    for cycle in range(3):
        obs = rng.normal(5.0 * cycle, 1.0 + cycle, (4, 6, 2, 3))  # (T, N, *obs_shape)
        stats = update(stats, obs)
        reference.update(obs.reshape(-1, 2, 3))
    np.testing.assert_allclose(stats.mean, reference.mean, rtol=1e-5)
    np.testing.assert_allclose(stats.var, reference.var, rtol=1e-4)
    np.testing.assert_allclose(stats.count, reference.count, rtol=1e-6)
    obs = rng.normal(0.0, 100.0, (5, 2, 3))
    expected = np.clip((obs - reference.mean) / np.sqrt(reference.var + 1e-8), -10.0, 10.0)
    np.testing.assert_allclose(ppo_mlp.normalize_obs(stats, obs), expected, rtol=1e-4, atol=1e-5)
    assert np.abs(np.asarray(ppo_mlp.normalize_obs(stats, obs))).max() == 10.0  # clipped
    assert ppo_mlp.normalize_obs(None, obs) is obs and ppo_mlp.update_obs_stats(None, obs, None) is None


def test_norm_obs_freezes_the_statistics_within_a_cycle():
    """The rollout samples from the policy on obs normalised with the cycle's starting stats, the
    first minibatch reproduces the rollout's log-probs (approxkl 0 with one minibatch, one epoch),
    and the stats count every raw observation of each rollout once."""
    args = ppo_mlp.Args(num_parallel_envs=4, num_env_steps_per_cycle=16, num_minibatches_per_epoch=1,
                        num_epochs_per_cycle=1, num_total_env_steps=4 * 16 * 3, norm_obs=True, norm_reward=True)
    env, env_params = envs.make_env(args.env_id)
    init, train = ppo_mlp.make_train(args, env, env_params)
    states, metrics = jax.jit(train)(devices.stack_seeds([init(1)]))
    np.testing.assert_array_equal(metrics["losses/actor_approxkl1"], 0.0)
    np.testing.assert_array_equal(metrics["losses/actor_clipfrac"], 0.0)
    np.testing.assert_allclose(states.obs_stats.count, 1e-4 + 3 * args.batch_size)
    assert states.reward_stats.count == pytest.approx(1e-4 + 3 * 16 * 4)  # one update per step, of N returns
    assert np.all(np.asarray(states.obs_stats.var) != 1.0)

    # the rollout's actions: Gumbel-max on the logits of the normalised observations
    state = jax.tree.map(lambda x: x[0], states)
    network = ppo_mlp.make_network(args, 2)
    key = jax.random.key(7)
    _, transitions, _ = ppo_mlp.collect_rollout(state.params, state.env, key, network, env, env_params, 16, False,
                                                obs_stats=state.obs_stats)
    gumbel = jax.random.gumbel(jax.random.split(key)[0], (16, 4, 2))
    logits = network.apply(state.params, ppo_mlp.normalize_obs(state.obs_stats, transitions.obs.reshape(64, 4)),
                           method=ppo_mlp.ActorCritic.policy).reshape(16, 4, 2)
    np.testing.assert_array_equal(transitions.action, jnp.argmax(logits + gumbel, axis=-1))


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_normalisation_off_leaves_no_statistics(name):
    """With the flags off the TrainState holds None (no leaves): the path is today's, and older
    checkpoints still load."""
    env, env_params = envs.make_env("CartPole-v1" if name == "ppo_mlp" else "Breakout-MinAtar")
    stats = SCRIPTS[name].normalization_stats(SCRIPTS[name].Args(), env, env_params)
    assert set(stats) <= {"obs_stats", "reward_stats"} and all(value is None for value in stats.values())


TWO_DEVICES = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
import ppo_mlp as m
mesh = jax.make_mesh((2,), ("d",))
obs = jax.random.normal(jax.random.key(0), (5, 8, 3)) * 3 + 1
reward = jax.random.normal(jax.random.key(1), (5, 8))
done = jax.random.uniform(jax.random.key(2), (5, 8)) < 0.2
fields = dict.fromkeys(m.Transition._fields)
transitions = m.Transition(**{**fields, "reward": reward, "terminated": done, "truncated": jnp.zeros_like(done)})
carry = m.RolloutState(**dict.fromkeys(m.RolloutState._fields))._replace(discounted_return=jnp.arange(8.0))

def both(axis_name):
    def f(obs, transitions, carry):
        obs_stats = m.update_obs_stats(m.running_mean_std((3,)), obs, axis_name)
        reward_stats, carry, scaled = m.normalize_rewards(m.running_mean_std(()), carry, transitions, 0.9, axis_name)
        return obs_stats, reward_stats, carry, scaled
    return f

one = jax.jit(both(None))(obs, transitions, carry)
split = P(None, "d")
place = lambda x, spec: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
inputs = place(obs, split), place(transitions, split), place(carry, P("d"))
two = jax.jit(jax.shard_map(both("d"), mesh=mesh, in_specs=(split, split, P("d")),
                            out_specs=(P(), P(), P("d"), split)))(*inputs)
for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(two)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
print("same")
"""


def test_statistics_under_shard_map_combine_every_device_s_envs():
    env = {**os.environ, "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=2"), "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", TWO_DEVICES], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0 and "same" in result.stdout, result.stderr


# --- sticky actions -----------------------------------------------------------------------


class ManyActions(probe_envs.TimeLimit):
    """Reward 1 per step, truncated after 5 steps, 6 actions."""

    num_actions_ = 6


def executed_actions(env, env_params, agent_actions, key):
    """Steps one env through agent_actions (T,); returns what the env executed at each step
    (the wrapper's previous_action after the step, or 0 where the episode ended) and the dones."""

    def step(carry, step_input):
        state, key = carry
        action, step_key = step_input
        _, state, _, terminated, truncated, _ = env.step(step_key, state, action, env_params)
        return (state, key), (state.previous_action, terminated | truncated)

    _, state = env.reset(key, env_params)
    keys = jax.random.split(key, agent_actions.shape[0])
    return jax.lax.scan(step, (state, key), (agent_actions, keys))[1]


def test_sticky_actions_repeat_the_previous_executed_action_at_rate_p():
    p, num_envs, num_steps = 0.25, 64, 400
    inner = ManyActions()
    env = envs.StickyActions(inner, p)
    agent = jax.random.randint(jax.random.key(3), (num_envs, num_steps), 0, 6)
    run = jax.jit(jax.vmap(lambda actions, key: executed_actions(env, inner.default_params, actions, key)))
    executed, done = (np.asarray(x) for x in run(agent, jax.random.split(jax.random.key(4), num_envs)))
    agent = np.asarray(agent)
    # executed[t] is known exactly where the episode goes on; previous[t] is what step t could repeat
    previous = np.concatenate([np.zeros((num_envs, 1), int), executed[:, :-1]], axis=1)
    known = ~done & (agent != previous)  # a repeat is visible only where the agent chose otherwise
    assert np.all(((executed == agent) | (executed == previous))[~done])
    repeats = (executed == previous)[known]
    std = math.sqrt(p * (1 - p) / repeats.size)
    assert abs(repeats.mean() - p) < 5 * std, (repeats.mean(), std, repeats.size)
    # after a reset the previous action is 0
    after_done = np.concatenate([np.zeros((num_envs, 1), bool), done[:, :-1]], axis=1)
    assert np.all(((executed == agent) | (executed == 0))[after_done & ~done])


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_sticky_action_prob_0_is_the_unwrapped_env_and_p_wraps_any_env(name):
    module = SCRIPTS[name]
    env_id = "CartPole-v1" if name == "ppo_mlp" else "Breakout-MinAtar"
    plain, _ = envs.make_env(env_id)
    assert type(plain) is type(gymnax.make(env_id)[0])
    assert type(envs.make_env(env_id, 0.0)[0]) is type(plain)
    sticky, env_params = envs.make_env(env_id, 0.1)
    assert isinstance(sticky, envs.StickyActions) and sticky.env.__class__ is plain.__class__
    assert sticky.action_space(env_params).n == plain.action_space(env_params).n
    assert sticky.observation_space(env_params).shape == plain.observation_space(env_params).shape
    assert not module.uses_action_mask(module.Args(), sticky)


def test_sticky_actions_wrap_a_suite_adapter():
    env, env_params = envs.make_env("MiniGrid-Empty-5x5", 0.5)
    assert isinstance(env.env, envs.SuiteEnv)
    _, state = jax.eval_shape(env.reset, jax.random.key(0), env_params)  # traced, not run
    obs, state, *_, info = jax.eval_shape(env.step, jax.random.key(1), state, jnp.int32(2), env_params)
    assert obs.shape == env.observation_space(env_params).shape == info["final_observation"].shape
    assert state.previous_action.dtype == jnp.int32 and "success" in envs.env_info_names(env, env_params)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_a_repeated_action_the_mask_forbids_is_not_executed(name):
    """MaskedActions: one-step episodes, so the previous action is always 0 (after the reset),
    which the mask always forbids: the agent's action 1 (reward 0.5) is always executed."""
    module = SCRIPTS[name]
    inner = probe_envs.MaskedActions()
    env = envs.StickyActions(inner, 0.9)
    assert module.uses_action_mask(module.Args(), env)
    np.testing.assert_array_equal(env.action_mask(env.reset(jax.random.key(0), inner.default_params)[1], None),
                                  [False, True, True])

    def reward(key):
        _, state = env.reset(key, inner.default_params)
        return env.step(key, state, jnp.int32(1), inner.default_params)[2]

    rewards = jax.jit(jax.vmap(reward))(jax.random.split(jax.random.key(5), 200))
    np.testing.assert_array_equal(rewards, 0.5)
    # without a mask, the same env repeats action 0 (reward 1) about 90% of the time
    unmasked = envs.StickyActions(probe_envs.ActionDependentReward(), 0.9)
    step = lambda key: unmasked.step(key, unmasked.reset(key, None)[1], jnp.int32(1), inner.default_params)[2]  # noqa: E731
    assert 0.8 < float(jnp.mean(jax.vmap(step)(jax.random.split(jax.random.key(6), 200)) == 1.0)) < 0.97


# --- the Nature CNN torso -----------------------------------------------------------------


@pytest.mark.parametrize("shape, first_kernel, conv_out", [
    ((84, 84, 4), (8, 8, 4, 32), (7, 7)),  # Atari: 84 -> 20 -> 9 -> 7
    ((63, 63, 3), (8, 8, 3, 32), (4, 4)),  # Craftax-Classic-Pixels: 63 -> 14 -> 6 -> 4
    ((10, 10, 4), (3, 3, 4, 32), (4, 4)),  # MinAtar: 10 -> 8 -> 6 -> 4, the 3x3 stride-1 variant
])
def test_nature_torso_shapes(shape, first_kernel, conv_out):
    torso = ppo_lstm_impala.NatureTorso(orthogonal_init=True)
    x = jax.ShapeDtypeStruct((2, *shape), jnp.float32)
    params = jax.eval_shape(torso.init, jax.random.key(0), x)  # shapes only: nothing is computed
    assert jax.eval_shape(torso.apply, params, x).shape == (2, ppo_lstm_impala.NATURE_DENSE_SIZE)
    kernels = {name: leaf["kernel"].shape for name, leaf in params["params"].items()}
    assert kernels["Conv_0"] == first_kernel
    assert kernels["Dense_0"] == (conv_out[0] * conv_out[1] * 64, 512)


def test_the_cpu_convolution_equals_xla_s_for_valid_padding():
    """As test_ppo_lstm_impala's SAME test: value and both gradients inside a lax.scan."""
    padding = "VALID"
    x = jax.random.normal(jax.random.key(0), (3, 6, 6, 4))
    kernel = jax.random.normal(jax.random.key(1), (3, 3, 4, 5))

    def grads(convolution):
        loss = lambda x, kernel: (jnp.tanh(convolution(x, kernel, (1, 1), padding)) ** 2).sum()  # noqa: E731
        body = lambda carry, _: (carry, jax.value_and_grad(loss, argnums=(0, 1))(x, kernel))  # noqa: E731
        return jax.jit(lambda: jax.lax.scan(body, 0.0, None, length=2)[1])()

    xla = grads(lambda x, k, s, p: jax.lax.conv_general_dilated(x, k, s, p, dimension_numbers=cpu.NHWC_HWIO))
    for expected, actual in zip(jax.tree.leaves(xla), jax.tree.leaves(grads(cpu.conv3x3_for_cpu))):
        np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4)


def test_torso_nature_refuses_images_too_small_for_it(capsys):
    code = ppo_lstm_impala.main(["--torso", "nature", "--env-id", "probe_envs:ConstantRewardImage"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--torso nature" in err[0] and "(3, 3, 1)" in err[0], err


LSTM_TINY = ["--num-parallel-envs", "4", "--num-env-steps-per-cycle", "8", "--num-minibatches-per-epoch", "2",
             "--num-epochs-per-cycle", "1", "--num-total-env-steps", "64", "--lstm-size", "0"]


def test_a_tiny_nature_torso_run_with_reward_scaling_and_sticky_actions_writes_metrics(tmp_path):
    run_dir = tmp_path / "nature"
    result = run_script("ppo_lstm_impala.py", *LSTM_TINY, "--torso", "nature", "--norm-reward",
                        "--sticky-action-prob", "0.1", "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["cycle"] for row in rows] == [1, 2]
    assert all(math.isfinite(row["losses/value_loss"]) for row in rows)
    assert json.loads((run_dir / "args.json").read_text())["torso"] == "nature"


# --- checkpoints hold the statistics --------------------------------------------------------


def test_resume_with_normalisation_and_sticky_actions_is_bit_identical(tmp_path):
    """The obs and reward statistics, the discounted returns and the sticky previous actions are
    in the checkpoint: resuming from the next-to-last one reproduces the run exactly."""
    flags = ["--num-parallel-envs", "4", "--num-env-steps-per-cycle", "16", "--num-total-env-steps", "1536",
             "--checkpoint-every-cycles", "8", "--norm-obs", "--norm-reward", "--sticky-action-prob", "0.2"]
    whole = tmp_path / "whole"
    result = run_script("ppo_mlp.py", *flags, "--run-dir", str(whole))
    assert result.returncode == 0, result.stderr
    # the final observation statistics are saved for the policy, and evaluate.py uses them
    obs_stats = ppo_mlp.load_obs_stats(whole)
    np.testing.assert_allclose(obs_stats.count, [1e-4 + 24 * 64])
    assert obs_stats.mean.shape == (1, 4) and np.all(np.asarray(obs_stats.var) != 1.0)
    evaluated = run_script("scripts/evaluate.py", str(whole), "--episodes", "2")
    assert evaluated.returncode == 0 and "mean_return" in evaluated.stdout, evaluated.stderr
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    for name in ["params.msgpack", "obs_stats.msgpack", "summary.json", "checkpoint-24.npz"]:
        (resumed / name).unlink()
    result = run_script("ppo_mlp.py", "--resume", str(resumed))
    assert result.returncode == 0, result.stderr
    assert "resuming" in result.stdout and "from cycle 16" in result.stdout
    for name in ["params.msgpack", "obs_stats.msgpack"]:
        assert (resumed / name).read_bytes() == (whole / name).read_bytes(), name
    strip = lambda path: [{k: v for k, v in json.loads(line).items() if k != "charts/SPS"}  # noqa: E731
                          for line in (path / "metrics.jsonl").read_text().splitlines()]
    assert strip(resumed) == strip(whole)
