"""Tests for the Craftax and XLand-MiniGrid ids (requirements-envs.txt): the adapters against each
suite's own step, which never resets; env/<name> metrics and the Craftax score; the IMPALA torso on
XLand-MiniGrid's small views; ids that are refused; and one short training run per suite.

Craftax compiles slowly (its world generation is large), so its adapter checks share one
compiled function, and its training run is tiny. Pixels ids are not used: their first use makes
Craftax build its texture cache, which is slow.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT

import ppo_lstm_impala
import ppo_mlp
from ppo_support import devices, envs, errors

SCRIPTS = [ppo_mlp, ppo_lstm_impala]
CRAFTAX_ID = "Craftax-Classic-Symbolic-v1"
NOOP = 0  # Craftax
FORWARD, TURN = 0, 1  # XLand-MiniGrid: turning in place never ends an episode


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main_error(module, argv: list[str], capsys, tmp_path: Path) -> str:
    """Runs the script's main() in-process; asserts exit code 2, one stderr line, nothing written."""
    code = module.main([*argv, "--run-dir", str(tmp_path / "never")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert not (tmp_path / "never").exists()
    return lines[0]


# ======================================================================================
# Craftax: the adapter against Craftax's own step_env (no reset) and reset_env
# ======================================================================================


@pytest.fixture(scope="module")
def craftax():
    """The adapter, Craftax's own reset_env (compiled), and one compiled function that runs the
    adapter's step, Craftax's step_env with the step key and its reset_env with the reset key."""
    craftax_env = pytest.importorskip("craftax.craftax_env")
    env, env_params = envs.make_env(CRAFTAX_ID)
    raw = craftax_env.make_craftax_env_from_name(CRAFTAX_ID, auto_reset=False)

    @jax.jit
    def step_both(key, state, params):
        step_key, reset_key = jax.random.split(key)  # the adapter's split
        return env.step(key, state, NOOP, params), raw.step_env(step_key, state, NOOP, params), raw.reset_env(reset_key, params)

    return env, env_params, jax.jit(raw.reset_env), step_both


def test_craftax_time_limit_truncates_and_the_final_observation_is_the_pre_reset_one(craftax):
    env, env_params, reset, step_both = craftax
    limit = 3
    params = env_params.replace(max_timesteps=limit)
    _, state = reset(jax.random.key(0), params)
    for t in range(1, limit + 1):
        adapted, (raw_obs, raw_state, raw_reward, raw_done, _), (reset_obs, _) = step_both(jax.random.key(t), state, params)
        obs, state, reward, terminated, truncated, info = adapted
        assert bool(raw_done) == (t == limit)  # Craftax's own done includes the time limit
        assert not bool(terminated) and bool(truncated) == (t == limit) and float(info["discount"]) == 1.0
        assert float(reward) == float(raw_reward)
        np.testing.assert_array_equal(info["final_observation"], raw_obs)  # what V(final_obs) bootstraps from
        np.testing.assert_array_equal(obs, reset_obs if t == limit else raw_obs)
        assert int(state.timestep) == (0 if t == limit else t)
    achievements = [float(value) for name, value in info.items() if name.startswith(envs.ACHIEVEMENT_PREFIX)]
    assert len(achievements) == 22 and set(achievements) <= {0.0, 1.0}


def test_craftax_death_terminates_even_on_the_last_step(craftax):
    env, env_params, reset, step_both = craftax
    _, state = reset(jax.random.key(0), env_params)
    dying = state.replace(player_health=jnp.zeros_like(state.player_health), player_recover=jnp.zeros_like(state.player_recover))
    for timestep in (0, env_params.max_timesteps - 1):  # dying at the time limit is a termination
        adapted, (raw_obs, _, _, raw_done, raw_info), (reset_obs, _) = step_both(
            jax.random.key(7), dying.replace(timestep=state.timestep + timestep), env_params  # keeps its dtype: no recompile
        )
        obs, next_state, _, terminated, truncated, info = adapted
        assert bool(raw_done) and float(raw_info["discount"]) == 0.0
        assert bool(terminated) and not bool(truncated) and float(info["discount"]) == 0.0
        np.testing.assert_array_equal(info["final_observation"], raw_obs)
        np.testing.assert_array_equal(obs, reset_obs)
        assert int(next_state.timestep) == 0 and int(next_state.player_health) > 0


# ======================================================================================
# XLand-MiniGrid: the adapter against xminigrid's own step (no reset) and reset
# ======================================================================================


def decode(obs: jax.Array) -> jax.Array:
    """The adapter's one-hots back to xminigrid's (V, V, 2) tile and colour ids."""
    from xminigrid.core.constants import NUM_COLORS, NUM_TILES

    tiles, colours = obs[..., :NUM_TILES], obs[..., NUM_TILES:NUM_TILES + NUM_COLORS]
    return jnp.stack([tiles.argmax(-1), colours.argmax(-1)], axis=-1)


@pytest.fixture(scope="module")
def memory():
    """16 MiniGrid-MemoryS8 envs, a time limit of 9 steps, the adapter's compiled reset, and one
    compiled function that runs the adapter's step, xminigrid's own step and its reset."""
    xminigrid = pytest.importorskip("xminigrid")
    env, env_params = envs.make_env("MiniGrid-MemoryS8")
    raw, _ = xminigrid.make("MiniGrid-MemoryS8")
    params = env_params.replace(max_steps=9)  # a static field: a compile per value, so one value

    @jax.jit
    def step_both(keys, state, action):
        adapted = jax.vmap(env.step, in_axes=(0, 0, None, None))(keys, state, action, params)
        stepped = jax.vmap(raw.step, in_axes=(None, 0, None))(params, state, action)
        reset_keys = jax.vmap(jax.random.split)(keys)[:, 1]  # SuiteEnv.step's split: (step key, reset key)
        return adapted, stepped, jax.vmap(raw.reset, in_axes=(None, 0))(params, reset_keys)

    reset = jax.jit(lambda keys: jax.vmap(env.reset, in_axes=(0, None))(keys, params))
    return env, params, reset(jax.random.split(jax.random.key(0), 16)), step_both


def test_minigrid_time_limit_truncates_and_the_final_observation_is_the_pre_reset_one(memory):
    env, params, (obs, state), step_both = memory
    assert env.observation_space(params).shape == (3, 3, 13 + 12 + 4) and env.action_space(params).n == 6
    assert obs.dtype == jnp.float32 and set(np.unique(obs)) == {0.0, 1.0}
    np.testing.assert_array_equal(decode(obs), state.observation)
    np.testing.assert_array_equal(obs[:, 1, 2, 25:], jax.nn.one_hot(state.state.agent.direction, 4))
    for t in range(1, params.max_steps + 1):
        last = t == params.max_steps
        adapted, stepped, reset = step_both(jax.random.split(jax.random.key(t), 16), state, TURN)
        obs, state, reward, terminated, truncated, info = adapted
        assert (stepped.last() == last).all() and (stepped.discount == 1.0).all()
        assert not terminated.any() and (truncated == last).all() and (reward == 0.0).all()
        np.testing.assert_array_equal(decode(info["final_observation"]), stepped.observation)
        np.testing.assert_array_equal(decode(obs), (reset if last else stepped).observation)
        assert (state.state.step_num == (0 if last else t)).all()


def test_minigrid_memory_end_is_terminated_and_success_says_which_object(memory):
    """Down the corridor, turn, step onto one of the two objects: the right one pays."""
    _, _, (_, state), step_both = memory
    actions = [FORWARD] * 6 + [TURN, FORWARD]
    for t, action in enumerate(actions, start=1):
        adapted, stepped, reset = step_both(jax.random.split(jax.random.key(t), 16), state, action)
        obs, state, reward, terminated, truncated, info = adapted
        np.testing.assert_array_equal(decode(info["final_observation"]), stepped.observation)
        np.testing.assert_array_equal(reward, stepped.reward)
        assert not truncated.any() and (terminated == (t == len(actions))).all()
    assert (stepped.discount == 0.0).all() and (info["discount"] == 0.0).all()
    np.testing.assert_array_equal(decode(obs), reset.observation)
    np.testing.assert_array_equal(info["success"], (stepped.reward > 0).astype(np.float32))
    assert 0 < float(info["success"].sum()) < 16  # both the right and the wrong object were reached
    assert (state.state.step_num == 0).all()


TURN_LEFT = 2  # XLand-MiniGrid's actions: 0 forward, 1 turn clockwise, 2 turn counter-clockwise
NORTH, EAST, SOUTH, WEST = 0, 1, 2, 3  # its directions; MemoryS8 (7 x 8): the corridor is row 3,
ANY_OBJECT = 99  # the cue of a policy that does not look for it: it takes the upper object
CORRIDOR_END = 6  # the start room with the cue at (2, 1) on its west, the two objects at (1, 6), (5, 6)


def seen_object(obs: np.ndarray) -> np.ndarray:
    """Per env, the ball's or key's tile id somewhere in the adapter's observation of its view
    (-1 for neither), read from the one-hot tile channels (decode)."""
    from xminigrid.core.constants import Tiles

    tiles = np.asarray(decode(obs))[..., 0].reshape(obs.shape[0], -1)
    found = np.where((tiles == Tiles.BALL).any(1), Tiles.BALL, -1)
    return np.where((tiles == Tiles.KEY).any(1), Tiles.KEY, found)


def scripted_success_rate(remember: bool, num_envs: int = 256, num_steps: int = 40) -> tuple[float, int]:
    """A scripted policy through the adapter's batched step (auto-reset), over every episode that
    ends within num_steps: (success rate from info["success"], episodes). It navigates by the
    agent's position, and reads objects only from the adapter's observations. remember=True:
    turn round, walk west until the cue is in view (at once when the episode starts in column 1),
    remember its tile, walk to the corridor's end, face north, and step onto the upper object if
    it is the cue's, else turn on to face south and step onto the lower one. remember=False: walk
    straight to the end and step onto the upper object."""
    env, params = envs.make_env("MiniGrid-MemoryS8")
    step = jax.jit(lambda keys, state, action: env.step_batch(keys, state, action, params))
    keys = jax.random.split(jax.random.key(0), num_envs)
    obs, state = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))(keys, params)
    unknown = -1 if remember else ANY_OBJECT
    cue = np.full(num_envs, unknown)
    successes = []
    for t in range(num_steps):
        row_col = np.asarray(state.state.agent.position)
        column, direction = row_col[:, 1], np.asarray(state.state.agent.direction)
        seen = seen_object(obs)  # west of column 4 only the cue; at the end, facing north, only the upper object
        cue = np.where((cue == -1) & (column <= 3), seen, cue)
        action = np.where(
            cue < 0,
            np.where(direction == WEST, FORWARD, TURN),  # go back for the cue
            np.where(column != CORRIDOR_END,
                     np.where(direction == EAST, FORWARD, TURN),  # down the corridor
                     np.where((direction == NORTH) & ((seen == cue) | (cue == ANY_OBJECT)), FORWARD,  # the upper one
                              np.where(direction == SOUTH, FORWARD, TURN_LEFT))),  # east, north, west, south
        )
        keys = jax.random.split(jax.random.key(t + 1), num_envs)
        obs, state, _, terminated, truncated, info = step(keys, state, jnp.asarray(action, jnp.int32))
        done = np.asarray(terminated | truncated)
        assert not np.asarray(truncated).any()
        successes += list(np.asarray(info["success"])[done])
        cue = np.where(done, unknown, cue)
    return float(np.mean(successes)), len(successes)


