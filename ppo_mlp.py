"""PPO with separate MLP actor and critic, for gymnax environments with discrete actions.

    python ppo_mlp.py --env-id CartPole-v1 --num-seeds 5

The whole algorithm is in this file: copy it and own it. Read top to bottom: Args, containers,
network, then PPO in run order up to one compiled train program, then a short `run`.
What PPO does not need (env suites, devices, logging, checkpoints, the NaN guard) is imported
from the ppo_support package beside this file, by namespace: `envs.make_env`, `rundir.Checkpointer`.
"37 details" numbers: https://iclr-blog-track.github.io/2022/03/25/ppo-implementation-details/
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path
from typing import Any, ClassVar, Literal, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

try:
    from ppo_support import cli, contract, cpu, devices, envs, evaluation, nan_guard, rundir, sessions, sweeps
except ModuleNotFoundError as missing:  # a copy of this file away from the repository
    if missing.name != "ppo_support":
        raise
    print(f"error: {Path(__file__).name} imports ppo_support, which sits beside ppo_mlp.py in the repository; "
          "install it once with: pip install -e /path/to/that/repository", file=sys.stderr)
    sys.exit(2)

# --- Args ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Args:
    """PPO for gymnax environments with vector observations and discrete actions."""

    # --- experiment -----------------------------------------------------------------
    env_id: str = "CartPole-v1"  # a gymnax id, or `module.path:Name`: an Environment class or a () -> (env, env_params)
    exp_name: str = Path(__file__).stem  # name of the experiment, in the default run dir and the wandb run name
    seed: int = 1  # seed of the first run; seed i uses seed + i
    num_seeds: int = 1  # independent seeds trained together in one compiled program (jax.vmap)
    sweep: tuple[str, ...] = ()  # KEY=V1,V2,...: a grid of the flags in `sweepable` (below) x seeds in one program
    # What --sweep may vary inside one program: flags that only enter the math as values (traced
    # scalars; a bool through jnp.where), never an array's shape or a Python `if`. A float or bool
    # flag you add to a copy can join them.
    sweepable: ClassVar[tuple[str, ...]] = (
        "lr", "clip_eps", "ent_coef", "vf_coef", "gamma", "gae_lambda", "max_grad_norm", "adam_eps", "target_kl",
        "norm_adv", "clip_vloss", "anneal_lr", "anneal_clip_eps",
    )
    num_total_env_steps: int = 500_000  # environment steps per seed

    # --- rollout (37 details: 1 vectorized env, 28-30 normalisation) -------------------
    num_parallel_envs: int = 4  # parallel environments per seed
    num_env_steps_per_cycle: int = 128  # steps per env per rollout; one cycle = one rollout + its update epochs
    reset_envs_each_cycle: bool = False  # UED style: every cycle starts from fresh episodes
    bootstrap_truncated: bool = True  # time-limit steps bootstrap from V(final_observation); off: as terminations
    sticky_action_prob: float = 0.0  # the env repeats its last executed action with this probability (MinAtar's own: 0.1)
    optimistic_reset_ratio: int = 1  # Craftax, XLand-MiniGrid: ceil(envs / R) new episodes per step (Craftax's PPO: 16)
    env_params: tuple[str, ...] = ()  # KEY=VALUE fields of the env's params, e.g. memory_length=30 max_steps_in_episode=500
    norm_obs: bool = False  # observations normalised by their running mean and std, clipped to [-10, 10]
    norm_reward: bool = False  # rewards divided by the running std of a discounted return (gym's NormalizeReward)

    # --- optimisation (37 details: 3 Adam eps, 4 LR annealing, 6 minibatches) --------
    num_epochs_per_cycle: int = 4  # passes over the rollout per cycle (K epochs)
    num_minibatches_per_epoch: int = 4  # minibatches each epoch is cut into
    lr: float = 2.5e-4  # Adam learning rate
    anneal_lr: bool = True  # linearly to exactly 0 at the run's last gradient step, counting those --target-kl skips
    adam_eps: float = 1e-5  # Adam epsilon (PyTorch's default is 1e-8; the PPO baselines use 1e-5)
    max_grad_norm: float = 0.5  # clip gradients to this global norm (37 details: 11)

    # --- loss (37 details: 5 GAE, 7 adv norm, 8 clipped objective, 9 value clipping, 10) --
    gamma: float = 0.99  # discount factor
    gae_lambda: float = 0.95  # GAE lambda
    clip_eps: float = 0.2  # PPO clip range, also used for value clipping
    anneal_clip_eps: bool = False  # anneal the clip range linearly to exactly 0 at the last gradient step
    clip_vloss: bool = True  # clip the value loss around the rollout's values
    norm_adv: bool = True  # normalize advantages per minibatch
    ent_coef: float = 0.01  # entropy bonus coefficient
    vf_coef: float = 0.5  # value loss coefficient
    target_kl: float | None = None  # skip the rest of a cycle's updates once a minibatch's approxkl3 exceeds this
    mask_invalid_actions: bool = True  # if the env has `action_mask(env_state, env_params) -> bool (A,)`

    # --- network (37 details: 2 orthogonal init, 13 separate networks) ----------------
    hidden_sizes: tuple[int, ...] = (64, 64)  # hidden layer widths of the MLP(s)
    activation: Literal["tanh", "relu"] = "tanh"  # hidden activation
    shared_network: bool = False  # one torso with actor and critic heads, instead of two MLPs
    orthogonal_init: bool = True  # gains sqrt(2) hidden, 0.01 actor head, 1 critic head, zero biases; off: flax's

    # --- scale (37 details, auxiliary: parallelized gradient update) ----------------------
    num_devices: int = 1  # split the parallel envs across devices (0 = all); gradients are pmean-ed
    distributed: bool = False  # multi-host: join the other processes first (jax.distributed.initialize); then --num-devices 0
    coordinator_address: str | None = None  # --distributed: process 0's HOST:PORT; None: detected (SLURM, Open MPI)
    num_processes: int | None = None  # --distributed: how many processes; None: detected
    process_id: int | None = None  # --distributed: this process, 0 to --num-processes - 1; None: detected

    # --- logging ----------------------------------------------------------------------
    track: bool = False  # log to Weights & Biases
    # The wandb flags left unset defer to wandb's own variables (WANDB_PROJECT, WANDB_MODE, ...).
    wandb_project: str | None = None  # wandb project; default $WANDB_PROJECT, else ppo-jax
    wandb_entity: str | None = None  # wandb entity (team or user); default $WANDB_ENTITY, else your default entity
    wandb_group: str | None = None  # wandb group; default $WANDB_RUN_GROUP, else <env>__<exp-name>
    wandb_tags: tuple[str, ...] = ()  # wandb tags; default $WANDB_TAGS (comma-separated)
    wandb_run_per_seed: bool = False  # one wandb run per seed, plain metric names (CleanRL's layout); off: seed_<n>/
    wandb_mode: Literal["online", "offline", "disabled"] | None = None  # default $WANDB_MODE, else online; offline: for `wandb sync`
    run_dir: str | None = None  # output folder; default runs/<env>__<exp-name>__<seed>__<time>
    log_every_cycles: int = 1  # write metrics every this many cycles (the last cycle is always written)
    eval_every_cycles: int | None = None  # evaluate every K cycles and at the last, on fresh envs (eval/*); None: off
    eval_episodes: int = 10  # episodes per evaluation and seed: one per fresh env, in parallel
    eval_greedy: bool = True  # evaluate the argmax of the masked logits; off: sample, as in training
    capture_video: bool = False  # a GIF of seed 0's first eval episode at each evaluation and at the end (RUN_DIR/videos)
    checkpoint_every_cycles: int | None = None  # save the full training state; default: every 10% of the run
    keep_checkpoints: int = 2  # keep the newest N checkpoints; --resume falls back past a damaged one
    resume: str | None = None  # continue this run dir from its last checkpoint; only logging flags may change
    compilation_cache_dir: str | None = None  # compiled programs kept for the next run; default ~/.cache/ppo-jax/xla; "off"

    # --- derived ----------------------------------------------------------------------
    @property
    def batch_size(self) -> int:  # transitions per rollout, per seed
        return self.num_parallel_envs * self.num_env_steps_per_cycle

    @property
    def num_cycles(self) -> int:
        return self.num_total_env_steps // self.batch_size

    @property
    def num_gradient_steps(self) -> int:  # nominal, in the whole run (target-KL may skip some)
        return self.num_cycles * self.num_epochs_per_cycle * self.num_minibatches_per_epoch


# --- Containers ----------------------------------------------------------------------------
class Transition(NamedTuple):
    """One rollout, time-major: every field is (T, N, ...). `done[t] = terminated[t] | truncated[t]`
    means obs[t+1] starts a new episode. `final_obs[t]` is the observation the step produced before
    the automatic reset (obs[t+1] when the episode goes on). Truncation bootstraps from V(final_obs);
    termination does not."""

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


class RolloutState(NamedTuple):
    """The environments' state from one cycle to the next, per seed."""

    env_state: Any
    obs: jax.Array  # (N, *obs_shape)
    episode_return: jax.Array  # (N,) running return of the unfinished episode
    episode_length: jax.Array  # (N,)
    discounted_return: jax.Array  # (N,) --norm-reward's running discounted return, zeroed after an episode ends


