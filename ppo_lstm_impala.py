"""PPO with an IMPALA CNN torso and an LSTM, for gymnax environments with (H, W, C) image
observations (e.g. the MinAtar games) and discrete actions.

    python ppo_lstm_impala.py --env-id Breakout-MinAtar --num-seeds 5

Sibling of ppo_mlp.py: `diff ppo_mlp.py ppo_lstm_impala.py` shows the network, the recurrent carry
and how minibatches are cut (whole env sequences for BPTT, or single transitions with their
stored LSTM carry).

One file: copy it and own it. Read top to bottom: Args, containers, network, then PPO in run order,
all in one `jax.jit` over `jax.lax.scan`. Below the "Infrastructure" marker sits what PPO does not
need: validation, env loading, devices, metric callbacks, the NaN guard, checkpoints, `run`.
"37 details" numbers: https://iclr-blog-track.github.io/2022/03/25/ppo-implementation-details/
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import difflib
import functools
import hashlib
import importlib
import io
import itertools
import json
import logging
import math
import os
import re
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable, Literal, NamedTuple

import flax.linen as nn
import flax.serialization
import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tyro
from gymnax.environments import spaces
from jax.sharding import PartitionSpec as P

# --- Args ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Args:
    """PPO with an IMPALA CNN and an LSTM, for gymnax environments with image observations."""

    # --- experiment -----------------------------------------------------------------
    env_id: str = "Breakout-MinAtar"  # an image-observation gymnax id, or `module.path:Name` (see ppo_mlp.py)
    exp_name: str = Path(__file__).stem  # name of the experiment, in the default run dir and the wandb run name
    seed: int = 1  # seed of the first run; seed i uses seed + i
    num_seeds: int = 1  # independent seeds trained together in one compiled program (jax.vmap)
    num_total_env_steps: int = 20_000_000  # environment steps per seed

    # --- rollout (37 details: 1 vectorized env, 30 reward scaling) ----------------------
    num_parallel_envs: int = 256  # parallel environments per seed
    num_env_steps_per_cycle: int = 128  # steps per env per rollout; one cycle = one rollout + its update epochs
    reset_envs_each_cycle: bool = False  # UED style: every cycle starts from fresh episodes and zero LSTM carries
    bootstrap_truncated: bool = True  # time-limit steps bootstrap from V(final_observation); off: as terminations
    sticky_action_prob: float = 0.0  # the env repeats its last executed action with this probability (MinAtar's own: 0.1)
    optimistic_reset_ratio: int = 1  # Craftax, XLand-MiniGrid: ceil(envs / R) new episodes per step (Craftax's PPO: 16)
    norm_reward: bool = False  # rewards divided by the running std of a discounted return (gym's NormalizeReward)

    # --- optimisation (37 details: 3 Adam eps, 4 LR annealing, 6 minibatches) --------
    num_epochs_per_cycle: int = 5  # passes over the rollout per cycle (K epochs)
    num_minibatches_per_epoch: int = 8  # minibatches each epoch is cut into (bptt: groups of whole env sequences)
    lr: float = 5e-5  # Adam learning rate
    anneal_lr: bool = True  # linearly to exactly 0 at the last update (optax counts applied updates only)
    adam_eps: float = 1e-5  # Adam epsilon (PyTorch's default is 1e-8; the PPO baselines use 1e-5)
    max_grad_norm: float = 0.5  # clip gradients to this global norm (37 details: 11)

    # --- loss (37 details: 5 GAE, 7 adv norm, 8 clipped objective, 9 value clipping, 10) --
    gamma: float = 0.999  # discount factor
    gae_lambda: float = 0.95  # GAE lambda
    clip_eps: float = 0.1  # PPO clip range, also used for value clipping
    anneal_clip_eps: bool = False  # anneal the clip range linearly to exactly 0 at the last gradient step
    clip_vloss: bool = True  # clip the value loss around the rollout's values
    norm_adv: bool = True  # normalize advantages per minibatch
    ent_coef: float = 0.001  # entropy bonus coefficient
    vf_coef: float = 0.5  # value loss coefficient
    target_kl: float | None = None  # skip the rest of a cycle's updates once a minibatch's approxkl3 exceeds this
    mask_invalid_actions: bool = True  # if the env has `action_mask(env_state, env_params) -> bool (A,)`

    # --- network (37 details: 2 orthogonal init, 13 separate networks, 21 Nature CNN) ---
    torso: Literal["impala", "nature"] = "impala"  # the CNN: IMPALA's (Espeholt et al. 2018) or the Nature DQN's (Mnih et al. 2015)
    impala_channels: tuple[int, ...] = (16, 32, 32)  # channels of the IMPALA stages (conv, max-pool, 2 residual blocks)
    torso_size: int = 256  # width of the dense layer after the IMPALA convolutions (--torso nature: 512, NATURE_DENSE_SIZE)
    lstm_size: int = 256  # LSTM width; 0: no LSTM, a feed-forward IMPALA network (IMPALA-FF)
    # bptt: minibatches of whole env sequences, replayed from the rollout's first carry, with
    # gradients through time; stored: single transitions, each a one-step forward from the carry
    # stored during the rollout (no gradient through time, more memory)
    lstm_training: Literal["bptt", "stored"] = "bptt"
    separate_critic: bool = False  # the critic gets its own torso and LSTM, instead of sharing the actor's
    frame_stack: int = 1  # stack the last K observations along the channel axis
    orthogonal_init: bool = True  # gains sqrt(2) convs/dense, 1 LSTM, 0.01 actor, 1 critic, zero biases; off: flax's

    # --- scale (37 details, auxiliary: parallelized gradient update) ----------------------
    num_devices: int = 1  # split the parallel envs across devices (0 = all); gradients are pmean-ed
    distributed: bool = False  # multi-host: jax.distributed.initialize() first, from the cluster's env vars

    # --- logging ----------------------------------------------------------------------
    track: bool = False  # log to Weights & Biases
    wandb_project: str = "ppo-jax"  # wandb project
    wandb_entity: str | None = None  # wandb entity (team or user)
    wandb_group: str | None = None  # wandb group; default <env>__<exp-name>
    wandb_tags: tuple[str, ...] = ()  # wandb tags
    wandb_run_per_seed: bool = False  # one wandb run per seed, plain metric names (CleanRL's layout); off: seed_<n>/
    wandb_mode: Literal["online", "offline", "disabled"] = "online"  # offline: RUN_DIR/wandb, for `wandb sync`
    run_dir: str | None = None  # output folder; default runs/<env>__<exp-name>__<seed>__<time>
    log_every_cycles: int = 1  # write metrics every this many cycles (the last cycle is always written)
    eval_every_cycles: int | None = None  # evaluate every K cycles and at the last, on fresh envs (eval/*); None: off
    eval_episodes: int = 10  # episodes per evaluation and seed: one per fresh env, in parallel
    eval_greedy: bool = True  # evaluate the argmax of the masked logits; off: sample, as in training
    capture_video: bool = False  # a GIF of seed 0's first eval episode at each evaluation and at the end (RUN_DIR/videos)
    checkpoint_every_cycles: int | None = None  # save the full training state; default: every 10% of the run
    keep_checkpoints: int = 2  # keep the newest N checkpoints; --resume falls back past a damaged one
    resume: str | None = None  # continue this run dir from its last checkpoint; only logging flags may change

    # --- derived ----------------------------------------------------------------------
    @property
    def batch_size(self) -> int:  # transitions per rollout, per seed
        return self.num_parallel_envs * self.num_env_steps_per_cycle

    @property
    def num_cycles(self) -> int:
        return self.num_total_env_steps // self.batch_size

    @property
    def sequence_length(self) -> int:  # steps each loss sequence unrolls: the whole rollout for bptt, 1 for stored
        return self.num_env_steps_per_cycle if self.lstm_training == "bptt" else 1

    @property
    def num_sequences(self) -> int:  # sequences per rollout, per seed; minibatches are cut along them
        return self.batch_size // self.sequence_length

    @property
    def carry_size(self) -> int:  # floats of recurrent state per env: (c, h) of each LSTM
        return (2 if self.separate_critic else 1) * 2 * self.lstm_size

    @property
    def num_gradient_steps(self) -> int:  # nominal, in the whole run (target-KL may skip some)
        return self.num_cycles * self.num_epochs_per_cycle * self.num_minibatches_per_epoch


# --- Containers ----------------------------------------------------------------------------
class Transition(NamedTuple):
    """One rollout, time-major: every field is (T, N, ...).

    Convention: `done[t] = terminated[t] | truncated[t]` means obs[t+1] starts a new episode;
    the LSTM carry is reset to zeros before the cell sees obs[t+1]. The flag travels into the
    forward pass as `episode_start[t+1] = done[t]`; nothing is reset inside the env.
    `final_obs[t]` is the observation the step produced before the automatic reset; when the
    episode goes on it equals obs[t+1]. Truncation bootstraps from V(final_obs), computed with
    the carry after obs[t] (never a reset carry); termination does not bootstrap.
    Observations are frame-stacked (H, W, C * frame_stack).
    """

    obs: jax.Array  # (T, N, *obs_shape)
    episode_start: jax.Array  # (T, N) bool: done[t - 1], the carry is reset before obs[t]
    carry: jax.Array  # (T, N, carry_size) after the reset, with --lstm-training stored; else (T, N, 0)
    action: jax.Array  # (T, N)
    reward: jax.Array  # (T, N)
    terminated: jax.Array  # (T, N) bool
    truncated: jax.Array  # (T, N) bool
    final_obs: jax.Array  # (T, N, *obs_shape)
    action_mask: jax.Array | None  # (T, N, A) bool, or None when actions are not masked


class Batch(NamedTuple):
    """Training data of one cycle, cut into sequences: every field but `carry` is (L, S, ...)
    with sequence length L and S sequences, L * S = T * N. bptt: L = T, S = N (whole env
    sequences, `carry` is each env's carry at the start of the rollout). stored: L = 1, S = T * N
    (single transitions, `carry` is the one stored at that step, after its reset)."""

    obs: jax.Array
    episode_start: jax.Array  # (L, S) bool
    carry: jax.Array  # (S, carry_size)
    action: jax.Array
    logp: jax.Array
    value: jax.Array
    advantage: jax.Array
    target: jax.Array  # GAE return, the value target
    action_mask: jax.Array | None  # (L, S, A) bool, or None


class EnvCarry(NamedTuple):
    """What the environments carry from one cycle to the next, per seed."""

    env_state: Any
    obs: jax.Array  # (N, H, W, C * frame_stack) the frame stack
    episode_start: jax.Array  # (N,) bool: obs is the first of an episode (the previous step's done)
    lstm_carry: jax.Array  # (N, carry_size) before its reset by episode_start
    episode_return: jax.Array  # (N,) running return of the unfinished episode
    episode_length: jax.Array  # (N,)
    discounted_return: jax.Array  # (N,) --norm-reward's running discounted return, zeroed after an episode ends


class TrainState(NamedTuple):
    """Everything the train loop carries, per seed."""

    params: Any
    opt_state: Any
    env: EnvCarry
    key: jax.Array
    cycle: jax.Array  # cycles completed
    non_finite: jax.Array  # NaN guard: 0 while healthy, else the NON_FINITE_CHECKS index that failed
    non_finite_cycle: jax.Array  # the cycle whose update was not finite (0 while healthy)
    reward_stats: RunningMeanStd | None  # --norm-reward: running variance of env.discounted_return; else None


class UpdateCarry(NamedTuple):
    """What the minibatch updates of one cycle carry from one to the next."""

    params: Any
    opt_state: Any
    kl_stopped: jax.Array  # bool: --target-kl was exceeded; no later minibatch of the cycle is applied
    non_finite: jax.Array  # NaN guard: 0, or the NON_FINITE_CHECKS index of the first non-finite value
    metric_sums: dict[str, jax.Array]  # over the minibatches applied
    num_applied: jax.Array  # minibatch updates applied


# --- Network -------------------------------------------------------------------------------

HIDDEN_GAIN = math.sqrt(2.0)  # 37 details: 2; convs and the dense torso layer
LSTM_GAIN = 1.0  # input and recurrent kernels of the LSTM
ACTOR_HEAD_GAIN = 0.01  # near-uniform initial policy
CRITIC_HEAD_GAIN = 1.0
POOL_WINDOW = (3, 3)
POOL_STRIDES = (2, 2)
NUM_RESIDUAL_BLOCKS = 2  # per IMPALA stage
# --torso nature (Mnih et al. 2015; 37 details: 21): (channels, kernel, stride) per conv, VALID padding,
# then a dense layer of 512. Its strides need sides of 36 px or more (36 -> 8 -> 3 -> 1); below that
# (MinAtar's 10x10) every conv is 3x3 stride 1 with the same channels, which needs 7 px (7 -> 5 -> 3 -> 1).
NATURE_CONVS = ((32, 8, 4), (64, 4, 2), (64, 3, 1))
SMALL_NATURE_CONVS = ((32, 3, 1), (64, 3, 1), (64, 3, 1))
NATURE_MIN_SIDE, SMALL_NATURE_MIN_SIDE = 36, 7
NATURE_DENSE_SIZE = 512


def init_kwargs(gain: float, orthogonal_init: bool) -> dict[str, Any]:
    if orthogonal_init:
        return {"kernel_init": nn.initializers.orthogonal(gain), "bias_init": nn.initializers.zeros}
    return {}


def dense(features: int, gain: float, orthogonal_init: bool) -> nn.Dense:
    return nn.Dense(features, **init_kwargs(gain, orthogonal_init))


def conv(features: int, orthogonal_init: bool, kernel: int = 3, stride: int = 1, padding: str = "SAME") -> nn.Conv:
    """IMPALA's convs (Espeholt et al. 2018, fig. 3) are all 3x3 stride 1 SAME, the defaults; the
    Nature CNN's are VALID, of several sizes."""
    # The same parameters either way; see conv3x3_for_cpu. Other kernels and strides: XLA's own.
    on_cpu_3x3 = jax.default_backend() == "cpu" and (kernel, stride) == (3, 1)
    return nn.Conv(
        features, (kernel, kernel), (stride, stride), padding=padding,
        conv_general_dilated=conv3x3_for_cpu if on_cpu_3x3 else None, **init_kwargs(HIDDEN_GAIN, orthogonal_init),
    )


class ResidualBlock(nn.Module):
    channels: int
    orthogonal_init: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = conv(self.channels, self.orthogonal_init)(nn.relu(x))
        y = conv(self.channels, self.orthogonal_init)(nn.relu(y))
        return x + y


class ImpalaTorso(nn.Module):
    """IMPALA CNN: per stage a conv, a 3x3 stride-2 max-pool and two residual blocks; then relu,
    flatten and a dense relu layer."""

    impala_channels: tuple[int, ...]
    torso_size: int
    orthogonal_init: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """x (B, H, W, C) -> (B, torso_size)"""
        for channels in self.impala_channels:
            x = conv(channels, self.orthogonal_init)(x)
            x = nn.max_pool(x, POOL_WINDOW, strides=POOL_STRIDES, padding="SAME")
            for _ in range(NUM_RESIDUAL_BLOCKS):
                x = ResidualBlock(channels, self.orthogonal_init)(x)
        x = nn.relu(x).reshape(x.shape[0], -1)
        return nn.relu(dense(self.torso_size, HIDDEN_GAIN, self.orthogonal_init)(x))


class NatureTorso(nn.Module):
    """The Nature DQN CNN: three relu convs (NATURE_CONVS, or SMALL_NATURE_CONVS for images
    under 36 px), flatten, a dense relu layer of 512. On CPU the 3x3 stride-1 convs use
    conv3x3_for_cpu, the others XLA's own (conv3x3_for_cpu is
    only for 3x3 stride-1 convs)."""

    orthogonal_init: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """x (B, H, W, C) -> (B, NATURE_DENSE_SIZE)"""
        convs = NATURE_CONVS if min(x.shape[1:3]) >= NATURE_MIN_SIDE else SMALL_NATURE_CONVS
        for channels, kernel, stride in convs:
            x = nn.relu(conv(channels, self.orthogonal_init, kernel, stride, padding="VALID")(x))
        x = x.reshape(x.shape[0], -1)
        return nn.relu(dense(NATURE_DENSE_SIZE, HIDDEN_GAIN, self.orthogonal_init)(x))


def reset_carry(carry: jax.Array, episode_start: jax.Array) -> jax.Array:
    """carry (B, S), episode_start (B,): zeros where an episode starts (the initial carry)."""
    return jnp.where(episode_start[:, None], jnp.zeros_like(carry), carry)


class ResettingLSTM(nn.Module):
    """One LSTM step: zero the carry where an episode starts, then the cell. The carry is one
    array (B, 2 * lstm_size), c then h."""

    lstm_size: int
    orthogonal_init: bool

    @nn.compact
    def __call__(self, carry: jax.Array, inputs: tuple[jax.Array, jax.Array]):
        features, episode_start = inputs  # (B, F), (B,)
        cell_carry = jnp.split(reset_carry(carry, episode_start), 2, axis=-1)
        init = {}
        if self.orthogonal_init:
            orthogonal = nn.initializers.orthogonal(LSTM_GAIN)
            init = {"kernel_init": orthogonal, "recurrent_kernel_init": orthogonal, "bias_init": nn.initializers.zeros}
        (c, h), output = nn.OptimizedLSTMCell(self.lstm_size, **init)(cell_carry, features)
        new_carry = jnp.concatenate([c, h], axis=-1)
        return new_carry, (new_carry, output)


class Core(nn.Module):
    """IMPALA (or Nature) torso, then (unless lstm_size is 0) an LSTM scanned over time."""

    torso: str
    impala_channels: tuple[int, ...]
    torso_size: int
    lstm_size: int
    orthogonal_init: bool

    @nn.compact
    def __call__(self, carry: jax.Array, obs: jax.Array, episode_start: jax.Array):
        """carry (B, 2 * lstm_size), obs (T, B, H, W, C), episode_start (T, B) ->
        carry after each step (T, B, 2 * lstm_size), features (T, B, F)"""
        num_steps, num_sequences = obs.shape[:2]
        flat_obs = obs.reshape(num_steps * num_sequences, *obs.shape[2:]).astype(jnp.float32)
        if self.torso == "nature":
            features = NatureTorso(self.orthogonal_init)(flat_obs)
        else:
            features = ImpalaTorso(self.impala_channels, self.torso_size, self.orthogonal_init)(flat_obs)
        features = features.reshape(num_steps, num_sequences, -1)  # the torso runs batched over T
        if self.lstm_size == 0:  # IMPALA-FF: an empty carry
            return jnp.zeros((num_steps, num_sequences, 0), jnp.float32), features
        scanned_lstm = nn.scan(ResettingLSTM, variable_broadcast="params", split_rngs={"params": False})
        _, (carries, features) = scanned_lstm(self.lstm_size, self.orthogonal_init)(carry, (features, episode_start))
        return carries, features


class ActorCritic(nn.Module):
    """A shared IMPALA torso and LSTM with actor and critic heads, or a separate torso and LSTM
    for the critic (37 details: 13)."""

    num_actions: int
    torso: str
    impala_channels: tuple[int, ...]
    torso_size: int
    lstm_size: int
    orthogonal_init: bool
    separate_critic: bool

    def setup(self):
        core = lambda: Core(self.torso, self.impala_channels, self.torso_size, self.lstm_size, self.orthogonal_init)  # noqa: E731
        self.actor_core = core()
        self.critic_core = core() if self.separate_critic else self.actor_core
        self.actor_head = dense(self.num_actions, ACTOR_HEAD_GAIN, self.orthogonal_init)
        self.critic_head = dense(1, CRITIC_HEAD_GAIN, self.orthogonal_init)

    def __call__(self, carry: jax.Array, obs: jax.Array, episode_start: jax.Array):
        """carry (B, carry_size) before the first step's reset, obs (T, B, *obs_shape),
        episode_start (T, B) -> carry after each step (T, B, carry_size), logits (T, B, A),
        value (T, B)"""
        if not self.separate_critic:
            carries, features = self.actor_core(carry, obs, episode_start)
            return carries, self.actor_head(features), self.critic_head(features)[..., 0]
        actor_carry, critic_carry = jnp.split(carry, 2, axis=-1)
        actor_carries, actor_features = self.actor_core(actor_carry, obs, episode_start)
        critic_carries, critic_features = self.critic_core(critic_carry, obs, episode_start)
        carries = jnp.concatenate([actor_carries, critic_carries], axis=-1)
        return carries, self.actor_head(actor_features), self.critic_head(critic_features)[..., 0]


INVALID_ACTION_LOGIT = -1e9  # exp() is exactly 0, and 0 * logit stays finite in the entropy


def masked(logits: jax.Array, action_mask: jax.Array | None) -> jax.Array:
    return logits if action_mask is None else jnp.where(action_mask, logits, INVALID_ACTION_LOGIT)


def log_prob_and_entropy(logits: jax.Array, action: jax.Array) -> tuple[jax.Array, jax.Array]:
    """log pi(action) and the entropy of a categorical policy (as distrax.Categorical, tested)."""
    log_probs = jax.nn.log_softmax(logits)
    log_prob = jnp.take_along_axis(log_probs, action[..., None], axis=-1)[..., 0]
    entropy = -(jnp.exp(log_probs) * log_probs).sum(-1)
    return log_prob, entropy


def make_network(args: Args, num_actions: int) -> ActorCritic:
    return ActorCritic(
        num_actions, args.torso, tuple(args.impala_channels), args.torso_size, args.lstm_size, args.orthogonal_init,
        args.separate_critic,
    )


def init_params(network: ActorCritic, key: jax.Array, args: Args, obs_shape: tuple[int, ...]) -> Any:
    carry = jnp.zeros((1, args.carry_size), jnp.float32)
    return network.init(key, carry, jnp.zeros((1, 1, *obs_shape), jnp.float32), jnp.zeros((1, 1), bool))


# --- PPO, in run order: rollout, GAE, loss, minibatch update, epochs, cycle, make_train -------
# To hack: the network above, the loss in loss_fn, the optimizer in make_optimizer, the logged
# metrics at the end of train_cycle, the environment in make_env (below the marker).
def stacked_obs_shape(env: Any, env_params: Any, frame_stack: int) -> tuple[int, ...]:
    height, width, channels = env.observation_space(env_params).shape
    return (height, width, channels * frame_stack)


def push_frame(stack: jax.Array, frame: jax.Array, episode_start: jax.Array) -> jax.Array:
    """stack (N, H, W, C * K), frame (N, H, W, C) -> the new stack, newest frame last. At an
    episode start the stack is zeros except the newest frame (no frames of the last episode)."""
    channels = frame.shape[-1]
    older = stack[..., channels:]  # drops the oldest frame; empty when K = 1
    older = jnp.where(episode_start[:, None, None, None], jnp.zeros_like(older), older)
    return jnp.concatenate([older, frame.astype(jnp.float32)], axis=-1)


def collect_rollout(
    params: Any, env_carry: EnvCarry, key: jax.Array, network: ActorCritic, env: Any, env_params: Any,
    num_steps: int, mask_actions: bool, store_carries: bool, info_names: tuple[str, ...] = (),
) -> tuple[EnvCarry, Transition, dict[str, jax.Array]]:
    """Steps N envs for T steps with the current policy, carrying the LSTM state. Returns the new
    carry, the transitions, and `finished`: per step (T, N) the return, the length and the env's
    own `info` metrics (info_names, as env/<name>) of the episodes that ended there, NaN where
    none ended. With store_carries each step's carry (after its reset) is kept (stored)."""
    num_envs = env_carry.obs.shape[0]
    num_actions = env.action_space(env_params).n
    gumbel_key, env_key = jax.random.split(key)
    gumbel = jax.random.gumbel(gumbel_key, (num_steps, num_envs, num_actions))  # (T, N, A)
    env_keys = jax.random.split(env_key, num_steps * num_envs).reshape(num_steps, num_envs)

    def step(carry: EnvCarry, step_input):
        step_gumbel, step_keys = step_input
        lstm_carries, logits, _ = network.apply(params, carry.lstm_carry, carry.obs[None], carry.episode_start[None])
        action_mask = jax.vmap(env.action_mask, in_axes=(0, None))(carry.env_state, env_params) if mask_actions else None
        action = jnp.argmax(masked(logits[0], action_mask) + step_gumbel, axis=-1)  # Gumbel-max = categorical sample
        stepped = step_envs(env, step_keys, carry.env_state, action, env_params)
        next_frame, env_state, reward, terminated, truncated, info = stepped
        done = jnp.logical_or(terminated, truncated)
        next_obs = push_frame(carry.obs, next_frame, done)
        # The stack the step produced, before the reset: the same history, its own last frame.
        final_obs = push_frame(carry.obs, info["final_observation"], jnp.zeros_like(done))
        episode_return = carry.episode_return + reward
        episode_length = carry.episode_length + 1
        episode_end = {"charts/episodic_return": episode_return, "charts/episodic_length": episode_length}
        episode_end.update({f"env/{name}": info[name] for name in info_names})
        finished = {name: jnp.where(done, value.astype(jnp.float32), jnp.nan) for name, value in episode_end.items()}
        new_carry = EnvCarry(  # the carry reset itself happens in the next forward pass, from episode_start
            env_state, next_obs, done, lstm_carries[0], jnp.where(done, 0.0, episode_return), jnp.where(done, 0, episode_length),
            carry.discounted_return,
        )
        stored_carry = reset_carry(carry.lstm_carry, carry.episode_start) if store_carries else carry.lstm_carry[:, :0]
        transition = Transition(
            obs=carry.obs, episode_start=carry.episode_start, carry=stored_carry, action=action,
            reward=reward.astype(jnp.float32), terminated=terminated, truncated=truncated, final_obs=final_obs,
            action_mask=action_mask,
        )
        return new_carry, (transition, finished)

    env_carry, (transitions, finished) = jax.lax.scan(step, env_carry, (gumbel, env_keys))
    return env_carry, transitions, finished


def evaluate_rollout(
    params: Any, first_carry: jax.Array, transitions: Transition, network: ActorCritic, args: Args
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Cuts the rollout into the sequences the loss unrolls, (L, S, ...) with L * S = T * N, and
    computes the rollout's log-probs and values with the loss's own forward pass (not the
    rollout's), so that the first minibatch reproduces them exactly.

    Returns the sequences' first carry (S, C) and episode starts (L, S), logp (L, S),
    value (L, S), and next_value (T, N) = V(final_obs[t]) from the carry after obs[t], before
    any reset: a reset carry would bootstrap a truncated episode from the wrong state.
    """
    num_steps, num_envs = transitions.action.shape  # this device's envs
    sequence_shape = (args.sequence_length, num_steps * num_envs // args.sequence_length)
    to_sequences = lambda x: x.reshape(*sequence_shape, *x.shape[2:])  # noqa: E731
    if args.lstm_training == "bptt":
        sequence_carry, sequence_start = first_carry, transitions.episode_start
    else:  # the stored carries are already reset
        sequence_carry = transitions.carry.reshape(num_steps * num_envs, args.carry_size)
        sequence_start = jnp.zeros(sequence_shape, bool)

    carries, logits, value = forward_in_minibatches(
        params, sequence_carry, to_sequences(transitions.obs), sequence_start, network, args.num_minibatches_per_epoch
    )
    action_mask = None if transitions.action_mask is None else to_sequences(transitions.action_mask)
    logp, _ = log_prob_and_entropy(masked(logits, action_mask), to_sequences(transitions.action))
    _, _, next_value = forward_in_minibatches(
        params,
        carries.reshape(num_steps * num_envs, args.carry_size),  # carry after obs[t], (T * N, C)
        transitions.final_obs.reshape(1, num_steps * num_envs, *transitions.final_obs.shape[2:]),
        jnp.zeros((1, num_steps * num_envs), bool),
        network,
        args.num_minibatches_per_epoch,
    )
    return sequence_carry, sequence_start, logp, value, next_value.reshape(num_steps, num_envs)


def compute_gae(
    reward: jax.Array, value: jax.Array, next_value: jax.Array, terminated: jax.Array, done: jax.Array,
    gamma: float, gae_lambda: float,
) -> tuple[jax.Array, jax.Array]:
    """GAE over (T, N) arrays (37 details: 5). Returns advantages and value targets.

    next_value[t] is V of the observation that step t produced, before any reset: it is
    bootstrapped unless the episode terminated. The advantage recursion stops at every episode
    end, terminated or truncated. The last step of the rollout bootstraps the same way.
    """
    delta = reward + gamma * next_value * (1.0 - terminated) - value

    def backward(next_advantage, step):
        delta_t, done_t = step
        advantage = delta_t + gamma * gae_lambda * (1.0 - done_t) * next_advantage
        return advantage, advantage

    _, advantage = jax.lax.scan(backward, jnp.zeros_like(delta[0]), (delta, done.astype(jnp.float32)), reverse=True)
    return advantage, advantage + value


def ppo_loss_terms(
    new_logp: jax.Array, entropy: jax.Array, new_value: jax.Array, batch: Batch, clip_eps: jax.Array,
    clip_vloss: bool, norm_adv: bool, axis_name: str | None = None,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Clipped surrogate and value losses on one minibatch (37 details: 7, 8, 9): (policy_loss,
    value_loss, metrics); the total is policy_loss - ent_coef * entropy + vf_coef * value_loss."""
    advantage = batch.advantage
    if norm_adv:  # over the whole minibatch, every device's share of it included
        mean = mean_over_devices(advantage.mean(), axis_name)
        std = jnp.sqrt(mean_over_devices(((advantage - mean) ** 2).mean(), axis_name))
        advantage = (advantage - mean) / (std + 1e-8)
    logratio = new_logp - batch.logp
    ratio = jnp.exp(logratio)
    surrogate = ratio * advantage
    clipped_surrogate = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantage
    policy_loss = -jnp.minimum(surrogate, clipped_surrogate).mean()

    value_change = new_value - batch.value
    unclipped_value_loss = (new_value - batch.target) ** 2
    if clip_vloss:
        clipped_value = batch.value + jnp.clip(value_change, -clip_eps, clip_eps)
        value_loss = 0.5 * jnp.maximum(unclipped_value_loss, (clipped_value - batch.target) ** 2).mean()
    else:
        value_loss = 0.5 * unclipped_value_loss.mean()

    metrics = {
        "losses/policy_loss": policy_loss,
        "losses/value_loss": value_loss,
        "losses/entropy": entropy.mean(),
        "losses/actor_clipfrac": (jnp.abs(ratio - 1.0) > clip_eps).mean(),
        "losses/critic_clipfrac": (jnp.abs(value_change) > clip_eps).mean(),
        "losses/actor_approxkl1": (-logratio).mean(),
        "losses/actor_approxkl3": ((ratio - 1.0) - logratio).mean(),
    }
    return policy_loss, value_loss, metrics


def loss_fn(params: Any, batch: Batch, clip_eps: jax.Array, network: ActorCritic, args: Args, axis_name: str | None):
    # bptt: replays whole sequences from their first carry with the rollout's resets (gradients
    # flow through time); stored: a one-step forward from each transition's stored carry.
    _, logits, new_value = network.apply(params, batch.carry, batch.obs, batch.episode_start)
    new_logp, entropy = log_prob_and_entropy(masked(logits, batch.action_mask), batch.action)
    policy_loss, value_loss, metrics = ppo_loss_terms(new_logp, entropy, new_value, batch, clip_eps, args.clip_vloss,
                                                      args.norm_adv, axis_name)
    total = policy_loss - args.ent_coef * entropy.mean() + args.vf_coef * value_loss
    return total, metrics


# Metrics averaged over every minibatch applied in a cycle: the loss's, and the gradient norm.
MINIBATCH_METRIC_NAMES = ("losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/actor_clipfrac",
                          "losses/critic_clipfrac", "losses/actor_approxkl1", "losses/actor_approxkl3", "losses/grad_norm")


def annealed(value: float, anneal: bool, num_steps: int) -> optax.Schedule:
    """`value` at gradient step 0, falling linearly to exactly 0 at step num_steps - 1 and never
    below (37 details: 4); or constant. (optax.linear_schedule ends at -6e-12 in float32.)"""
    if not anneal:
        return optax.constant_schedule(value)
    return lambda step: value * jnp.clip(1.0 - step / max(num_steps - 1, 1), 0.0, 1.0)


def make_optimizer(args: Args) -> optax.GradientTransformation:
    """Global-norm clipping of the whole gradient (37 details: 11), then Adam."""
    learning_rate = annealed(args.lr, args.anneal_lr, args.num_gradient_steps)
    return optax.chain(optax.clip_by_global_norm(args.max_grad_norm), optax.adam(learning_rate, eps=args.adam_eps))


def minibatch_update(
    carry: UpdateCarry, minibatch: Batch, clip_eps: jax.Array, network: ActorCritic,
    optimizer: optax.GradientTransformation, args: Args, axis_name: str | None,
) -> UpdateCarry:
    """One gradient step, skipped once --target-kl is exceeded (measured before this step, on this
    minibatch). A non-finite loss or gradient is recorded in `non_finite`; the NaN guard then undoes
    the whole cycle. Under shard_map the gradients, loss and metrics are averaged over devices."""
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(carry.params, minibatch, clip_eps, network, args, axis_name)
    loss, metrics, grads = mean_over_devices((loss, metrics, grads), axis_name)
    metrics["losses/grad_norm"] = optax.tree.norm(grads)  # before clipping
    updates, opt_state = optimizer.update(grads, carry.opt_state, carry.params)
    params = optax.apply_updates(carry.params, updates)

    kl_stopped = carry.kl_stopped
    if args.target_kl is not None:  # 37 details: target-KL early stopping
        kl_stopped = kl_stopped | (metrics["losses/actor_approxkl3"] > args.target_kl)
        keep_if_not_stopped = lambda new, old: jnp.where(kl_stopped, old, new)  # noqa: E731
        params, opt_state = jax.tree.map(keep_if_not_stopped, (params, opt_state), (carry.params, carry.opt_state))
    non_finite = first_non_finite(carry.non_finite, loss, metrics["losses/grad_norm"])
    applied = ~kl_stopped & (non_finite == 0)
    metric_sums = jax.tree.map(lambda total, value: total + jnp.where(applied, value, 0.0), carry.metric_sums, metrics)
    return UpdateCarry(params, opt_state, kl_stopped, non_finite, metric_sums, carry.num_applied + applied)


def split_sequences(x: jax.Array, axis: int, num_minibatches: int) -> jax.Array:
    """Cuts the sequence axis (0 for `carry`, 1 for every other Batch field) into
    num_minibatches groups: (..., S, ...) -> (M, ..., S / M, ...)."""
    x = jnp.moveaxis(x, axis, 0)
    x = x.reshape(num_minibatches, x.shape[0] // num_minibatches, *x.shape[1:])
    return jnp.moveaxis(x, 1, axis + 1)


def merge_sequences(x: jax.Array, axis: int) -> jax.Array:
    """The inverse of split_sequences."""
    x = jnp.moveaxis(x, axis + 1, 1)
    x = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    return jnp.moveaxis(x, 0, axis)


def cut_minibatches(batch: Batch, permutation: jax.Array, num_minibatches: int) -> Batch:
    """Shuffled minibatches (M, L, S / M, ...) of whole sequences; `carry` (M, S / M, C)."""
    return Batch(
        *(
            None if x is None else split_sequences(jnp.take(x, permutation, axis=axis), axis, num_minibatches)
            for x, axis in zip(batch, sequence_axes(batch))
        )
    )


def sequence_axes(batch: Batch) -> Batch:
    return Batch(*(0 if name == "carry" else 1 for name in Batch._fields))


def forward_in_minibatches(
    params: Any, carry: jax.Array, obs: jax.Array, episode_start: jax.Array, network: ActorCritic, num_minibatches: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The loss's forward pass over all S sequences, one minibatch-sized group at a time:
    carry (S, C), obs (L, S, ...), episode_start (L, S) -> carries (L, S, C), logits (L, S, A),
    value (L, S). Same shapes and function as in loss_fn, so the first minibatch's ratio is 1.0
    exactly, as in ppo_mlp.py; it also bounds the memory of the pass."""
    groups = (
        split_sequences(carry, 0, num_minibatches),
        split_sequences(obs, 1, num_minibatches),
        split_sequences(episode_start, 1, num_minibatches),
    )
    carries, logits, value = jax.lax.map(lambda group: network.apply(params, *group), groups)
    return merge_sequences(carries, 1), merge_sequences(logits, 1), merge_sequences(value, 1)


def update_cycle(
    params: Any, opt_state: Any, batch: Batch, key: jax.Array, cycle: jax.Array, non_finite: jax.Array,
    network: ActorCritic, optimizer: optax.GradientTransformation, args: Args, axis_name: str | None = None,
) -> tuple[Any, Any, dict[str, jax.Array], jax.Array]:
    """K epochs of M minibatch updates on one rollout, each epoch on a fresh shuffle (keys are never
    reused); nothing is applied once `non_finite` is set. Returns the new params and optimizer
    state, the metrics averaged over the minibatches applied, and the NaN guard's code."""
    num_epochs, num_minibatches = args.num_epochs_per_cycle, args.num_minibatches_per_epoch
    num_sequences = batch.carry.shape[0]  # this device's share of the seed's sequences
    clip_schedule = annealed(args.clip_eps, args.anneal_clip_eps, args.num_gradient_steps)

    def epoch(carry: UpdateCarry, epoch_input) -> tuple[UpdateCarry, None]:
        epoch_key, epoch_index = epoch_input
        permutation = jax.random.permutation(epoch_key, num_sequences)
        minibatches = cut_minibatches(batch, permutation, num_minibatches)  # (M, L, S / M, ...)
        first_step = (cycle * num_epochs + epoch_index) * num_minibatches
        gradient_steps = first_step + jnp.arange(num_minibatches)

        def one_minibatch(carry, minibatch_input):
            minibatch, gradient_step = minibatch_input
            clip_eps = clip_schedule(gradient_step)
            return minibatch_update(carry, minibatch, clip_eps, network, optimizer, args, axis_name), None

        return jax.lax.scan(one_minibatch, carry, (minibatches, gradient_steps))[0], None

    metric_sums = {name: jnp.float32(0.0) for name in MINIBATCH_METRIC_NAMES}
    carry = UpdateCarry(params, opt_state, jnp.bool_(False), non_finite, metric_sums, num_applied=jnp.float32(0.0))
    carry, _ = jax.lax.scan(epoch, carry, (jax.random.split(key, num_epochs), jnp.arange(num_epochs)))
    metrics = {name: total / jnp.maximum(carry.num_applied, 1.0) for name, total in carry.metric_sums.items()}
    metrics["losses/epochs_run"] = carry.num_applied / num_minibatches
    return carry.params, carry.opt_state, metrics, carry.non_finite


# Logged every cycle (charts/SPS is added on the host), then the env's own env/<name> metrics.
METRIC_NAMES = ("charts/episodic_return", "charts/episodic_length", "charts/learning_rate", "charts/clip_eps",
                *MINIBATCH_METRIC_NAMES, "losses/explained_variance", "losses/epochs_run")


def train_cycle(
    state: TrainState, network: ActorCritic, optimizer: optax.GradientTransformation, env: Any, env_params: Any,
    args: Args, axis_name: str | None = None, info_names: tuple[str, ...] = (),
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One cycle of one seed: a rollout, GAE, then the update epochs. Returns the new state and
    the cycle's metrics (run_metric_names). Under shard_map it sees this device's envs."""
    key, reset_key, rollout_key, update_key = jax.random.split(state.key, 4)
    reset_key, rollout_key, update_key = (per_device(k, axis_name) for k in (reset_key, rollout_key, update_key))
    env_carry = state.env
    if args.reset_envs_each_cycle:
        env_carry = reset_envs(reset_key, env, env_params, env_carry.obs.shape[0], args)
    first_carry = env_carry.lstm_carry  # (N, C) before the first step's reset

    env_carry, transitions, finished = collect_rollout(
        state.params, env_carry, rollout_key, network, env, env_params, args.num_env_steps_per_cycle,
        uses_action_mask(args, env), store_carries=args.lstm_training == "stored", info_names=info_names,
    )
    reward_stats, env_carry, reward = normalize_rewards(state.reward_stats, env_carry, transitions, args.gamma, axis_name)

    num_steps, num_envs = transitions.action.shape
    sequence_carry, sequence_start, logp, value, next_value = evaluate_rollout(
        state.params, first_carry, transitions, network, args
    )
    to_sequences = lambda x: x.reshape(*logp.shape, *x.shape[2:])  # noqa: E731  (T, N, ...) -> (L, S, ...)

    done = jnp.logical_or(transitions.terminated, transitions.truncated)
    bootstrap_stops = transitions.terminated if args.bootstrap_truncated else done
    advantage, target = compute_gae(
        reward, value.reshape(num_steps, num_envs), next_value.reshape(num_steps, num_envs),
        bootstrap_stops.astype(jnp.float32), done, args.gamma, args.gae_lambda,
    )
    action_mask = None if transitions.action_mask is None else to_sequences(transitions.action_mask)
    batch = Batch(
        obs=to_sequences(transitions.obs), episode_start=sequence_start, carry=sequence_carry,
        action=to_sequences(transitions.action), logp=logp, value=value, advantage=to_sequences(advantage),
        target=to_sequences(target), action_mask=action_mask,
    )
    params, opt_state, metrics, non_finite = update_cycle(
        state.params, state.opt_state, batch, update_key, state.cycle, state.non_finite, network, optimizer, args, axis_name
    )

    last_step = (state.cycle + 1) * args.num_epochs_per_cycle * args.num_minibatches_per_epoch - 1
    for name, values in finished.items():  # return, length, env/<name>: over the episodes that ended
        metrics[name] = nanmean_or_nan(values, axis_name)
    metrics.update(craftax_score(metrics))  # env/score, from the env/achievement_* rates (Craftax only)
    metrics["charts/learning_rate"] = jnp.float32(annealed(args.lr, args.anneal_lr, args.num_gradient_steps)(last_step))
    metrics["charts/clip_eps"] = jnp.float32(annealed(args.clip_eps, args.anneal_clip_eps, args.num_gradient_steps)(last_step))
    metrics["losses/explained_variance"] = explained_variance(batch.value, batch.target, axis_name)
    new_state = guard_non_finite(state, params, opt_state, non_finite)._replace(env=env_carry, key=key, cycle=state.cycle + 1)
    return new_state._replace(reward_stats=reward_stats), metrics


def make_train(args: Args, env: Any, env_params: Any, mesh: jax.sharding.Mesh | None = None, video_fn: Callable | None = None):
    """Returns init(seed) -> TrainState of one seed, and train(states, log_fn, checkpoint_fn,
    start_cycle) -> (states, metrics (cycles, seeds)): the remaining cycles of a stack of seeds in
    one `lax.scan`, meant to be jitted. log_fn, checkpoint_fn and video_fn are host callbacks."""
    network = make_network(args, env.action_space(env_params).n)
    optimizer = make_optimizer(args)
    info_names = env_info_names(env, env_params)  # the env's own episode metrics, logged as env/<name>
    metric_names = METRIC_NAMES + env_metric_names(info_names)

    @jax.jit
    def init_one(key: jax.Array) -> TrainState:
        key, params_key, env_key = jax.random.split(key, 3)
        params = init_params(network, params_key, args, stacked_obs_shape(env, env_params, args.frame_stack))
        env_carry = reset_envs(env_key, env, env_params, args.num_parallel_envs, args)
        zero = jnp.int32(0)
        stats = normalization_stats(args, env, env_params)  # reward_stats: None where --norm-reward is off
        return TrainState(params, optimizer.init(params), env_carry, key, cycle=zero, non_finite=zero, non_finite_cycle=zero, **stats)

    init = lambda seed: init_one(jax.random.key(seed))  # noqa: E731  init(seed) -> TrainState

    axis_name = None if mesh is None else DEVICE_AXIS
    one_seed = lambda state: train_cycle(state, network, optimizer, env, env_params, args, axis_name, info_names)  # noqa: E731
    every_seed = skip_when_every_seed_failed(vmap_over_seeds(one_seed, args.num_seeds), metric_names)
    one_cycle = every_seed if mesh is None else shard_over_devices(every_seed, mesh)
    one_cycle, metric_names = with_evaluation(one_cycle, metric_names, network, env, env_params, args, video_fn)  # eval/*

    def train(states: TrainState, log_fn: Callable | None = None, checkpoint_fn: Callable | None = None, start_cycle: int = 0):
        def cycle_body(carry, _):
            states, outbox = carry
            states, metrics = one_cycle(states)
            outbox = send_to_host(outbox, states, metrics, metric_names, args, log_fn, checkpoint_fn, ordered=mesh is None)
            return (states, outbox), metrics

        outbox = empty_outbox(args, num_seeds=states.cycle.shape[0], num_metrics=len(metric_names))
        (states, _), metrics = jax.lax.scan(cycle_body, (states, outbox), None, length=args.num_cycles - start_cycle)
        return states, metrics

    return init, train


# ======================================================================================
# ==== Infrastructure: not needed to understand PPO ====
# Validation, env loading, devices, seeds, host callbacks, the NaN guard, logging,
# checkpoints, CPU settings, run and main.
# ======================================================================================


class ConfigError(ValueError):
    """Bad user input. `main` prints it as one line and exits with code 2."""


def validate_args(args: Args) -> None:
    """Every check on the arguments, in one place, before anything is compiled or written."""
    positive_ints = [
        "num_seeds",
        "num_total_env_steps",
        "num_parallel_envs",
        "num_env_steps_per_cycle",
        "num_epochs_per_cycle",
        "num_minibatches_per_epoch",
        "log_every_cycles",
        "keep_checkpoints",
        "eval_episodes",
        "torso_size",
        "frame_stack",
    ]
    for name in positive_ints:
        if getattr(args, name) <= 0:
            raise ConfigError(f"{flag(name)} must be a positive integer, got {getattr(args, name)}")
    if args.num_devices < 0:
        raise ConfigError(f"--num-devices must be >= 0 (0 = every device), got {args.num_devices}")
    if args.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {args.seed}")
    if args.lstm_training == "bptt" and args.num_parallel_envs % args.num_minibatches_per_epoch != 0:
        raise ConfigError(
            f"--lstm-training bptt cuts minibatches of whole env sequences, so --num-parallel-envs "
            f"{args.num_parallel_envs} must be divisible by --num-minibatches-per-epoch "
            f"{args.num_minibatches_per_epoch}"
        )
    if args.batch_size % args.num_minibatches_per_epoch != 0:
        raise ConfigError(
            f"--num-minibatches-per-epoch {args.num_minibatches_per_epoch} does not divide the "
            f"batch of --num-parallel-envs x --num-env-steps-per-cycle = {args.batch_size}"
        )
    if args.num_cycles == 0:
        raise ConfigError(
            f"--num-total-env-steps {args.num_total_env_steps} is smaller than one cycle "
            f"(--num-parallel-envs x --num-env-steps-per-cycle = {args.batch_size})"
        )
    for name in ["lr", "clip_eps", "max_grad_norm", "adam_eps"]:
        if not 0 < getattr(args, name) < math.inf:
            raise ConfigError(f"{flag(name)} must be a finite number > 0, got {getattr(args, name)}")
    for name in ["ent_coef", "vf_coef"]:
        if not 0 <= getattr(args, name) < math.inf:
            raise ConfigError(f"{flag(name)} must be a finite number >= 0, got {getattr(args, name)}")
    for name in ["gamma", "gae_lambda"]:
        if not 0 <= getattr(args, name) <= 1:
            raise ConfigError(f"{flag(name)} must be in [0, 1], got {getattr(args, name)}")
    if args.eval_every_cycles is not None and args.eval_every_cycles <= 0:
        raise ConfigError(f"--eval-every-cycles must be a positive integer, got {args.eval_every_cycles}")
    if args.checkpoint_every_cycles is not None and args.checkpoint_every_cycles <= 0:
        raise ConfigError(f"--checkpoint-every-cycles must be a positive integer, got {args.checkpoint_every_cycles}")
    if args.target_kl is not None and not 0 < args.target_kl < math.inf:
        raise ConfigError(f"--target-kl must be a finite number > 0 when set, got {args.target_kl}")
    for name in ["run_dir", "resume"]:
        if getattr(args, name) is not None and not getattr(args, name).strip():
            raise ConfigError(f"{flag(name)} must name a folder, got {getattr(args, name)!r}")
    validate_wandb_args(args)
    if not args.impala_channels or min(args.impala_channels) <= 0:
        raise ConfigError(f"--impala-channels must be one or more positive integers, got {args.impala_channels}")
    if args.lstm_size < 0:
        raise ConfigError(f"--lstm-size must be >= 0 (0: no LSTM), got {args.lstm_size}")
    if not 0 <= args.sticky_action_prob < 1:
        raise ConfigError(f"--sticky-action-prob must be in [0, 1), got {args.sticky_action_prob}")
    if args.optimistic_reset_ratio < 1:
        raise ConfigError(f"--optimistic-reset-ratio must be at least 1, got {args.optimistic_reset_ratio}")


def check_torso_fits(args: Args, obs_shape: tuple[int, ...]) -> None:
    """--torso nature needs images of at least SMALL_NATURE_MIN_SIDE px a side."""
    if args.torso == "nature" and min(obs_shape[:2]) < SMALL_NATURE_MIN_SIDE:
        raise ConfigError(
            f"--torso nature needs images of at least {SMALL_NATURE_MIN_SIDE}x{SMALL_NATURE_MIN_SIDE} px; --env-id "
            f"{args.env_id} has observations of shape {tuple(obs_shape)} (use --torso impala)"
        )


WANDB_NAME_LIMIT = 128  # characters in a wandb project or group name
WANDB_TAG_LIMIT = 64  # characters in a wandb tag
WANDB_PROJECT_FORBIDDEN = "/\\#?%:"  # characters wandb refuses in a project name


def validate_wandb_args(args: Args) -> None:
    """The limits wandb.init and its server put on names, checked before anything is compiled."""
    project = args.wandb_project
    if not project.strip() or len(project) > WANDB_NAME_LIMIT or any(char in project for char in WANDB_PROJECT_FORBIDDEN):
        raise ConfigError(
            f"--wandb-project must be 1 to {WANDB_NAME_LIMIT} characters, none of {' '.join(WANDB_PROJECT_FORBIDDEN)}; "
            f"got {project!r}"
        )
    group = args.wandb_group
    if group is not None and (not group.strip() or len(group) > WANDB_NAME_LIMIT):
        raise ConfigError(f"--wandb-group must be 1 to {WANDB_NAME_LIMIT} characters when set, got {group!r}")
    for tag in args.wandb_tags:
        if not tag.strip() or len(tag) > WANDB_TAG_LIMIT:
            raise ConfigError(f"--wandb-tags: each tag must be 1 to {WANDB_TAG_LIMIT} characters, got {tag!r}")


def flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


# --- environment loading ------------------------------------------------------------------
# Every env keeps gymnax's contract: step(key, state, action, params) -> (obs, state, reward,
# terminated, truncated, info) resets a finished episode itself and puts the observation from
# before that reset in info["final_observation"]. Craftax and XLand-MiniGrid are adapted to it
# below; their packages (requirements-envs.txt) are imported only when one of their ids is used.

CRAFTAX_IDS = ("Craftax-Classic-Symbolic-v1", "Craftax-Classic-Pixels-v1", "Craftax-Symbolic-v1", "Craftax-Pixels-v1")
XMINIGRID_PREFIXES = ("MiniGrid-", "XLand-MiniGrid-")  # every id in xminigrid.registered_environments()


def make_env(env_id: str, sticky_action_prob: float = 0.0, optimistic_reset_ratio: int = 1) -> tuple[Any, Any]:
    """`env_id` is a gymnax id, a Craftax id (CRAFTAX_IDS), an XLand-MiniGrid id, or
    `module.path:Name` (an Environment subclass, or a zero-argument factory returning
    (env, env_params)). Wrapped in StickyActions only when sticky_action_prob > 0; a suite's env
    resets optimistically (SuiteEnv.step_batch) when optimistic_reset_ratio > 1."""
    if ":" in env_id:
        module_name, _, attr_name = env_id.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ConfigError(f"--env-id {env_id}: cannot import module {module_name!r} ({error})")
        if not hasattr(module, attr_name):
            raise ConfigError(f"--env-id {env_id}: module {module_name!r} has no attribute {attr_name!r}")
        target = getattr(module, attr_name)
        if isinstance(target, type) and issubclass(target, gymnax.environments.environment.Environment):
            env = target()
            env_params = env.default_params
        elif callable(target):
            made = target()
            if not (isinstance(made, tuple) and len(made) == 2):
                raise ConfigError(f"--env-id {env_id}: the factory must return (env, env_params)")
            env, env_params = made
        else:
            raise ConfigError(f"--env-id {env_id}: {attr_name!r} is neither an Environment class nor a factory")
    elif env_id in CRAFTAX_IDS:
        env, env_params = craftax_env(env_id)
    elif env_id.startswith(XMINIGRID_PREFIXES):
        env, env_params = xminigrid_env(env_id)
    else:
        if env_id not in gymnax.registered_envs:
            raise ConfigError(f"--env-id {env_id} is not a gymnax, Craftax or XLand-MiniGrid environment{did_you_mean(env_id)}")
        env, env_params = gymnax.make(env_id)
    action_space = env.action_space(env_params)
    if not isinstance(action_space, spaces.Discrete):
        raise ConfigError(
            f"--env-id {env_id} has a {type(action_space).__name__} action space; "
            f"{Path(__file__).name} supports discrete actions only"
        )
    obs_shape = tuple(env.observation_space(env_params).shape)
    if len(obs_shape) != 3:
        raise ConfigError(
            f"--env-id {env_id} has observations of shape {obs_shape}; {Path(__file__).name} "
            f"needs (H, W, C) images, use ppo_mlp.py"
        )
    if optimistic_reset_ratio > 1:
        if not isinstance(env, SuiteEnv):
            raise ConfigError(
                f"--optimistic-reset-ratio applies to Craftax and XLand-MiniGrid ids only; --env-id {env_id} resets its "
                "episodes inside its own step"
            )
        if sticky_action_prob > 0:
            raise ConfigError("--optimistic-reset-ratio above 1 cannot be combined with --sticky-action-prob (the "
                              "sticky-action wrapper steps one env at a time)")
        env = dataclasses.replace(env, reset_ratio=optimistic_reset_ratio)
    if sticky_action_prob > 0:
        env = StickyActions(env, sticky_action_prob)
    return env, env_params


def uses_action_mask(args: Args, env: Any) -> bool:
    return args.mask_invalid_actions and callable(getattr(env, "action_mask", None))


def reset_envs(key: jax.Array, env: Any, env_params: Any, num_envs: int, args: Args) -> EnvCarry:
    """Fresh episodes in every env, a fresh frame stack, zero LSTM carries and a zero discounted
    return for --norm-reward."""
    frame, env_state = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(key, num_envs), env_params)
    starts = jnp.ones((num_envs,), bool)
    stack = jnp.zeros((num_envs, *stacked_obs_shape(env, env_params, args.frame_stack)), jnp.float32)
    lstm_carry = jnp.zeros((num_envs, args.carry_size), jnp.float32)
    zeros = jnp.zeros((num_envs,), jnp.float32)
    return EnvCarry(env_state, push_frame(stack, frame, starts), starts, lstm_carry, zeros, jnp.zeros((num_envs,), jnp.int32), zeros)


class StickyState(NamedTuple):
    env_state: Any  # the wrapped env's state
    previous_action: jax.Array  # int32: the action executed at the previous step; 0 after a reset


@dataclasses.dataclass(frozen=True)
class StickyActions:
    """--sticky-action-prob p (Machado et al. 2018; MinAtar's own default is 0.1, gymnax has none):
    at every step, with probability p, the env executes its previous executed action instead of
    the agent's. The coin's key is split from the step's key. The transition still stores the
    agent's action: the policy's log-prob is of what the agent chose. With an env that has an
    action_mask, an action is only repeated while the mask still allows it."""

    env: Any
    prob: float

    def reset(self, key: jax.Array, params: Any) -> tuple[jax.Array, StickyState]:
        obs, env_state = self.env.reset(key, params)
        return obs, StickyState(env_state, jnp.int32(0))

    def step(self, key: jax.Array, state: StickyState, action: jax.Array, params: Any):
        step_key, coin_key = jax.random.split(key)
        repeat = jax.random.uniform(coin_key) < self.prob
        if self.action_mask is not None:
            repeat = repeat & self.action_mask(state, params)[state.previous_action]
        executed = jnp.where(repeat, state.previous_action, action).astype(jnp.int32)
        obs, env_state, reward, terminated, truncated, info = self.env.step(step_key, state.env_state, executed, params)
        previous_action = jnp.where(jnp.logical_or(terminated, truncated), 0, executed)  # the episode was reset
        return obs, StickyState(env_state, previous_action), reward, terminated, truncated, info

    @property
    def action_mask(self) -> Callable | None:
        """The env's own action_mask on the wrapped state; None when the env has none."""
        env_mask = getattr(self.env, "action_mask", None)
        return None if not callable(env_mask) else lambda state, params: env_mask(state.env_state, params)

    def action_space(self, params: Any = None) -> spaces.Discrete:
        return self.env.action_space(params)

    def observation_space(self, params: Any = None) -> Any:
        return self.env.observation_space(params)


def did_you_mean(env_id: str) -> str:
    """Close names among every suite's ids (XLand-MiniGrid's only when it is installed)."""
    try:
        import xminigrid

        xminigrid_ids = xminigrid.registered_environments()
    except ImportError:
        xminigrid_ids = ()
    close = difflib.get_close_matches(env_id, [*gymnax.registered_envs, *CRAFTAX_IDS, *xminigrid_ids], n=3, cutoff=0.5)
    if close:
        return f"; did you mean {', '.join(close)}?"
    return "; see gymnax.registered_envs, CRAFTAX_IDS and xminigrid.registered_environments()"


def import_suite(module_name: str, env_id: str) -> Any:
    """The suite's package, imported only now; one line saying how to install it if it is missing."""
    try:
        return importlib.import_module(module_name)
    except ImportError as error:
        package = module_name.partition(".")[0]
        raise ConfigError(
            f"--env-id {env_id} needs the {package} package ({error}); install it with: pip install -r requirements-envs.txt"
        )


@dataclasses.dataclass(frozen=True)
class SuiteEnv:
    """An env of another suite behind the gymnax interface above: reset(key, params) -> (obs,
    state) and step(key, state, action, params), which resets a finished episode itself. The
    adapter supplies `step_without_reset`: (final obs, final state, reward, terminated,
    truncated, info)."""

    reset: Callable
    step_without_reset: Callable
    num_actions: int
    obs_shape: tuple[int, ...]
    reset_ratio: int = 1  # --optimistic-reset-ratio: used by step_batch

    def step(self, key: jax.Array, state: Any, action: jax.Array, params: Any):
        """One env; a finished episode restarts from reset(its own reset key): exact, but under
        vmap XLA runs the reset for every env at every step."""
        step_key, reset_key = jax.random.split(key)
        final_obs, final_state, reward, terminated, truncated, info = self.step_without_reset(step_key, state, action, params)
        obs, state = where_done(terminated | truncated, self.reset(reset_key, params), (final_obs, final_state))
        return obs, state, reward, terminated, truncated, {**info, "final_observation": final_obs}

    def step_batch(self, keys: jax.Array, states: Any, actions: jax.Array, params: Any):
        """N envs. With --optimistic-reset-ratio R > 1 (as Craftax's own PPO, which uses 16) only
        M = ceil(N / R) new episodes are generated per step, from the first M envs' reset keys,
        and the k-th env to finish at this step (in env order) takes new episode k mod M: exact
        while at most M episodes end at once, beyond that some envs restart from the same state."""
        if self.reset_ratio == 1:
            return jax.vmap(self.step, in_axes=(0, 0, 0, None))(keys, states, actions, params)
        step_keys, reset_keys = jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0)
        stepped = jax.vmap(self.step_without_reset, in_axes=(0, 0, 0, None))(step_keys, states, actions, params)
        final_obs, final_states, reward, terminated, truncated, info = stepped
        done = terminated | truncated
        num_resets = -(-done.shape[0] // self.reset_ratio)
        new_episodes = jax.vmap(self.reset, in_axes=(0, None))(reset_keys[:num_resets], params)
        which = (jnp.cumsum(done) - 1) % num_resets
        obs, states = jax.vmap(where_done)(done, jax.tree.map(lambda x: x[which], new_episodes), (final_obs, final_states))
        return obs, states, reward, terminated, truncated, {**info, "final_observation": final_obs}

    def action_space(self, params: Any = None) -> spaces.Discrete:
        return spaces.Discrete(self.num_actions)

    def observation_space(self, params: Any = None) -> spaces.Box:
        return spaces.Box(0.0, 1.0, self.obs_shape, jnp.float32)


def step_envs(env: Any, keys: jax.Array, states: Any, actions: jax.Array, params: Any):
    """Steps a batch of envs: env.step under vmap, or a suite's step_batch (optimistic resets)."""
    if isinstance(env, SuiteEnv):
        return env.step_batch(keys, states, actions, params)
    return jax.vmap(env.step, in_axes=(0, 0, 0, None))(keys, states, actions, params)


def where_done(done: jax.Array, reset: Any, stepped: Any) -> Any:
    """The reset (obs, state) where the episode is done, else the stepped one (one env)."""
    return jax.tree.map(lambda new, old: jax.lax.select(done, new, old), reset, stepped)


ACHIEVEMENT_PREFIX = "achievement_"  # Craftax's achievements in info: achievement_<name>, 1 or 0


def craftax_env(env_id: str) -> tuple[SuiteEnv, Any]:
    """Craftax (Matthews et al. 2024), made without its auto-reset and reset here. Its `done`
    includes the time limit (params.max_timesteps: 10,000 steps in Classic, 100,000 in Craftax):
    here game over (death, lava, the final boss beaten) terminates and the limit truncates.
    Generating a world costs about 40 steps: see --optimistic-reset-ratio in the README."""
    craftax = import_suite("craftax.craftax_env", env_id).make_craftax_env_from_name(env_id, auto_reset=False)
    env_params = craftax.default_params

    def step_without_reset(key, state, action, params):
        final_obs, final_state, reward, done, craftax_info = craftax.step_env(key, state, action, params)
        terminated = craftax.is_terminal(final_state, params.replace(max_timesteps=jnp.iinfo(jnp.int32).max))  # no limit
        truncated = done & ~terminated
        info = {  # Craftax reports 100 x achieved at episode ends (0 elsewhere): here 1 or 0
            ACHIEVEMENT_PREFIX + name.partition("/")[2]: value / 100.0
            for name, value in craftax_info.items() if name.startswith("Achievements/")
        }
        info.update(discount=1.0 - terminated.astype(jnp.float32), terminated=terminated, truncated=truncated)
        return final_obs, final_state, reward, terminated, truncated, info

    obs_shape = tuple(craftax.observation_space(env_params).shape)
    return SuiteEnv(craftax.reset_env, step_without_reset, craftax.num_actions, obs_shape), env_params


XMINIGRID_DIRECTIONS = 4  # the agent faces one of 4 directions


def xminigrid_env(env_id: str) -> tuple[SuiteEnv, Any]:
    """XLand-MiniGrid (Nikulin et al. 2024), whose TimeStep API does not reset, reset here. An
    episode terminates when it is won or lost (LAST with discount 0) and is truncated at
    params.max_steps (LAST with discount 1). Observation: the (V, V, 2) tile and colour ids of the
    agent's view as one-hots, and its direction as a one-hot broadcast over the view: float32
    (V, V, 13 + 12 + 4). info["success"]: 1 for a won episode (terminated with reward > 0)."""
    xminigrid = import_suite("xminigrid", env_id)
    if env_id not in xminigrid.registered_environments():
        raise ConfigError(f"--env-id {env_id} is not an XLand-MiniGrid environment{did_you_mean(env_id)}")
    if env_id.startswith("XLand-MiniGrid-"):
        raise ConfigError(
            f"--env-id {env_id} needs a ruleset (its task: without one it has no goal), which xminigrid only gets by "
            "downloading a benchmark (xminigrid.load_benchmark); this script downloads nothing. Use a MiniGrid-* id"
        )
    from xminigrid.core.constants import NUM_COLORS, NUM_TILES

    minigrid, env_params = xminigrid.make(env_id)

    def encode(timestep) -> jax.Array:
        ids = timestep.observation  # (V, V, 2) uint8: tile id, colour id
        direction = jax.nn.one_hot(timestep.state.agent.direction, XMINIGRID_DIRECTIONS)
        return jnp.concatenate(
            [jax.nn.one_hot(ids[..., 0], NUM_TILES), jax.nn.one_hot(ids[..., 1], NUM_COLORS),
             jnp.broadcast_to(direction, (*ids.shape[:2], XMINIGRID_DIRECTIONS))],
            axis=-1,
        )

    def reset(key, params):
        timestep = minigrid.reset(params, key)
        return encode(timestep), timestep

    def step_without_reset(key, timestep, action, params):  # xminigrid's step is deterministic: no key
        final = minigrid.step(params, timestep, action)
        terminated = final.last() & (final.discount == 0.0)
        truncated = final.last() & ~terminated
        info = {
            "success": (terminated & (final.reward > 0.0)).astype(jnp.float32),
            "discount": final.discount, "terminated": terminated, "truncated": truncated,
        }
        return encode(final), final, final.reward, terminated, truncated, info

    view = minigrid.observation_shape(env_params)[0]
    obs_shape = (view, view, NUM_TILES + NUM_COLORS + XMINIGRID_DIRECTIONS)
    return SuiteEnv(reset, step_without_reset, minigrid.num_actions(env_params), obs_shape), env_params


# --- env info metrics ---------------------------------------------------------------------
# An env's own episode metrics (Craftax's achievements, XLand-MiniGrid's success) are the
# numeric scalar entries of its step's `info`. Each is logged as env/<name>: the mean of its
# values at the steps where episodes ended in the cycle (NaN when none did).

STEP_INFO_KEYS = ("final_observation", "discount", "terminated", "truncated")  # per step, not episode metrics
CRAFTAX_SCORE = "env/score"


def env_info_names(env: Any, env_params: Any) -> tuple[str, ...]:
    """The names of the numeric scalar entries of one step's info, besides STEP_INFO_KEYS; from
    jax.eval_shape of a step (traced, nothing computed). They shape the metrics rows, so they
    must be known before the training loop is traced."""
    key = jax.random.key(0)
    _, state = jax.eval_shape(env.reset, key, env_params)
    info = jax.eval_shape(env.step, key, state, jax.ShapeDtypeStruct((), jnp.int32), env_params)[5]
    return tuple(sorted(
        name for name, value in info.items()
        if name not in STEP_INFO_KEYS and isinstance(value, jax.ShapeDtypeStruct) and value.shape == ()
        and (jnp.issubdtype(value.dtype, jnp.number) or value.dtype == jnp.bool_)
    ))


def env_metric_names(info_names: tuple[str, ...]) -> tuple[str, ...]:
    names = tuple(f"env/{name}" for name in info_names)
    has_achievements = any(name.startswith(ACHIEVEMENT_PREFIX) for name in info_names)
    return names + ((CRAFTAX_SCORE,) if has_achievements else ())


def run_metric_names(env: Any, env_params: Any) -> tuple[str, ...]:
    """Everything a run logs per cycle, in the order of the metrics rows: METRIC_NAMES, then
    the env's own metrics."""
    return METRIC_NAMES + env_metric_names(env_info_names(env, env_params))


def craftax_score(metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The Craftax score (Crafter's, Hafner 2021; Matthews et al. 2024): the geometric mean of
    the achievements' success rates in percent, offset by 1, exp(mean(log(1 + 100 rate))) - 1,
    from 0 to 100; here over the episodes that ended in the cycle. Empty without achievements."""
    rates = [value for name, value in metrics.items() if name.startswith(f"env/{ACHIEVEMENT_PREFIX}")]
    if not rates:
        return {}
    return {CRAFTAX_SCORE: jnp.exp(jnp.mean(jnp.log1p(100.0 * jnp.stack(rates)))) - 1.0}


def console_env_metrics(metric_names: tuple[str, ...]) -> list[str]:
    """The env metrics on the console line: the score when there is one, else every env/<name>."""
    if CRAFTAX_SCORE in metric_names:
        return [CRAFTAX_SCORE]
    return [name for name in metric_names if name.startswith("env/")]


# --- devices and seeds ----------------------------------------------------------------------

DEVICE_AXIS = "devices"  # the shard_map axis that splits the parallel envs across devices


def mean_over_devices(x: Any, axis_name: str | None) -> Any:
    """The mean of every device's value under shard_map; the value itself on one device."""
    return x if axis_name is None else jax.lax.pmean(x, axis_name)


def sum_over_devices(x: Any, axis_name: str | None) -> Any:
    return x if axis_name is None else jax.lax.psum(x, axis_name)


def per_device(key: jax.Array, axis_name: str | None) -> jax.Array:
    """Different random numbers on each device (only when there are several)."""
    if axis_name is None or jax.lax.axis_size(axis_name) == 1:
        return key
    return jax.random.fold_in(key, jax.lax.axis_index(axis_name))


def vmap_over_seeds(train_cycle_of_one_seed: Callable, num_seeds: int) -> Callable:
    """The cycle of every seed (leading axis of the states and metrics). One seed runs unvmapped:
    vmap over a size-1 axis turns every matmul into a batched one, which XLA:CPU runs slower."""
    if num_seeds > 1:
        return jax.vmap(train_cycle_of_one_seed)

    def one_seed(states: TrainState) -> tuple[TrainState, dict[str, jax.Array]]:
        state, metrics = train_cycle_of_one_seed(jax.tree.map(lambda x: x[0], states))
        return jax.tree.map(lambda x: x[None], (state, metrics))

    return one_seed


def state_partition_specs() -> TrainState:
    """How a stack of TrainStates lies across devices: the envs (axis 1 of every EnvCarry leaf,
    after the seed axis) are split, everything else is replicated."""
    return TrainState(*([P()] * len(TrainState._fields)))._replace(env=P(None, DEVICE_AXIS))


def shard_over_devices(cycle_of_every_seed: Callable, mesh: jax.sharding.Mesh) -> Callable:
    """Each device steps its share of the envs; gradients and metrics are averaged across them."""
    specs = state_partition_specs()
    return jax.shard_map(cycle_of_every_seed, mesh=mesh, in_specs=(specs,), out_specs=(specs, P()))


def place_on_mesh(states: TrainState, mesh: jax.sharding.Mesh | None) -> TrainState:
    if mesh is None:
        return states
    shardings = jax.tree.map(
        lambda spec, subtree: jax.tree.map(lambda _: jax.sharding.NamedSharding(mesh, spec), subtree),
        state_partition_specs(),
        states,
        is_leaf=lambda node: isinstance(node, P),
    )
    return jax.device_put(states, shardings)


def make_mesh(args: Args) -> jax.sharding.Mesh | None:
    """The devices the envs are split across; None for one device (no shard_map at all)."""
    if args.distributed:
        jax.distributed.initialize()  # reads the coordinator address etc. from the environment
    devices = jax.devices()
    num_devices = args.num_devices or len(devices)
    if num_devices > len(devices):
        raise ConfigError(
            f"--num-devices {num_devices}: only {len(devices)} {devices[0].platform} device(s) here "
            "(on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N simulates N)"
        )
    if args.num_parallel_envs % num_devices != 0:
        raise ConfigError(f"--num-parallel-envs {args.num_parallel_envs} does not split evenly across {num_devices} devices (--num-devices)")
    per_device_batch = args.batch_size // num_devices
    if per_device_batch % args.num_minibatches_per_epoch != 0:
        raise ConfigError(
            f"--num-minibatches-per-epoch {args.num_minibatches_per_epoch} does not divide each device's batch of "
            f"{per_device_batch} transitions (--num-parallel-envs / --num-devices x --num-env-steps-per-cycle)"
        )
    if args.lstm_training == "bptt" and args.num_parallel_envs // num_devices % args.num_minibatches_per_epoch != 0:
        raise ConfigError(
            f"--lstm-training bptt cuts each device's minibatches from its own whole env sequences, so "
            f"--num-parallel-envs / --num-devices = {args.num_parallel_envs // num_devices} must be divisible by "
            f"--num-minibatches-per-epoch {args.num_minibatches_per_epoch}"
        )
    if num_devices == 1:
        return None
    return jax.make_mesh((num_devices,), (DEVICE_AXIS,), devices=devices[:num_devices])


def stack_seeds(trees: list[Any]) -> Any:
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


# --- reward normalisation (37 details: 30) --------------------------------------------------
# As gym's NormalizeReward (the wrapper of CleanRL's PPO), but inside the jit: the statistics
# live in the TrainState and are updated step by step with the batch of envs, after the rollout.
# (No observation normalisation here: ppo_mlp.py's --norm-obs is for vector observations.)

RUNNING_STATS_INITIAL_COUNT = 1e-4  # gym's RunningMeanStd(epsilon=1e-4)
NORMALIZE_EPS = 1e-8  # in sqrt(var + eps)


class RunningMeanStd(NamedTuple):
    """Running mean and variance of a stream of batches, per feature."""

    mean: jax.Array
    var: jax.Array
    count: jax.Array  # float32, starts at RUNNING_STATS_INITIAL_COUNT


def running_mean_std(shape: tuple[int, ...]) -> RunningMeanStd:
    """Mean 0, variance 1, count 1e-4, as gym's RunningMeanStd starts."""
    ones = jnp.ones(shape, jnp.float32)
    return RunningMeanStd(jnp.zeros(shape, jnp.float32), ones, jnp.float32(RUNNING_STATS_INITIAL_COUNT))


def normalization_stats(args: Args, env: Any, env_params: Any) -> dict[str, RunningMeanStd | None]:
    """The initial reward_stats of a TrainState; None when --norm-reward is off."""
    return {"reward_stats": running_mean_std(()) if args.norm_reward else None}


def update_running_mean_std(stats: RunningMeanStd, batch: jax.Array, axis_name: str | None) -> RunningMeanStd:
    """The parallel-variance update (Chan et al.) with the moments of `batch` (axis 0: the batch),
    as gym's RunningMeanStd.update; under shard_map the batch is every device's share."""
    batch = batch.astype(jnp.float32)
    batch_count = sum_over_devices(jnp.float32(batch.shape[0]), axis_name)
    batch_mean = sum_over_devices(batch.sum(axis=0), axis_name) / batch_count
    batch_var = sum_over_devices(((batch - batch_mean) ** 2).sum(axis=0), axis_name) / batch_count
    delta = batch_mean - stats.mean
    count = stats.count + batch_count
    mean = stats.mean + delta * batch_count / count
    sum_of_squares = stats.var * stats.count + batch_var * batch_count + delta**2 * stats.count * batch_count / count
    return RunningMeanStd(mean, sum_of_squares / count, count)


def normalize_rewards(
    stats: RunningMeanStd | None, env_carry: EnvCarry, transitions: Transition, gamma: float, axis_name: str | None
) -> tuple[RunningMeanStd | None, EnvCarry, jax.Array]:
    """--norm-reward (37 details: 30), step by step as gym's NormalizeReward (gym 0.21-0.25, as
    the 37 details used it): per env, ret = ret * gamma + reward; the variance of ret is updated
    with the batch of N envs; the reward becomes reward / sqrt(var + 1e-8) (no mean subtracted);
    then ret = 0 where the episode ended (done = terminated or truncated). Returns the new stats,
    env_carry with the new discounted_return, and the rewards (T, N) to train on (the raw ones
    when stats is None)."""
    if stats is None:
        return None, env_carry, transitions.reward
    done = jnp.logical_or(transitions.terminated, transitions.truncated)

    def step(carry, step_input):
        stats, discounted_return = carry
        reward, done = step_input
        discounted_return = discounted_return * gamma + reward
        stats = update_running_mean_std(stats, discounted_return, axis_name)
        scaled = reward / jnp.sqrt(stats.var + NORMALIZE_EPS)
        return (stats, jnp.where(done, 0.0, discounted_return)), scaled

    (stats, discounted_return), reward = jax.lax.scan(step, (stats, env_carry.discounted_return), (transitions.reward, done))
    return stats, env_carry._replace(discounted_return=discounted_return), reward


# --- the NaN guard ------------------------------------------------------------------------
# A seed whose loss, gradient or parameters stop being finite keeps its last good parameters
# and applies no update from then on; run() reports it and exits with code 1.

NON_FINITE_CHECKS = ("none", "loss", "gradient", "parameters")  # code 0: every check passed


def first_non_finite(non_finite: jax.Array, loss: jax.Array, grad_norm: jax.Array) -> jax.Array:
    """The code already set, else that of the first check that fails now (0: all finite)."""
    code = jnp.where(
        ~jnp.isfinite(loss),
        NON_FINITE_CHECKS.index("loss"),
        jnp.where(~jnp.isfinite(grad_norm), NON_FINITE_CHECKS.index("gradient"), 0),
    )
    return jnp.where(non_finite > 0, non_finite, code)


def guard_non_finite(state: TrainState, params: Any, opt_state: Any, non_finite: jax.Array) -> TrainState:
    """The state after a cycle's update: the whole cycle is undone if any check failed in it (or
    failed before: a failed seed never changes again), and the seed's first failure is recorded
    with its cycle. One select per cycle, not per minibatch."""
    params_finite = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(params)]))
    non_finite = jnp.where(non_finite > 0, non_finite, jnp.where(params_finite, 0, NON_FINITE_CHECKS.index("parameters")))
    params, opt_state = jax.tree.map(
        lambda new, old: jnp.where(non_finite == 0, new, old), (params, opt_state), (state.params, state.opt_state)
    )
    newly_failed = (state.non_finite == 0) & (non_finite > 0)
    return state._replace(
        params=params,
        opt_state=opt_state,
        non_finite=non_finite,
        non_finite_cycle=jnp.where(newly_failed, state.cycle + 1, state.non_finite_cycle),
    )


def skip_when_every_seed_failed(cycle_of_every_seed: Callable, metric_names: tuple[str, ...]) -> Callable:
    """Once every seed has failed, a cycle only counts itself and logs NaN (costs nothing)."""

    def skip(states: TrainState) -> tuple[TrainState, dict[str, jax.Array]]:
        nan = jnp.full(states.cycle.shape, jnp.nan)
        return states._replace(cycle=states.cycle + 1), {name: nan for name in metric_names}

    def cycle(states: TrainState) -> tuple[TrainState, dict[str, jax.Array]]:
        return jax.lax.cond(jnp.all(states.non_finite > 0), skip, cycle_of_every_seed, states)

    return cycle


# --- metric helpers ---------------------------------------------------------------------


def explained_variance(prediction: jax.Array, target: jax.Array, axis_name: str | None = None) -> jax.Array:
    """1 - Var(target - prediction) / Var(target) over every device's batch; NaN when the
    target is constant."""

    def variance(x):
        mean = mean_over_devices(x.mean(), axis_name)
        return mean_over_devices(((x - mean) ** 2).mean(), axis_name)

    target_variance = variance(target)
    return jnp.where(target_variance == 0, jnp.nan, 1.0 - variance(target - prediction) / target_variance)


def nanmean_or_nan(x: jax.Array, axis_name: str | None = None) -> jax.Array:
    """Mean over the non-NaN entries (finished episodes only) of every device; NaN when there
    are none."""
    count = sum_over_devices(jnp.sum(~jnp.isnan(x)), axis_name)
    total = sum_over_devices(jnp.nansum(x), axis_name)
    return jnp.where(count > 0, total / jnp.maximum(count, 1), jnp.nan)


# --- evaluation and videos -----------------------------------------------------------------
# --eval-every-cycles K: after every K-th cycle and after the last, each seed plays
# --eval-episodes episodes with its current params, inside the jit, on fresh envs of its own and
# with keys folded from TrainState.key (never split from it), so training runs bit for bit as
# without evaluation. --capture-video: at those cycles (only the last one without
# --eval-every-cycles) the episode of seed 0's first eval env is played once more inside the jit,
# recorded step by step, and sent to a host callback that writes RUN_DIR/videos/cycle-<n>.gif.

EVAL_METRIC_NAMES = ("eval/episodic_return", "eval/episodic_length")
EVAL_KEY_TAG = 0x6576616C  # folded into TrainState.key ("eval"): the evaluation's own random stream
DEFAULT_MAX_STEPS = 10_000  # episode cap of the evaluation for envs whose params have no max_steps_in_episode


class EvalCarry(NamedTuple):
    """What the evaluation's steps carry. In `env`, episode_return and episode_length are those
    of each env's first episode, frozen once it has ended."""

    env: EnvCarry
    finished: jax.Array  # (N,) bool: the env's first episode has ended
    key: jax.Array
    num_steps: jax.Array  # steps taken


def eval_metric_names(args: Args) -> tuple[str, ...]:
    return EVAL_METRIC_NAMES if args.eval_every_cycles else ()


def evaluation_due(cycle: jax.Array, args: Args) -> jax.Array:
    """After the last cycle, and after every --eval-every-cycles-th one when it is set."""
    last = cycle == args.num_cycles
    return last | (cycle % args.eval_every_cycles == 0) if args.eval_every_cycles else last


def max_eval_steps(env_params: Any) -> int:
    return int(getattr(env_params, "max_steps_in_episode", DEFAULT_MAX_STEPS))


def start_evaluation(key: jax.Array, env: Any, env_params: Any, args: Args) -> EvalCarry:
    reset_key, key = jax.random.split(key)
    env_carry = reset_envs(reset_key, env, env_params, args.eval_episodes, args)  # zero LSTM carries
    return EvalCarry(env_carry, jnp.zeros((args.eval_episodes,), bool), key, jnp.int32(0))


def eval_step(params: Any, carry: EvalCarry, network: ActorCritic, env: Any, env_params: Any, args: Args) -> EvalCarry:
    """One step of every eval env. The policy is called as in collect_rollout (the only call of
    the evaluation), with the LSTM carry reset where an episode starts and invalid actions masked
    the same way; --eval-greedy takes the argmax of the masked logits, else a sample (Gumbel-max,
    as in training)."""
    env_carry = carry.env
    key, action_key, env_key = jax.random.split(carry.key, 3)
    lstm_carries, logits, _ = network.apply(params, env_carry.lstm_carry, env_carry.obs[None], env_carry.episode_start[None])
    logits = logits[0]
    mask_actions = uses_action_mask(args, env)
    action_mask = jax.vmap(env.action_mask, in_axes=(0, None))(env_carry.env_state, env_params) if mask_actions else None
    noise = 0.0 if args.eval_greedy else jax.random.gumbel(action_key, logits.shape)
    action = jnp.argmax(masked(logits, action_mask) + noise, axis=-1)
    env_keys = jax.random.split(env_key, action.shape[0])
    stepped = step_envs(env, env_keys, env_carry.env_state, action, env_params)
    next_frame, env_state, reward, terminated, truncated, _ = stepped
    done = jnp.logical_or(terminated, truncated)
    running = ~carry.finished
    episode_return = env_carry.episode_return + jnp.where(running, reward.astype(jnp.float32), 0.0)
    env_carry = env_carry._replace(  # the carry reset itself happens in the next forward pass, from episode_start
        env_state=env_state, obs=push_frame(env_carry.obs, next_frame, done), episode_start=done,
        lstm_carry=lstm_carries[0], episode_return=episode_return, episode_length=env_carry.episode_length + running,
    )
    return EvalCarry(env_carry, carry.finished | done, key, carry.num_steps + 1)


def evaluate_policy(
    params: Any, key: jax.Array, network: ActorCritic, env: Any, env_params: Any, args: Args
) -> dict[str, jax.Array]:
    """--eval-episodes fresh envs play with `params` until each has finished its first episode,
    or max_eval_steps. Returns eval/episodic_return and eval/episodic_length: their means over
    the finished episodes (NaN when none finished)."""
    max_steps = max_eval_steps(env_params)
    carry = jax.lax.while_loop(
        lambda carry: ~jnp.all(carry.finished) & (carry.num_steps < max_steps),
        lambda carry: eval_step(params, carry, network, env, env_params, args),
        start_evaluation(key, env, env_params, args),
    )
    finished_only = lambda x: jnp.where(carry.finished, x.astype(jnp.float32), jnp.nan)  # noqa: E731
    return {
        "eval/episodic_return": nanmean_or_nan(finished_only(carry.env.episode_return)),
        "eval/episodic_length": nanmean_or_nan(finished_only(carry.env.episode_length)),
    }


def with_evaluation(
    cycle_of_every_seed: Callable, metric_names: tuple[str, ...], network: ActorCritic, env: Any, env_params: Any,
    args: Args, video_fn: Callable | None,
) -> tuple[Callable, tuple[str, ...]]:
    """The cycle, then on the cycles that are evaluation_due: evaluate_policy for every seed
    (eval/* metrics, NaN on the other cycles), and record_video_episode of seed 0, sent to
    video_fn(cycle, env states, frames, done). Also returns the metric names with eval/* appended. Outside shard_map:
    with several devices the evaluation is one replicated computation, the same on each."""
    names = eval_metric_names(args)
    if not names and video_fn is None:
        return cycle_of_every_seed, metric_names
    evaluate_one_seed = lambda params, key: evaluate_policy(params, key, network, env, env_params, args)  # noqa: E731
    evaluate_every_seed = jax.vmap(evaluate_one_seed) if args.num_seeds > 1 else (  # see vmap_over_seeds
        lambda params, keys: jax.tree.map(lambda x: x[None], evaluate_one_seed(jax.tree.map(lambda x: x[0], params), keys[0]))
    )

    def evaluate(states: TrainState) -> dict[str, jax.Array]:
        keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(states.key, EVAL_KEY_TAG)  # TrainState.key is not consumed
        if video_fn is not None:
            seed_0_params = jax.tree.map(lambda x: x[0], states.params)
            video = record_video_episode(seed_0_params, keys[0], network, env, env_params, args)
            jax.debug.callback(video_fn, states.cycle[0], *video)
        return evaluate_every_seed(states.params, keys) if names else {}

    def no_evaluation(states: TrainState) -> dict[str, jax.Array]:
        return {name: jnp.full(states.cycle.shape, jnp.nan) for name in names}

    def cycle(states: TrainState) -> tuple[TrainState, dict[str, jax.Array]]:
        states, metrics = cycle_of_every_seed(states)
        due = evaluation_due(states.cycle[0], args)
        return states, {**metrics, **jax.lax.cond(due, evaluate, no_evaluation, states)}

    return cycle, metric_names + names


VIDEO_MAX_FRAMES = 1_000  # a video shows at most this many steps of its episode
GIF_FRAME_MS = 60
MINATAR_CELL_PX = 20
# One colour per MinAtar channel (cycled when an env has more channels); empty cells are black.
CHANNEL_COLOURS = [
    (230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48), (145, 30, 180),
    (70, 240, 240), (240, 50, 230), (210, 245, 60), (250, 190, 212),
]


def record_video_episode(params: Any, key: jax.Array, network: ActorCritic, env: Any, env_params: Any, args: Args):
    """The episode of evaluate_policy's first env for this key, step by step as it plays there,
    until it ends or for VIDEO_MAX_FRAMES steps: (VIDEO_MAX_FRAMES, ...) arrays of the env state
    before each step, the frame shown (the newest of the stack) and whether the episode has ended (zeros after its end)."""
    channels = env.observation_space(env_params).shape[-1]  # of one frame
    first_env = lambda carry: (jax.tree.map(lambda x: x[0], without_sticky_actions(carry.env.env_state)), carry.env.obs[0, ..., -channels:])  # noqa: E731
    carry = start_evaluation(key, env, env_params, args)
    buffers = jax.tree.map(lambda x: jnp.zeros((VIDEO_MAX_FRAMES, *x.shape), x.dtype), (*first_env(carry), carry.finished[0]))

    def step(loop: tuple[EvalCarry, Any]) -> tuple[EvalCarry, Any]:
        carry, buffers = loop
        new_carry = eval_step(params, carry, network, env, env_params, args)
        recorded = (*first_env(carry), new_carry.finished[0])
        return new_carry, jax.tree.map(lambda buffer, x: buffer.at[carry.num_steps].set(x), buffers, recorded)

    running = lambda loop: ~loop[0].finished[0] & (loop[0].num_steps < VIDEO_MAX_FRAMES)  # noqa: E731
    return jax.lax.while_loop(running, step, (carry, buffers))[1]


def without_sticky_actions(env_state: Any) -> Any:
    """The wrapped env's own state, which the renderers draw (--sticky-action-prob adds a layer)."""
    return env_state.env_state if isinstance(env_state, StickyState) else env_state


def minatar_image(frame) -> Any:
    from PIL import Image

    frame = np.asarray(frame) > 0.5  # (H, W, C) boolean channels
    image = np.zeros((*frame.shape[:2], 3), np.uint8)
    for channel in range(frame.shape[-1]):  # later channels paint over earlier ones
        image[frame[..., channel]] = CHANNEL_COLOURS[channel % len(CHANNEL_COLOURS)]
    image = image.repeat(MINATAR_CELL_PX, axis=0).repeat(MINATAR_CELL_PX, axis=1)
    return Image.fromarray(image)


def cartpole_image(state, env_params) -> Any:
    from PIL import Image, ImageDraw

    width, height, scale = 480, 240, 480 / (2 * 2.4 * 1.2)
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    ground = 170
    draw.line([(0, ground), (width, ground)], fill="black")
    cart_x = width / 2 + float(state.x) * scale
    draw.rectangle([cart_x - 25, ground - 15, cart_x + 25, ground + 15], fill=(60, 60, 60))
    pole = 2 * float(env_params.length) * scale
    theta = float(state.theta)
    draw.line([(cart_x, ground - 15), (cart_x + pole * math.sin(theta), ground - 15 - pole * math.cos(theta))],
              fill=(200, 120, 60), width=8)
    return image


def acrobot_image(state, env_params) -> Any:
    from PIL import Image, ImageDraw

    size = 300
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    scale = size / 2 / 2.2
    origin = (size / 2, size / 2)
    angle1, angle2 = float(state.joint_angle1), float(state.joint_angle2)
    # Angles are measured from straight down; y grows downwards in the image.
    joint = (origin[0] + scale * math.sin(angle1), origin[1] + scale * math.cos(angle1))
    tip = (joint[0] + scale * math.sin(angle1 + angle2), joint[1] + scale * math.cos(angle1 + angle2))
    draw.line([(0, origin[1] - scale), (size, origin[1] - scale)], fill="black")  # the goal height
    draw.line([origin, joint], fill=(0, 100, 200), width=8)
    draw.line([joint, tip], fill=(0, 100, 200), width=8)
    for point in (origin, joint):
        draw.ellipse([point[0] - 5, point[1] - 5, point[0] + 5, point[1] + 5], fill=(200, 200, 0))
    return image


def frame_renderer(env_id: str, env_params: Any) -> Callable | None:
    """A function (env_state, frame) -> PIL image, or None when we cannot draw this env."""
    if env_id.endswith("-MinAtar"):
        return lambda state, frame: minatar_image(frame)
    if env_id == "CartPole-v1":
        return lambda state, frame: cartpole_image(state, env_params)
    if env_id == "Acrobot-v1":
        return lambda state, frame: acrobot_image(state, env_params)
    return None


def write_gif(path: Path, states: Any, frames: Any, done: Any, render: Callable) -> int:
    """One environment's states and frames (T, ...) up to and including its first done. Returns
    the number of steps shown: Pillow merges identical consecutive frames into one shown longer,
    so the GIF lasts that many GIF_FRAME_MS."""
    done = np.asarray(done)
    length = int(np.argmax(done)) + 1 if done.any() else done.shape[0]
    images = [render(jax.tree.map(lambda x: x[t], states), frames[t]) for t in range(length)]
    images = to_one_palette(images)
    path.parent.mkdir(parents=True, exist_ok=True)
    images[0].save(path, save_all=True, append_images=images[1:], duration=GIF_FRAME_MS, loop=0)
    return length


def to_one_palette(images: list[Any]) -> list[Any]:
    """RGB images -> palette images sharing one palette of every colour they use (our drawings
    use a handful; beyond GIF's 256, the first 256). Pillow would otherwise build a palette for
    each frame: 30 times slower (15 s for a 500-step CartPole episode on a 2-core VM)."""
    from PIL import Image

    colours = sorted({colour for image in images for _, colour in image.getcolors(maxcolors=256) or []})[:256]
    if not colours:  # a frame of more than 256 colours: one adaptive palette, from the first frame
        palette = images[0].quantize(colors=256)
    else:
        palette = Image.new("P", (1, 1))
        palette.putpalette([channel for colour in colours for channel in colour])
    return [image.quantize(palette=palette, dither=Image.Dither.NONE) for image in images]


class VideoRecorder:
    """Host side of the video callback (--capture-video): draws the steps recorded inside the jit
    (record_video_episode) into RUN_DIR/videos/cycle-<n>.gif, and has the logger send it to
    wandb. No JAX computation runs here: one started from inside a callback could wait for the
    very program that waits for the callback. Training waits while a GIF is drawn; a failed
    write is a warning."""

    def __init__(self, render: Callable, run_dir: Path, logger: MetricsLogger):
        self.render = render
        self.video_dir = run_dir / "videos"
        self.logger = logger
        self.last_cycle = -1

    def __call__(self, cycle: Any, states: Any, frames: Any, done: Any) -> None:
        if jax.process_index() != 0 or int(cycle) <= self.last_cycle:  # one writer; each cycle once
            return
        self.last_cycle = int(cycle)
        path = self.video_dir / f"cycle-{self.last_cycle}.gif"
        try:
            write_gif(path, jax.tree.map(np.asarray, states), np.asarray(frames), np.asarray(done), self.render)
        except OSError as error:
            print(f"warning: --capture-video: cannot write {path} ({error}); training goes on", file=sys.stderr)
            return
        self.logger.log_video(path, self.last_cycle)


def make_video_recorder(args: Args, env: Any, env_params: Any, run_dir: Path, logger: MetricsLogger) -> VideoRecorder | None:
    """The video callback with --capture-video, else None; also None, with one warning line, for
    an env we cannot draw."""
    if not args.capture_video:
        return None
    try:
        import PIL  # noqa: F401  (the GIFs are drawn with Pillow)
    except ImportError:
        raise ConfigError("--capture-video needs Pillow: pip install pillow") from None
    render = frame_renderer(args.env_id, env_params)
    if render is None:
        print(f"warning: --capture-video: cannot draw {args.env_id} (supported: *-MinAtar, CartPole-v1, Acrobot-v1); "
              "training goes on without videos", file=sys.stderr)
        return None
    return VideoRecorder(render, run_dir, logger)


# --- host callbacks: metrics rows and checkpoints leave the jit ---------------------------

LOG_ROWS_ENV_STEPS = 8192  # metrics rows leave the jit together, once per this many env steps


class Outbox(NamedTuple):
    """Metrics rows waiting inside the jit for the next host callback (one callback costs more
    than a small cycle on CPU)."""

    rows: jax.Array  # (rows_per_callback, metrics (run_metric_names), seeds)
    row_cycles: jax.Array  # (rows_per_callback,) int
    num_rows: jax.Array  # rows filled


def empty_outbox(args: Args, num_seeds: int, num_metrics: int) -> Outbox:
    rows_per_callback = max(1, LOG_ROWS_ENV_STEPS // args.batch_size)
    return Outbox(
        rows=jnp.zeros((rows_per_callback, num_metrics, num_seeds), jnp.float32),
        row_cycles=jnp.zeros(rows_per_callback, jnp.int32),
        num_rows=jnp.int32(0),
    )


def send_to_host(
    outbox: Outbox,
    states: TrainState,
    metrics: dict[str, jax.Array],
    metric_names: tuple[str, ...],
    args: Args,
    log_fn: Callable | None,
    checkpoint_fn: Callable | None,
    ordered: bool,
) -> Outbox:
    """After each cycle: buffers its metrics row (every --log-every-cycles, every evaluation and
    the last cycle), sends the buffered rows to log_fn(cycles, num_rows, rows) when the buffer is
    full, before a checkpoint and at the end, and sends the states to checkpoint_fn(cycle, states)
    every checkpoint interval, unless a seed has failed (the last good checkpoint stays on disk).
    JAX orders callbacks on one device only (`ordered`); on several, each row and checkpoint
    carries its cycle number, and the checkpointer never goes back in time."""
    cycle = states.cycle[0]
    should_save = (cycle % checkpoint_interval(args) == 0) & ~jnp.any(states.non_finite > 0)
    if log_fn is not None:
        last = cycle == args.num_cycles
        should_log = (cycle % args.log_every_cycles == 0) | evaluation_due(cycle, args)  # the last cycle is due
        values = jnp.stack([metrics[name] for name in metric_names])  # (metrics, seeds)
        outbox = Outbox(
            rows=jnp.where(should_log, outbox.rows.at[outbox.num_rows].set(values), outbox.rows),
            row_cycles=jnp.where(should_log, outbox.row_cycles.at[outbox.num_rows].set(cycle), outbox.row_cycles),
            num_rows=outbox.num_rows + should_log,
        )
        flush_now = (last | should_save) if checkpoint_fn is not None else last
        flush = (outbox.num_rows > 0) & ((outbox.num_rows == outbox.rows.shape[0]) | flush_now)
        jax.lax.cond(
            flush,
            lambda: jax.debug.callback(log_fn, outbox.row_cycles, outbox.num_rows, outbox.rows, ordered=ordered),
            lambda: None,
        )
        outbox = outbox._replace(num_rows=jnp.where(flush, 0, outbox.num_rows))
    if checkpoint_fn is not None:
        host_states = jax.tree.map(key_data_or_array, states)  # callbacks take no PRNG keys
        jax.lax.cond(
            should_save,
            lambda: jax.debug.callback(checkpoint_fn, cycle, host_states, ordered=ordered),
            lambda: None,
        )
    return outbox


def checkpoint_interval(args: Args) -> int:
    return args.checkpoint_every_cycles or max(1, args.num_cycles // 10)


def key_data_or_array(leaf: jax.Array) -> jax.Array:
    return jax.random.key_data(leaf) if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key) else leaf


# --- logging --------------------------------------------------------------------------------


class MetricsLogger:
    """Host side of the metrics callback: metrics.jsonl, a console line and wandb. A failed write
    (disk full, no permission) raises a WriteError, which stops the run."""

    def __init__(self, args: Args, run_dir: Path, metric_names: tuple[str, ...] = METRIC_NAMES):
        self.args = args
        self.metric_names = metric_names  # the order of the rows' values: run_metric_names
        self.seeds = [args.seed + i for i in range(args.num_seeds)]
        self.path = run_dir / "metrics.jsonl"
        self.file: Any = None
        self.wandb_runs: list[Any] = []  # start_wandb_runs: seed 0's first (the only one without --wandb-run-per-seed)
        self.last_time: float | None = None
        self.last_cycle = 0
        self.last_print = 0.0
        self.error: WriteError | None = None
        self.videos: dict[int, dict[str, Any]] = {}  # wandb videos by cycle, waiting for that cycle's row
        self.last_wandb_cycle = 0

    def start(self, cycle: int, wandb_runs: list[Any]) -> None:
        """Called once compiled, just before training: nothing is written before that."""
        self.file = open(self.path, "a")
        self.wandb_runs = wandb_runs
        self.last_time = time.perf_counter()
        self.last_cycle = self.last_wandb_cycle = cycle

    def __call__(self, cycles: Any, num_rows: Any, values: Any) -> None:
        """The first num_rows of cycles (rows,) and values (rows, len(metric_names), num_seeds)."""
        if jax.process_index() != 0:  # multi-host: one writer
            return
        now = time.perf_counter()
        cycles = [int(cycle) for cycle in np.asarray(cycles)[: int(num_rows)]]
        cycle = cycles[-1]
        env_steps = cycle * self.args.batch_size
        elapsed = now - (self.last_time if self.last_time is not None else now)
        sps = (cycle - self.last_cycle) * self.args.batch_size * self.args.num_seeds / max(elapsed, 1e-9)
        self.last_time, self.last_cycle = now, cycle

        # Plain Python floats, NaN -> None: this runs while the device waits, so it avoids
        # per-value NumPy calls (README: Performance).
        rows = np.asarray(values, dtype=np.float64)[: len(cycles)].transpose(0, 2, 1).tolist()  # (rows, seeds, metrics)
        lines = []
        for row_cycle, row in zip(cycles, rows):
            for seed, seed_values in zip(self.seeds, row):
                line = {"cycle": row_cycle, "env_steps": row_cycle * self.args.batch_size, "seed": seed, "charts/SPS": sps}
                line.update((name, value if math.isfinite(value) else None) for name, value in zip(self.metric_names, seed_values))
                lines.append(json.dumps(line))
        try:
            self.file.write("\n".join(lines) + "\n")
            self.file.flush()
        except OSError as error:
            self.error = WriteError(f"cannot write {self.path}: {error}; the run stopped")
            raise self.error from None
        if self.wandb_runs:  # every row, against its env steps
            for row_cycle, row in zip(cycles, rows):
                row_env_steps = row_cycle * self.args.batch_size
                logs = self.wandb_logs(row, row_env_steps, sps)
                for video_cycle in [video_cycle for video_cycle in self.videos if video_cycle <= row_cycle]:
                    logs[0].update(self.videos.pop(video_cycle))  # to seed 0's run
                for wandb_run, log in zip(self.wandb_runs, logs):
                    wandb_run.log(log, step=row_env_steps)
                self.last_wandb_cycle = row_cycle

        if now - self.last_print >= 1.0 or cycle == self.args.num_cycles:
            self.last_print = now
            mean = self.seed_means(rows[-1])
            episodic_return = mean["charts/episodic_return"]
            print(
                f"cycle {cycle}/{self.args.num_cycles} | env steps {env_steps:,} | SPS {sps:,.0f} | "
                f"return {'-' if episodic_return is None else f'{episodic_return:.2f}'} | "
                f"policy loss {fmt(mean['losses/policy_loss'])} | value loss {fmt(mean['losses/value_loss'])} | "
                f"entropy {fmt(mean['losses/entropy'])} | approxkl3 {fmt(mean['losses/actor_approxkl3'])}"
                + "".join(f" | {name} {fmt(mean[name])}" for name in console_env_metrics(self.metric_names))
                + (f" | eval return {fmt(mean['eval/episodic_return'])}" if mean.get("eval/episodic_return") is not None else ""),
                flush=True,
            )

    def wandb_logs(self, row: list[list[float]], env_steps: int, sps: float) -> list[dict[str, float]]:
        """What each wandb run logs of one row (seeds, metrics), finite values only. Per seed
        (--wandb-run-per-seed): the seed's values under the plain names. One run: the mean over
        seeds under the plain names and, with several seeds, each seed's under seed_<seed>/.
        `global_step` (env steps per seed) is the x-axis that CleanRL's runs, and so
        openrlbenchmark, use; charts/SPS counts every seed's steps, as in metrics.jsonl."""
        common = {"global_step": env_steps, "charts/SPS": sps}
        if self.args.wandb_run_per_seed:
            return [{**common, **self.finite(seed_values)} for seed_values in row]
        log = {**common, **{name: value for name, value in self.seed_means(row).items() if value is not None}}
        if self.args.num_seeds > 1:
            for seed, seed_values in zip(self.seeds, row):
                log.update(self.finite(seed_values, prefix=f"seed_{seed}/"))
        return [log]

    def finite(self, values: list[float], prefix: str = "") -> dict[str, float]:
        return {prefix + name: value for name, value in zip(self.metric_names, values) if math.isfinite(value)}

    def log_video(self, path: Path, cycle: int) -> None:
        """A video (--capture-video) to wandb, with --track, in seed 0's run: at the env steps of its
        cycle, with that cycle's metrics row when the row is still to come, else at once (wandb's
        steps only grow)."""
        if not self.wandb_runs:
            return
        import wandb

        video = {"media/video": wandb.Video(str(path), format="gif")}
        if cycle > self.last_wandb_cycle:
            self.videos[cycle] = video
        else:
            self.wandb_runs[0].log(video)

    def seed_means(self, row: list[list[float]]) -> dict[str, float | None]:
        """Each metric's mean over the seeds where it is finite; None where it is nowhere."""
        columns = [[value for value in column if math.isfinite(value)] for column in zip(*row)]
        return {name: sum(column) / len(column) if column else None for name, column in zip(self.metric_names, columns)}

    def close(self) -> None:
        for cycle, video in sorted(self.videos.items()):  # a video whose row never came
            self.wandb_runs[0].log(video, step=cycle * self.args.batch_size)
        self.videos = {}
        try:
            self.file.close()
        except OSError:
            if self.error is None:  # else: the rows that failed to write, already reported
                raise


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def final_returns(args: Args, episodic_return: np.ndarray) -> list[float | None]:
    """Per seed: mean of the per-cycle episodic returns over the last 10% of cycles (cycles in
    which no episode finished are left out)."""
    num_last = max(1, math.ceil(0.1 * args.num_cycles))
    last = episodic_return[-num_last:]  # (cycles, seeds)
    result = []
    for seed_index in range(last.shape[1]):
        values = last[:, seed_index]
        values = values[~np.isnan(values)]
        result.append(float(values.mean()) if values.size else None)
    return result


def experiment_name(args: Args) -> str:
    """<env>__<exp-name>: the default wandb group."""
    return f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', args.env_id)}__{args.exp_name}"


def run_name(args: Args, seed: int) -> str:
    """<env>__<exp-name>__<seed>__<time>: the default run dir's name, and a per-seed wandb run's."""
    return f"{experiment_name(args)}__{seed}__{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def final_eval_returns(args: Args, metrics: dict[str, Any]) -> list[float | None]:
    """Per seed: eval/episodic_return at the last cycle (always an evaluation); None per seed
    without --eval-every-cycles or when no eval episode finished."""
    if not args.eval_every_cycles:
        return [None] * args.num_seeds
    last = np.asarray(metrics["eval/episodic_return"])[-1]  # (seeds,)
    return [float(value) if np.isfinite(value) else None for value in last]


def default_run_dir(args: Args) -> Path:
    return Path("runs") / run_name(args, args.seed)


def script_info() -> dict[str, str]:
    """Which file wrote a run: args.json records it, so that the tools in scripts/ load this
    file (or a renamed copy of it) to read the run."""
    return {"script": Path(__file__).name, "script_path": str(Path(__file__).resolve())}


def git_info() -> dict[str, Any]:
    """The commit of the git checkout this file lives in, and whether its tracked files differ
    from it; empty outside a checkout, or without git. wandb's config records it."""
    import subprocess

    def git(*words: str) -> subprocess.CompletedProcess:
        folder = Path(__file__).resolve().parent
        return subprocess.run(["git", *words], cwd=folder, capture_output=True, text=True, timeout=10)

    try:
        commit, status = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):  # no git, or it hangs
        return {}
    if commit.returncode != 0 or status.returncode != 0:
        return {}
    return {"git_commit": commit.stdout.strip(), "git_dirty": bool(status.stdout.strip())}


def args_from_json(path: Path) -> Args:
    """The Args of a run. An unreadable file, or one written by another script, is a ConfigError."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:  # ValueError: not UTF-8, or not JSON
        raise ConfigError(f"{path} is unreadable ({error})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is damaged: it holds no arguments")
    unknown = sorted(set(data) - {field.name for field in dataclasses.fields(Args)} - set(script_info()))
    if unknown:
        raise ConfigError(
            f"{path} was written by {data.get('script', 'another script')}, not {Path(__file__).name} "
            f"(it has {', '.join(unknown)})"
        )
    for key in script_info():
        data.pop(key, None)
    data["wandb_tags"] = tuple(data.get("wandb_tags", Args.wandb_tags))
    data["impala_channels"] = tuple(data.get("impala_channels", Args.impala_channels))
    return Args(**data)


def load_params(run_dir: str | Path) -> tuple[Args, Any]:
    """The final parameters of every seed (leading seed axis), from RUN_DIR alone."""
    run_dir = Path(run_dir)
    args = args_from_json(run_dir / "args.json")
    env, env_params = make_env(args.env_id)
    network = make_network(args, env.action_space(env_params).n)
    obs_shape = stacked_obs_shape(env, env_params, args.frame_stack)
    template = init_params(network, jax.random.key(0), args, obs_shape)
    template = stack_seeds([template] * args.num_seeds)
    path = run_dir / "params.msgpack"
    try:
        params = flax.serialization.from_bytes(template, path.read_bytes())
    except Exception as error:  # msgpack and flax raise several kinds for a damaged file
        raise ConfigError(f"{path} is damaged ({type(error).__name__}: {error})") from None
    if jax.tree.map(np.shape, params) != jax.tree.map(np.shape, template):
        raise ConfigError(f"{path} is damaged: its shapes do not match {run_dir / 'args.json'}")
    return args, params


# --- CPU settings -------------------------------------------------------------------------
# Why conv3x3_for_cpu: XLA:CPU rewrites convolutions into the one layout its libraries take
# (NHWC, HWIO) only in the program's entry computation, not inside a loop body; there, the
# backward convolutions stay in other layouts and run as naive loops (README: Performance). Here every
# convolution, forward and both gradients, is written in that layout already.

NHWC_HWIO = ("NHWC", "HWIO", "NHWC")


def nhwc_conv(x: jax.Array, kernel: jax.Array, padding: Any) -> jax.Array:
    return jax.lax.conv_general_dilated(x, kernel, (1, 1), padding, dimension_numbers=NHWC_HWIO)


CONV3X3_PADS = {"SAME": 1, "VALID": 0}  # zeros added on each side of a 3x3 stride-1 convolution's input


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def nhwc_conv_3x3(x: jax.Array, kernel: jax.Array, pad: int) -> jax.Array:
    """A 3x3 stride-1 convolution with `pad` zeros on each side: 1 is SAME, 0 is VALID."""
    return nhwc_conv(x, kernel, ((pad, pad), (pad, pad)))


def nhwc_conv_3x3_forward(x: jax.Array, kernel: jax.Array, pad: int):
    return nhwc_conv_3x3(x, kernel, pad), (x, kernel)


def nhwc_conv_3x3_backward(pad: int, residuals, d_out):
    x, kernel = residuals
    d_x = nhwc_conv(d_out, jnp.flip(kernel, (0, 1)).swapaxes(2, 3), ((2 - pad, 2 - pad), (2 - pad, 2 - pad)))
    # the kernel gradient as a convolution with the input channels as batch and the batch as features
    d_kernel = nhwc_conv(x.transpose(3, 1, 2, 0), d_out.transpose(1, 2, 0, 3), ((pad, pad), (pad, pad)))
    return d_x, d_kernel.transpose(1, 2, 0, 3)


nhwc_conv_3x3.defvjp(nhwc_conv_3x3_forward, nhwc_conv_3x3_backward)


def shifted_matmul_3x3(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """A 3x3 SAME convolution as 9 shifted slices and one matmul."""
    height, width = x.shape[1:3]
    padded = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    columns = jnp.concatenate([padded[:, i:i + height, j:j + width] for i in range(3) for j in range(3)], axis=-1)
    return columns @ kernel.reshape(-1, kernel.shape[-1])


def conv3x3_for_cpu(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                    dimension_numbers=None, feature_group_count=1, precision=None) -> jax.Array:
    """nn.Conv's convolution on CPU, for its 3x3 stride-1 convs, SAME (IMPALA) or VALID (Nature):
    fast inside loops (see above). At 2x2 or less XLA swaps a SAME convolution's operands into a
    naive form: a matmul then."""
    assert rhs.shape[:2] == (3, 3) and tuple(window_strides) == (1, 1) and feature_group_count == 1
    pad = CONV3X3_PADS.get(padding) if isinstance(padding, str) else None
    if pad == 1 and min(lhs.shape[1:3]) <= 2:
        return shifted_matmul_3x3(lhs, rhs)
    if pad is None or jax.typeof(lhs).manual_axis_type.varying:  # under shard_map (simulated CPU devices): XLA's own
        return jax.lax.conv_general_dilated(lhs, rhs, window_strides, padding, dimension_numbers=NHWC_HWIO)
    return nhwc_conv_3x3(lhs, rhs, pad)


def avoid_cpu_qr_deadlock() -> None:
    """jaxlib 0.10 on CPU can deadlock in executables with several batched QR factorizations
    (flax's orthogonal init under vmap; init_params also runs one seed at a time for this). This
    CPU-only scheduler flag avoids it at full speed. XLA reads XLA_FLAGS when JAX first starts a
    backend, so this must run before any computation; it leaves a user's own setting alone."""
    name = "--xla_cpu_enable_concurrency_optimized_scheduler"
    if name not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {name}=false".strip()


def use_unrolled_threefry_on_cpu() -> None:
    """JAX lowers its threefry PRNG to a rolled 5-iteration loop on CPU (to save compile time),
    and every env step draws random numbers inside our sequential rollout loop. The unrolled
    lowering that GPUs use gives the same bits and runs faster (README: Performance). This
    touches a private JAX API, so it is skipped silently when that API moves."""
    try:
        from jax._src.interpreters import mlir
        from jax._src.random import threefry2x32

        rule = threefry2x32._threefry2x32_lowering_rule
        mlir.register_lowering(threefry2x32.threefry2x32_p, rule, platform="cpu")
    except (ImportError, AttributeError):
        pass


# --- checkpoints and resume -----------------------------------------------------------


# Args that may differ when a run is resumed: they change what is logged, not what is trained.
RESUMABLE_FIELDS = (
    "track", "wandb_project", "wandb_entity", "wandb_group", "wandb_tags", "wandb_run_per_seed", "wandb_mode", "run_dir",
    "log_every_cycles", "checkpoint_every_cycles", "keep_checkpoints", "resume", "exp_name",
    "eval_every_cycles", "eval_episodes", "eval_greedy", "capture_video",  # training is the same with or without them
)


class WriteError(RuntimeError):
    """A checkpoint or metrics.jsonl could not be written (disk full, no permission). Raised in a
    host callback, it stops the compiled run; `main` prints it as one line and exits with code 1."""


def without_write_error_tracebacks(record: logging.LogRecord) -> bool:
    """A logging filter for jax.debug.callback, which logs the traceback of whatever its callback
    raises: a WriteError gets its one line from `main` instead."""
    return not (record.exc_info and isinstance(record.exc_info[1], WriteError))


def checksum(arrays: dict[str, np.ndarray]) -> str:
    """SHA-256 of every array's name, dtype, shape and bytes."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        digest.update(f"{name} {array.dtype.str} {array.shape}\n".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def checkpoint_cycle(path: Path) -> int | None:
    """The cycle in a checkpoint's file name (checkpoint-<cycle>.npz); None for other names."""
    number = path.name.removeprefix("checkpoint-").removesuffix(".npz")
    return int(number) if number.isdigit() else None


def read_checkpoint(path: Path) -> dict[str, np.ndarray]:
    """The arrays of a checkpoint that validates: it opens, and holds its cycle (the one in its
    name) and the checksum of its arrays. Otherwise a ValueError says what is wrong."""
    try:
        with np.load(path) as saved:
            arrays = {name: saved[name] for name in saved.files}
    except Exception as error:  # a damaged zip raises many kinds: BadZipFile, EOFError, NotImplementedError...
        raise ValueError(f"unreadable: {type(error).__name__}: {error}") from None
    stored = arrays.pop("checksum", None)
    if stored is None or "cycle" not in arrays:
        raise ValueError("it has no checksum or no cycle")
    if str(stored) != checksum(arrays):
        raise ValueError("its checksum does not match its contents")
    if arrays["cycle"].shape != () or int(arrays["cycle"]) != checkpoint_cycle(path):
        raise ValueError(f"it holds cycle {arrays['cycle']}, not the one in its name")
    return arrays


class Checkpointer:
    """Host side of the checkpoint callback: the full training state of every seed (params,
    optimizer state, env states, RNG keys, counters) in RUN_DIR/checkpoint-<cycle>.npz, with its
    cycle and a checksum, for the newest `keep` checkpoints. Each write goes to a temporary file
    that is atomically renamed, so a kill mid-write keeps the previous ones; a failed write
    (disk full, no permission) raises a WriteError, which stops the run."""

    def __init__(self, run_dir: Path, keep: int):
        self.run_dir = run_dir
        self.keep = keep
        self.last_saved_cycle = -1
        self.error: WriteError | None = None
        self.restored: tuple[Path, dict[str, np.ndarray]] | None = None  # set by read_newest_valid

    def __call__(self, cycle: Any, host_states: Any) -> None:
        if jax.process_index() != 0 or int(cycle) <= self.last_saved_cycle:  # one writer; never older
            return
        self.last_saved_cycle = int(cycle)
        arrays = {f"leaf_{index}": np.asarray(leaf) for index, leaf in enumerate(jax.tree.leaves(host_states))}
        arrays["cycle"] = np.asarray(cycle)
        path = self.run_dir / f"checkpoint-{int(cycle)}.npz"
        temporary = path.with_suffix(".npz.tmp")
        try:
            with open(temporary, "wb") as file:
                np.savez(file, checksum=np.asarray(checksum(arrays)), **arrays)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
            for old in self.paths()[self.keep :]:
                old.unlink()
        except OSError as error:
            with contextlib.suppress(OSError):
                temporary.unlink()
            self.error = WriteError(f"cannot write {path}: {error}; the run stopped, its earlier checkpoints are intact")
            raise self.error from None

    def paths(self) -> list[Path]:
        """The checkpoints in the run dir, newest first."""
        found = [(checkpoint_cycle(path), path) for path in self.run_dir.glob("checkpoint-*.npz")]
        return [path for cycle, path in sorted(found, reverse=True) if cycle is not None]

    def read_newest_valid(self) -> None:
        """Reads the newest checkpoint that validates, for `load`, with one warning line for each
        newer one that does not. None at all is a ConfigError."""
        damaged = []
        for path in self.paths():
            try:
                self.restored = path, read_checkpoint(path)
            except ValueError as error:
                damaged.append(f"{path} is damaged ({error})")
                continue
            for text in damaged:
                print(f"warning: {text}; resuming from cycle {checkpoint_cycle(path)} ({path.name})", file=sys.stderr)
            return
        if not damaged:
            raise ConfigError(f"--resume {self.run_dir}: no checkpoint was written before it stopped; start it again")
        raise ConfigError(f"--resume {self.run_dir}: no checkpoint validates: {'; '.join(damaged)}")

    def load(self, template: TrainState) -> tuple[TrainState, int]:
        """The states read by read_newest_valid, shaped and typed like `template` (freshly
        initialised states)."""
        path, arrays = self.restored
        template_leaves, treedef = jax.tree.flatten(template)
        if len(arrays) != len(template_leaves) + 1:
            raise ConfigError(f"--resume: {path} does not match this script's training state")
        leaves = []
        for index, like in enumerate(template_leaves):
            data = arrays.get(f"leaf_{index}")
            if data is None or data.shape != key_data_or_array(like).shape:
                raise ConfigError(f"--resume: {path} does not match this script's training state")
            if jnp.issubdtype(like.dtype, jax.dtypes.prng_key):
                leaves.append(jax.random.wrap_key_data(data, impl=jax.random.key_impl(like)))
            else:
                leaves.append(jnp.asarray(data, like.dtype))
        return jax.tree.unflatten(treedef, leaves), int(arrays["cycle"])

    def drop_after(self, cycle: int) -> None:
        """On resume: the checkpoints after `cycle` (damaged ones it fell back past) and leftover
        temporary files go, as the metrics rows after it do."""
        for path in self.paths():
            if checkpoint_cycle(path) > cycle:
                path.unlink()
        for path in self.run_dir.glob("checkpoint-*.npz.tmp"):
            path.unlink()


def prepare_resume(args: Args) -> tuple[Path, Checkpointer]:
    """Checks that --resume can continue the run in that folder, and reads its newest checkpoint
    that validates. Nothing in the folder changes here."""
    run_dir = Path(args.resume)
    if not (run_dir / "args.json").exists():
        raise ConfigError(f"--resume {run_dir}: no args.json there, so no run to resume")
    saved = args_from_json(run_dir / "args.json")
    for field in dataclasses.fields(Args):
        if field.name not in RESUMABLE_FIELDS and getattr(args, field.name) != getattr(saved, field.name):
            raise ConfigError(
                f"--resume {run_dir}: {flag(field.name)} is {getattr(args, field.name)!r} here but "
                f"{getattr(saved, field.name)!r} in the run; only logging flags may change"
            )
    if (run_dir / "summary.json").exists():
        raise ConfigError(f"--resume {run_dir}: that run already finished")
    read_metrics_rows(run_dir / "metrics.jsonl")
    checkpointer = Checkpointer(run_dir, args.keep_checkpoints)
    checkpointer.read_newest_valid()
    return run_dir, checkpointer


def read_metrics_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of metrics.jsonl. A last line without its newline was torn by a kill mid-write:
    it is left out (a resumed run logs it again). Any other line that is not a row is a ConfigError."""
    try:
        text = path.read_text()
    except (OSError, ValueError) as error:  # ValueError: not UTF-8
        raise ConfigError(f"--resume: {path} is unreadable ({error})") from None
    rows = []
    for number, line in enumerate(text.split("\n")[:-1], start=1):  # [-1]: after the last newline
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not (isinstance(row, dict) and all(name in row for name in ("cycle", "seed", *METRIC_NAMES))):
            raise ConfigError(f"--resume: {path} line {number} is damaged: {line[:40]!r}")
        rows.append(row)
    return rows


def keep_metrics_up_to(run_dir: Path, last_cycle: int) -> list[dict[str, Any]]:
    """Drops metrics.jsonl rows logged after the checkpoint (they are logged again on resume)
    and returns the rows kept."""
    path = run_dir / "metrics.jsonl"
    kept = [row for row in read_metrics_rows(path) if row["cycle"] <= last_cycle]
    temporary = path.with_suffix(".jsonl.tmp")
    temporary.write_text("".join(json.dumps(row) + "\n" for row in kept))
    os.replace(temporary, path)
    return kept


def run(args: Args) -> dict[str, Any]:
    """Validates, trains (or resumes), and writes the run dir. Returns the summary."""
    validate_args(args)
    avoid_cpu_qr_deadlock()
    use_unrolled_threefry_on_cpu()
    env, env_params = make_env(args.env_id, args.sticky_action_prob, args.optimistic_reset_ratio)
    check_torso_fits(args, stacked_obs_shape(env, env_params, args.frame_stack))
    mesh = make_mesh(args)
    if args.resume:
        run_dir, checkpointer = prepare_resume(args)
    else:
        run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(args)
        if (run_dir / "metrics.jsonl").exists():
            raise ConfigError(f"--run-dir {run_dir} already holds a run; choose another folder, or --resume it")
        checkpointer = Checkpointer(run_dir, args.keep_checkpoints)

    start = time.perf_counter()
    logger = MetricsLogger(args, run_dir, run_metric_names(env, env_params) + eval_metric_names(args))
    video_recorder = make_video_recorder(args, env, env_params, run_dir, logger)  # None without --capture-video
    init, train = make_train(args, env, env_params, mesh, video_recorder)
    states = stack_seeds([init(args.seed + i) for i in range(args.num_seeds)])
    start_cycle = 0
    if args.resume:
        states, start_cycle = checkpointer.load(states)
    states = place_on_mesh(states, mesh)
    train_jit = jax.jit(lambda states: train(states, logger, checkpointer, start_cycle), donate_argnums=0)
    compiled = train_jit.lower(states).compile()
    compile_seconds = time.perf_counter() - start
    devices = "" if mesh is None else f" on {mesh.size} devices"
    print(f"compiled in {compile_seconds:.1f} s{devices}", flush=True)

    # Nothing is written before this point: bad input and compile errors leave no run dir.
    kept_rows = []
    if args.resume:
        kept_rows = keep_metrics_up_to(run_dir, start_cycle)
        checkpointer.drop_after(start_cycle)
        print(f"resuming {run_dir} from cycle {start_cycle}", flush=True)
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "args.json").write_text(json.dumps({**script_info(), **dataclasses.asdict(args)}, indent=2) + "\n")
    wandb_runs = start_wandb_runs(args, run_dir) if args.track else []
    print(f"run dir: {run_dir}  |  {args.num_cycles} cycles x {args.batch_size} env steps x {args.num_seeds} seeds", flush=True)
    if args.lstm_training == "stored":
        carry_bytes = args.batch_size * args.carry_size * 4  # T * N * 2 * lstm_size float32s per LSTM
        print(f"--lstm-training stored keeps {carry_bytes / 2**20:.1f} MiB of LSTM carries per seed", flush=True)

    logger.start(start_cycle, wandb_runs)
    logging.getLogger("jax._src.debugging").addFilter(without_write_error_tracebacks)
    run_start = time.perf_counter()
    try:
        states, metrics = compiled(states)
        jax.block_until_ready((states, metrics))
    except jax.errors.JaxRuntimeError:
        write_error = checkpointer.error or logger.error
        if write_error is None:
            raise
        raise write_error from None
    finally:
        logger.close()
    run_seconds = time.perf_counter() - run_start

    episodic_return = np.full((args.num_cycles, args.num_seeds), np.nan)
    seed_index = {args.seed + i: i for i in range(args.num_seeds)}
    for row in kept_rows:
        if row["charts/episodic_return"] is not None:
            episodic_return[row["cycle"] - 1, seed_index[row["seed"]]] = row["charts/episodic_return"]
    episodic_return[start_cycle:] = np.asarray(metrics["charts/episodic_return"])
    returns = final_returns(args, episodic_return)
    finite = [value for value in returns if value is not None]
    eval_returns = final_eval_returns(args, metrics)
    finite_eval = [value for value in eval_returns if value is not None]
    failures = {
        args.seed + i: {"cycle": int(cycle), "non_finite": NON_FINITE_CHECKS[int(check)]}
        for i, (cycle, check) in enumerate(zip(np.asarray(states.non_finite_cycle), np.asarray(states.non_finite)))
        if cycle > 0
    }
    summary = {
        "sps": (args.num_cycles - start_cycle) * args.batch_size * args.num_seeds / run_seconds,
        "compile_seconds": compile_seconds,
        "train_seconds": run_seconds,
        "total_seconds": time.perf_counter() - start,
        "env_steps_per_seed": args.num_cycles * args.batch_size,
        "num_seeds": args.num_seeds,
        "resumed_from_cycle": start_cycle,
        "final_episodic_return": float(np.mean(finite)) if finite else None,
        "final_episodic_return_per_seed": returns,
        "final_eval_return": float(np.mean(finite_eval)) if finite_eval else None,  # --eval-every-cycles
        "final_eval_return_per_seed": eval_returns,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
        "peak_device_memory_mb": peak_device_memory_mb(),
        "failures": failures,
    }
    (run_dir / "params.msgpack").write_bytes(flax.serialization.to_bytes(states.params))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    finish_wandb_runs(args, wandb_runs, summary)
    print(
        f"done: {summary['sps']:,.0f} env steps/s, compile {compile_seconds:.1f} s, "
        f"final return {fmt(summary['final_episodic_return'])}"
        + (f", final eval return {fmt(summary['final_eval_return'])}" if args.eval_every_cycles else ""),
        flush=True,
    )
    for seed, failure in failures.items():
        print(
            f"error: seed {seed}: non-finite {failure['non_finite']} at cycle {failure['cycle']}; no update was "
            f"applied from then on. {run_dir}/params.msgpack holds its last good parameters.",
            file=sys.stderr,
        )
    return summary


def start_wandb_runs(args: Args, run_dir: Path) -> list[Any]:
    """The wandb runs, seed 0's first: one per seed with --wandb-run-per-seed (named run_name,
    its seed in the config), else one named after the run dir. Each config holds every arg,
    the script and git_info; the group defaults to experiment_name. Each run's id is kept in
    RUN_DIR (wandb_id.txt, or wandb_id_seed_<seed>.txt), so that --resume continues it."""
    import wandb

    config = {**dataclasses.asdict(args), **script_info(), **git_info()}
    seeds = [args.seed + i for i in range(args.num_seeds)] if args.wandb_run_per_seed else [None]
    wandb_runs = []
    for seed in seeds:
        id_file = run_dir / ("wandb_id.txt" if seed is None else f"wandb_id_seed_{seed}.txt")
        resumed_id = id_file.read_text().strip() if id_file.exists() else None
        name = run_dir.name if seed is None else run_name(args, seed)
        wandb_run = wandb.init(
            project=args.wandb_project,
            entity=args.wandb_entity,
            group=args.wandb_group or experiment_name(args),
            tags=list(args.wandb_tags),
            name=None if resumed_id and seed is not None else name,  # a resumed seed's run keeps its first name
            mode=args.wandb_mode,
            dir=str(run_dir),
            config=config if seed is None else {**config, "seed": seed},
            id=resumed_id,
            resume="allow",
            reinit="create_new",  # several runs at once in this process
        )
        id_file.write_text(wandb_run.id)
        wandb_runs.append(wandb_run)
    return wandb_runs


def finish_wandb_runs(args: Args, wandb_runs: list[Any], summary: dict[str, Any]) -> None:
    """The run summary into each wandb run (a per-seed run gets its seed's final return and
    failure), then finish them."""
    for index, wandb_run in enumerate(wandb_runs):
        values = dict(summary)
        if args.wandb_run_per_seed:
            values["final_episodic_return"] = values.pop("final_episodic_return_per_seed")[index]
            values["failure"] = values.pop("failures").get(args.seed + index)
            values["final_eval_return"] = values.pop("final_eval_return_per_seed")[index]
        wandb_run.summary.update({key: value for key, value in values.items() if value is not None})
        wandb_run.finish()


def peak_device_memory_mb() -> float | None:
    """The accelerator's peak memory in use by this process (None where the backend does not tell,
    as on CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats["peak_bytes_in_use"] / 2**20 if "peak_bytes_in_use" in stats else None


def parse_args(argv: list[str] | None = None) -> Args:
    """tyro, with its boxed parse errors folded into the one-line `error: ...` (exit code 2).
    With --resume RUN_DIR, the run's args.json gives the defaults."""
    argv = sys.argv[1:] if argv is None else list(argv)
    default = None
    for index, word in enumerate(argv):
        resume_dir = argv[index + 1] if word == "--resume" and index + 1 < len(argv) else None
        resume_dir = word.partition("=")[2] if word.startswith("--resume=") else resume_dir
        if resume_dir and (Path(resume_dir) / "args.json").exists():
            default = dataclasses.replace(args_from_json(Path(resume_dir) / "args.json"), resume=resume_dir)
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return tyro.cli(Args, args=argv, default=default)
    except SystemExit as exit_request:
        if exit_request.code in (0, None):
            raise
        # The box is: a title line, the message, a rule, then help text. Keep the message.
        lines = [line.strip(" │╭╮╰╯") for line in captured.getvalue().splitlines()]
        is_rule = lambda text: set(text) <= set("-─")  # noqa: E731
        body = [text for text in lines[1:] if text]
        body = body[1:] if body and is_rule(body[0]) else body
        message = " ".join(itertools.takewhile(lambda text: not is_rule(text), body))
        print(f"error: {message or captured.getvalue().strip()}", file=sys.stderr)
        raise SystemExit(2) from None


def main(argv: list[str] | None = None) -> int:
    try:
        summary = run(parse_args(argv))
    except ConfigError as error:  # bad input: nothing was written
        print(f"error: {error}", file=sys.stderr)
        return 2
    except (WriteError, OSError) as error:  # the run dir could not be written (disk full, no permission)
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