@pytest.mark.parametrize("remember, low, high", [(True, 1.0, 1.0), (False, 0.45, 0.55)])
def test_minigrid_memory_scripted_policies_succeed_always_with_the_cue_and_half_the_time_without(remember, low, high):
    """The adapter end to end on MiniGrid-MemoryS8: a policy that reads the cue from the
    observations succeeds every time; one that ignores it is at chance (0.5; measured 0.496 over
    1,967 episodes, so the bounds are 4 standard errors)."""
    pytest.importorskip("xminigrid")
    rate, episodes = scripted_success_rate(remember)
    assert episodes >= 300
    assert low <= rate <= high, (rate, episodes)


def test_the_minigrid_memory_variants_take_away_what_they_say():
    """tests/support/minigrid_memory.py, over 256 resets each: every episode starts at column 1,
    facing east, with the cue in the adapter's first observation; the wide view shows both end
    objects from the corridor's end; the right side follows the layout alone (fixed_cue) or the
    cue alone (fixed_layout), and the part that is not fixed still varies; half_fixed_layout fixes
    the layout in half the episodes; the *_any_start variants start where MiniGrid-MemoryS8 does
    for the same keys (at column 1 to 5), and the *_starts_to_K variants at every column from 1 to K."""
    pytest.importorskip("xminigrid")
    import minigrid_memory as variants
    from xminigrid.core.constants import Tiles

    keys = jax.random.split(jax.random.key(0), 256)
    shares = {}  # per variant, the share of resets with: the ball as the cue, the ball on top, the key below
    memory_env, memory_params = envs.xminigrid_env("MiniGrid-MemoryS8", ())
    _, memory_state = jax.jit(jax.vmap(memory_env.reset, in_axes=(0, None)))(keys, memory_params)
    memory_starts = np.asarray(memory_state.state.agent.position)
    names = ("cue_in_view", "cue_in_view_wide", "fixed_cue", "fixed_layout", "half_fixed_layout")
    other_starts = ("fixed_layout_any_start", "half_fixed_layout_any_start", "fixed_layout_starts_to_2", "fixed_layout_starts_to_3",
                    "half_fixed_layout_starts_to_2", "half_fixed_layout_starts_to_3")
    for name in (*names, *other_starts):
        env, params = getattr(variants, name)()
        obs, state = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))(keys, params)
        grid = np.asarray(state.state.grid)[..., 0]
        cue, upper, lower = grid[:, 2, 1], grid[:, 1, CORRIDOR_END], grid[:, 5, CORRIDOR_END]
        upper_is_right = np.asarray(state.state.carry.success_pos)[:, 0] == 2
        assert (np.asarray(state.state.agent.direction) == EAST).all()
        np.testing.assert_array_equal(upper_is_right, upper == cue)
        shares[name] = float((cue == Tiles.BALL).mean()), float((upper == Tiles.BALL).mean()), float((lower == Tiles.KEY).mean())
        if name.endswith("_any_start"):
            np.testing.assert_array_equal(np.asarray(state.state.agent.position), memory_starts)
            continue
        if "_starts_to_" in name:
            rows, columns = np.asarray(state.state.agent.position).T
            assert (rows == 3).all() and set(columns) == set(range(1, int(name[-1]) + 1)), name
            continue
        np.testing.assert_array_equal(np.asarray(state.state.agent.position), np.tile([3, 1], (256, 1)))
        if name == "cue_in_view_wide":
            wide = env, params, state
        else:
            np.testing.assert_array_equal(seen_object(obs), cue)  # the only object in the 3 x 3 first view
    assert set(memory_starts[:, 1]) == {1, 2, 3, 4, 5} and (memory_starts[:, 0] == 3).all()

    cue, upper, _ = shares["cue_in_view"]
    assert 0 < cue < 1 and 0 < upper < 1
    cue, upper, _ = shares["fixed_cue"]
    assert cue == 1 and 0 < upper < 1
    for name in ("fixed_layout", "fixed_layout_any_start", "fixed_layout_starts_to_2", "fixed_layout_starts_to_3"):
        cue, upper, lower = shares[name]
        assert upper == 1 and lower == 1 and 0 < cue < 1, name
    for name in ("half_fixed_layout", "half_fixed_layout_any_start", "half_fixed_layout_starts_to_2", "half_fixed_layout_starts_to_3"):
        cue, upper, _ = shares[name]  # fixed in half the episodes: the ball on top in 3/4
        assert 0.65 < upper < 0.85 and 0 < cue < 1, name

    env, params, state = wide
    step = jax.jit(jax.vmap(env.step, in_axes=(0, 0, None, None)))
    for _ in range(CORRIDOR_END - 1):  # walk east to the corridor's end
        obs, state, *_ = step(keys, state, jnp.int32(FORWARD), params)
    assert (np.asarray(state.state.agent.position)[:, 1] == CORRIDOR_END).all()
    tiles = np.asarray(decode(obs))[..., 0].reshape(256, -1)
    assert ((tiles == Tiles.BALL).any(1) & (tiles == Tiles.KEY).any(1)).all()  # both end objects in view