# --norm-obs, --norm-reward (37 details: 28-30): running statistics, as gym's wrappers keep them.
RUNNING_STATS_INITIAL_COUNT = 1e-4  # gym's RunningMeanStd(epsilon=1e-4)
NORMALIZE_EPS = 1e-8  # in sqrt(var + eps)
OBS_CLIP = 10.0  # normalised observations are clipped to [-10, 10]


class RunningMeanStd(NamedTuple):
    """Running mean and variance of a stream of batches, per feature."""

    mean: jax.Array
    var: jax.Array
    count: jax.Array  # float32, starts at RUNNING_STATS_INITIAL_COUNT


class TrainState(NamedTuple):
    """Everything the train loop carries, per seed."""

    params: Any
    opt_state: Any
    env: RolloutState
    key: jax.Array
    cycle: jax.Array  # cycles completed
    non_finite: jax.Array  # NaN guard: 0 while healthy, else the nan_guard.NON_FINITE_CHECKS index that failed
    non_finite_cycle: jax.Array  # the cycle whose update was not finite (0 while healthy)
    obs_stats: RunningMeanStd | None  # --norm-obs: running mean and variance of the observations; else None
    reward_stats: RunningMeanStd | None  # --norm-reward: running variance of env.discounted_return; else None
    sweep: dict[str, jax.Array] | None = None  # --sweep: this run's hyper-parameters (ppo_support/sweeps.py); else None


