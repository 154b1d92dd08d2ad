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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
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


class HalfFixedLayout(CueInView):
    def _generate_problem(self, params, key):
        drawn = super()._generate_problem(params, key)
        half = jax.random.bernoulli(jax.random.fold_in(key, HALF_FIXED_SALT))
        return jax.tree.map(lambda fixed, free: jnp.where(half, fixed, free), with_fixed_layout(drawn), drawn)


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