def test_cue_in_view_of_says_when_the_observation_shows_the_cue():
    """minigrid_memory.cue_in_view_of (the analysis' "cue ever in view") from the agent's position
    and direction, against the adapter's observation, on 256 random walks of 40 steps in
    MiniGrid-MemoryS8: west of column 4 the only object the view can show is the cue."""
    pytest.importorskip("xminigrid")
    from minigrid_memory import cue_in_view_of

    env, params = envs.make_env("MiniGrid-MemoryS8")
    keys = jax.random.split(jax.random.key(0), 256)
    obs, state = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))(keys, params)
    step = jax.jit(lambda keys, state, action: env.step_batch(keys, state, action, params))
    agreed = []
    for t in range(40):
        agent = state.state.agent
        west = np.asarray(agent.position)[:, 1] <= 3
        in_view = np.asarray(cue_in_view_of(agent))
        np.testing.assert_array_equal(in_view[west], seen_object(obs)[west] != -1)
        agreed.extend(in_view[west])
        actions = jax.random.randint(jax.random.key(100 + t), (256,), 0, 3)  # forward, turn right, turn left
        obs, state, *_ = step(jax.random.split(jax.random.key(t + 1), 256), state, actions)
    assert 0.1 < np.mean(agreed) < 0.9  # both answers were checked, many times