class UpdateState(NamedTuple):
    """The state of one cycle's minibatch updates, from one to the next."""

    params: Any
    opt_state: Any
    kl_stopped: jax.Array  # bool: --target-kl was exceeded; no later minibatch of the cycle is applied
    non_finite: jax.Array  # NaN guard: 0, or the nan_guard.NON_FINITE_CHECKS index of the first non-finite value
    metric_sums: dict[str, jax.Array]  # over the minibatches applied
    num_applied: jax.Array  # minibatch updates applied
    lr_and_clip: dict[str, jax.Array]  # charts/learning_rate and charts/clip_eps of the last update applied (NaN before)


# --- Network -------------------------------------------------------------------------------

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
    """log pi(action) and the entropy of a categorical policy (as distrax.Categorical, tested)."""
    log_probs = jax.nn.log_softmax(logits)
    log_prob = devices.take_along_last_axis(log_probs, action)
    entropy = -(jnp.exp(log_probs) * log_probs).sum(-1)
    return log_prob, entropy


def make_network(args: Args, num_actions: int) -> ActorCritic:
    return ActorCritic(num_actions, tuple(args.hidden_sizes), args.activation, args.orthogonal_init, args.shared_network)


def init_params(network: ActorCritic, key: jax.Array, args: Args, obs_shape: tuple[int, ...]) -> Any:
    return network.init(key, jnp.zeros((1, *obs_shape), jnp.float32))


# --- PPO, in run order: rollout, GAE, loss, minibatch update, epochs, cycle, make_train -------
# To hack: the network above, the loss in loss_fn, the optimizer in make_optimizer, the logged
# metrics at the end of train_cycle; the environments are envs.make_env's (ppo_support/envs.py).
def uses_action_mask(args: Args, env: Any) -> bool:
    return args.mask_invalid_actions and callable(getattr(env, "action_mask", None))


def reset_envs(key: jax.Array, env: Any, env_params: Any, num_envs: int) -> RolloutState:
    """Fresh episodes in every env, and a zero discounted return for --norm-reward."""
    obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(key, num_envs), env_params)
    zeros = jnp.zeros((num_envs,), jnp.float32)
    return RolloutState(env_state, obs, zeros, jnp.zeros((num_envs,), jnp.int32), zeros)


def collect_rollout(
    params: Any, rollout_state: RolloutState, key: jax.Array, network: ActorCritic, env: Any, env_params: Any,
    num_steps: int, mask_actions: bool, info_names: tuple[str, ...] = (), obs_stats: RunningMeanStd | None = None,
) -> tuple[RolloutState, Transition, dict[str, jax.Array]]:
    """Steps N envs for T steps with the current policy. Returns the new rollout state, the
    transitions, and `finished`: per step (T, N) the return, the length and the env's own `info`
    metrics (info_names, as env/<name>) of the episodes that ended there, NaN where none ended."""
    num_envs = rollout_state.obs.shape[0]
    num_actions = env.action_space(env_params).n
    gumbel_key, env_key = jax.random.split(key)
    gumbel = jax.random.gumbel(gumbel_key, (num_steps, num_envs, num_actions))  # (T, N, A)
    env_keys = jax.random.split(env_key, num_steps * num_envs).reshape(num_steps, num_envs)

    def step(rollout: RolloutState, step_input):
        step_gumbel, step_keys = step_input
        logits = network.apply(params, normalize_obs(obs_stats, rollout.obs), method="policy")
        action_mask = jax.vmap(env.action_mask, in_axes=(0, None))(rollout.env_state, env_params) if mask_actions else None
        action = jnp.argmax(masked(logits, action_mask) + step_gumbel, axis=-1)  # Gumbel-max = categorical sample
        stepped = envs.step_envs(env, step_keys, rollout.env_state, action, env_params)
        next_obs, env_state, reward, terminated, truncated, info = stepped
        done = jnp.logical_or(terminated, truncated)
        episode_return = rollout.episode_return + reward
        episode_length = rollout.episode_length + 1
        episode_end = {"charts/episodic_return": episode_return, "charts/episodic_length": episode_length}
        episode_end.update({f"env/{name}": info[name] for name in info_names})
        finished = {name: jnp.where(done, value.astype(jnp.float32), jnp.nan) for name, value in episode_end.items()}
        new_rollout = RolloutState(env_state, next_obs, jnp.where(done, 0.0, episode_return), jnp.where(done, 0, episode_length),
                                   rollout.discounted_return)
        transition = Transition(
            obs=rollout.obs, action=action, reward=reward.astype(jnp.float32), terminated=terminated, truncated=truncated,
            final_obs=info["final_observation"], action_mask=action_mask,
        )
        return new_rollout, (transition, finished)

    rollout_state, (transitions, finished) = jax.lax.scan(step, rollout_state, (gumbel, env_keys))
    return rollout_state, transitions, finished


