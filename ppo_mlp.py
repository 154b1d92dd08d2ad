"""PPO with separate MLP actor and critic, for gymnax environments with discrete actions.

One file, no package: copy it and own it. The whole training run (rollout, GAE, every epoch and
minibatch, all seeds) is one `jax.jit` over `jax.lax.scan`; metrics leave it through a host
callback, to the console, `RUN_DIR/metrics.jsonl` and (with `--track`) wandb.

    python ppo_mlp.py --env-id CartPole-v1 --num-seeds 5

Sections: Args | environment | containers | network | algorithm | make_train | logging | main.
"37 details" item numbers refer to Huang et al. (2022),
https://iclr-blog-track.github.io/2022/03/25/ppo-implementation-details/
"""

from __future__ import annotations

import os

# jaxlib 0.10 on CPU can deadlock in executables with several batched QR factorizations (flax's
# orthogonal init under vmap). This scheduler flag avoids it at full speed; it is a CPU-only flag
# and does nothing on GPU. We only set it when the user has not set XLA_FLAGS themselves.
if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_cpu_enable_concurrency_optimized_scheduler=false"

import contextlib
import dataclasses
import datetime
import difflib
import importlib
import io
import itertools
import json
import math
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
from jax.flatten_util import ravel_pytree
from jax.sharding import PartitionSpec as P

# ======================================================================================
# Args
# ======================================================================================


@dataclasses.dataclass(frozen=True)
class Args:
    """PPO for gymnax environments with vector observations and discrete actions."""

    # --- experiment -----------------------------------------------------------------
    env_id: str = "CartPole-v1"
    """a gymnax id (e.g. CartPole-v1, Acrobot-v1), or `module.path:Name` where Name is a gymnax
    Environment subclass or a zero-argument factory returning (env, env_params)"""
    exp_name: str = Path(__file__).stem
    """name of this experiment, used in the default run dir and the wandb run name"""
    seed: int = 1
    """seed of the first run; seed i uses seed + i"""
    num_seeds: int = 1
    """independent seeds trained together in one compiled program (jax.vmap)"""
    num_total_env_steps: int = 500_000
    """environment steps per seed"""

    # --- rollout (37 details: 1 vectorized env) ---------------------------------------
    num_parallel_envs: int = 4
    """parallel environments per seed"""
    num_env_steps_per_cycle: int = 128
    """steps each env takes per rollout; one cycle = one rollout + its update epochs"""
    reset_envs_each_cycle: bool = False
    """UED style: every cycle starts from freshly reset environments; episodes never span cycles"""
    bootstrap_truncated: bool = True
    """a truncated (time-limit) step bootstraps from V(final_observation); off: treated as a
    termination, as in most older PPO code"""

    # --- optimisation (37 details: 3 Adam eps, 4 LR annealing, 6 minibatches) --------
    num_epochs_per_cycle: int = 4
    """passes over the rollout per cycle (K epochs)"""
    num_minibatches_per_epoch: int = 4
    """minibatches each epoch is cut into"""
    lr: float = 2.5e-4
    """Adam learning rate"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to exactly 0 at the run's last gradient step"""
    adam_eps: float = 1e-5
    """Adam epsilon (PyTorch's default is 1e-8; the PPO baselines use 1e-5)"""
    max_grad_norm: float = 0.5
    """clip gradients to this global norm (37 details: 11)"""

    # --- loss (37 details: 5 GAE, 7 adv norm, 8 clipped objective, 9 value clipping, 10) --
    gamma: float = 0.99
    """discount factor"""
    gae_lambda: float = 0.95
    """GAE lambda"""
    clip_eps: float = 0.2
    """PPO clip range, also used for value clipping"""
    anneal_clip_eps: bool = False
    """anneal the clip range linearly to exactly 0 at the last gradient step"""
    clip_vloss: bool = True
    """clip the value loss around the rollout's values"""
    norm_adv: bool = True
    """normalize advantages per minibatch"""
    ent_coef: float = 0.01
    """entropy bonus coefficient"""
    vf_coef: float = 0.5
    """value loss coefficient"""
    target_kl: float | None = None
    """skip the rest of a cycle's updates once a minibatch's approxkl3 exceeds this"""
    mask_invalid_actions: bool = True
    """if the env has a method `action_mask(env_state, env_params) -> bool (A,)`, invalid actions
    get zero probability in the rollout and in the loss (37 details: invalid action masking)"""

    # --- network (37 details: 2 orthogonal init, 13 separate networks) ----------------
    hidden_sizes: tuple[int, ...] = (64, 64)
    """hidden layer widths of the MLP(s)"""
    activation: Literal["tanh", "relu"] = "tanh"
    """hidden activation"""
    shared_network: bool = False
    """one torso with an actor and a critic head, instead of separate actor and critic MLPs"""
    orthogonal_init: bool = True
    """orthogonal init (gain sqrt(2) hidden, 0.01 actor head, 1.0 critic head, zero biases);
    off: flax's default init"""

    # --- scale (37 details, auxiliary: parallelized gradient update) ----------------------
    num_devices: int = 1
    """devices to split the parallel envs across (0 = every device); each computes gradients on
    its share of every minibatch, and they are averaged (pmean) before the optimizer step"""
    distributed: bool = False
    """multi-host: call jax.distributed.initialize() (from the cluster's environment variables)
    so that --num-devices spans every host's devices"""

    # --- logging ----------------------------------------------------------------------
    track: bool = False
    """log to Weights & Biases"""
    wandb_project: str = "ppo-jax"
    """wandb project"""
    wandb_entity: str | None = None
    """wandb entity (team or user)"""
    wandb_group: str | None = None
    """wandb group"""
    wandb_mode: Literal["online", "offline", "disabled"] = "online"
    """wandb mode; offline writes the run under RUN_DIR/wandb for a later `wandb sync`"""
    run_dir: str | None = None
    """output folder; default runs/<env>__<exp-name>__<seed>__<time>"""
    log_every_cycles: int = 1
    """write metrics every this many cycles (the last cycle is always written)"""
    checkpoint_every_cycles: int | None = None
    """write RUN_DIR/checkpoint.npz (the full training state) every this many cycles; default:
    about every 10% of the run"""
    resume: str | None = None
    """continue the run in this run dir from its last checkpoint, with its args.json; flags given
    here may change only logging (--track, --wandb-*, --log-every-cycles, --checkpoint-every-cycles)"""

    # --- derived ----------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        """transitions per rollout, per seed"""
        return self.num_parallel_envs * self.num_env_steps_per_cycle

    @property
    def minibatch_size(self) -> int:
        return self.batch_size // self.num_minibatches_per_epoch

    @property
    def num_cycles(self) -> int:
        return self.num_total_env_steps // self.batch_size

    @property
    def checkpoint_interval(self) -> int:
        return self.checkpoint_every_cycles or max(1, self.num_cycles // 10)

    @property
    def num_gradient_steps(self) -> int:
        """nominal gradient steps in the whole run (target-KL may skip some)"""
        return self.num_cycles * self.num_epochs_per_cycle * self.num_minibatches_per_epoch


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
    ]
    for name in positive_ints:
        if getattr(args, name) <= 0:
            raise ConfigError(f"{flag(name)} must be a positive integer, got {getattr(args, name)}")
    if args.num_devices < 0:
        raise ConfigError(f"--num-devices must be >= 0 (0 = every device), got {args.num_devices}")
    if args.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {args.seed}")
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
        if not getattr(args, name) > 0:
            raise ConfigError(f"{flag(name)} must be > 0, got {getattr(args, name)}")
    for name in ["ent_coef", "vf_coef"]:
        if not getattr(args, name) >= 0:
            raise ConfigError(f"{flag(name)} must be >= 0, got {getattr(args, name)}")
    for name in ["gamma", "gae_lambda"]:
        if not 0 <= getattr(args, name) <= 1:
            raise ConfigError(f"{flag(name)} must be in [0, 1], got {getattr(args, name)}")
    if args.checkpoint_every_cycles is not None and args.checkpoint_every_cycles <= 0:
        raise ConfigError(f"--checkpoint-every-cycles must be a positive integer, got {args.checkpoint_every_cycles}")
    if args.target_kl is not None and not args.target_kl > 0:
        raise ConfigError(f"--target-kl must be > 0 when set, got {args.target_kl}")
    if not args.hidden_sizes or min(args.hidden_sizes) <= 0:
        raise ConfigError(f"--hidden-sizes must be one or more positive integers, got {args.hidden_sizes}")


def flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


# ======================================================================================
# Environment
# ======================================================================================


def make_env(env_id: str) -> tuple[Any, Any]:
    """`env_id` is a gymnax id or `module.path:Name` (an Environment subclass, or a
    zero-argument factory returning (env, env_params))."""
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
    else:
        if env_id not in gymnax.registered_envs:
            close = difflib.get_close_matches(env_id, gymnax.registered_envs, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else "; see gymnax.registered_envs"
            raise ConfigError(f"--env-id {env_id} is not a gymnax environment{hint}")
        env, env_params = gymnax.make(env_id)
    action_space = env.action_space(env_params)
    if not isinstance(action_space, spaces.Discrete):
        raise ConfigError(
            f"--env-id {env_id} has a {type(action_space).__name__} action space; "
            f"{Path(__file__).name} supports discrete actions only"
        )
    return env, env_params


# ======================================================================================
# Containers
# ======================================================================================


class Transition(NamedTuple):
    """One rollout, time-major: every field is (T, N, ...).

    Convention: `done[t] = terminated[t] | truncated[t]` means obs[t+1] starts a new episode.
    `final_obs[t]` is the observation the step produced before the automatic reset; when the
    episode goes on it equals obs[t+1]. Truncation bootstraps from V(final_obs); termination
    does not.
    """

    obs: jax.Array  # (T, N, *obs_shape)
    action: jax.Array  # (T, N)
    reward: jax.Array  # (T, N)
    terminated: jax.Array  # (T, N) bool
    truncated: jax.Array  # (T, N) bool
    final_obs: jax.Array  # (T, N, *obs_shape)
    action_mask: jax.Array | None  # (T, N, A) bool, or None when actions are not masked


class Batch(NamedTuple):
    """Flattened training data of one cycle: every field is (B, ...), B = T * N."""

    obs: jax.Array
    action: jax.Array
    logp: jax.Array
    value: jax.Array
    advantage: jax.Array
    target: jax.Array  # GAE return, the value target
    action_mask: jax.Array | None  # (B, A) bool, or None


class EnvCarry(NamedTuple):
    """What the environments carry from one cycle to the next, per seed."""

    env_state: Any
    obs: jax.Array  # (N, *obs_shape)
    episode_return: jax.Array  # (N,) running return of the unfinished episode
    episode_length: jax.Array  # (N,)


class TrainState(NamedTuple):
    """Everything the train loop carries, per seed."""

    params: Any
    opt_state: Any
    env: EnvCarry
    key: jax.Array
    cycle: jax.Array  # cycles completed
    failed_cycle: jax.Array  # 0 while healthy; else the cycle whose update was not finite
    failed_check: jax.Array  # index into NON_FINITE_CHECKS of what was not finite


# ======================================================================================
# Network
# ======================================================================================

HIDDEN_GAIN = math.sqrt(2.0)  # 37 details: 2
ACTOR_HEAD_GAIN = 0.01  # near-uniform initial policy
CRITIC_HEAD_GAIN = 1.0


def dense(features: int, gain: float, orthogonal_init: bool) -> nn.Dense:
    if orthogonal_init:
        return nn.Dense(features, kernel_init=nn.initializers.orthogonal(gain), bias_init=nn.initializers.zeros)
    return nn.Dense(features)


class MLP(nn.Module):
    hidden_sizes: tuple[int, ...]
    activation: str
    orthogonal_init: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        activation = {"tanh": nn.tanh, "relu": nn.relu}[self.activation]
        for width in self.hidden_sizes:
            x = activation(dense(width, HIDDEN_GAIN, self.orthogonal_init)(x))
        return x


class ActorCritic(nn.Module):
    """Separate actor and critic MLPs (37 details: 13), or one shared torso with two heads."""

    num_actions: int
    hidden_sizes: tuple[int, ...]
    activation: str
    orthogonal_init: bool
    shared_network: bool

    def setup(self):
        mlp = lambda: MLP(self.hidden_sizes, self.activation, self.orthogonal_init)  # noqa: E731
        self.actor_torso = mlp()
        self.critic_torso = self.actor_torso if self.shared_network else mlp()
        self.actor_head = dense(self.num_actions, ACTOR_HEAD_GAIN, self.orthogonal_init)
        self.critic_head = dense(1, CRITIC_HEAD_GAIN, self.orthogonal_init)

    def __call__(self, obs: jax.Array) -> tuple[jax.Array, jax.Array]:
        """obs (B, *obs_shape) -> logits (B, A), value (B,)"""
        x = obs.reshape(obs.shape[0], -1).astype(jnp.float32)  # flatten any observation shape
        actor_features = self.actor_torso(x)
        critic_features = actor_features if self.shared_network else self.critic_torso(x)
        return self.actor_head(actor_features), self.critic_head(critic_features)[:, 0]

    def policy(self, obs: jax.Array) -> jax.Array:
        """Only the logits: what the rollout needs at every step."""
        x = obs.reshape(obs.shape[0], -1).astype(jnp.float32)
        return self.actor_head(self.actor_torso(x))


INVALID_ACTION_LOGIT = -1e9  # exp() is exactly 0, and 0 * logit stays finite in the entropy


def masked(logits: jax.Array, action_mask: jax.Array | None) -> jax.Array:
    return logits if action_mask is None else jnp.where(action_mask, logits, INVALID_ACTION_LOGIT)


def log_prob_and_entropy(logits: jax.Array, action: jax.Array) -> tuple[jax.Array, jax.Array]:
    """log pi(action) and the entropy of a categorical policy, from one log-softmax.
    (distrax.Categorical gives the same numbers, tested, but its log_prob and entropy each redo
    the log-softmax: 20% of a CartPole cycle on CPU.)"""
    log_probs = jax.nn.log_softmax(logits)
    log_prob = jnp.take_along_axis(log_probs, action[..., None], axis=-1)[..., 0]
    entropy = -(jnp.exp(log_probs) * log_probs).sum(-1)
    return log_prob, entropy


def uses_action_mask(args: Args, env: Any) -> bool:
    return args.mask_invalid_actions and callable(getattr(env, "action_mask", None))


def make_network(args: Args, num_actions: int) -> ActorCritic:
    return ActorCritic(
        num_actions=num_actions,
        hidden_sizes=tuple(args.hidden_sizes),
        activation=args.activation,
        orthogonal_init=args.orthogonal_init,
        shared_network=args.shared_network,
    )


# ======================================================================================
# Algorithm: pure functions
# ======================================================================================


LOG_ROWS_ENV_STEPS = 8192  # metrics rows leave the jit together, once per this many env steps

DEVICE_AXIS = "devices"  # the shard_map axis that splits the parallel envs across devices


def mean_over_devices(x: Any, axis_name: str | None) -> Any:
    """The mean of every device's value under shard_map; the value itself on one device."""
    return x if axis_name is None else jax.lax.pmean(x, axis_name)


def sum_over_devices(x: Any, axis_name: str | None) -> Any:
    return x if axis_name is None else jax.lax.psum(x, axis_name)


def linear_schedule(start: float, step: jax.Array, num_steps: int) -> jax.Array:
    """`start` at step 0, falling linearly to exactly 0 at step num_steps - 1, never below."""
    fraction = 1.0 - step / max(num_steps - 1, 1)
    return start * jnp.clip(fraction, 0.0, 1.0)


def collect_rollout(
    params: Any,
    env_carry: EnvCarry,
    key: jax.Array,
    network: ActorCritic,
    env: Any,
    env_params: Any,
    num_steps: int,
    mask_actions: bool,
) -> tuple[EnvCarry, Transition, jax.Array, jax.Array]:
    """Steps N envs for T steps with the current policy.

    Returns the new carry, the transitions, and per step the return and length of episodes that
    ended there (NaN where none ended). Random numbers for the whole rollout are drawn up front,
    in one batched call each, so the sequential loop does only the policy, the env and the sampling.
    """
    num_envs = env_carry.obs.shape[0]
    num_actions = env.action_space(env_params).n
    gumbel_key, env_key = jax.random.split(key)
    gumbel = jax.random.gumbel(gumbel_key, (num_steps, num_envs, num_actions))  # (T, N, A)
    env_keys = jax.random.split(env_key, num_steps * num_envs).reshape(num_steps, num_envs)

    def step(carry: EnvCarry, step_input):
        step_gumbel, step_keys = step_input
        logits = network.apply(params, carry.obs, method=ActorCritic.policy)
        action_mask = jax.vmap(env.action_mask, in_axes=(0, None))(carry.env_state, env_params) if mask_actions else None
        action = jnp.argmax(masked(logits, action_mask) + step_gumbel, axis=-1)  # Gumbel-max = categorical sample
        next_obs, env_state, reward, terminated, truncated, info = jax.vmap(
            env.step, in_axes=(0, 0, 0, None)
        )(step_keys, carry.env_state, action, env_params)
        done = jnp.logical_or(terminated, truncated)
        episode_return = carry.episode_return + reward
        episode_length = carry.episode_length + 1
        finished_return = jnp.where(done, episode_return, jnp.nan)
        finished_length = jnp.where(done, episode_length, jnp.nan)
        new_carry = EnvCarry(
            env_state=env_state,
            obs=next_obs,
            episode_return=jnp.where(done, 0.0, episode_return),
            episode_length=jnp.where(done, 0, episode_length),
        )
        transition = Transition(
            obs=carry.obs,
            action=action,
            reward=reward.astype(jnp.float32),
            terminated=terminated,
            truncated=truncated,
            final_obs=info["final_observation"],
            action_mask=action_mask,
        )
        return new_carry, (transition, finished_return, finished_length)

    env_carry, (transitions, finished_return, finished_length) = jax.lax.scan(
        step, env_carry, (gumbel, env_keys)
    )
    return env_carry, transitions, finished_return, finished_length


def compute_gae(
    reward: jax.Array,
    value: jax.Array,
    next_value: jax.Array,
    terminated: jax.Array,
    done: jax.Array,
    gamma: float,
    gae_lambda: float,
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

    _, advantage = jax.lax.scan(
        backward, jnp.zeros_like(delta[0]), (delta, done.astype(jnp.float32)), reverse=True
    )
    return advantage, advantage + value


def ppo_loss_terms(
    new_logp: jax.Array,
    entropy: jax.Array,
    new_value: jax.Array,
    batch: Batch,
    clip_eps: jax.Array,
    clip_vloss: bool,
    norm_adv: bool,
    axis_name: str | None = None,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Clipped surrogate and value losses on one minibatch (37 details: 7, 8, 9).

    Returns (policy_loss, value_loss, metrics); the total is
    policy_loss - ent_coef * entropy + vf_coef * value_loss.
    """
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
    logits, new_value = network.apply(params, batch.obs)
    new_logp, entropy = log_prob_and_entropy(masked(logits, batch.action_mask), batch.action)
    policy_loss, value_loss, metrics = ppo_loss_terms(
        new_logp, entropy, new_value, batch, clip_eps, args.clip_vloss, args.norm_adv, axis_name
    )
    total = policy_loss - args.ent_coef * entropy.mean() + args.vf_coef * value_loss
    return total, metrics


def epoch_permutation(key: jax.Array, batch_size: int) -> jax.Array:
    """A fresh shuffle of the batch for each epoch of each cycle (keys are never reused).

    One plain sort of random 32-bit words whose low bits hold the index: on CPU 3.5x faster than
    jax.random.permutation, which sorts keys with values. Words whose random high bits tie keep
    index order; that only ever orders two neighbours of the shuffle.
    """
    index_bits = max(batch_size - 1, 1).bit_length()
    index = jnp.arange(batch_size, dtype=jnp.uint32)
    words = jax.random.bits(key, (batch_size,), jnp.uint32) >> index_bits << index_bits | index
    return (jnp.sort(words) & ((1 << index_bits) - 1)).astype(jnp.int32)


def make_optimizer(args: Args) -> optax.GradientTransformation:
    """Global-norm clipping (37 details: 11), then Adam's direction. The learning rate is applied
    by the caller, from our own schedule (optax.inject_hyperparams cost 25% of an update on CPU)."""
    return optax.chain(optax.clip_by_global_norm(args.max_grad_norm), optax.scale_by_adam(eps=args.adam_eps))


def update_cycle(
    params: Any,
    opt_state: Any,
    batch: Batch,
    key: jax.Array,
    cycle: jax.Array,
    failed: jax.Array,
    network: ActorCritic,
    optimizer: optax.GradientTransformation,
    args: Args,
    axis_name: str | None = None,
) -> tuple[Any, Any, dict[str, jax.Array], jax.Array]:
    """K epochs of M minibatch updates on one rollout.

    A minibatch update is not applied, and neither is any later one in the cycle, when:
    - --target-kl is set and the minibatch's approxkl3 (measured before its update) exceeds it;
    - its loss or gradient is not finite (the NaN guard). The returned code (index into
      NON_FINITE_CHECKS, 0 = all finite) then tells the caller to stop training for good.
    Nothing is applied when `failed` is already set. Metrics are means over applied minibatches.
    Under shard_map (axis_name set) `batch` is this device's share; gradients, losses and metrics
    are averaged over devices, so every device takes the same step.
    """
    num_epochs, num_minibatches = args.num_epochs_per_cycle, args.num_minibatches_per_epoch
    batch_size = batch.action.shape[0]  # this device's share of the seed's batch
    # The update works on one flat vector of every parameter: the optimizer, the clipping and the
    # NaN guard are then a few fused ops instead of a few per layer.
    params, unravel = ravel_pytree(params)
    grad_fn = jax.value_and_grad(lambda flat, *rest: loss_fn(unravel(flat), *rest), has_aux=True)

    def minibatch_update(carry, minibatch_input):
        params, opt_state, stopped, non_finite, metric_sums, num_applied = carry
        minibatch, gradient_step = minibatch_input
        learning_rate = linear_schedule(args.lr, gradient_step, args.num_gradient_steps) if args.anneal_lr else jnp.float32(args.lr)
        clip_eps = (
            linear_schedule(args.clip_eps, gradient_step, args.num_gradient_steps)
            if args.anneal_clip_eps
            else jnp.float32(args.clip_eps)
        )

        def apply_update(_):
            (loss, metrics), grads = grad_fn(params, minibatch, clip_eps, network, args, axis_name)
            loss, metrics, grads = mean_over_devices((loss, metrics, grads), axis_name)
            metrics["losses/grad_norm"] = optax.tree.norm(grads)  # before clipping
            direction, new_opt_state = optimizer.update(grads, opt_state, params)
            new_params = jax.tree.map(lambda param, step: param - learning_rate * step, params, direction)
            code = jnp.where(
                ~jnp.isfinite(loss), NON_FINITE_CHECKS.index("loss"),
                jnp.where(~jnp.isfinite(metrics["losses/grad_norm"]), NON_FINITE_CHECKS.index("gradient"), 0),
            )
            reject = stopped | (code > 0)
            if args.target_kl is not None:
                reject = reject | (metrics["losses/actor_approxkl3"] > args.target_kl)
            keep_old = lambda old, new: jnp.where(reject, old, new)  # noqa: E731
            return jax.tree.map(keep_old, params, new_params), jax.tree.map(keep_old, opt_state, new_opt_state), reject, code, metrics

        def skip(_):
            return params, opt_state, jnp.bool_(True), jnp.int32(0), jax.tree.map(jnp.zeros_like, metric_sums)

        if args.target_kl is None:  # after a NaN the update is computed but not applied (rare)
            params, opt_state, rejected, code, metrics = apply_update(None)
        else:  # target-KL stops early often: skip the compute
            params, opt_state, rejected, code, metrics = jax.lax.cond(stopped, skip, apply_update, None)
        applied = ~(stopped | rejected)
        metric_sums = jax.tree.map(lambda total, value: total + jnp.where(applied, value, 0.0), metric_sums, metrics)
        carry = (params, opt_state, stopped | rejected, jnp.maximum(non_finite, code), metric_sums, num_applied + applied)
        return carry, None

    def epoch(carry, epoch_input):
        epoch_key, epoch_index = epoch_input
        permutation = epoch_permutation(epoch_key, batch_size)
        minibatches = jax.tree.map(
            lambda x: x[permutation].reshape(num_minibatches, batch_size // num_minibatches, *x.shape[1:]), batch
        )
        first_step = (cycle * num_epochs + epoch_index) * num_minibatches
        gradient_steps = first_step + jnp.arange(num_minibatches)
        return jax.lax.scan(minibatch_update, carry, (minibatches, gradient_steps))[0], None

    metric_sums = {name: jnp.float32(0.0) for name in MINIBATCH_METRIC_NAMES}
    carry = (params, opt_state, failed, jnp.int32(0), metric_sums, jnp.float32(0.0))
    epoch_keys = jax.random.split(key, num_epochs)
    (params, opt_state, _, non_finite, metric_sums, num_applied), _ = jax.lax.scan(
        epoch, carry, (epoch_keys, jnp.arange(num_epochs))
    )
    metrics = {name: total / jnp.maximum(num_applied, 1.0) for name, total in metric_sums.items()}
    metrics["losses/epochs_run"] = num_applied / num_minibatches
    return unravel(params), opt_state, metrics, non_finite


# What the NaN guard checks, in order; code 0 means every check passed.
NON_FINITE_CHECKS = ("none", "loss", "gradient", "parameters")


# Metrics averaged over every minibatch applied in a cycle, and everything logged per cycle
# (charts/SPS is added on the host).
MINIBATCH_METRIC_NAMES = (
    "losses/policy_loss",
    "losses/value_loss",
    "losses/entropy",
    "losses/actor_clipfrac",
    "losses/critic_clipfrac",
    "losses/actor_approxkl1",
    "losses/actor_approxkl3",
    "losses/grad_norm",
)
METRIC_NAMES = (
    "charts/episodic_return",
    "charts/episodic_length",
    "charts/learning_rate",
    "charts/clip_eps",
    *MINIBATCH_METRIC_NAMES,
    "losses/explained_variance",
    "losses/epochs_run",
)


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


# ======================================================================================
# make_train
# ======================================================================================


def reset_envs(key: jax.Array, env: Any, env_params: Any, num_envs: int) -> EnvCarry:
    obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(key, num_envs), env_params)
    zeros = jnp.zeros((num_envs,), jnp.float32)
    return EnvCarry(env_state, obs, zeros, jnp.zeros((num_envs,), jnp.int32))


def make_train(args: Args, env: Any, env_params: Any, mesh: jax.sharding.Mesh | None = None):
    """Returns (init, train).

    init(seed) -> TrainState for one seed, in Python, one seed at a time: parameter init is never
    vmapped, which keeps batched QR factorizations out of the program (see the XLA_FLAGS note).
    train(states, log_fn, checkpoint_fn, start_cycle) runs the cycles for a stack of seeds; it is
    meant to be jitted. With a mesh, each cycle runs under shard_map: every device steps its
    share of the envs, and gradients and metrics are averaged across devices.
    """
    num_devices = 1 if mesh is None else mesh.size
    axis_name = None if mesh is None else DEVICE_AXIS
    local_envs = args.num_parallel_envs // num_devices

    def per_device(key: jax.Array) -> jax.Array:
        """Different random numbers on each device (only when there are several)."""
        return key if num_devices == 1 else jax.random.fold_in(key, jax.lax.axis_index(DEVICE_AXIS))

    network = make_network(args, env.action_space(env_params).n)
    optimizer = make_optimizer(args)
    obs_shape = env.observation_space(env_params).shape
    mask_actions = uses_action_mask(args, env)

    @jax.jit
    def init_one(key: jax.Array) -> TrainState:
        key, params_key, env_key = jax.random.split(key, 3)
        params = network.init(params_key, jnp.zeros((1, *obs_shape), jnp.float32))
        env_carry = reset_envs(env_key, env, env_params, args.num_parallel_envs)
        zero = jnp.int32(0)
        opt_state = optimizer.init(ravel_pytree(params)[0])  # the update's flat parameter vector
        return TrainState(params, opt_state, env_carry, key, zero, zero, zero)

    def init(seed: int) -> TrainState:
        return init_one(jax.random.key(seed))

    def train_cycle(state: TrainState) -> tuple[TrainState, dict[str, jax.Array]]:
        key, reset_key, rollout_key, update_key = jax.random.split(state.key, 4)
        reset_key, rollout_key, update_key = per_device(reset_key), per_device(rollout_key), per_device(update_key)
        env_carry = state.env
        if args.reset_envs_each_cycle:
            env_carry = reset_envs(reset_key, env, env_params, local_envs)

        env_carry, transitions, finished_return, finished_length = collect_rollout(
            state.params, env_carry, rollout_key, network, env, env_params, args.num_env_steps_per_cycle, mask_actions
        )

        # One batched forward pass over the whole rollout for log-probs and values, instead of
        # one per step inside the sequential loop (cheaper, and the same numbers).
        num_steps, num_envs = transitions.action.shape
        flat_obs = transitions.obs.reshape(num_steps * num_envs, *obs_shape)
        flat_final_obs = transitions.final_obs.reshape(num_steps * num_envs, *obs_shape)
        logits, value = network.apply(state.params, flat_obs)
        _, next_value = network.apply(state.params, flat_final_obs)
        num_actions = logits.shape[-1]
        flat_mask = None if transitions.action_mask is None else transitions.action_mask.reshape(-1, num_actions)
        logp, _ = log_prob_and_entropy(masked(logits, flat_mask), transitions.action.reshape(-1))

        done = jnp.logical_or(transitions.terminated, transitions.truncated)
        bootstrap_stops = transitions.terminated if args.bootstrap_truncated else done
        advantage, target = compute_gae(
            transitions.reward,
            value.reshape(num_steps, num_envs),
            next_value.reshape(num_steps, num_envs),
            bootstrap_stops.astype(jnp.float32),
            done,
            args.gamma,
            args.gae_lambda,
        )
        batch = Batch(
            obs=flat_obs,
            action=transitions.action.reshape(-1),
            logp=logp,
            value=value,
            advantage=advantage.reshape(-1),
            target=target.reshape(-1),
            action_mask=flat_mask,
        )
        failed = state.failed_cycle > 0
        params, opt_state, metrics, non_finite = update_cycle(
            state.params, state.opt_state, batch, update_key, state.cycle, failed, network, optimizer, args, axis_name
        )
        # NaN guard, last line: parameters must be finite too, or the cycle's updates are undone.
        params_finite = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(params)]))
        non_finite = jnp.where(non_finite > 0, non_finite, jnp.where(params_finite, 0, NON_FINITE_CHECKS.index("parameters")))
        params, opt_state = jax.tree.map(
            lambda new, old: jnp.where(params_finite, new, old), (params, opt_state), (state.params, state.opt_state)
        )
        newly_failed = ~failed & (non_finite > 0)
        last_step = (state.cycle + 1) * args.num_epochs_per_cycle * args.num_minibatches_per_epoch - 1
        metrics["charts/episodic_return"] = nanmean_or_nan(finished_return, axis_name)
        metrics["charts/episodic_length"] = nanmean_or_nan(finished_length, axis_name)
        metrics["charts/learning_rate"] = (
            linear_schedule(args.lr, last_step, args.num_gradient_steps) if args.anneal_lr else jnp.float32(args.lr)
        )
        metrics["charts/clip_eps"] = (
            linear_schedule(args.clip_eps, last_step, args.num_gradient_steps)
            if args.anneal_clip_eps
            else jnp.float32(args.clip_eps)
        )
        metrics["losses/explained_variance"] = explained_variance(batch.value, batch.target, axis_name)
        new_state = TrainState(
            params,
            opt_state,
            env_carry,
            key,
            state.cycle + 1,
            failed_cycle=jnp.where(newly_failed, state.cycle + 1, state.failed_cycle),
            failed_check=jnp.where(newly_failed, non_finite, state.failed_check),
        )
        return new_state, metrics

    def train_cycle_each_seed(states: TrainState) -> tuple[TrainState, dict[str, jax.Array]]:
        if args.num_seeds == 1:
            # vmap over a size-1 axis turns every matmul into a batched one, which XLA:CPU
            # runs 60% slower here; one seed runs unbatched.
            state, metrics = train_cycle(jax.tree.map(lambda x: x[0], states))
            return jax.tree.map(lambda x: x[None], (state, metrics))
        return jax.vmap(train_cycle)(states)

    def skip_cycle(states: TrainState) -> tuple[TrainState, dict[str, jax.Array]]:
        """Every seed has failed: nothing to train, just count the cycle (costs nothing)."""
        nan = jnp.full(states.cycle.shape, jnp.nan)
        return states._replace(cycle=states.cycle + 1), {name: nan for name in METRIC_NAMES}

    def train(
        states: TrainState,
        log_fn: Callable | None = None,
        checkpoint_fn: Callable | None = None,
        start_cycle: int = 0,
    ):
        """states: TrainState with a leading seed axis, after `start_cycle` cycles. Runs the
        remaining cycles; returns final states and per-cycle metrics, each (cycles, seeds).
        log_fn(cycles, num_rows, values) and checkpoint_fn(cycle, states) are host callbacks."""

        def one_cycle(states):
            all_failed = jnp.all(states.failed_cycle > 0)
            return jax.lax.cond(all_failed, skip_cycle, train_cycle_each_seed, states)

        if mesh is not None:
            specs = state_partition_specs()
            one_cycle = jax.shard_map(one_cycle, mesh=mesh, in_specs=(specs,), out_specs=(specs, P()))

        # JAX orders host callbacks on one device only; on several, each row and checkpoint
        # carries its cycle number, and the checkpointer never goes back in time.
        ordered = mesh is None

        # A host callback costs ~0.4 ms on CPU, longer than a whole small cycle, so metrics rows
        # wait in a buffer and leave in one callback per LOG_ROWS_ENV_STEPS env steps (every row
        # at once for big batches). Rows also leave before every checkpoint and at the end.
        rows_per_callback = max(1, LOG_ROWS_ENV_STEPS // args.batch_size)
        seeds = states.cycle.shape[0]

        def cycle_body(carry, _):
            states, rows, row_cycles, num_rows = carry
            states, metrics = one_cycle(states)
            cycle = states.cycle[0]
            # Never checkpoint after a failure: the last good checkpoint stays on disk.
            should_save = (cycle % args.checkpoint_interval == 0) & ~jnp.any(states.failed_cycle > 0)
            if log_fn is not None:
                last = cycle == args.num_cycles
                should_log = (cycle % args.log_every_cycles == 0) | last
                values = jnp.stack([metrics[name] for name in METRIC_NAMES])  # (metrics, seeds)
                rows = jnp.where(should_log, rows.at[num_rows].set(values), rows)
                row_cycles = jnp.where(should_log, row_cycles.at[num_rows].set(cycle), row_cycles)
                num_rows = num_rows + should_log
                flush_now = (last | should_save) if checkpoint_fn is not None else last
                flush = (num_rows > 0) & ((num_rows == rows_per_callback) | flush_now)
                jax.lax.cond(
                    flush,
                    lambda: jax.debug.callback(log_fn, row_cycles, num_rows, rows, ordered=ordered),
                    lambda: None,
                )
                num_rows = jnp.where(flush, 0, num_rows)
            if checkpoint_fn is not None:
                host_states = jax.tree.map(key_data_or_array, states)  # callbacks take no PRNG keys
                jax.lax.cond(
                    should_save,
                    lambda: jax.debug.callback(checkpoint_fn, cycle, host_states, ordered=ordered),
                    lambda: None,
                )
            return (states, rows, row_cycles, num_rows), metrics

        rows = jnp.zeros((rows_per_callback, len(METRIC_NAMES), seeds), jnp.float32)
        row_cycles = jnp.zeros(rows_per_callback, jnp.int32)
        (states, *_), metrics = jax.lax.scan(
            cycle_body, (states, rows, row_cycles, jnp.int32(0)), None, length=args.num_cycles - start_cycle
        )
        return states, metrics

    return init, train


def state_partition_specs() -> TrainState:
    """How a stack of TrainStates lies across devices: the envs (axis 1 of every EnvCarry leaf,
    after the seed axis) are split, everything else is replicated."""
    return TrainState(*([P()] * len(TrainState._fields)))._replace(env=P(None, DEVICE_AXIS))


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


def key_data_or_array(leaf: jax.Array) -> jax.Array:
    return jax.random.key_data(leaf) if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key) else leaf


def stack_seeds(trees: list[Any]) -> Any:
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


# ======================================================================================
# Logging
# ======================================================================================


class MetricsLogger:
    """Host side of the metrics callback: metrics.jsonl, a console line and wandb."""

    def __init__(self, args: Args, run_dir: Path):
        self.args = args
        self.seeds = [args.seed + i for i in range(args.num_seeds)]
        self.path = run_dir / "metrics.jsonl"
        self.file: Any = None
        self.wandb_run: Any = None
        self.last_time: float | None = None
        self.last_cycle = 0
        self.last_print = 0.0

    def start(self, cycle: int, wandb_run: Any | None) -> None:
        """Called once compiled, just before training: nothing is written before that."""
        self.file = open(self.path, "a")
        self.wandb_run = wandb_run
        self.last_time = time.perf_counter()
        self.last_cycle = cycle

    def __call__(self, cycles: Any, num_rows: Any, values: Any) -> None:
        """The first num_rows of cycles (rows,) and values (rows, len(METRIC_NAMES), num_seeds)."""
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
        # per-value NumPy calls (they made the callback ~1.5 ms, a third of a CartPole cycle).
        rows = np.asarray(values, dtype=np.float64)[: len(cycles)].transpose(0, 2, 1).tolist()  # (rows, seeds, metrics)
        lines = []
        for row_cycle, row in zip(cycles, rows):
            for seed, seed_values in zip(self.seeds, row):
                line = {"cycle": row_cycle, "env_steps": row_cycle * self.args.batch_size, "seed": seed, "charts/SPS": sps}
                line.update((name, value if math.isfinite(value) else None) for name, value in zip(METRIC_NAMES, seed_values))
                lines.append(json.dumps(line))
        self.file.write("\n".join(lines) + "\n")
        self.file.flush()
        if self.wandb_run is not None:  # every row, against its env steps
            for row_cycle, row in zip(cycles, rows):
                log = {name: value for name, value in self.seed_means(row).items() if value is not None}
                log["charts/SPS"] = sps
                if self.args.num_seeds > 1:
                    for seed, seed_values in zip(self.seeds, row):
                        log.update({f"seed_{seed}/{name}": value for name, value in zip(METRIC_NAMES, seed_values) if math.isfinite(value)})
                self.wandb_run.log(log, step=row_cycle * self.args.batch_size)

        if now - self.last_print >= 1.0 or cycle == self.args.num_cycles:
            self.last_print = now
            mean = self.seed_means(rows[-1])
            episodic_return = mean["charts/episodic_return"]
            print(
                f"cycle {cycle}/{self.args.num_cycles} | env steps {env_steps:,} | SPS {sps:,.0f} | "
                f"return {'-' if episodic_return is None else f'{episodic_return:.2f}'} | "
                f"policy loss {fmt(mean['losses/policy_loss'])} | value loss {fmt(mean['losses/value_loss'])} | "
                f"entropy {fmt(mean['losses/entropy'])} | approxkl3 {fmt(mean['losses/actor_approxkl3'])}",
                flush=True,
            )

    @staticmethod
    def seed_means(row: list[list[float]]) -> dict[str, float | None]:
        """Each metric's mean over the seeds where it is finite; None where it is nowhere."""
        columns = [[value for value in column if math.isfinite(value)] for column in zip(*row)]
        return {name: sum(column) / len(column) if column else None for name, column in zip(METRIC_NAMES, columns)}

    def close(self) -> None:
        self.file.close()


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


def default_run_dir(args: Args) -> Path:
    env_name = re.sub(r"[^A-Za-z0-9_.-]+", "_", args.env_id)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{env_name}__{args.exp_name}__{args.seed}__{stamp}"


def script_info() -> dict[str, str]:
    """Which file wrote a run: args.json records it, so that the tools in scripts/ load this
    file (or a renamed copy of it) to read the run."""
    return {"script": Path(__file__).name, "script_path": str(Path(__file__).resolve())}


def args_from_json(path: Path) -> Args:
    data = json.loads(Path(path).read_text())
    for key in script_info():
        data.pop(key, None)
    data["hidden_sizes"] = tuple(data["hidden_sizes"])
    return Args(**data)


def load_params(run_dir: str | Path) -> tuple[Args, Any]:
    """The final parameters of every seed (leading seed axis), from RUN_DIR alone."""
    run_dir = Path(run_dir)
    args = args_from_json(run_dir / "args.json")
    env, env_params = make_env(args.env_id)
    network = make_network(args, env.action_space(env_params).n)
    obs_shape = env.observation_space(env_params).shape
    template = network.init(jax.random.key(0), jnp.zeros((1, *obs_shape), jnp.float32))
    template = stack_seeds([template] * args.num_seeds)
    params = flax.serialization.from_bytes(template, (run_dir / "params.msgpack").read_bytes())
    return args, params


# ======================================================================================
# main
# ======================================================================================


def use_unrolled_threefry_on_cpu() -> None:
    """JAX lowers its threefry PRNG to a rolled 5-iteration loop on CPU (to save compile time),
    and every env step draws random numbers inside our sequential rollout loop. The unrolled
    lowering that GPUs use gives the same bits and made a CartPole run 25% faster here. This
    touches a private JAX API, so it is skipped silently when that API moves."""
    try:
        from jax._src.interpreters import mlir
        from jax._src.random import threefry2x32

        rule = threefry2x32._threefry2x32_lowering_rule
        mlir.register_lowering(threefry2x32.threefry2x32_p, rule, platform="cpu")
    except (ImportError, AttributeError):
        pass


# Args that may differ when a run is resumed: they change what is logged, not what is trained.
RESUMABLE_FIELDS = (
    "track", "wandb_project", "wandb_entity", "wandb_group", "wandb_mode", "run_dir",
    "log_every_cycles", "checkpoint_every_cycles", "resume", "exp_name",
)


class Checkpointer:
    """Host side of the checkpoint callback: the full training state of every seed (params,
    optimizer state, env states, RNG keys, counters) in RUN_DIR/checkpoint.npz. Each write goes
    to a temporary file that is atomically renamed, so a kill mid-write keeps the previous one."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "checkpoint.npz"
        self.last_saved_cycle = -1

    def __call__(self, cycle: Any, host_states: Any) -> None:
        if jax.process_index() != 0 or int(cycle) <= self.last_saved_cycle:  # one writer; never older
            return
        self.last_saved_cycle = int(cycle)
        leaves = {f"leaf_{index}": np.asarray(leaf) for index, leaf in enumerate(jax.tree.leaves(host_states))}
        temporary = self.path.with_suffix(".npz.tmp")
        with open(temporary, "wb") as file:
            np.savez(file, cycle=np.asarray(cycle), **leaves)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, self.path)

    def load(self, template: TrainState) -> tuple[TrainState, int]:
        """The saved states, shaped and typed like `template` (freshly initialised states)."""
        with np.load(self.path) as saved:
            template_leaves, treedef = jax.tree.flatten(template)
            if len(saved.files) != len(template_leaves) + 1:
                raise ConfigError(f"--resume: {self.path} does not match this script's training state")
            leaves = []
            for index, like in enumerate(template_leaves):
                data = saved[f"leaf_{index}"]
                if jnp.issubdtype(like.dtype, jax.dtypes.prng_key):
                    leaves.append(jax.random.wrap_key_data(data, impl=jax.random.key_impl(like)))
                elif data.shape != like.shape:
                    raise ConfigError(f"--resume: {self.path} does not match this script's training state")
                else:
                    leaves.append(jnp.asarray(data, like.dtype))
            return jax.tree.unflatten(treedef, leaves), int(saved["cycle"])


def prepare_resume(args: Args) -> tuple[Path, Checkpointer]:
    """Checks that --resume can continue the run in that folder."""
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
    checkpointer = Checkpointer(run_dir)
    if not checkpointer.path.exists():
        raise ConfigError(f"--resume {run_dir}: no checkpoint was written before it stopped; start it again")
    return run_dir, checkpointer


def keep_metrics_up_to(run_dir: Path, last_cycle: int) -> list[dict[str, Any]]:
    """Drops metrics.jsonl rows logged after the checkpoint (they are logged again on resume)
    and returns the rows kept."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    kept = [row for row in rows if row["cycle"] <= last_cycle]
    temporary = path.with_suffix(".jsonl.tmp")
    temporary.write_text("".join(json.dumps(row) + "\n" for row in kept))
    os.replace(temporary, path)
    return kept


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
    if num_devices == 1:
        return None
    return jax.make_mesh((num_devices,), (DEVICE_AXIS,), devices=devices[:num_devices])


def run(args: Args) -> dict[str, Any]:
    """Validates, trains (or resumes), and writes the run dir. Returns the summary."""
    validate_args(args)
    use_unrolled_threefry_on_cpu()
    env, env_params = make_env(args.env_id)
    mesh = make_mesh(args)
    if args.resume:
        run_dir, checkpointer = prepare_resume(args)
    else:
        run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(args)
        if (run_dir / "metrics.jsonl").exists():
            raise ConfigError(f"--run-dir {run_dir} already holds a run; choose another folder, or --resume it")
        checkpointer = Checkpointer(run_dir)

    start = time.perf_counter()
    init, train = make_train(args, env, env_params, mesh)
    states = stack_seeds([init(args.seed + i) for i in range(args.num_seeds)])
    start_cycle = 0
    if args.resume:
        states, start_cycle = checkpointer.load(states)
    logger = MetricsLogger(args, run_dir)
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
        print(f"resuming {run_dir} from cycle {start_cycle}", flush=True)
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "args.json").write_text(json.dumps({**script_info(), **dataclasses.asdict(args)}, indent=2) + "\n")
    wandb_run = None
    if args.track:
        import wandb

        id_file = run_dir / "wandb_id.txt"
        wandb_run = wandb.init(
            project=args.wandb_project,
            entity=args.wandb_entity,
            group=args.wandb_group,
            name=run_dir.name,
            mode=args.wandb_mode,
            dir=str(run_dir),
            config=dataclasses.asdict(args),
            id=id_file.read_text().strip() if id_file.exists() else None,
            resume="allow",
        )
        id_file.write_text(wandb_run.id)
    print(f"run dir: {run_dir}  |  {args.num_cycles} cycles x {args.batch_size} env steps x {args.num_seeds} seeds", flush=True)

    logger.start(start_cycle, wandb_run)
    run_start = time.perf_counter()
    states, metrics = compiled(states)
    jax.block_until_ready((states, metrics))
    run_seconds = time.perf_counter() - run_start
    logger.close()

    episodic_return = np.full((args.num_cycles, args.num_seeds), np.nan)
    seed_index = {args.seed + i: i for i in range(args.num_seeds)}
    for row in kept_rows:
        if row["charts/episodic_return"] is not None:
            episodic_return[row["cycle"] - 1, seed_index[row["seed"]]] = row["charts/episodic_return"]
    episodic_return[start_cycle:] = np.asarray(metrics["charts/episodic_return"])
    returns = final_returns(args, episodic_return)
    finite = [value for value in returns if value is not None]
    failures = {
        args.seed + i: {"cycle": int(cycle), "non_finite": NON_FINITE_CHECKS[int(check)]}
        for i, (cycle, check) in enumerate(zip(np.asarray(states.failed_cycle), np.asarray(states.failed_check)))
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
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
        "failures": failures,
    }
    (run_dir / "params.msgpack").write_bytes(flax.serialization.to_bytes(states.params))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if wandb_run is not None:
        wandb_run.summary.update({key: value for key, value in summary.items() if value is not None})
        wandb_run.finish()
    print(
        f"done: {summary['sps']:,.0f} env steps/s, compile {compile_seconds:.1f} s, "
        f"final return {fmt(summary['final_episodic_return'])}",
        flush=True,
    )
    for seed, failure in failures.items():
        print(
            f"error: seed {seed}: non-finite {failure['non_finite']} at cycle {failure['cycle']}; no update was "
            f"applied from then on. {run_dir}/params.msgpack holds its last good parameters.",
            file=sys.stderr,
        )
    return summary


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
    args = parse_args(argv)
    try:
        summary = run(args)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