# ======================================================================================
# --optimistic-reset-ratio: SuiteEnv.step_batch against a Python loop, on a counting env
# ======================================================================================


def counting_suite_env(reset_ratio: int):
    """A SuiteEnv whose episode ends (terminated) after a length drawn at reset from 1-4 steps;
    obs = (steps so far, the episode's id drawn at reset). Reward 1 per step."""

    def reset(key, params):
        id_key, length_key = jax.random.split(key)
        state = (jnp.int32(0), jax.random.uniform(id_key), jax.random.randint(length_key, (), 1, 5))
        return jnp.stack([0.0, state[1]]), state

    def step_without_reset(key, state, action, params):
        count, episode_id, length = state
        final_state = (count + 1, episode_id, length)
        terminated = count + 1 >= length
        return jnp.stack([count + 1.0, episode_id]), final_state, jnp.float32(1.0), terminated, jnp.bool_(False), {}

    return envs.SuiteEnv(reset, step_without_reset, 2, (2,), reset_ratio)


@pytest.mark.parametrize("reset_ratio", [1, 3, 16])
def test_optimistic_resets_give_the_kth_finished_env_new_episode_k_mod_ceil_n_over_r(reset_ratio):
    num_envs = 8
    num_resets = -(-num_envs // reset_ratio)  # 8, 3, 1
    env = counting_suite_env(reset_ratio)
    step_batch = jax.jit(lambda keys, states: envs.step_envs(env, keys, states, jnp.zeros(num_envs, jnp.int32), None))
    obs, states = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(jax.random.key(0), num_envs), None)
    ends = shared_starts = 0
    for t in range(12):
        keys = jax.random.split(jax.random.key(100 + t), num_envs)
        new_obs, new_states, reward, terminated, truncated, info = step_batch(keys, states)
        finished = [i for i in range(num_envs) if int(states[0][i]) + 1 >= int(states[2][i])]  # the reference, per env
        assert np.asarray(terminated).tolist() == [i in finished for i in range(num_envs)]
        np.testing.assert_array_equal(info["final_observation"][:, 0], np.asarray(states[0]) + 1.0)
        np.testing.assert_array_equal(info["final_observation"][:, 1], states[1])
        for i in range(num_envs):
            if i in finished:  # its own reset key at ratio 1; else the k-th to finish takes env (k mod M)'s
                reset_key = jax.random.split(keys[i if reset_ratio == 1 else finished.index(i) % num_resets])[1]
                expected_obs, expected_state = env.reset(reset_key, None)
            else:
                expected_obs, expected_state = info["final_observation"][i], jax.tree.map(lambda x: x[i], new_states)
                assert int(expected_state[0]) == int(states[0][i]) + 1
            np.testing.assert_array_equal(new_obs[i], expected_obs)
            assert [float(x[i]) for x in new_states] == [float(x) for x in expected_state]
        restarted_ids = [float(new_states[1][i]) for i in finished]
        shared_starts += len(restarted_ids) - len(set(restarted_ids))
        assert (len(set(restarted_ids)) == len(finished)) == (len(finished) <= num_resets)
        ends += len(finished)
        states = new_states
    assert ends >= 12 and (shared_starts > 0) == (reset_ratio > 1)  # the loop saw both cases


