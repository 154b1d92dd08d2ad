"""Evaluation during training (--eval-every-cycles, --eval-episodes, --eval-greedy) and videos
(--capture-video), in both scripts: evaluation must not change training, its metrics must match
hand computations on probe envs, and the videos must show the evaluation's episode."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct
from gymnax.environments import environment, spaces
from helpers import run_script

import ppo_lstm_impala
import ppo_mlp
import probe_envs
from ppo_support import devices, envs, evaluation, logs, videos

MODULES = {"ppo_mlp": ppo_mlp, "ppo_lstm_impala": ppo_lstm_impala}
TINY = {  # three cycles each
    "ppo_mlp": dict(env_id="probe_envs:ActionDependentReward", lr=1e-2, num_parallel_envs=8, num_env_steps_per_cycle=32,
                    num_total_env_steps=3 * 256, num_seeds=2),
    "ppo_lstm_impala": dict(
        env_id="probe_envs:Memory", impala_channels=(4,), torso_size=16, lstm_size=8, num_parallel_envs=4,
        num_env_steps_per_cycle=12, num_minibatches_per_epoch=2, num_epochs_per_cycle=2, num_total_env_steps=3 * 48,
    ),
}


def train(module, args, video_fn=None):
    """Trains in segments of one cycle, as a run's host may cut them, and gives video_fn(cycle,
    env states, frames, done) the episode evaluation.record_video plays at each cycle a run
    records a video of (evaluation_due: every evaluation, or the last cycle without)."""
    env, env_params = envs.make_env(args.env_id)
    init, train_fn = module.make_train(args, env, env_params)
    states = devices.stack_seeds([init(args.seed + i) for i in range(args.num_seeds)])
    segment = jax.jit(lambda s, n: train_fn(s, n, 1))
    policy = module.make_evaluation(module.make_network(args, env.action_space(env_params).n), env, env_params, args)
    record_video = jax.jit(lambda s: evaluation.record_video(policy, s, args))
    rows = []
    for cycle in range(1, args.num_cycles + 1):
        states, metrics = segment(states, np.int32(1))
        rows.append(metrics)
        if video_fn is not None and evaluation.evaluation_due(cycle, args):
            video_fn(*record_video(states))
    return states, {name: np.concatenate([np.asarray(row[name]) for row in rows]) for name in rows[0]}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_evaluation_on_and_off_train_bit_for_bit_the_same(name):
    """With evaluation (and the video callback) the final params and every training metric are
    exactly those of a run without: the evaluation consumes none of training's keys or envs. The
    eval metrics are finite at cycles 2 and 3 (every 2nd, and the last) and NaN at cycle 1; the
    video callback gets an episode at those cycles, or at the last one alone without eval: one
    step long in ActionDependentReward, DELAY + 2 steps in Memory.
    ppo_mlp.py trains ActionDependentReward (action 0 pays 1, action 1 pays -1): after these three
    cycles its greedy evaluation reaches the optimum, exactly 1 in every episode."""
    module = MODULES[name]
    off_args = module.Args(**TINY[name])
    on_args = module.Args(**TINY[name], eval_every_cycles=2, eval_episodes=3, eval_greedy=name == "ppo_mlp")
    videos = {"off": [], "on": []}
    record = lambda run: lambda cycle, states, frames, done: videos[run].append((int(cycle), np.asarray(done)))  # noqa: E731
    off_states, off_metrics = train(module, off_args, record("off") if name == "ppo_mlp" else None)  # (compile time)
    on_states, on_metrics = train(module, on_args, record("on"))

    for off_leaf, on_leaf in zip(jax.tree.leaves(off_states.params), jax.tree.leaves(on_states.params), strict=True):
        np.testing.assert_array_equal(off_leaf, on_leaf)
    np.testing.assert_array_equal(jax.random.key_data(off_states.key), jax.random.key_data(on_states.key))
    assert set(on_metrics) == set(off_metrics) | {"eval/episodic_return", "eval/episodic_length"}
    for metric in off_metrics:
        np.testing.assert_array_equal(off_metrics[metric], on_metrics[metric], err_msg=metric)
    for metric in ["eval/episodic_return", "eval/episodic_length"]:
        values = on_metrics[metric]  # (cycles, seeds)
        assert values.shape == (3, on_args.num_seeds)
        assert np.isnan(values[0]).all() and np.isfinite(values[1:]).all(), metric

    if name == "ppo_mlp":
        assert (on_metrics["eval/episodic_return"][-1] == 1.0).all() and (on_metrics["eval/episodic_length"][-1] == 1.0).all()
    episode_length = 1 if name == "ppo_mlp" else probe_envs.Memory.DELAY + 2
    assert [cycle for cycle, _ in videos["off"]] == ([3] if name == "ppo_mlp" else [])
    assert [cycle for cycle, _ in videos["on"]] == [2, 3]
    for _, done in videos["off"] + videos["on"]:
        assert done.shape == (evaluation.VIDEO_MAX_FRAMES,) and np.flatnonzero(done).tolist() == [episode_length - 1]


def hand_set_params(module, args, env, env_params, actor_bias):
    """Params whose policy ignores the observation: zero actor-head kernel, these logits."""
    network = module.make_network(args, env.action_space(env_params).n)
    obs_shape = (
        module.stacked_obs_shape(env, env_params, args.frame_stack) if module is ppo_lstm_impala
        else env.observation_space(env_params).shape
    )
    params = module.init_params(network, jax.random.key(0), args, obs_shape)
    head = params["params"]["actor_head"]
    params["params"]["actor_head"] = {"kernel": jnp.zeros_like(head["kernel"]), "bias": jnp.asarray(actor_bias, jnp.float32)}
    return network, params


def state_with(module, params, obs_stats=None):
    """A TrainState of one seed that holds only what the evaluation's policy reads."""
    state = module.TrainState(**dict.fromkeys(module.TrainState._fields))._replace(params=params)
    return state._replace(obs_stats=obs_stats) if obs_stats is not None else state


