"""Probe environments with known answers, for both scripts' tests.

Each is a gymnax `Environment`, so the scripts load them with `--env-id probe_envs:Name` (with
this folder on the Python path). Every probe comes in a vector form (obs shape (1,)) for
`ppo_mlp.py` and an image form (obs shape (3, 3, 1)) for `ppo_lstm_impala.py`.

- ConstantReward: one-step episodes, reward 1. The value must learn V = 1.
- ObsDependentReward: one-step episodes, obs is +1 or -1 at random, reward = obs. V(obs) = obs.
- ActionDependentReward: one-step episodes, reward +1 for action 0 and -1 for action 1. The policy
  must pick action 0, and V -> 1.
- MaskedActions: one-step episodes, actions pay 1, 0.5 and 0, and action 0 is always invalid
  (the env has an `action_mask` method). With masking the best return is 0.5.
- TimeLimit: reward 1 every step, never terminates, truncated after 5 steps. With truncation
  bootstrapping V = 1 / (1 - gamma) everywhere; without it the value is much lower.
- Clock: reward 1 every step; the observation is the time step / 5, so the observation a time
  limit ends on (1.0) is never the reset's (0.0). Truncated after 5 steps, and terminated by
  action 1 from step 3 on: a rollout has both kinds of episode end.
- MatchTheObservation: one-step episodes, obs is +1 or -1 at random; action 0 pays 1 on +1,
  action 1 pays 1 on -1, anything else 0. A policy that ignores the observation gets 0.5; a
  feed-forward network that reads it gets 1.
- RandomEnds: three actions, a reward drawn uniformly from [-1, 1) at every step, terminated with
  probability 1/4 at every step and truncated after 4 steps: episodes of random lengths that end
  either way (for the inputs that must be reset at every episode start, --prev-action-reward's).
- Memory: a cue (one of NUM_CUES channels) is shown once, then DELAY blank frames, then a query
  frame; naming the cue at the query pays 1, anything else 0. Only a policy with memory beats
  chance (1 / NUM_CUES).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from gymnax.environments import environment, spaces


@struct.dataclass
class ProbeState(environment.EnvState):
    value: jax.Array  # what the observation shows (probe-specific)


@struct.dataclass
class ProbeParams(environment.EnvParams):
    max_steps_in_episode: int = 1


class _Probe(environment.Environment):
    obs_shape: tuple[int, ...] = (1,)
    num_actions_: int = 2
    max_steps: int = 1

    @property
    def default_params(self) -> ProbeParams:
        return ProbeParams(max_steps_in_episode=self.max_steps)

    def action_space(self, params=None) -> spaces.Discrete:
        return spaces.Discrete(self.num_actions_)

    def observation_space(self, params=None) -> spaces.Box:
        return spaces.Box(-1.0, 1.0, self.obs_shape, jnp.float32)

    def obs(self, state: ProbeState) -> jax.Array:
        return jnp.full(self.obs_shape, state.value, jnp.float32)

    def initial_value(self, key: jax.Array) -> jax.Array:
        return jnp.float32(0.0)

    def reward(self, state: ProbeState, action: jax.Array) -> jax.Array:
        raise NotImplementedError

    def reset_env(self, key, params):
        state = ProbeState(time=jnp.int32(0), value=self.initial_value(key))
        return self.obs(state), state

    def step_env(self, key, state, action, params):
        reward = self.reward(state, action)
        new_state = ProbeState(time=state.time + 1, value=state.value)
        terminated = self.is_terminated(new_state, params)
        return self.obs(new_state), new_state, reward, terminated, {}

    def is_terminated(self, state, params):
        return jnp.bool_(True)


class ConstantReward(_Probe):
    def reward(self, state, action):
        return jnp.float32(1.0)


class ObsDependentReward(_Probe):
    def initial_value(self, key):
        return jnp.where(jax.random.bernoulli(key), 1.0, -1.0).astype(jnp.float32)

    def reward(self, state, action):
        return state.value


class ActionDependentReward(_Probe):
    def reward(self, state, action):
        return jnp.where(action == 0, 1.0, -1.0).astype(jnp.float32)


class MatchTheObservation(ObsDependentReward):
    def reward(self, state, action):
        return (action == jnp.where(state.value > 0, 0, 1)).astype(jnp.float32)


class MaskedActions(_Probe):
    """Three actions paying 1, 0.5 and 0; action 0 is always invalid (see `action_mask`)."""

    num_actions_ = 3

    def reward(self, state, action):
        return jnp.asarray([1.0, 0.5, 0.0], jnp.float32)[action]

    def action_mask(self, state, params):
        return jnp.asarray([False, True, True])


class TimeLimit(_Probe):
    max_steps = 5

    def reward(self, state, action):
        return jnp.float32(1.0)

    def is_terminated(self, state, params):
        return jnp.bool_(False)


class Clock(_Probe):
    max_steps = 5

    def obs(self, state):
        return jnp.full(self.obs_shape, state.time / self.max_steps, jnp.float32)

    def reward(self, state, action):
        return jnp.float32(1.0)

    def step_env(self, key, state, action, params):
        obs, new_state, reward, _, info = super().step_env(key, state, action, params)
        return obs, new_state, reward, (action == 1) & (new_state.time >= 3), info


class RandomEnds(_Probe):
    """obs = time / 4; a random reward; terminated with probability 1/4, truncated after 4 steps."""

    num_actions_ = 3
    max_steps = 4
    TERMINATION_PROB = 0.25

    def obs(self, state):
        return jnp.full(self.obs_shape, state.time / self.max_steps, jnp.float32)

    def step_env(self, key, state, action, params):
        reward_key, end_key = jax.random.split(key)
        new_state = ProbeState(time=state.time + 1, value=state.value)
        reward = jax.random.uniform(reward_key, (), jnp.float32, -1.0, 1.0)
        return self.obs(new_state), new_state, reward, jax.random.bernoulli(end_key, self.TERMINATION_PROB), {}


class Memory(_Probe):
    """value = cue index (0 .. NUM_CUES - 1); time counts the frames already shown."""

    NUM_CUES = 2
    DELAY = 4
    obs_shape = (3, 3, NUM_CUES + 1)
    num_actions_ = NUM_CUES
    max_steps = DELAY + 2

    def initial_value(self, key):
        return jax.random.randint(key, (), 0, self.NUM_CUES).astype(jnp.float32)

    def obs(self, state):
        cue = jax.nn.one_hot(state.value.astype(jnp.int32), self.NUM_CUES) * (state.time == 0)
        query = (state.time == self.DELAY + 1).astype(jnp.float32)[None]
        channels = jnp.concatenate([cue, query])
        return jnp.broadcast_to(channels, self.obs_shape).astype(jnp.float32)

    def observation_space(self, params=None) -> spaces.Box:
        return spaces.Box(0.0, 1.0, self.obs_shape, jnp.float32)

    def reward(self, state, action):
        at_query = state.time == self.DELAY + 1
        return jnp.where(at_query & (action == state.value.astype(jnp.int32)), 1.0, 0.0).astype(jnp.float32)

    def is_terminated(self, state, params):
        return state.time >= self.DELAY + 2


class MemoryVector(Memory):
    """Memory with vector observations (cue one-hot, query flag), for ppo_lstm_impala.py's MLP torso."""

    obs_shape = (Memory.NUM_CUES + 1,)