def test_optimistic_resets_equal_exact_ones_while_no_more_episodes_end_than_are_generated():
    """Ratio 1 is vmap(step); with ratio R the envs that did not finish are stepped exactly alike."""
    exact, optimistic = counting_suite_env(1), counting_suite_env(4)
    keys = jax.random.split(jax.random.key(3), 8)
    _, states = jax.vmap(exact.reset, in_axes=(0, None))(keys, None)
    actions = jnp.zeros(8, jnp.int32)
    vmapped = jax.vmap(exact.step, in_axes=(0, 0, 0, None))(keys, states, actions, None)
    for got, want in zip(jax.tree.leaves(envs.step_envs(exact, keys, states, actions, None)), jax.tree.leaves(vmapped)):
        np.testing.assert_array_equal(got, want)
    stepped = envs.step_envs(optimistic, keys, states, actions, None)
    running = ~np.asarray(vmapped[3])
    assert running.any() and not running.all()
    for got, want in zip(jax.tree.leaves(stepped[:2]), jax.tree.leaves(vmapped[:2])):
        np.testing.assert_array_equal(np.asarray(got)[running], np.asarray(want)[running])
    for got, want in zip(jax.tree.leaves(stepped[2:]), jax.tree.leaves(vmapped[2:])):
        np.testing.assert_array_equal(got, want)