# --- observation and reward normalisation (37 details: 28-30) ---------------------------------
# As gym's NormalizeObservation and NormalizeReward (the wrappers of CleanRL's PPO), but inside
# the jit: the statistics live in the TrainState, and are updated once per cycle from the whole
# rollout (observations) or step by step with the batch of envs (rewards), after the rollout.


def running_mean_std(shape: tuple[int, ...]) -> RunningMeanStd:
    """Mean 0, variance 1, count 1e-4, as gym's RunningMeanStd starts."""
    ones = jnp.ones(shape, jnp.float32)
    return RunningMeanStd(jnp.zeros(shape, jnp.float32), ones, jnp.float32(RUNNING_STATS_INITIAL_COUNT))


def normalization_stats(args: Args, env: Any, env_params: Any) -> dict[str, RunningMeanStd | None]:
    """The initial obs_stats and reward_stats of a TrainState; None for a flag that is off."""
    return {
        "obs_stats": running_mean_std(env.observation_space(env_params).shape) if args.norm_obs else None,
        "reward_stats": running_mean_std(()) if args.norm_reward else None,
    }


def update_running_mean_std(stats: RunningMeanStd, batch: jax.Array, axis_name: str | None) -> RunningMeanStd:
    """The parallel-variance update (Chan et al.) with the moments of `batch` (axis 0: the batch),
    as gym's RunningMeanStd.update; under shard_map the batch is every device's share."""
    batch = batch.astype(jnp.float32)
    batch_count = devices.sum_over_devices(jnp.float32(batch.shape[0]), axis_name)
    batch_mean = devices.sum_over_devices(batch.sum(axis=0), axis_name) / batch_count
    batch_var = devices.sum_over_devices(((batch - batch_mean) ** 2).sum(axis=0), axis_name) / batch_count
    delta = batch_mean - stats.mean
    count = stats.count + batch_count
    mean = stats.mean + delta * batch_count / count
    sum_of_squares = stats.var * stats.count + batch_var * batch_count + delta**2 * stats.count * batch_count / count
    return RunningMeanStd(mean, sum_of_squares / count, count)


def normalize_obs(stats: RunningMeanStd | None, obs: jax.Array) -> jax.Array:
    """(obs - mean) / sqrt(var + 1e-8), clipped to [-10, 10]; obs itself when stats is None
    (--norm-obs off). obs (..., *obs_shape)."""
    if stats is None:
        return obs
    return jnp.clip((obs.astype(jnp.float32) - stats.mean) / jnp.sqrt(stats.var + NORMALIZE_EPS), -OBS_CLIP, OBS_CLIP)


def update_obs_stats(stats: RunningMeanStd | None, obs: jax.Array, axis_name: str | None) -> RunningMeanStd | None:
    """The stats after a rollout's raw observations obs (T, N, *obs_shape); None stays None."""
    if stats is None:
        return None
    return update_running_mean_std(stats, obs.reshape(-1, *stats.mean.shape), axis_name)