class HiddenArm(_Probe):
    """A two-armed bandit whose good arm (value) is drawn at each episode start and never shown:
    reward 1 for the good arm, 0 for the other, for 8 pulls. The observation is constant, so only
    the previous action and reward (--prev-action-reward) tell the LSTM which arm is good: with
    them, "stay after a 1, switch after a 0" earns 7.5 of 8 on average; without them, 4."""

    max_steps = 8

    def initial_value(self, key):
        return jax.random.randint(key, (), 0, 2).astype(jnp.float32)

    def obs(self, state):
        return jnp.zeros(self.obs_shape, jnp.float32)

    def reward(self, state, action):
        return (action == state.value.astype(jnp.int32)).astype(jnp.float32)

    def is_terminated(self, state, params):
        return state.time >= self.max_steps


class ContinuousActions(ConstantReward):
    """For the bad-input tests: a continuous action space."""

    def action_space(self, params=None) -> spaces.Box:
        return spaces.Box(-1.0, 1.0, (1,), jnp.float32)


class NonFiniteReward(ConstantReward):
    """Reward 1, but NaN with probability 1/5000 per step: training must stop updating at once."""

    def reward(self, state, action):
        return jnp.float32(1.0)

    def step_env(self, key, state, action, params):
        obs, new_state, reward, terminated, info = super().step_env(key, state, action, params)
        reward = jnp.where(jax.random.uniform(key) < 2e-4, jnp.nan, reward)
        return obs, new_state, reward, terminated, info


def with_images(probe: type) -> type:
    """The same probe with (3, 3, 1) image observations, for ppo_lstm_impala.py's torsos."""
    return type(f"{probe.__name__}Image", (probe,), {"obs_shape": (3, 3, 1), "__module__": __name__})


ConstantRewardImage = with_images(ConstantReward)
ObsDependentRewardImage = with_images(ObsDependentReward)
ActionDependentRewardImage = with_images(ActionDependentReward)
MatchTheObservationImage = with_images(MatchTheObservation)
TimeLimitImage = with_images(TimeLimit)
ClockImage = with_images(Clock)
MaskedActionsImage = with_images(MaskedActions)
NonFiniteRewardImage = with_images(NonFiniteReward)