# ======================================================================================
# env/<name> metrics and the Craftax score
# ======================================================================================


def test_env_metric_names_come_from_each_suites_info():
    pytest.importorskip("craftax")
    pytest.importorskip("xminigrid")
    assert ppo_mlp.run_metric_names(*gymnax.make("CartPole-v1")) == ppo_mlp.METRIC_NAMES
    assert ppo_mlp.run_metric_names(*envs.make_env("MiniGrid-MemoryS8")) == (*ppo_mlp.METRIC_NAMES, "env/success")
    names = ppo_mlp.run_metric_names(*envs.make_env(CRAFTAX_ID))[len(ppo_mlp.METRIC_NAMES):]
    assert len(names) == 23 and names[-1] == "env/score" and "env/achievement_collect_diamond" in names
    assert all(name.startswith("env/achievement_") for name in names[:-1])


class Countdown:
    """Episodes of exactly 3 steps; info["step"] is the step number, 1 to 3."""

    def action_space(self, params=None):
        return gymnax.environments.spaces.Discrete(2)

    def observation_space(self, params=None):
        return gymnax.environments.spaces.Box(0.0, 3.0, (1,), jnp.float32)

    def reset(self, key, params=None):
        return jnp.zeros((1,), jnp.float32), jnp.int32(0)

    def step(self, key, state, action, params=None):
        state = state + 1
        terminated = state == 3
        obs = jnp.full((1,), state, jnp.float32)
        truncated = jnp.bool_(False)
        info = {"step": state, "discount": 1.0 - terminated.astype(jnp.float32), "terminated": terminated,
                "truncated": truncated, "final_observation": obs, "not_a_scalar": jnp.zeros(2)}
        return jnp.where(terminated, 0.0, obs), jnp.where(terminated, 0, state), jnp.float32(1.0), terminated, truncated, info


def test_env_metrics_average_over_the_episodes_that_ended_only():
    env = Countdown()
    assert envs.env_info_names(env, None) == ("step",)
    args = ppo_mlp.Args(hidden_sizes=(8,), orthogonal_init=False)
    network = ppo_mlp.make_network(args, 2)

    @jax.jit
    def rollout(key):
        params = ppo_mlp.init_params(network, key, args, (1,))
        rollout_state = ppo_mlp.reset_envs(key, env, None, num_envs=2)
        return ppo_mlp.collect_rollout(params, rollout_state, key, network, env, None, 7, False, ("step",))

    finished = rollout(jax.random.key(0))[2]  # two episodes end per env in 7 steps, at steps 3 and 6
    assert set(finished) == {"charts/episodic_return", "charts/episodic_length", "env/step"}
    assert float(devices.nanmean_or_nan(finished["env/step"])) == 3.0  # the mean over all steps would be 2
    assert math.isnan(float(devices.nanmean_or_nan(finished["env/step"][:2])))  # no episode ended in steps 1-2