def normalize_rewards(
    stats: RunningMeanStd | None, rollout_state: RolloutState, transitions: Transition, gamma: float, axis_name: str | None
) -> tuple[RunningMeanStd | None, RolloutState, jax.Array]:
    """--norm-reward (37 details: 30), step by step as gym's NormalizeReward (gym 0.21-0.25, as
    the 37 details used it): per env, ret = ret * gamma + reward; the variance of ret is updated
    with the batch of N envs; the reward becomes reward / sqrt(var + 1e-8) (no mean subtracted);
    then ret = 0 where the episode ended (done = terminated or truncated). Returns the new stats,
    rollout_state with the new discounted_return, and the rewards (T, N) to train on (the raw ones
    when stats is None)."""
    if stats is None:
        return None, rollout_state, transitions.reward
    done = jnp.logical_or(transitions.terminated, transitions.truncated)

    def step(running, step_input):
        stats, discounted_return = running
        reward, done = step_input
        discounted_return = discounted_return * gamma + reward
        stats = update_running_mean_std(stats, discounted_return, axis_name)
        scaled = reward / jnp.sqrt(stats.var + NORMALIZE_EPS)
        return (stats, jnp.where(done, 0.0, discounted_return)), scaled

    (stats, discounted_return), reward = jax.lax.scan(step, (stats, rollout_state.discounted_return), (transitions.reward, done))
    return stats, rollout_state._replace(discounted_return=discounted_return), reward


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
    value_loss, metrics); the total is policy_loss - ent_coef * entropy + vf_coef * value_loss.
    clip_vloss and norm_adv are bools (traced ones under --sweep: jnp.where takes both)."""
    advantage = batch.advantage
    mean = devices.mean_over_devices(advantage.mean(), axis_name)  # the whole minibatch's, every device's share included
    std = jnp.sqrt(devices.mean_over_devices(((advantage - mean) ** 2).mean(), axis_name))
    advantage = jnp.where(norm_adv, (advantage - mean) / (std + 1e-8), advantage)
    logratio = new_logp - batch.logp
    ratio = jnp.exp(logratio)
    surrogate = ratio * advantage
    clipped_surrogate = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantage
    policy_loss = -jnp.minimum(surrogate, clipped_surrogate).mean()

    value_change = new_value - batch.value
    unclipped_value_loss = (new_value - batch.target) ** 2
    clipped_value = batch.value + jnp.clip(value_change, -clip_eps, clip_eps)
    clipped_value_loss = jnp.maximum(unclipped_value_loss, (clipped_value - batch.target) ** 2)
    value_loss = 0.5 * jnp.where(clip_vloss, clipped_value_loss, unclipped_value_loss).mean()

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
    return lambda step: value * jnp.where(anneal, jnp.clip(1.0 - step / max(num_steps - 1, 1), 0.0, 1.0), 1.0)


def make_optimizer(args: Args) -> optax.GradientTransformation:
    """Global-norm clipping of the whole gradient (37 details: 11), then Adam's scaling. The
    learning rate is applied in minibatch_update, from the nominal gradient step: Adam's own step
    count skips the minibatches --target-kl stops, so its schedule would never reach 0."""
    return optax.chain(optax.clip_by_global_norm(args.max_grad_norm), optax.scale_by_adam(eps=args.adam_eps))


def minibatch_update(
    state: UpdateState, minibatch: Batch, learning_rate: jax.Array, clip_eps: jax.Array, network: ActorCritic,
    optimizer: optax.GradientTransformation, args: Args, axis_name: str | None,
) -> UpdateState:
    """One gradient step, skipped once --target-kl is exceeded (measured before this step, on this
    minibatch). A non-finite loss or gradient is recorded in `non_finite`; the NaN guard then undoes
    the whole cycle. Under shard_map the gradients, loss and metrics are averaged over devices."""
    own_params = devices.varying(state.params, axis_name)  # each device's gradient, not their sum: see devices.varying
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(own_params, minibatch, clip_eps, network, args, axis_name)
    loss, metrics, grads = devices.mean_over_devices((loss, metrics, grads), axis_name)
    metrics["losses/grad_norm"] = optax.tree.norm(grads)  # before clipping
    contract.check_computed_metrics(metrics, MINIBATCH_METRIC_NAMES, "MINIBATCH_METRIC_NAMES", contract.script_name(type(args)))
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)  # clipped, scaled by Adam
    params = optax.apply_updates(state.params, jax.tree.map(lambda update: -learning_rate * update, updates))

    kl_stopped = state.kl_stopped
    if args.target_kl is not None:  # 37 details: target-KL early stopping
        kl_stopped = kl_stopped | (metrics["losses/actor_approxkl3"] > args.target_kl)
        keep_if_not_stopped = lambda new, old: jnp.where(kl_stopped, old, new)  # noqa: E731
        params, opt_state = jax.tree.map(keep_if_not_stopped, (params, opt_state), (state.params, state.opt_state))
    non_finite = nan_guard.first_non_finite(state.non_finite, loss, metrics["losses/grad_norm"])
    applied = ~kl_stopped & (non_finite == 0)
    metric_sums = jax.tree.map(lambda total, value: total + jnp.where(applied, value, 0.0), state.metric_sums, metrics)
    this_step = {"charts/learning_rate": learning_rate, "charts/clip_eps": clip_eps}
    lr_and_clip = jax.tree.map(lambda value, last: jnp.where(applied, value, last), this_step, state.lr_and_clip)
    return UpdateState(params, opt_state, kl_stopped, non_finite, metric_sums, state.num_applied + applied, lr_and_clip)


def update_cycle(
    params: Any, opt_state: Any, batch: Batch, key: jax.Array, cycle: jax.Array, non_finite: jax.Array,
    network: ActorCritic, optimizer: optax.GradientTransformation, args: Args, axis_name: str | None = None,
) -> tuple[Any, Any, dict[str, jax.Array], jax.Array]:
    """K epochs of M minibatch updates on one rollout, each epoch on a fresh shuffle (keys are never
    reused); nothing is applied once `non_finite` is set. Returns the new params and optimizer
    state, the metrics averaged over the minibatches applied (and the learning rate and clip range
    the last of them used), and the NaN guard's code."""
    num_epochs, num_minibatches = args.num_epochs_per_cycle, args.num_minibatches_per_epoch
    batch_size = batch.action.shape[0]
    lr_schedule = annealed(args.lr, args.anneal_lr, args.num_gradient_steps)
    clip_schedule = annealed(args.clip_eps, args.anneal_clip_eps, args.num_gradient_steps)

    def epoch(state: UpdateState, epoch_input) -> tuple[UpdateState, None]:
        epoch_key, epoch_index = epoch_input
        permutation = jax.random.permutation(epoch_key, batch_size)
        minibatches = jax.tree.map(
            lambda x: x.reshape(num_minibatches, batch_size // num_minibatches, *x.shape[1:]), devices.permute_rows(batch, permutation)
        )  # (M, B / M, ...)
        first_step = (cycle * num_epochs + epoch_index) * num_minibatches
        gradient_steps = first_step + jnp.arange(num_minibatches)

        def one_minibatch(state, minibatch_input):
            minibatch, gradient_step = minibatch_input  # nominal: the steps --target-kl skips count too
            learning_rate, clip_eps = lr_schedule(gradient_step), clip_schedule(gradient_step)
            return minibatch_update(state, minibatch, learning_rate, clip_eps, network, optimizer, args, axis_name), None

        return jax.lax.scan(one_minibatch, state, (minibatches, gradient_steps))[0], None

    metric_sums = {name: jnp.float32(0.0) for name in MINIBATCH_METRIC_NAMES}
    lr_and_clip = {"charts/learning_rate": jnp.float32(jnp.nan), "charts/clip_eps": jnp.float32(jnp.nan)}
    state = UpdateState(params, opt_state, jnp.bool_(False), non_finite, metric_sums, jnp.float32(0.0), lr_and_clip)
    state, _ = jax.lax.scan(epoch, state, (jax.random.split(key, num_epochs), jnp.arange(num_epochs)))
    metrics = {name: total / jnp.maximum(state.num_applied, 1.0) for name, total in state.metric_sums.items()}
    metrics["losses/epochs_run"] = state.num_applied / num_minibatches
    metrics.update(state.lr_and_clip)
    return state.params, state.opt_state, metrics, state.non_finite


def explained_variance(prediction: jax.Array, target: jax.Array, axis_name: str | None = None) -> jax.Array:
    """1 - Var(target - prediction) / Var(target) over every device's batch; NaN when the
    target is constant."""

    def variance(x):
        mean = devices.mean_over_devices(x.mean(), axis_name)
        return devices.mean_over_devices(((x - mean) ** 2).mean(), axis_name)

    target_variance = variance(target)
    return jnp.where(target_variance == 0, jnp.nan, 1.0 - variance(target - prediction) / target_variance)


# Logged every cycle (charts/SPS is added on the host), then the env's own env/<name> metrics.
METRIC_NAMES = ("charts/episodic_return", "charts/episodic_length", "charts/learning_rate", "charts/clip_eps",
                *MINIBATCH_METRIC_NAMES, "losses/explained_variance", "losses/epochs_run")


def run_metric_names(env: Any, env_params: Any) -> tuple[str, ...]:
    """Everything a run logs per cycle, in the order of the metrics rows: METRIC_NAMES, then
    the env's own metrics."""
    return METRIC_NAMES + envs.env_metric_names(envs.env_info_names(env, env_params))


def train_cycle(
    state: TrainState, network: ActorCritic, optimizer: optax.GradientTransformation, env: Any, env_params: Any,
    args: Args, axis_name: str | None = None, info_names: tuple[str, ...] = (),
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One cycle of one seed: a rollout, GAE, then the update epochs. Returns the new state and
    the cycle's metrics (run_metric_names). Under shard_map it sees this device's envs."""
    if state.sweep is not None:  # --sweep: this run's hyper-parameters (traced) in place of the flags'
        args = sweeps.point_args(args, state.sweep)
        optimizer = make_optimizer(args)
    key, reset_key, rollout_key, update_key = jax.random.split(state.key, 4)
    reset_key, rollout_key, update_key = (devices.per_device(k, axis_name) for k in (reset_key, rollout_key, update_key))
    rollout_state = state.env
    if args.reset_envs_each_cycle:
        rollout_state = reset_envs(reset_key, env, env_params, rollout_state.obs.shape[0])

    rollout_state, transitions, finished = collect_rollout(
        state.params, rollout_state, rollout_key, network, env, env_params, args.num_env_steps_per_cycle, uses_action_mask(args, env),
        info_names=info_names, obs_stats=state.obs_stats,
    )
    obs_stats = update_obs_stats(state.obs_stats, transitions.obs, axis_name)  # next cycle's; this one's stay frozen
    reward_stats, rollout_state, reward = normalize_rewards(state.reward_stats, rollout_state, transitions, args.gamma, axis_name)

    # One batched forward pass over the whole rollout for log-probs and values, instead of one
    # per step inside the sequential loop (the same numbers).
    num_steps, num_envs = transitions.action.shape
    flat_normalized = lambda obs: normalize_obs(state.obs_stats, obs.reshape(num_steps * num_envs, *obs.shape[2:]))  # noqa: E731
    flat_obs = flat_normalized(transitions.obs)
    logits, value = network.apply(state.params, flat_obs)
    _, next_value = network.apply(state.params, flat_normalized(transitions.final_obs))
    flat_mask = None if transitions.action_mask is None else transitions.action_mask.reshape(-1, logits.shape[-1])
    logp, _ = log_prob_and_entropy(masked(logits, flat_mask), transitions.action.reshape(-1))

    done = jnp.logical_or(transitions.terminated, transitions.truncated)
    bootstrap_stops = transitions.terminated if args.bootstrap_truncated else done
    advantage, target = compute_gae(
        reward, value.reshape(num_steps, num_envs), next_value.reshape(num_steps, num_envs),
        bootstrap_stops.astype(jnp.float32), done, args.gamma, args.gae_lambda,
    )
    batch = Batch(flat_obs, transitions.action.reshape(-1), logp, value, advantage.reshape(-1), target.reshape(-1), flat_mask)
    params, opt_state, metrics, non_finite = update_cycle(
        state.params, state.opt_state, batch, update_key, state.cycle, state.non_finite, network, optimizer, args, axis_name
    )

    for name, values in finished.items():  # return, length, env/<name>: over the episodes that ended
        metrics[name] = devices.nanmean_or_nan(values, axis_name)
    metrics.update(envs.craftax_score(metrics))  # env/score, from the env/achievement_* rates (Craftax only)
    metrics["losses/explained_variance"] = explained_variance(batch.value, batch.target, axis_name)
    new_state = nan_guard.guard_non_finite(state, params, opt_state, non_finite)._replace(env=rollout_state, key=key, cycle=state.cycle + 1)
    return new_state._replace(obs_stats=obs_stats, reward_stats=reward_stats), metrics


# --- evaluation (--eval-every-cycles, --capture-video): the policy's step; evaluation.py plays it -
def eval_step(
    params: Any, eval_state: evaluation.EvalState, network: ActorCritic, env: Any, env_params: Any, args: Args,
    obs_stats: RunningMeanStd | None = None,
) -> evaluation.EvalState:
    """One step of every eval env. The policy is called as in collect_rollout (the only call of
    the evaluation), with invalid actions masked the same way and, with --norm-obs, the
    observations normalised by the statistics as they stand (evaluation never updates them);
    --eval-greedy takes the argmax of the masked logits, else a sample (Gumbel-max, as in training)."""
    rollout_state = eval_state.env
    key, action_key, env_key = jax.random.split(eval_state.key, 3)
    logits = network.apply(params, normalize_obs(obs_stats, rollout_state.obs), method="policy")
    mask_actions = uses_action_mask(args, env)
    action_mask = jax.vmap(env.action_mask, in_axes=(0, None))(rollout_state.env_state, env_params) if mask_actions else None
    noise = 0.0 if args.eval_greedy else jax.random.gumbel(action_key, logits.shape)
    action = jnp.argmax(masked(logits, action_mask) + noise, axis=-1)
    env_keys = jax.random.split(env_key, action.shape[0])
    stepped = envs.step_envs(env, env_keys, rollout_state.env_state, action, env_params)
    obs, env_state, reward, terminated, truncated, _ = stepped
    running = ~eval_state.finished
    episode_return = rollout_state.episode_return + jnp.where(running, reward.astype(jnp.float32), 0.0)
    rollout_state = rollout_state._replace(env_state=env_state, obs=obs, episode_return=episode_return,
                                   episode_length=rollout_state.episode_length + running)
    return evaluation.EvalState(rollout_state, eval_state.finished | terminated | truncated, key, eval_state.num_steps + 1)


def make_evaluation(network: ActorCritic, env: Any, env_params: Any, args: Args) -> evaluation.Policy:
    """The policy as evaluation.py plays it, inside the jit and in scripts/evaluate.py: eval_step with
    one seed's state (its params and, with --norm-obs, its obs_stats), fresh envs, and the frame a
    video shows of an observation (the observation itself)."""
    return evaluation.Policy(
        step=lambda state, eval_state: eval_step(state.params, eval_state, network, env, env_params, args, state.obs_stats),
        reset=lambda key, num_envs: reset_envs(key, env, env_params, num_envs),
        frame=lambda obs: obs,
    )


def make_train(args: Args, env: Any, env_params: Any, mesh: jax.sharding.Mesh | None = None):
    """Returns init(seed) -> TrainState of one seed, and train(states, num_cycles, max_cycles) ->
    (states, metrics): the next num_cycles cycles of a stack of seeds, meant to be jitted."""
    network = make_network(args, env.action_space(env_params).n)
    optimizer = make_optimizer(args)
    info_names = envs.env_info_names(env, env_params)  # the env's own episode metrics, logged as env/<name>
    metric_names = run_metric_names(env, env_params)

    @jax.jit
    def init_one(key: jax.Array) -> TrainState:
        key, params_key, env_key = jax.random.split(key, 3)
        params = init_params(network, params_key, args, env.observation_space(env_params).shape)
        rollout_state = reset_envs(env_key, env, env_params, args.num_parallel_envs)
        zero = jnp.int32(0)
        stats = normalization_stats(args, env, env_params)  # obs_stats, reward_stats: None where --norm-obs / --norm-reward are off
        return TrainState(params, optimizer.init(params), rollout_state, key, cycle=zero, non_finite=zero, non_finite_cycle=zero, **stats)

    init = lambda seed: init_one(jax.random.key(seed))  # noqa: E731  init(seed) -> TrainState

    axis_name = None if mesh is None else devices.DEVICE_AXIS
    one_seed = lambda state: train_cycle(state, network, optimizer, env, env_params, args, axis_name, info_names)  # noqa: E731
    every_seed = nan_guard.skip_when_every_seed_failed(devices.vmap_over_seeds(one_seed), metric_names)
    one_cycle = every_seed if mesh is None else devices.shard_over_devices(every_seed, mesh, TrainState)
    policy = make_evaluation(network, env, env_params, args)
    one_cycle, metric_names = evaluation.with_evaluation(one_cycle, metric_names, policy, args, env_params)  # eval/*

    def train(states: TrainState, num_cycles: int | jax.Array = args.num_cycles, max_cycles: int | None = None):
        """num_cycles more cycles, by default the whole run. A run's host calls one compiled
        program of it with a runtime num_cycles again and again (segments: ppo_support/segments.py).
        Returns the states and every cycle's metrics, (max_cycles, seeds) per name (max_cycles:
        num_cycles by default), NaN after the last cycle run."""

        def cycle_body(index, loop):
            states, metrics = loop
            states, cycle_metrics = one_cycle(states)
            return states, {name: metrics[name].at[index].set(cycle_metrics[name]) for name in metric_names}

        max_cycles = num_cycles if max_cycles is None else max_cycles
        metrics = {name: jnp.full((max_cycles, states.cycle.shape[0]), jnp.nan) for name in metric_names}
        return jax.lax.fori_loop(0, num_cycles, cycle_body, (states, metrics))

    return init, train


# --- Run: check the flags, make the env, build the program, train, save ----------------------
def validate_args(args: Args) -> None:
    """Every check on the arguments, before anything is compiled or written: the flags both
    scripts have (cli.check_common_args), then this script's own."""
    cli.check_common_args(args)
    if not args.hidden_sizes or min(args.hidden_sizes) <= 0:
        raise cli.ConfigError(f"--hidden-sizes must be one or more positive integers, got {args.hidden_sizes}")


OBS_STATS_FILE = "obs_stats.msgpack"  # a --norm-obs run's final observation statistics


def run(args: Args) -> dict[str, Any]:
    """Trains (or resumes from the newest checkpoint) and writes the run dir; returns its summary.
    The session (ppo_support/sessions.py) writes nothing until the program has compiled."""
    validate_args(args)
    devices.start_distributed(args)  # --distributed: before anything starts JAX's backend
    cpu.avoid_cpu_qr_deadlock()  # CPU settings, before JAX starts its backend
    env, env_params = envs.make_env(args.env_id, args.sticky_action_prob, args.optimistic_reset_ratio, args.env_params)
    mesh = devices.make_mesh(args)
    session = sessions.Session(args, run_metric_names(env, env_params))  # checks --run-dir or --resume
    init, train = make_train(args, env, env_params, mesh)
    policy = make_evaluation(make_network(args, env.action_space(env_params).n), env, env_params, args)  # --capture-video's
    session.compile(train, init, mesh, policy, env_params)  # on a thread of its own
    states = session.restore(devices.on_host_cpu(lambda: devices.stack_seeds([init(args.seed + i) for i in range(args.num_seeds)])))
    states = session.train(states)
    return session.finish(states, {OBS_STATS_FILE: states.obs_stats})  # and params.msgpack, summary.json


def load_params(run_dir: str | Path) -> tuple[Args, Any]:
    """The run's Args and the final parameters of every seed (leading seed axis), from RUN_DIR alone."""

    def one_seed(args: Args) -> Any:
        env, env_params = envs.make_env(args.env_id, param_values=args.env_params)
        network = make_network(args, env.action_space(env_params).n)
        return init_params(network, jax.random.key(0), args, env.observation_space(env_params).shape)

    return rundir.load_params(Path(run_dir), Args, one_seed)


def load_obs_stats(run_dir: str | Path) -> RunningMeanStd:
    """The final --norm-obs statistics of every seed (leading seed axis), from RUN_DIR alone;
    the policy in params.msgpack sees normalize_obs(stats, obs)."""
    args = rundir.args_from_json(Path(run_dir) / "args.json", Args)
    env, env_params = envs.make_env(args.env_id, param_values=args.env_params)
    template = devices.stack_seeds([running_mean_std(env.observation_space(env_params).shape)] * args.num_seeds)
    return rundir.read_msgpack(Path(run_dir) / OBS_STATS_FILE, template)


def main(argv: list[str] | None = None) -> int:
    """Exit code 2 for bad input (one `error:` line, nothing written), 1 when the run dir could not
    be written or a seed failed, else 0."""
    return cli.main(lambda: run(cli.parse_args(Args, argv)))


if __name__ == "__main__":
    sys.exit(main())