def evaluate(module, args, env, env_params, network, params, key=0):
    policy = module.make_evaluation(network, env, env_params, args)
    run = jax.jit(lambda params, key: evaluation.evaluate_policy(policy, state_with(module, params), key, args, env_params))
    return {name: float(value) for name, value in run(params, jax.random.key(key)).items()}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_greedy_evaluation_of_masked_actions_takes_the_best_valid_action(name):
    """MaskedActions: actions pay 1, 0.5, 0 and action 0 is invalid. Logits (3, 2, 1) prefer the
    invalid action: masked greedy evaluation must take action 1, the optimum 0.5, in every
    one-step episode; ignoring the mask would give 1. Sampling from logits (0, 0, 0) gives 0.5
    or 0 per episode: their mean over the episodes, never 1."""
    module = MODULES[name]
    env_id = "probe_envs:MaskedActions" + ("Image" if module is ppo_lstm_impala else "")
    extra = dict(impala_channels=(4,), torso_size=16, lstm_size=8) if module is ppo_lstm_impala else {}
    args = module.Args(env_id=env_id, eval_episodes=16, **extra)
    env, env_params = envs.make_env(env_id)
    network, params = hand_set_params(module, args, env, env_params, [3.0, 2.0, 1.0])
    assert evaluate(module, args, env, env_params, network, params) == {"eval/episodic_return": 0.5, "eval/episodic_length": 1.0}

    sampled = dataclasses.replace(args, eval_greedy=False)
    network, params = hand_set_params(module, sampled, env, env_params, [0.0, 0.0, 0.0])
    result = evaluate(module, sampled, env, env_params, network, params)
    assert result["eval/episodic_length"] == 1.0
    assert 0.0 < result["eval/episodic_return"] < 0.5 and result["eval/episodic_return"] * 16 * 2 % 1 == 0  # k halves / 16


@struct.dataclass
class LengthState(environment.EnvState):
    length: jax.Array  # this episode's length, 1 to 4, drawn at reset


class RandomLength(environment.Environment):
    """Reward 1 every step; the episode terminates after `length` steps (1 to 4, random)."""

    @property
    def default_params(self):
        return environment.EnvParams(max_steps_in_episode=100)

    def action_space(self, params=None):
        return spaces.Discrete(2)

    def observation_space(self, params=None):
        return spaces.Box(0.0, 4.0, (1,), jnp.float32)

    def reset_env(self, key, params):
        state = LengthState(time=jnp.int32(0), length=jax.random.randint(key, (), 1, 5))
        return state.length.astype(jnp.float32)[None], state

    def step_env(self, key, state, action, params):
        state = state.replace(time=state.time + 1)
        return state.length.astype(jnp.float32)[None], state, jnp.float32(1.0), state.time >= state.length, {}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_eval_metrics_are_means_over_the_episodes_finished_within_the_step_cap(monkeypatch, name):
    """Episodes of random lengths 1 to 4, reward 1 per step. With the cap at 2 steps only the
    episodes of length 1 and 2 count: their mean return and length, by a Python loop over the
    lengths drawn at reset (only each env's first episode: the ones after it never count). With
    the cap at 100 every episode counts; with none under the cap NaN."""
    module = MODULES[name]
    extra = dict(lstm_size=8, hidden_sizes=(8,)) if module is ppo_lstm_impala else {}  # the MLP torso: vector observations
    args = module.Args(eval_episodes=12, eval_greedy=False, **extra)
    env, env_params = RandomLength(), RandomLength().default_params
    network, params = hand_set_params(module, args, env, env_params, [0.0, 0.0])
    key = jax.random.fold_in(jax.random.key(3), evaluation.EVAL_KEY_TAG)
    policy = module.make_evaluation(network, env, env_params, args)
    lengths = [int(x) for x in evaluation.start_evaluation(key, policy, args.eval_episodes).env.env_state.length]
    assert min(lengths) <= 2 < max(lengths)

    evaluate_with_cap = lambda cap: jax.jit(  # noqa: E731
        lambda params, key: evaluation.evaluate_policy(policy, state_with(module, params), key, args, env_params)
    )
    for cap in [2, 100]:
        monkeypatch.setattr(evaluation, "max_eval_steps", lambda env_params: cap)
        result = {name: float(value) for name, value in evaluate_with_cap(cap)(params, key).items()}
        counted = [length for length in lengths if length <= cap]
        expected = sum(counted) / len(counted)
        assert result == pytest.approx({"eval/episodic_return": expected, "eval/episodic_length": expected}, rel=1e-6)
    monkeypatch.setattr(evaluation, "max_eval_steps", lambda env_params: 0)
    assert all(np.isnan(float(value)) for value in evaluate_with_cap(0)(params, key).values())