def test_craftax_score_is_the_geometric_mean_of_success_rates_in_percent():
    metrics = {"env/achievement_a": jnp.float32(1.0), "env/achievement_b": jnp.float32(0.0),
               "env/achievement_c": jnp.float32(0.5), "charts/episodic_return": jnp.float32(7.0)}
    expected = (101.0 * 1.0 * 51.0) ** (1 / 3) - 1.0
    assert float(envs.craftax_score(metrics)["env/score"]) == pytest.approx(expected, rel=1e-5)
    assert float(envs.craftax_score({name: jnp.float32(1.0) for name in metrics})["env/score"]) == pytest.approx(100.0)
    assert math.isnan(float(envs.craftax_score({"env/achievement_a": jnp.float32(jnp.nan)})["env/score"]))
    assert envs.craftax_score({"env/success": jnp.float32(1.0)}) == {}


# ======================================================================================
# The IMPALA torso on XLand-MiniGrid's views
# ======================================================================================


@pytest.mark.parametrize("view", [3, 5, 7])
def test_impala_output_shapes_on_small_views(view):
    """The default 3 stages, each with a stride-2 SAME max-pool: 3 -> 2 -> 1 -> 1,
    5 -> 3 -> 2 -> 1, 7 -> 4 -> 2 -> 1; never 0."""
    channels = ppo_lstm_impala.Args().impala_channels
    assert len(channels) == 3
    torso = ppo_lstm_impala.ImpalaTorso(channels, 32, True)
    obs = jax.ShapeDtypeStruct((4, view, view, 29), jnp.float32)
    params = jax.eval_shape(torso.init, jax.random.key(0), obs)  # shapes only: nothing is computed
    assert params["params"]["Dense_0"]["kernel"].shape == (1 * 1 * channels[-1], 32)  # a 1 x 1 map is left
    assert jax.eval_shape(torso.apply, params, obs).shape == (4, 32)


# ======================================================================================
# Ids that are refused: one line, exit code 2, nothing written
# ======================================================================================


@pytest.mark.parametrize("module", SCRIPTS, ids=lambda module: module.__name__)
@pytest.mark.parametrize("env_id, package", [(CRAFTAX_ID, "craftax"), ("MiniGrid-MemoryS8", "xminigrid")])
def test_an_id_of_a_suite_that_is_not_installed_says_how_to_install_it(module, env_id, package, monkeypatch, capsys, tmp_path):
    for name in [name for name in sys.modules if name == package or name.startswith(package + ".")] + [package]:
        monkeypatch.setitem(sys.modules, name, None)  # `import package` now raises ImportError
    line = main_error(module, ["--env-id", env_id], capsys, tmp_path)
    assert f"needs the {package} package" in line and "pip install -r requirements-envs.txt" in line


@pytest.mark.parametrize("module", SCRIPTS, ids=lambda module: module.__name__)
def test_an_xland_id_that_needs_a_downloaded_ruleset_is_refused(module, capsys, tmp_path):
    pytest.importorskip("xminigrid")
    line = main_error(module, ["--env-id", "XLand-MiniGrid-R1-9x9"], capsys, tmp_path)
    assert "ruleset" in line and "xminigrid.load_benchmark" in line and "download" in line


def test_a_symbolic_craftax_env_is_refused_by_the_impala_torso(capsys, tmp_path):
    pytest.importorskip("craftax")
    line = main_error(ppo_lstm_impala, ["--env-id", CRAFTAX_ID, "--torso", "impala"], capsys, tmp_path)
    assert "(1345,)" in line and "--torso impala needs (H, W, C) images" in line and "--torso mlp" in line


@pytest.mark.parametrize(
    "env_id, suggestion",
    [("Craftax-Classic-Symbolic-v2", CRAFTAX_ID), ("MiniGrid-MemoryS9", "MiniGrid-MemoryS8"), ("Breakout-MinAtr", "Breakout-MinAtar")],
)
def test_unknown_ids_get_close_names_from_every_suite(env_id, suggestion):
    pytest.importorskip("xminigrid")
    with pytest.raises(errors.ConfigError, match=f"did you mean {suggestion}"):
        envs.make_env(env_id)


# ======================================================================================
# Short training runs write every metric, env/* included
# ======================================================================================


