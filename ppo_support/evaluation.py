"""Evaluation inside the jit. --eval-every-cycles K: after every K-th cycle and after the last,
each seed plays --eval-episodes episodes with its current policy, on fresh envs of its own and
with keys folded from its state's key (never split from it), so training runs bit for bit as
without evaluation. --capture-video: at those cycles (only the last one without
--eval-every-cycles) the episode of seed 0's first eval env is played once more, recorded step by
step (record_video, a program of its own that the host runs between segments), and drawn by
videos.VideoRecorder.

The policy is the script's: its eval_step, its env resets and the frame a video shows of an
observation, handed over as a Policy (the script's make_evaluation). This module only plays
episodes with it; scripts/evaluate.py plays a finished run's policy the same way."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from . import devices, envs

EVAL_METRIC_NAMES = ("eval/episodic_return", "eval/episodic_length")
EVAL_KEY_TAG = 0x6576616C  # folded into the state's key ("eval"): the evaluation's own random stream
DEFAULT_MAX_STEPS = 10_000  # episode cap of the evaluation for envs whose params have no max_steps_in_episode
VIDEO_MAX_FRAMES = 1_000  # a video shows at most this many steps of its episode


class EvalState(NamedTuple):
    """The evaluation's state from step to step. In `env` (the script's RolloutState),
    episode_return and episode_length are those of each env's first episode, frozen once it has
    ended."""

    env: Any
    finished: jax.Array  # (N,) bool: the env's first episode has ended
    key: jax.Array
    num_steps: jax.Array  # steps taken


class Policy(NamedTuple):
    """A script's policy, as evaluation plays it."""

    step: Callable  # (state of one seed, EvalState) -> EvalState: the script's eval_step
    reset: Callable  # (key, num_envs) -> the script's RolloutState of fresh episodes
    frame: Callable  # one env's observation -> the frame a video shows of it


def eval_metric_names(args: Any) -> tuple[str, ...]:
    return EVAL_METRIC_NAMES if args.eval_every_cycles else ()


def evaluation_due(cycle: jax.Array, args: Any) -> jax.Array:
    """After the last cycle, and after every --eval-every-cycles-th one when it is set."""
    last = cycle == args.num_cycles
    return last | (cycle % args.eval_every_cycles == 0) if args.eval_every_cycles else last


def max_eval_steps(env_params: Any) -> int:
    return int(getattr(env_params, "max_steps_in_episode", DEFAULT_MAX_STEPS))


def start_evaluation(key: jax.Array, policy: Policy, num_envs: int) -> EvalState:
    reset_key, key = jax.random.split(key)
    return EvalState(policy.reset(reset_key, num_envs), jnp.zeros((num_envs,), bool), key, jnp.int32(0))


def play_first_episodes(policy: Policy, state: Any, eval_state: EvalState, max_steps: int) -> EvalState:
    """Steps every env until each has finished its first episode, or for max_steps steps."""
    return jax.lax.while_loop(
        lambda eval_state: ~jnp.all(eval_state.finished) & (eval_state.num_steps < max_steps),
        lambda eval_state: policy.step(state, eval_state),
        eval_state,
    )


def evaluate_policy(policy: Policy, state: Any, key: jax.Array, args: Any, env_params: Any) -> dict[str, jax.Array]:
    """--eval-episodes fresh envs play one seed's policy until each has finished its first episode,
    or max_eval_steps. Returns eval/episodic_return and eval/episodic_length: their means over the
    finished episodes (NaN when none finished)."""
    start = start_evaluation(key, policy, args.eval_episodes)
    eval_state = play_first_episodes(policy, state, start, max_eval_steps(env_params))
    finished_only = lambda x: jnp.where(eval_state.finished, x.astype(jnp.float32), jnp.nan)  # noqa: E731
    return {
        "eval/episodic_return": devices.nanmean_or_nan(finished_only(eval_state.env.episode_return)),
        "eval/episodic_length": devices.nanmean_or_nan(finished_only(eval_state.env.episode_length)),
    }


def record_video_episode(policy: Policy, state: Any, eval_state: EvalState):
    """The episode of the first env of `eval_state`, step by step as evaluate_policy plays it,
    until it ends or for VIDEO_MAX_FRAMES steps: (VIDEO_MAX_FRAMES, ...) arrays of the env state before
    each step, the frame shown and whether the episode has ended (zeros after its end)."""
    first_env = lambda eval_state: (  # noqa: E731
        jax.tree.map(lambda x: x[0], envs.without_sticky_actions(eval_state.env.env_state)), policy.frame(eval_state.env.obs[0])
    )
    buffers = jax.tree.map(lambda x: jnp.zeros((VIDEO_MAX_FRAMES, *x.shape), x.dtype), (*first_env(eval_state), eval_state.finished[0]))

    def step(loop: tuple[EvalState, Any]) -> tuple[EvalState, Any]:
        eval_state, buffers = loop
        new_eval_state = policy.step(state, eval_state)
        recorded = (*first_env(eval_state), new_eval_state.finished[0])
        return new_eval_state, jax.tree.map(lambda buffer, x: buffer.at[eval_state.num_steps].set(x), buffers, recorded)

    running = lambda loop: ~loop[0].finished[0] & (loop[0].num_steps < VIDEO_MAX_FRAMES)  # noqa: E731
    return jax.lax.while_loop(running, step, (eval_state, buffers))[1]


def record_video(policy: Policy, states: Any, args: Any):
    """What a video (--capture-video) shows of the states' cycle: record_video_episode of seed 0's
    first eval env, started as with_evaluation starts its evaluation, with the cycle: (cycle, env
    states, frames, done), for videos.VideoRecorder. A program of its own, which the host runs on
    the states of the cycles that are evaluation_due."""
    first = jax.tree.map(lambda x: x[0], states)
    key = jax.random.fold_in(first.key, EVAL_KEY_TAG)  # as evaluate() below: the video plays seed 0's first eval env
    return (first.cycle, *record_video_episode(policy, first, start_evaluation(key, policy, args.eval_episodes)))


def with_evaluation(
    cycle_of_every_seed: Callable, metric_names: tuple[str, ...], policy: Policy, args: Any, env_params: Any,
) -> tuple[Callable, tuple[str, ...]]:
    """The cycle, then on the cycles that are evaluation_due: evaluate_policy for every seed
    (eval/* metrics, NaN on the other cycles). Also returns the metric names with eval/* appended.
    Outside shard_map: with several devices the evaluation is one replicated computation, the
    same on each."""
    names = eval_metric_names(args)
    if not names:
        return cycle_of_every_seed, metric_names
    evaluate_one_seed = lambda state, key: evaluate_policy(policy, state, key, args, env_params)  # noqa: E731
    evaluate_every_seed = devices.vmap_over_seeds(evaluate_one_seed)

    def evaluate(states: Any) -> dict[str, jax.Array]:
        keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(states.key, EVAL_KEY_TAG)  # the states' keys are not consumed
        return evaluate_every_seed(states, keys)

    def no_evaluation(states: Any) -> dict[str, jax.Array]:
        return {name: jnp.full(states.cycle.shape, jnp.nan) for name in names}

    def cycle(states: Any) -> tuple[Any, dict[str, jax.Array]]:
        states, metrics = cycle_of_every_seed(states)
        due = evaluation_due(states.cycle[0], args)
        return states, {**metrics, **jax.lax.cond(due, evaluate, no_evaluation, states)}

    return cycle, metric_names + names
