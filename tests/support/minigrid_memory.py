"""Variants of MiniGrid-MemoryS8 that take one difficulty away each, to find which one stops
the LSTM (docs/experiments.md, "What stops it"). Each is a zero-argument factory for
`--env-id minigrid_memory:NAME` (with this folder on the Python path), behind the same adapter
(ppo_support.envs.xminigrid_env) as MiniGrid-MemoryS8 itself.

MemoryS8 (7 x 8): the agent starts in the corridor's row 3 at column 1 to 5, facing east; the cue
(a ball or a key) is at (2, 1), the two end objects at (1, 6) and (5, 6); stepping onto (2, 6) or
(4, 6), next to the upper or the lower object, ends the episode, won when that object is the cue's.

- cue_in_view: every episode starts at column 1, so the cue is in the first view: no walk back.
- cue_in_view_wide: cue_in_view with a 5 x 5 view, so both end objects are seen from the
  corridor's end before the agent turns: the choice is one turn, left or right.
- fixed_cue: cue_in_view_wide with the cue always the ball: the right side can be read off the
  end objects, with nothing to remember.
- fixed_layout: cue_in_view with the ball always the upper object: the right side follows from
  the cue alone, and nothing needs to be seen at the end.
- half_fixed_layout: fixed_layout in half the episodes (a coin at each reset), cue_in_view in
  the other half: the cue alone is worth remembering there, and the layout matters here.
- fixed_layout_any_start, half_fixed_layout_any_start: fixed_layout and half_fixed_layout with
  MemoryS8's own start (column 1 to 5), so that in most episodes the agent must walk back to see
  the cue.
- fixed_layout_starts_to_2, fixed_layout_starts_to_3: fixed_layout starting at column 1 to 2 or 1
  to 3 (drawn uniformly), facing east: from column 2 one turn north shows the cue, from column 3
  two turns (to face west). half_fixed_layout_starts_to_2, half_fixed_layout_starts_to_3: the same
  starts for half_fixed_layout.

Run as a script, it plays a run's final policies and splits their success by start column
(docs/experiments.md, "The walk back for the cue"):

    PYTHONPATH=. python tests/support/minigrid_memory.py RUN_DIR [--env-id ID] [--episodes N]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import xminigrid
from xminigrid.core.constants import Colors, Tiles
from xminigrid.envs.minigrid.memory import Memory

from ppo_support.envs import xminigrid_env

WIDTH = 8  # MemoryS8's; xminigrid puts the corridor's end at column WIDTH - 2
CUE = (2, 1)
UPPER, LOWER = (1, WIDTH - 2), (5, WIDTH - 2)  # the end objects
NEXT_TO_UPPER, NEXT_TO_LOWER = (2, WIDTH - 2), (4, WIDTH - 2)  # where stepping ends the episode
START_IN_VIEW_OF_THE_CUE = (3, 1)
WIDE_VIEW = 5
HALF_FIXED_SALT = 1  # HalfFixedLayout's coin: a key of its own, apart from the layout's
START_SALT = 2  # with_start_up_to's start column
NORTH, EAST, SOUTH, WEST = range(4)  # xminigrid's agent directions


def cue_in_view_of(agent) -> jnp.ndarray:
    """Whether the cue's cell lies in the agent's 3 x 3 view (the agent at the middle of its
    view's back row), from its position and direction; walls hide nothing in xminigrid's view."""
    row, column, direction = agent.position[..., 0], agent.position[..., 1], agent.direction
    top = jnp.select([direction == NORTH, direction == SOUTH], [row - 2, row], row - 1)
    left = jnp.select([direction == EAST, direction == WEST], [column, column - 2], column - 1)
    return (top <= CUE[0]) & (CUE[0] <= top + 2) & (left <= CUE[1]) & (CUE[1] <= left + 2)


class CueInView(Memory):
    def _generate_problem(self, params, key):
        state = super()._generate_problem(params, key)
        return state.replace(agent=state.agent.replace(position=jnp.array(START_IN_VIEW_OF_THE_CUE)))


def tile(kind: int, grid: jnp.ndarray) -> jnp.ndarray:
    return jnp.array((kind, Colors.GREEN), dtype=grid.dtype)  # MemoryS8's objects are green


def with_right_side(state, upper_is_right: jnp.ndarray):
    success, failure = jnp.array(NEXT_TO_UPPER), jnp.array(NEXT_TO_LOWER)
    carry = state.carry.replace(
        success_pos=jnp.where(upper_is_right, success, failure), failure_pos=jnp.where(upper_is_right, failure, success)
    )
    return state.replace(carry=carry)


class FixedCue(CueInView):
    def _generate_problem(self, params, key):
        state = super()._generate_problem(params, key)
        state = state.replace(grid=state.grid.at[CUE].set(tile(Tiles.BALL, state.grid)))
        return with_right_side(state, state.grid[UPPER][0] == Tiles.BALL)


def with_fixed_layout(state):
    """The ball on top, the key below: the right side follows from the cue alone."""
    grid = state.grid.at[UPPER].set(tile(Tiles.BALL, state.grid)).at[LOWER].set(tile(Tiles.KEY, state.grid))
    return with_right_side(state.replace(grid=grid), state.grid[CUE][0] == Tiles.BALL)


class FixedLayout(CueInView):
    def _generate_problem(self, params, key):
        return with_fixed_layout(super()._generate_problem(params, key))


def with_layout_fixed_half_the_time(drawn, key):
    half = jax.random.bernoulli(jax.random.fold_in(key, HALF_FIXED_SALT))
    return jax.tree.map(lambda fixed, free: jnp.where(half, fixed, free), with_fixed_layout(drawn), drawn)


class HalfFixedLayout(CueInView):
    def _generate_problem(self, params, key):
        return with_layout_fixed_half_the_time(super()._generate_problem(params, key), key)


class FixedLayoutAnyStart(Memory):
    def _generate_problem(self, params, key):
        return with_fixed_layout(super()._generate_problem(params, key))


def with_start_up_to(state, key, last_column: int):
    """The agent starts at a column drawn from 1 to last_column, in the corridor, facing east."""
    column = jax.random.randint(jax.random.fold_in(key, START_SALT), (), 1, last_column + 1)
    return state.replace(agent=state.agent.replace(position=jnp.array(START_IN_VIEW_OF_THE_CUE).at[1].set(column)))


class StartsUpTo:
    """Mixed in before a variant: its agent starts at a column drawn from 1 to last_column."""

    last_column: int

    def _generate_problem(self, params, key):
        return with_start_up_to(super()._generate_problem(params, key), key, self.last_column)


class FixedLayoutStartsTo2(StartsUpTo, FixedLayout):
    last_column = 2


class FixedLayoutStartsTo3(StartsUpTo, FixedLayout):
    last_column = 3


class HalfFixedLayoutStartsTo2(StartsUpTo, HalfFixedLayout):
    last_column = 2


class HalfFixedLayoutStartsTo3(StartsUpTo, HalfFixedLayout):
    last_column = 3


class HalfFixedLayoutAnyStart(Memory):
    def _generate_problem(self, params, key):
        return with_layout_fixed_half_the_time(super()._generate_problem(params, key), key)


def made(env_class: type, param_values: tuple[str, ...] = ()):
    env_id = f"MiniGrid-MemoryS8-{env_class.__name__}"  # xminigrid's registry wants the MiniGrid- prefix
    if env_id not in xminigrid.registered_environments():
        xminigrid.register(id=env_id, entry_point=f"{__name__}:{env_class.__name__}", width=WIDTH)
    return xminigrid_env(env_id, param_values)


def cue_in_view():
    return made(CueInView)


def cue_in_view_wide():
    return made(CueInView, (f"view_size={WIDE_VIEW}",))


def fixed_cue():
    return made(FixedCue, (f"view_size={WIDE_VIEW}",))


def fixed_layout():
    return made(FixedLayout)


def half_fixed_layout():
    return made(HalfFixedLayout)


def fixed_layout_any_start():
    return made(FixedLayoutAnyStart)


def fixed_layout_starts_to_2():
    return made(FixedLayoutStartsTo2)


def fixed_layout_starts_to_3():
    return made(FixedLayoutStartsTo3)


def half_fixed_layout_starts_to_2():
    return made(HalfFixedLayoutStartsTo2)


def half_fixed_layout_starts_to_3():
    return made(HalfFixedLayoutStartsTo3)


def half_fixed_layout_any_start():
    return made(HalfFixedLayoutAnyStart)


# ======================================================================================
# The analysis: success by start column, and how often the cue was ever in view
# ======================================================================================


def by_start_column(run_dir: Path, env_id: str | None, episodes: int) -> None:
    """Plays each seed's final policy with ppo_lstm_impala.py's own evaluation (sampled actions,
    as in training) in `episodes` fresh envs, one episode each, on the run's env or on env_id."""
    import ppo_lstm_impala as script

    args, params = script.load_params(run_dir)
    args = dataclasses.replace(args, env_id=env_id or args.env_id, eval_greedy=False)
    env, env_params = script.envs.make_env(args.env_id, param_values=args.env_params)
    policy = script.make_evaluation(script.make_network(args, env.action_space(env_params).n), env, env_params, args)
    states = script.TrainState(**dict.fromkeys(script.TrainState._fields))._replace(params=params)
    agent = lambda eval_state: eval_state.env.env_state.state.agent  # noqa: E731  (the adapter's xminigrid state)

    def play(state, key):
        start = script.evaluation.start_evaluation(key, policy, episodes)

        def step(carry):
            eval_state, seen = carry
            seen = seen | (cue_in_view_of(agent(eval_state)) & ~eval_state.finished)
            return policy.step(state, eval_state), seen

        unfinished = lambda carry: ~jnp.all(carry[0].finished) & (carry[0].num_steps < env_params.max_steps)  # noqa: E731
        end, seen = jax.lax.while_loop(unfinished, step, (start, jnp.zeros(episodes, bool)))
        return agent(start).position[:, 1], end.env.episode_return > 0, end.env.episode_length, seen, end.finished

    keys = jax.random.split(jax.random.key(0), args.num_seeds)
    columns, won, length, seen, finished = map(np.asarray, jax.jit(jax.vmap(play))(states, keys))
    print(f"{run_dir} on {args.env_id}: {episodes} episodes per seed, sampled actions")
    for index in range(args.num_seeds):
        by_column = "  ".join(f"col {c}: {won[index][columns[index] == c].mean():.2f}" for c in np.unique(columns[index]))
        walked = columns[index] >= 2
        from_east = lambda values: f" (from column 2+: {values[walked].mean():.2f})" if walked.any() else ""  # noqa: E731
        print(f"  seed {args.seed + index}: success {won[index].mean():.3f}{from_east(won[index])} | {by_column} | "
              f"cue ever in view {seen[index].mean():.2f}{from_east(seen[index])} | "
              f"length {length[index].mean():.1f} | unfinished {(~finished[index]).sum()}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Success by start column of a run's final policies on MemoryS8 or a variant.")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--env-id", help="play on this env instead of the run's, e.g. MiniGrid-MemoryS8")
    parser.add_argument("--episodes", type=int, default=2000)
    options = parser.parse_args()
    by_start_column(options.run_dir, options.env_id, options.episodes)