def test_capture_video_writes_the_evaluation_episode_and_logs_it_to_offline_wandb(tmp_path):
    """CartPole, one eval episode per evaluation: each cycle's GIF has as many frames as that
    evaluation's episode has steps; summary.json has the last evaluation's return; the offline
    wandb run holds the GIFs as media."""
    run_dir = tmp_path / "cartpole"
    result = run_script(
        "ppo_mlp.py", "--num-total-env-steps", "1024", "--eval-every-cycles", "1", "--eval-episodes", "1",
        "--capture-video", "--track", "--wandb-mode", "offline", "--run-dir", str(run_dir), timeout=600,
    )
    assert result.returncode == 0, result.stderr
    from PIL import Image, ImageSequence

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["cycle"] for row in rows] == [1, 2]
    for row in rows:
        with Image.open(run_dir / "videos" / f"cycle-{row['cycle']}.gif") as image:
            # Pillow merges identical consecutive frames into one shown longer: count steps by duration.
            durations = [frame.info["duration"] for frame in ImageSequence.Iterator(image)]
            assert image.size == (480, 240) and len(durations) > 1
            steps = sum(durations) / videos.GIF_FRAME_MS
            assert steps == row["eval/episodic_length"] == row["eval/episodic_return"]  # reward 1 per step
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_eval_return_per_seed"] == [rows[-1]["eval/episodic_return"]] == [summary["final_eval_return"]]
    media = sorted(Path(run_dir / "wandb").glob("offline-run-*/files/media/videos/**/*.gif"))
    assert len(media) == 2, list(Path(run_dir / "wandb").rglob("*"))


def test_capture_video_of_an_env_without_a_renderer_warns_once_and_records_nothing(tmp_path, capsys):
    """No renderer: one warning line and no video callback, so training runs as without the flag."""
    args = ppo_mlp.Args(env_id="probe_envs:ConstantReward", capture_video=True)
    env, env_params = envs.make_env(args.env_id)
    logger = logs.MetricsLogger(args, tmp_path, ppo_mlp.METRIC_NAMES)
    assert videos.make_video_recorder(args, env_params, tmp_path, logger) is None
    warnings = capsys.readouterr().err.strip().splitlines()
    assert len(warnings) == 1 and "warning: --capture-video: cannot draw probe_envs:ConstantReward" in warnings[0]
    assert not (tmp_path / "videos").exists()
    cartpole = ppo_mlp.Args(capture_video=True)
    cartpole_params = envs.make_env(cartpole.env_id)[1]
    assert isinstance(videos.make_video_recorder(cartpole, cartpole_params, tmp_path, logger), videos.VideoRecorder)


class SignPolicy:
    """A stand-in network: greedy takes action 0 where the first observation feature is
    positive, else action 1."""

    def apply(self, params, obs, method=None):
        return jnp.stack([obs[:, 0], -obs[:, 0]], axis=-1)


def test_evaluation_normalises_observations_with_the_runs_statistics():
    """ppo_mlp.py --norm-obs: the evaluation's policy sees normalised observations. On
    ActionDependentReward (action 0 pays 1, action 1 pays -1; the observation is 0), statistics
    with mean -1 make the normalised first feature +1 and the greedy SignPolicy takes action 0;
    mean +1 makes it -1 and the policy takes action 1. Raw observations would give the same
    action both times."""
    args = ppo_mlp.Args(eval_episodes=4)
    env, env_params = envs.make_env("probe_envs:ActionDependentReward")
    key = jax.random.key(0)
    obs_shape = env.observation_space(env_params).shape
    policy = ppo_mlp.make_evaluation(SignPolicy(), env, env_params, args)
    returns = [
        float(evaluation.evaluate_policy(
            policy, state_with(ppo_mlp, None, ppo_mlp.running_mean_std(obs_shape)._replace(mean=jnp.full(obs_shape, mean))),
            key, args, env_params,
        )["eval/episodic_return"])
        for mean in (-1.0, 1.0)
    ]
    assert returns == [1.0, -1.0]