def test_craftax_classic_symbolic_trains_and_logs_achievements_and_score(tmp_path, capsys):
    """Craftax_Baselines' PPO-RNN workload, tiny, with ppo_lstm_impala.py: a vector observation, so
    --torso auto is mlp. The env's adapter, its metrics and the optimistic resets are the package's
    (envs.py), the same for ppo_mlp.py, whose rollout steps the env as this one does."""
    pytest.importorskip("craftax")
    run_dir = tmp_path / "craftax-rnn"
    args = ppo_lstm_impala.Args(
        env_id=CRAFTAX_ID, hidden_sizes=(16,), lstm_size=16, num_parallel_envs=16, num_env_steps_per_cycle=64,
        num_minibatches_per_epoch=2, num_epochs_per_cycle=1, num_total_env_steps=2 * 16 * 64, run_dir=str(run_dir),
        optimistic_reset_ratio=4,  # the rollout through SuiteEnv.step_batch
    )
    summary = ppo_lstm_impala.run(args)
    assert not summary["failures"]
    assert "env/score" in capsys.readouterr().out  # on the console line
    rows = read_metrics(run_dir)
    assert [row["cycle"] for row in rows] == [1, 2] and all(set(ppo_lstm_impala.METRIC_NAMES) <= set(row) for row in rows)
    achievements = [name for name in rows[0] if name.startswith("env/achievement_")]
    assert len(achievements) == 22 and all({*achievements, "env/score"} <= set(row) for row in rows)
    scored = [row for row in rows if row["env/score"] is not None]
    assert scored, "no episode ended"
    for row in scored:  # the score of the row's own success rates
        rates = np.array([row[name] for name in achievements])
        assert len(rates) == 22 and ((rates >= 0) & (rates <= 1)).all()
        assert row["env/score"] == pytest.approx(np.exp(np.log1p(100 * rates).mean()) - 1, rel=1e-4)


def test_minigrid_memory_trains_with_ppo_lstm_impala_and_logs_success(tmp_path):
    pytest.importorskip("xminigrid")
    run_dir = tmp_path / "memory"
    args = ppo_lstm_impala.Args(
        env_id="MiniGrid-MemoryS8", impala_channels=(4,), torso_size=32, lstm_size=32, num_parallel_envs=16,
        num_env_steps_per_cycle=32, num_minibatches_per_epoch=2, num_epochs_per_cycle=1, num_total_env_steps=2 * 16 * 32,
        run_dir=str(run_dir),
    )
    summary = ppo_lstm_impala.run(args)
    assert not summary["failures"]
    rows = read_metrics(run_dir)
    assert [row["cycle"] for row in rows] == [1, 2]
    assert all(set(ppo_lstm_impala.METRIC_NAMES) | {"env/success", "charts/SPS"} <= set(row) for row in rows)
    successes = [row["env/success"] for row in rows if row["env/success"] is not None]
    assert successes and all(0.0 <= value <= 1.0 for value in successes)
    assert all((row["env/success"] is None) == (row["charts/episodic_return"] is None) for row in rows)


def test_gymnax_loads_seaborn_and_pyplot_only_when_a_renderer_uses_them():
    """gymnax imports seaborn (and scipy) for Pong's palette and matplotlib.pyplot for five
    renderers: a script's process starts without loading them (envs.DeferredModule), and the
    renderers still get the real modules."""
    code = (
        "import sys, ppo_lstm_impala, gymnax\n"
        "from gymnax.environments.misc import pong\n"
        "from gymnax.environments.bsuite import catch\n"
        "assert 'seaborn.palettes' not in sys.modules and 'scipy.stats' not in sys.modules, 'seaborn loaded at start'\n"
        "assert 'matplotlib.figure' not in sys.modules, 'pyplot loaded at start'\n"
        "palette = pong.sns.color_palette('cubehelix', 3)\n"
        "import seaborn\n"
        "assert 'seaborn.palettes' in sys.modules and len(palette) == 3\n"
        "assert seaborn.color_palette('cubehelix', 3) == palette and type(sys.modules['seaborn']).__name__ == 'module'\n"
        "import matplotlib\n"
        "matplotlib.use('Agg')\n"
        "figure, _ = catch.plt.subplots()\n"
        "import matplotlib.pyplot as plt\n"
        "assert type(sys.modules['matplotlib.pyplot']).__name__ == 'module' and plt.gcf() is figure\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
