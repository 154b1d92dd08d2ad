"""PPO with an IMPALA CNN torso and an LSTM, for gymnax environments with (H, W, C) image
observations (e.g. the MinAtar games) and discrete actions; with an MLP torso (--torso mlp, which
--torso auto picks for them), for vector observations and any task that needs memory.

    python ppo_lstm_impala.py --env-id Breakout-MinAtar --num-seeds 5

Sibling of ppo_mlp.py: `diff ppo_mlp.py ppo_lstm_impala.py` shows the network, the recurrent carry
and how minibatches are cut (whole env sequences for BPTT, or single transitions with their
stored LSTM carry).

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
from flax import traverse_util
import jax
import jax.numpy as jnp
import optax

try:
    from ppo_support import cli, contract, cpu, devices, envs, evaluation, nan_guard, rundir, sessions, sweeps
except ModuleNotFoundError as missing:  # a copy of this file away from the repository
    if missing.name != "ppo_support":
        raise
    print(f"error: {Path(__file__).name} imports ppo_support, which sits beside ppo_lstm_impala.py in the repository; "
          "install it once with: pip install -e /path/to/that/repository", file=sys.stderr)
    sys.exit(2)

# --- Args ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Args:
    """PPO with an IMPALA CNN and an LSTM, for gymnax environments with image observations."""

    # --- experiment -----------------------------------------------------------------
    env_id: str = "Breakout-MinAtar"  # a gymnax id (images: the IMPALA CNN; else --torso mlp), or `module.path:Name` (see ppo_mlp.py)
    exp_name: str = Path(__file__).stem  # name of the experiment, in the default run dir and the wandb run name
    seed: int = 1  # seed of the first run; seed i uses seed + i
    num_seeds: int = 1  # independent seeds trained together in one compiled program (jax.vmap; on CPU in turn)
    sweep: tuple[str, ...] = ()  # KEY=V1,V2,...: a grid of the flags in `sweepable` (below) x seeds in one program
    # What --sweep may vary inside one program: flags that only enter the math as values (traced
    # scalars; a bool through jnp.where), never an array's shape or a Python `if`. A float or bool
    # flag you add to a copy can join them.
    sweepable: ClassVar[tuple[str, ...]] = (
        "lr", "clip_eps", "ent_coef", "vf_coef", "gamma", "gae_lambda", "max_grad_norm", "adam_eps", "target_kl",
        "norm_adv", "clip_vloss", "anneal_lr", "anneal_clip_eps",
    )
    num_total_env_steps: int = 20_000_000  # environment steps per seed

    # --- rollout (37 details: 1 vectorized env, 30 reward scaling) ----------------------
    num_parallel_envs: int = 256  # parallel environments per seed
    num_env_steps_per_cycle: int = 128  # steps per env per rollout; one cycle = one rollout + its update epochs
    reset_envs_each_cycle: bool = False  # UED style: every cycle starts from fresh episodes and zero LSTM carries
    bootstrap_truncated: bool = True  # time-limit steps bootstrap from V(final_observation); off: as terminations
    sticky_action_prob: float = 0.0  # the env repeats its last executed action with this probability (MinAtar's own: 0.1)
    optimistic_reset_ratio: int = 1  # Craftax, XLand-MiniGrid: ceil(envs / R) new episodes per step (Craftax's PPO: 16)
    env_params: tuple[str, ...] = ()  # KEY=VALUE fields of the env's params, e.g. memory_length=30 max_steps_in_episode=500
    norm_reward: bool = False  # rewards divided by the running std of a discounted return (gym's NormalizeReward)

    # --- optimisation (37 details: 3 Adam eps, 4 LR annealing, 6 minibatches) --------
    num_epochs_per_cycle: int = 5  # passes over the rollout per cycle (K epochs)
    num_minibatches_per_epoch: int = 8  # minibatches each epoch is cut into (bptt: groups of whole env sequences)
    lr: float = 5e-5  # Adam learning rate
    anneal_lr: bool = True  # linearly to exactly 0 at the run's last gradient step, counting those --target-kl skips
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

    # the torso before the LSTM: IMPALA's CNN (Espeholt et al. 2018), the Nature DQN's (Mnih et al. 2015), or
    # dense layers (--hidden-sizes, --activation, as ppo_mlp.py's) on the flattened observation; auto: impala
    # for (H, W, C) images, mlp for every other observation (vectors: Craftax-Symbolic, bsuite's MemoryChain)
    torso: Literal["auto", "impala", "nature", "mlp"] = "auto"
    impala_channels: tuple[int, ...] = (16, 32, 32)  # channels of the IMPALA stages (conv, max-pool, 2 residual blocks)
    torso_size: int = 256  # width of the dense layer after the IMPALA convolutions (--torso nature: 512, NATURE_DENSE_SIZE)
    hidden_sizes: tuple[int, ...] = (64, 64)  # --torso mlp: its hidden layer widths
    activation: Literal["tanh", "relu"] = "tanh"  # --torso mlp: its hidden activation
    lstm_size: int = 256  # LSTM width; 0: no LSTM, a feed-forward IMPALA network (IMPALA-FF)
    # bptt: minibatches of whole env sequences, replayed from the rollout's first carry, with
    # gradients through time; stored: single transitions, each a one-step forward from the carry
    # stored during the rollout (no gradient through time, more memory)
    lstm_training: Literal["bptt", "stored"] = "bptt"
    separate_critic: bool = False  # the critic gets its own torso and LSTM, instead of sharing the actor's
    head_hidden_sizes: tuple[int, ...] = ()  # ReLU layers in the actor's and the critic's head (PureJaxRL's ppo_rnn.py: 128); (): linear heads
    lstm_forget_bias: float | None = None  # added to the LSTM forget gate's initial bias; None: 1.0 (Jozefowicz et al. 2015) where there is an LSTM; 0: CleanRL's
    prev_action_reward: bool = False  # the LSTM also gets the previous action (one-hot) and raw reward; zeros at an episode start
    frame_stack: int = 1  # stack the last K observations along the channel axis
    orthogonal_init: bool = True  # gains sqrt(2) convs/dense, 1 LSTM, 0.01 actor, 1 critic, zero biases; off: flax's

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
    Image observations are frame-stacked along the channels (--frame-stack).
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
    prev_action_reward: jax.Array | None = None  # (T, N, A + 1) the LSTM's extra input with obs[t] (RolloutState's), or None


class Batch(NamedTuple):
    """Training data of one cycle, cut into sequences: every field but `carry` is (L, S, ...)
    with sequence length L and S sequences, L * S = T * N. bptt: L = T, S = N (whole env
    sequences, `carry` is each env's carry at the start of the rollout). stored: L = 1, S = T * N
    (single transitions, `carry` is the one stored at that step, after its reset).
    batch_from_rollout makes it; advantage and target are None until GAE fills them in."""

    obs: jax.Array
    episode_start: jax.Array  # (L, S) bool
    carry: jax.Array  # (S, carry_size)
    action: jax.Array
    logp: jax.Array
    value: jax.Array
    advantage: jax.Array
    target: jax.Array  # GAE return, the value target
    action_mask: jax.Array | None  # (L, S, A) bool, or None
    prev_action_reward: jax.Array | None = None  # (L, S, A + 1), or None


class RolloutState(NamedTuple):
    """The environments' state from one cycle to the next, per seed."""

    env_state: Any
    obs: jax.Array  # (N, *obs_shape): the frame stack, with --frame-stack
    episode_start: jax.Array  # (N,) bool: obs is the first of an episode (the previous step's done)
    lstm_carry: jax.Array  # (N, carry_size) before its reset by episode_start
    episode_return: jax.Array  # (N,) running return of the unfinished episode
    episode_length: jax.Array  # (N,)
    discounted_return: jax.Array  # (N,) --norm-reward's running discounted return, zeroed after an episode ends
    # --prev-action-reward: (N, A + 1) the previous action one-hot and its raw reward (before --norm-reward),
    # zeros where obs starts an episode; the LSTM's input with obs. None without the flag.
    prev_action_reward: jax.Array | None = None


# --norm-reward (37 details: 30): running statistics, as gym's wrapper keeps them.
RUNNING_STATS_INITIAL_COUNT = 1e-4  # gym's RunningMeanStd(epsilon=1e-4)
NORMALIZE_EPS = 1e-8  # in sqrt(var + eps)


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
    return nn.Conv(
        features, (kernel, kernel), (stride, stride), padding=padding,
        conv_general_dilated=cpu.convolution(kernel, stride), **init_kwargs(HIDDEN_GAIN, orthogonal_init),
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
    cpu.conv3x3_for_cpu, the others XLA's own."""

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


def resolved_torso(torso: str, obs_shape: tuple[int, ...]) -> str:
    """--torso auto: impala for (H, W, C) images, mlp for every other observation."""
    return torso if torso != "auto" else "impala" if len(obs_shape) == 3 else "mlp"


class Core(nn.Module):
    """IMPALA, Nature or MLP torso, then (unless lstm_size is 0) an LSTM scanned over time."""

    torso: str
    impala_channels: tuple[int, ...]
    torso_size: int
    hidden_sizes: tuple[int, ...]
    activation: str
    lstm_size: int
    orthogonal_init: bool

    @nn.compact
    def __call__(self, carry: jax.Array, obs: jax.Array, episode_start: jax.Array, prev_action_reward: jax.Array | None = None):
        """carry (B, 2 * lstm_size), obs (T, B, *obs_shape), episode_start (T, B), and with
        --prev-action-reward prev_action_reward (T, B, A + 1) -> carry after each step
        (T, B, 2 * lstm_size), features (T, B, F)"""
        num_steps, num_sequences = obs.shape[:2]
        flat_obs = obs.reshape(num_steps * num_sequences, *obs.shape[2:]).astype(jnp.float32)
        torso = resolved_torso(self.torso, obs.shape[2:])
        if torso == "mlp":
            features = MLP(self.hidden_sizes, self.activation, self.orthogonal_init)(flat_obs.reshape(len(flat_obs), -1))
        elif torso == "nature":
            features = NatureTorso(self.orthogonal_init)(flat_obs)
        else:
            features = ImpalaTorso(self.impala_channels, self.torso_size, self.orthogonal_init)(flat_obs)
        features = features.reshape(num_steps, num_sequences, -1)  # the torso runs batched over T
        if self.lstm_size == 0:  # IMPALA-FF: an empty carry, made from the input one so that it keeps
            return jnp.broadcast_to(carry, (num_steps, *carry.shape)), features  # its type under shard_map
        if prev_action_reward is not None:  # the LSTM's input: the torso's features, the previous action and reward
            features = jnp.concatenate([features, prev_action_reward], axis=-1)
        scanned_lstm = nn.scan(ResettingLSTM, variable_broadcast="params", split_rngs={"params": False})
        _, (carries, features) = scanned_lstm(self.lstm_size, self.orthogonal_init)(carry, (features, episode_start))
        return carries, features


def head(num_outputs: int, gain: float, hidden_sizes: tuple[int, ...], orthogonal_init: bool) -> nn.Module:
    """A head on the LSTM's output: one dense layer (CleanRL's, IMPALA's), or with --head-hidden-sizes
    ReLU layers before it (PureJaxRL's ppo_rnn.py). The LSTM's output lies in [-1, 1], and a linear
    value head on it learns large returns slowly (docs/experiments.md, the CartPole gap)."""
    if not hidden_sizes:
        return dense(num_outputs, gain, orthogonal_init)
    hidden = [layer for width in hidden_sizes for layer in (dense(width, HIDDEN_GAIN, orthogonal_init), nn.relu)]
    return nn.Sequential([*hidden, dense(num_outputs, gain, orthogonal_init)])


class ActorCritic(nn.Module):
    """A core (Core: the torso and the LSTM) with actor and critic heads; with --separate-critic the
    critic has a core of its own, a copy of the actor's (37 details: 13)."""

    num_actions: int
    core: Core  # unbound: the settings of the actor's core and the critic's
    separate_critic: bool
    head_hidden_sizes: tuple[int, ...] = ()

    def setup(self):
        self.actor_core = self.core.clone()
        self.critic_core = self.core.clone() if self.separate_critic else self.actor_core
        self.actor_head = head(self.num_actions, ACTOR_HEAD_GAIN, self.head_hidden_sizes, self.core.orthogonal_init)
        self.critic_head = head(1, CRITIC_HEAD_GAIN, self.head_hidden_sizes, self.core.orthogonal_init)

    def __call__(self, carry: jax.Array, obs: jax.Array, episode_start: jax.Array, prev_action_reward: jax.Array | None = None):
        """carry (B, carry_size) before the first step's reset, obs (T, B, *obs_shape),
        episode_start (T, B), prev_action_reward (T, B, A + 1) or None -> carry after each step
        (T, B, carry_size), logits (T, B, A), value (T, B)"""
        if not self.separate_critic:
            carries, features = self.actor_core(carry, obs, episode_start, prev_action_reward)
            return carries, self.actor_head(features), self.critic_head(features)[..., 0]
        actor_carry, critic_carry = jnp.split(carry, 2, axis=-1)
        actor_carries, actor_features = self.actor_core(actor_carry, obs, episode_start, prev_action_reward)
        critic_carries, critic_features = self.critic_core(critic_carry, obs, episode_start, prev_action_reward)
        carries = jnp.concatenate([actor_carries, critic_carries], axis=-1)
        return carries, self.actor_head(actor_features), self.critic_head(critic_features)[..., 0]


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
    core = Core(args.torso, tuple(args.impala_channels), args.torso_size, tuple(args.hidden_sizes), args.activation,
                args.lstm_size, args.orthogonal_init)
    return ActorCritic(num_actions, core, args.separate_critic, tuple(args.head_hidden_sizes))


def init_params(network: ActorCritic, key: jax.Array, args: Args, obs_shape: tuple[int, ...]) -> Any:
    carry = jnp.zeros((1, args.carry_size), jnp.float32)
    prev_action_reward = jnp.zeros((1, 1, network.num_actions + 1), jnp.float32) if args.prev_action_reward else None
    params = network.init(key, carry, jnp.zeros((1, 1, *obs_shape), jnp.float32), jnp.zeros((1, 1), bool), prev_action_reward)
    return add_forget_bias(params, args.lstm_forget_bias)


def add_forget_bias(params: Any, forget_bias: float | None) -> Any:
    """--lstm-forget-bias: adds forget_bias to the forget gate's bias (flax's `hf`) of every LSTM, so
    that at initialisation the cell keeps its memory (sigmoid(1) = 0.73 of it per step, not half).
    None (the default) adds 1.0 where there is an LSTM and leaves a network without one (--lstm-size
    0, a GRU) as it is; a value given for a network without one is refused."""
    flat = traverse_util.flatten_dict(params)
    forget_gates = [path for path in flat if path[-2:] == ("hf", "bias")]
    if not forget_gates and forget_bias:
        raise cli.ConfigError("--lstm-forget-bias: the network has no LSTM forget gate (a parameter .../hf/bias)")
    forget_bias = 1.0 if forget_bias is None else forget_bias
    return traverse_util.unflatten_dict({**flat, **{path: flat[path] + forget_bias for path in forget_gates}})


# --- PPO, in run order: rollout, GAE, loss, minibatch update, epochs, cycle, make_train -------
# To hack: the network above, the loss in loss_fn, the optimizer in make_optimizer, the logged
# metrics at the end of train_cycle; the environments are envs.make_env's (ppo_support/envs.py).
def stacked_obs_shape(env: Any, env_params: Any, frame_stack: int) -> tuple[int, ...]:
    """The last K observations along the last axis: (H, W, C * K) for images, (D * K,) for vectors."""
    *leading, channels = env.observation_space(env_params).shape
    return (*leading, channels * frame_stack)


def push_frame(stack: jax.Array, frame: jax.Array, episode_start: jax.Array) -> jax.Array:
    """stack (N, ..., C * K), frame (N, ..., C) -> the new stack, newest frame last. At an
    episode start the stack is zeros except the newest frame (no frames of the last episode)."""
    channels = frame.shape[-1]
    older = stack[..., channels:]  # drops the oldest frame; empty when K = 1
    older = jnp.where(episode_start.reshape(-1, *[1] * (frame.ndim - 1)), jnp.zeros_like(older), older)
    return jnp.concatenate([older, frame.astype(jnp.float32)], axis=-1)


def uses_action_mask(args: Args, env: Any) -> bool:
    return args.mask_invalid_actions and callable(getattr(env, "action_mask", None))


def reset_envs(key: jax.Array, env: Any, env_params: Any, num_envs: int, args: Args) -> RolloutState:
    """Fresh episodes in every env, a fresh frame stack, zero LSTM carries and a zero discounted
    return for --norm-reward."""
    frame, env_state = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(key, num_envs), env_params)
    starts = jnp.ones((num_envs,), bool)
    stack = jnp.zeros((num_envs, *stacked_obs_shape(env, env_params, args.frame_stack)), jnp.float32)
    lstm_carry = jnp.zeros((num_envs, args.carry_size), jnp.float32)
    zeros = jnp.zeros((num_envs,), jnp.float32)
    prev_action_reward = jnp.zeros((num_envs, env.action_space(env_params).n + 1), jnp.float32) if args.prev_action_reward else None
    return RolloutState(env_state, push_frame(stack, frame, starts), starts, lstm_carry, zeros, jnp.zeros((num_envs,), jnp.int32), zeros,
                    prev_action_reward)


def next_prev_action_reward(prev_action_reward: jax.Array | None, action: jax.Array, reward: jax.Array, done: jax.Array):
    """--prev-action-reward: the LSTM's extra input with the next observation, (N, A + 1): this
    step's action one-hot and raw reward, zeros where the next observation starts an episode."""
    if prev_action_reward is None:
        return None
    this_step = jnp.concatenate([jax.nn.one_hot(action, prev_action_reward.shape[-1] - 1), reward[:, None]], axis=-1)
    return jnp.where(done[:, None], 0.0, this_step.astype(jnp.float32))


def add_time_axis(x: jax.Array | None) -> jax.Array | None:
    return None if x is None else x[None]


def collect_rollout(
    params: Any, rollout_state: RolloutState, key: jax.Array, network: ActorCritic, env: Any, env_params: Any,
    num_steps: int, mask_actions: bool, store_carries: bool, info_names: tuple[str, ...] = (),
) -> tuple[RolloutState, Transition, dict[str, jax.Array]]:
    """Steps N envs for T steps with the current policy, carrying the LSTM state. Returns the new
    rollout state, the transitions, and `finished`: per step (T, N) the return, the length and the
    env's own `info` metrics (info_names, as env/<name>) of the episodes that ended there, NaN
    where none ended. With store_carries each step's carry (after its reset) is kept (stored)."""
    num_envs = rollout_state.obs.shape[0]
    num_actions = env.action_space(env_params).n
    gumbel_key, env_key = jax.random.split(key)
    gumbel = jax.random.gumbel(gumbel_key, (num_steps, num_envs, num_actions))  # (T, N, A)
    env_keys = jax.random.split(env_key, num_steps * num_envs).reshape(num_steps, num_envs)

    def step(rollout: RolloutState, step_input):
        step_gumbel, step_keys = step_input
        lstm_carries, logits, _ = network.apply(params, rollout.lstm_carry, rollout.obs[None], rollout.episode_start[None],
                                                add_time_axis(rollout.prev_action_reward))
        action_mask = jax.vmap(env.action_mask, in_axes=(0, None))(rollout.env_state, env_params) if mask_actions else None
        action = jnp.argmax(masked(logits[0], action_mask) + step_gumbel, axis=-1)  # Gumbel-max = categorical sample
        stepped = envs.step_envs(env, step_keys, rollout.env_state, action, env_params)
        next_frame, env_state, reward, terminated, truncated, info = stepped
        done = jnp.logical_or(terminated, truncated)
        next_obs = push_frame(rollout.obs, next_frame, done)
        # The stack the step produced, before the reset: the same history, its own last frame.
        final_obs = push_frame(rollout.obs, info["final_observation"], jnp.zeros_like(done))
        episode_return = rollout.episode_return + reward
        episode_length = rollout.episode_length + 1
        episode_end = {"charts/episodic_return": episode_return, "charts/episodic_length": episode_length}
        episode_end.update({f"env/{name}": info[name] for name in info_names})
        finished = {name: jnp.where(done, value.astype(jnp.float32), jnp.nan) for name, value in episode_end.items()}
        new_rollout = RolloutState(  # the carry reset itself happens in the next forward pass, from episode_start
            env_state, next_obs, done, lstm_carries[0], jnp.where(done, 0.0, episode_return), jnp.where(done, 0, episode_length),
            rollout.discounted_return, next_prev_action_reward(rollout.prev_action_reward, action, reward, done),
        )
        stored_carry = reset_carry(rollout.lstm_carry, rollout.episode_start) if store_carries else rollout.lstm_carry[:, :0]
        transition = Transition(
            obs=rollout.obs, episode_start=rollout.episode_start, carry=stored_carry, action=action,
            reward=reward.astype(jnp.float32), terminated=terminated, truncated=truncated, final_obs=final_obs,
            action_mask=action_mask, prev_action_reward=rollout.prev_action_reward,
        )
        return new_rollout, (transition, finished)

    rollout_state, (transitions, finished) = jax.lax.scan(step, rollout_state, (gumbel, env_keys))
    return rollout_state, transitions, finished


def final_prev_action_reward(transitions: Transition) -> jax.Array | None:
    """--prev-action-reward: the LSTM's extra input with final_obs[t], (1, T * N, A + 1): step t's
    action and raw reward (final_obs continues step t's episode), never reset."""
    if transitions.prev_action_reward is None:
        return None
    num_actions = transitions.prev_action_reward.shape[-1] - 1
    this_step = jnp.concatenate([jax.nn.one_hot(transitions.action, num_actions), transitions.reward[..., None]], axis=-1)
    return this_step.reshape(1, -1, num_actions + 1)


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


def forward_in_minibatches(
    params: Any, carry: jax.Array, obs: jax.Array, episode_start: jax.Array, network: ActorCritic, num_minibatches: int,
    prev_action_reward: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The loss's forward pass over all S sequences, one minibatch-sized group at a time:
    carry (S, C), obs (L, S, ...), episode_start (L, S) -> carries (L, S, C), logits (L, S, A),
    value (L, S). Same shapes and function as in loss_fn, so the first minibatch's ratio is 1.0
    exactly, as in ppo_mlp.py; it also bounds the memory of the pass."""
    groups = (
        split_sequences(carry, 0, num_minibatches),
        split_sequences(obs, 1, num_minibatches),
        split_sequences(episode_start, 1, num_minibatches),
        None if prev_action_reward is None else split_sequences(prev_action_reward, 1, num_minibatches),
    )
    carries, logits, value = jax.lax.map(lambda group: network.apply(params, *group), groups)
    return merge_sequences(carries, 1), merge_sequences(logits, 1), merge_sequences(value, 1)


def batch_from_rollout(
    params: Any, first_carry: jax.Array, transitions: Transition, network: ActorCritic, args: Args
) -> tuple[Batch, jax.Array]:
    """The rollout as the loss sees it: cut into the sequences the loss unrolls, (L, S, ...) with
    L * S = T * N, with the log-probs and values of the loss's own forward pass (not the
    rollout's), so that the first minibatch reproduces them exactly. Its advantage and target are
    None until GAE fills them in.

    Also returns next_value (T, N) = V(final_obs[t]) from the carry after obs[t], before any
    reset: a reset carry would bootstrap a truncated episode from the wrong state.
    """
    num_steps, num_envs = transitions.action.shape  # this device's envs
    sequence_shape = (args.sequence_length, num_steps * num_envs // args.sequence_length)
    to_sequences = lambda x: None if x is None else x.reshape(*sequence_shape, *x.shape[2:])  # noqa: E731
    if args.lstm_training == "bptt":
        sequence_carry, sequence_start = first_carry, transitions.episode_start
    else:  # the stored carries are already reset
        sequence_carry = transitions.carry.reshape(num_steps * num_envs, args.carry_size)
        sequence_start = jnp.zeros(sequence_shape, bool)
    batch = Batch(
        obs=to_sequences(transitions.obs), episode_start=sequence_start, carry=sequence_carry,
        action=to_sequences(transitions.action), logp=None, value=None, advantage=None, target=None,
        action_mask=to_sequences(transitions.action_mask), prev_action_reward=to_sequences(transitions.prev_action_reward),
    )

    carries, logits, value = forward_in_minibatches(
        params, batch.carry, batch.obs, batch.episode_start, network, args.num_minibatches_per_epoch, batch.prev_action_reward
    )
    logp, _ = log_prob_and_entropy(masked(logits, batch.action_mask), batch.action)
    _, _, next_value = forward_in_minibatches(
        params,
        carries.reshape(num_steps * num_envs, args.carry_size),  # carry after obs[t], (T * N, C)
        transitions.final_obs.reshape(1, num_steps * num_envs, *transitions.final_obs.shape[2:]),
        jnp.zeros((1, num_steps * num_envs), bool),
        network,
        args.num_minibatches_per_epoch,
        final_prev_action_reward(transitions),  # the final observation's: its own step's action and reward
    )
    return batch._replace(logp=logp, value=value), next_value.reshape(num_steps, num_envs)


# --- reward normalisation (37 details: 30) ------------------------------------------------------
# As gym's NormalizeReward (the wrapper of CleanRL's PPO), but inside the jit: the statistics
# live in the TrainState and are updated step by step with the batch of envs, after the rollout.
# (No observation normalisation here: ppo_mlp.py's --norm-obs is for vector observations.)


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
    batch_count = devices.sum_over_devices(jnp.float32(batch.shape[0]), axis_name)
    batch_mean = devices.sum_over_devices(batch.sum(axis=0), axis_name) / batch_count
    batch_var = devices.sum_over_devices(((batch - batch_mean) ** 2).sum(axis=0), axis_name) / batch_count
    delta = batch_mean - stats.mean
    count = stats.count + batch_count
    mean = stats.mean + delta * batch_count / count
    sum_of_squares = stats.var * stats.count + batch_var * batch_count + delta**2 * stats.count * batch_count / count
    return RunningMeanStd(mean, sum_of_squares / count, count)


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
    # bptt: replays whole sequences from their first carry with the rollout's resets (gradients
    # flow through time); stored: a one-step forward from each transition's stored carry.
    _, logits, new_value = network.apply(params, batch.carry, batch.obs, batch.episode_start, batch.prev_action_reward)
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


def update_cycle(
    params: Any, opt_state: Any, batch: Batch, key: jax.Array, cycle: jax.Array, non_finite: jax.Array,
    network: ActorCritic, optimizer: optax.GradientTransformation, args: Args, axis_name: str | None = None,
) -> tuple[Any, Any, dict[str, jax.Array], jax.Array]:
    """K epochs of M minibatch updates on one rollout, each epoch on a fresh shuffle (keys are never
    reused); nothing is applied once `non_finite` is set. Returns the new params and optimizer
    state, the metrics averaged over the minibatches applied (and the learning rate and clip range
    the last of them used), and the NaN guard's code."""
    num_epochs, num_minibatches = args.num_epochs_per_cycle, args.num_minibatches_per_epoch
    num_sequences = batch.carry.shape[0]  # this device's share of the seed's sequences
    lr_schedule = annealed(args.lr, args.anneal_lr, args.num_gradient_steps)
    clip_schedule = annealed(args.clip_eps, args.anneal_clip_eps, args.num_gradient_steps)

    def epoch(state: UpdateState, epoch_input) -> tuple[UpdateState, None]:
        epoch_key, epoch_index = epoch_input
        permutation = jax.random.permutation(epoch_key, num_sequences)
        minibatches = cut_minibatches(batch, permutation, num_minibatches)  # (M, L, S / M, ...)
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
        rollout_state = reset_envs(reset_key, env, env_params, rollout_state.obs.shape[0], args)
    first_carry = rollout_state.lstm_carry  # (N, C) before the first step's reset

    rollout_state, transitions, finished = collect_rollout(
        state.params, rollout_state, rollout_key, network, env, env_params, args.num_env_steps_per_cycle,
        uses_action_mask(args, env), store_carries=args.lstm_training == "stored", info_names=info_names,
    )
    reward_stats, rollout_state, reward = normalize_rewards(state.reward_stats, rollout_state, transitions, args.gamma, axis_name)

    batch, next_value = batch_from_rollout(state.params, first_carry, transitions, network, args)
    num_steps, num_envs = transitions.action.shape
    done = jnp.logical_or(transitions.terminated, transitions.truncated)
    bootstrap_stops = transitions.terminated if args.bootstrap_truncated else done
    advantage, target = compute_gae(
        reward, batch.value.reshape(num_steps, num_envs), next_value,
        bootstrap_stops.astype(jnp.float32), done, args.gamma, args.gae_lambda,
    )
    batch = batch._replace(advantage=advantage.reshape(batch.logp.shape), target=target.reshape(batch.logp.shape))
    params, opt_state, metrics, non_finite = update_cycle(
        state.params, state.opt_state, batch, update_key, state.cycle, state.non_finite, network, optimizer, args, axis_name
    )

    for name, values in finished.items():  # return, length, env/<name>: over the episodes that ended
        metrics[name] = devices.nanmean_or_nan(values, axis_name)
    metrics.update(envs.craftax_score(metrics))  # env/score, from the env/achievement_* rates (Craftax only)
    metrics["losses/explained_variance"] = explained_variance(batch.value, batch.target, axis_name)
    new_state = nan_guard.guard_non_finite(state, params, opt_state, non_finite)._replace(env=rollout_state, key=key, cycle=state.cycle + 1)
    return new_state._replace(reward_stats=reward_stats), metrics


# --- evaluation (--eval-every-cycles, --capture-video): the policy's step; evaluation.py plays it -
def eval_step(
    params: Any, eval_state: evaluation.EvalState, network: ActorCritic, env: Any, env_params: Any, args: Args
) -> evaluation.EvalState:
    """One step of every eval env. The policy is called as in collect_rollout (the only call of
    the evaluation), with the LSTM carry reset where an episode starts and invalid actions masked
    the same way; --eval-greedy takes the argmax of the masked logits, else a sample (Gumbel-max,
    as in training)."""
    rollout_state = eval_state.env
    key, action_key, env_key = jax.random.split(eval_state.key, 3)
    lstm_carries, logits, _ = network.apply(
        params, rollout_state.lstm_carry, rollout_state.obs[None], rollout_state.episode_start[None],
        add_time_axis(rollout_state.prev_action_reward),
    )
    logits = logits[0]
    mask_actions = uses_action_mask(args, env)
    action_mask = jax.vmap(env.action_mask, in_axes=(0, None))(rollout_state.env_state, env_params) if mask_actions else None
    noise = 0.0 if args.eval_greedy else jax.random.gumbel(action_key, logits.shape)
    action = jnp.argmax(masked(logits, action_mask) + noise, axis=-1)
    env_keys = jax.random.split(env_key, action.shape[0])
    stepped = envs.step_envs(env, env_keys, rollout_state.env_state, action, env_params)
    next_frame, env_state, reward, terminated, truncated, _ = stepped
    done = jnp.logical_or(terminated, truncated)
    running = ~eval_state.finished
    episode_return = rollout_state.episode_return + jnp.where(running, reward.astype(jnp.float32), 0.0)
    rollout_state = rollout_state._replace(  # the carry reset itself happens in the next forward pass, from episode_start
        env_state=env_state, obs=push_frame(rollout_state.obs, next_frame, done), episode_start=done,
        lstm_carry=lstm_carries[0], episode_return=episode_return, episode_length=rollout_state.episode_length + running,
        prev_action_reward=next_prev_action_reward(rollout_state.prev_action_reward, action, reward, done),
    )
    return evaluation.EvalState(rollout_state, eval_state.finished | done, key, eval_state.num_steps + 1)


def make_evaluation(network: ActorCritic, env: Any, env_params: Any, args: Args) -> evaluation.Policy:
    """The policy as evaluation.py plays it, inside the jit and in scripts/evaluate.py: eval_step with
    one seed's state (its params), fresh envs with zero LSTM carries, and the frame a video shows of
    an observation (the newest frame of the stack)."""
    channels = env.observation_space(env_params).shape[-1]  # of one frame
    return evaluation.Policy(
        step=lambda state, eval_state: eval_step(state.params, eval_state, network, env, env_params, args),
        reset=lambda key, num_envs: reset_envs(key, env, env_params, num_envs, args),
        frame=lambda obs: obs[..., -channels:],
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
        params = init_params(network, params_key, args, stacked_obs_shape(env, env_params, args.frame_stack))
        rollout_state = reset_envs(env_key, env, env_params, args.num_parallel_envs, args)
        zero = jnp.int32(0)
        stats = normalization_stats(args, env, env_params)  # reward_stats: None where --norm-reward is off
        return TrainState(params, optimizer.init(params), rollout_state, key, cycle=zero, non_finite=zero, non_finite_cycle=zero, **stats)

    init = lambda seed: init_one(jax.random.key(seed))  # noqa: E731  init(seed) -> TrainState

    axis_name = None if mesh is None else devices.DEVICE_AXIS
    one_seed = lambda state: train_cycle(state, network, optimizer, env, env_params, args, axis_name, info_names)  # noqa: E731
    every_seed = nan_guard.skip_when_every_seed_failed(cpu.seeds_in_turn_on_cpu(one_seed), metric_names)  # vmapped off CPU
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
    cli.check_common_args(args, more_positive_ints=("torso_size", "frame_stack"))
    devices.check_minibatches(args, sequence_length=args.sequence_length)  # bptt: of whole env sequences
    if not args.impala_channels or min(args.impala_channels) <= 0:
        raise cli.ConfigError(f"--impala-channels must be one or more positive integers, got {args.impala_channels}")
    if not args.hidden_sizes or min(args.hidden_sizes) <= 0:
        raise cli.ConfigError(f"--hidden-sizes must be one or more positive integers, got {args.hidden_sizes}")
    if args.head_hidden_sizes and min(args.head_hidden_sizes) <= 0:
        raise cli.ConfigError(f"--head-hidden-sizes must be positive integers (none: linear heads), got {args.head_hidden_sizes}")
    if args.lstm_size < 0:
        raise cli.ConfigError(f"--lstm-size must be >= 0 (0: no LSTM), got {args.lstm_size}")
    if args.prev_action_reward and args.lstm_size == 0:
        raise cli.ConfigError("--prev-action-reward feeds the LSTM, and --lstm-size 0 has none")
    if args.lstm_forget_bias and args.lstm_size == 0:
        raise cli.ConfigError("--lstm-forget-bias sets the LSTM's forget gate, and --lstm-size 0 has none")


TORSO_FLAGS = {"impala": ("impala_channels", "torso_size"), "nature": (), "mlp": ("hidden_sizes", "activation")}


def check_observations(args: Args, env: Any, env_params: Any) -> None:
    """--torso impala and nature take (H, W, C) images, nature of at least SMALL_NATURE_MIN_SIDE px
    a side; mlp (and auto) any observation. A torso flag set away from its default that the torso
    in use does not read (TORSO_FLAGS) is refused, instead of being ignored."""
    obs_shape = tuple(env.observation_space(env_params).shape)
    torso = resolved_torso(args.torso, obs_shape)
    defaults = {field.name: field.default for field in dataclasses.fields(Args)}
    for name in [name for names in TORSO_FLAGS.values() for name in names if name not in TORSO_FLAGS[torso]]:
        if getattr(args, name) != defaults[name]:
            reads = " and ".join(map(cli.flag, TORSO_FLAGS[torso])) or "no size flag (its layers are the Nature DQN's)"
            raise cli.ConfigError(
                f"{cli.flag(name)} is not read by the {torso} torso (--torso {args.torso}, --env-id {args.env_id}), which "
                f"reads {reads}"
            )
    if args.torso in ("impala", "nature") and len(obs_shape) != 3:
        raise cli.ConfigError(
            f"--torso {args.torso} needs (H, W, C) images; --env-id {args.env_id} has observations of shape "
            f"{obs_shape} (use --torso mlp, or auto)"
        )
    if args.torso == "nature" and min(obs_shape[:2]) < SMALL_NATURE_MIN_SIDE:
        raise cli.ConfigError(
            f"--torso nature needs images of at least {SMALL_NATURE_MIN_SIDE}x{SMALL_NATURE_MIN_SIDE} px; --env-id "
            f"{args.env_id} has observations of shape {obs_shape} (use --torso impala)"
        )


def run(args: Args) -> dict[str, Any]:
    """Trains (or resumes from the newest checkpoint) and writes the run dir; returns its summary.
    The session (ppo_support/sessions.py) writes nothing until the program has compiled."""
    validate_args(args)
    devices.start_distributed(args)  # --distributed: before anything starts JAX's backend
    cpu.avoid_cpu_qr_deadlock()  # CPU settings, before JAX starts its backend
    env, env_params = envs.make_env(args.env_id, args.sticky_action_prob, args.optimistic_reset_ratio, args.env_params)
    check_observations(args, env, env_params)
    mesh = devices.make_mesh(args, args.sequence_length)
    session = sessions.Session(args, run_metric_names(env, env_params))  # checks --run-dir or --resume
    init, train = make_train(args, env, env_params, mesh)
    policy = make_evaluation(make_network(args, env.action_space(env_params).n), env, env_params, args)  # --capture-video's
    session.compile(train, init, mesh, policy, env_params)  # on a thread of its own
    states = session.restore(devices.on_host_cpu(lambda: devices.stack_seeds([init(args.seed + i) for i in range(args.num_seeds)])))
    if args.lstm_training == "stored":  # T * N * carry_size float32s per seed, said before they are spent
        print(f"--lstm-training stored keeps {args.batch_size * args.carry_size * 4 / 2**20:.1f} MiB of LSTM carries "
              "per seed", flush=True)
    states = session.train(states)
    return session.finish(states)  # params.msgpack, summary.json


def load_params(run_dir: str | Path) -> tuple[Args, Any]:
    """The run's Args and the final parameters of every seed (leading seed axis), from RUN_DIR alone."""

    def one_seed(args: Args) -> Any:
        env, env_params = envs.make_env(args.env_id, param_values=args.env_params)
        network = make_network(args, env.action_space(env_params).n)
        return init_params(network, jax.random.key(0), args, stacked_obs_shape(env, env_params, args.frame_stack))

    return rundir.load_params(Path(run_dir), Args, one_seed)


def main(argv: list[str] | None = None) -> int:
    """Exit code 2 for bad input (one `error:` line, nothing written), 1 when the run dir could not
    be written or a seed failed, else 0."""
    return cli.main(lambda: run(cli.parse_args(Args, argv)))


if __name__ == "__main__":
    sys.exit(main())
