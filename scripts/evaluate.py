"""Evaluates the final policy of every seed of a run dir, and optionally writes a GIF.

    python scripts/evaluate.py runs/cartpole --episodes 32 --greedy
    python scripts/evaluate.py runs/breakout --gif breakout.gif

Reads RUN_DIR/args.json and RUN_DIR/params.msgpack with the training script that wrote them:
the file args.json records (a renamed copy too), else the file of that name in the repo root
(`script_path_for_run` in runs.py). Each seed plays --episodes episodes in parallel environments
(vmapped over envs and seeds, one jit); the return of each environment's first episode counts.
Prints `mean_return: X ± Y` (std over all episodes of all seeds), then one line per seed.

As in training: the LSTM's carry is threaded through the steps and reset where an episode
starts, frames are stacked, invalid actions are masked where the env has an `action_mask`, and a
`ppo_mlp.py --norm-obs` run's observations are normalised with its saved final statistics. The
env has no sticky actions (whatever --sticky-action-prob the run trained with).
--gif records the first episode of the first seed's first env with the training script's own
renderers (those of its --capture-video): MinAtar channels as coloured cells, CartPole and
Acrobot as a line drawing of the state.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runs import DamagedRunDir, load_script_for_run, read_json_object  # noqa: E402

# What this tool takes from the training script besides its policy: the episode cap of its own
# evaluation, and its renderers (which it uses for --capture-video).
SCRIPT_FUNCTIONS = ("max_eval_steps", "frame_renderer", "write_gif")


class UsageError(ValueError):
    """Printed as one `error: ...` line, exit code 2."""


# ======================================================================================
# Policies of the two scripts: reset, act, observe
# ======================================================================================


class Agent:
    """What both agents share: the script's pieces, and invalid actions masked as in training."""

    def __init__(self, module: Any, args: Any, network: Any, env: Any, env_params: Any):
        self.module, self.args, self.network, self.env, self.env_params = module, args, network, env, env_params
        self.mask_actions = module.uses_action_mask(args, env)

    def masked(self, logits, env_state):
        """logits (N, A) with the env's invalid actions masked, where the script masks them."""
        if not self.mask_actions:
            return logits
        import jax

        action_mask = jax.vmap(self.env.action_mask, in_axes=(0, None))(env_state, self.env_params)
        return self.module.masked(logits, action_mask)


class MLPAgent(Agent):
    """ppo_mlp.py: the observation is the whole agent state."""

    def reset(self, frame):
        return frame

    def logits(self, params, agent, env_state):
        if getattr(self.args, "norm_obs", False):  # params is (params, obs_stats): see evaluate()
            params, obs_stats = params
            logits, _ = self.network.apply(params, self.module.normalize_obs(obs_stats, agent))
        else:
            logits, _ = self.network.apply(params, agent)
        return self.masked(logits, env_state), agent

    def observe(self, agent, next_frame, done):
        return next_frame


class LSTMAgent(Agent):
    """ppo_lstm_impala.py: (frame stack, episode_start, LSTM carry). `episode_start` is the
    previous step's done; the network zeroes the carry there before it sees the observation."""

    def __init__(self, module: Any, args: Any, network: Any, env: Any, env_params: Any):
        super().__init__(module, args, network, env, env_params)
        self.stack_shape = module.stacked_obs_shape(env, env_params, args.frame_stack)

    def reset(self, frame):
        import jax.numpy as jnp

        num_envs = frame.shape[0]
        starts = jnp.ones((num_envs,), bool)
        stack = self.module.push_frame(jnp.zeros((num_envs, *self.stack_shape), jnp.float32), frame, starts)
        return stack, starts, jnp.zeros((num_envs, self.args.carry_size), jnp.float32)

    def logits(self, params, agent, env_state):
        stack, starts, carry = agent
        carries, logits, _ = self.network.apply(params, carry, stack[None], starts[None])  # one step
        return self.masked(logits[0], env_state), (stack, starts, carries[0])

    def observe(self, agent, next_frame, done):
        stack, _, carry = agent
        return self.module.push_frame(stack, next_frame, done), done, carry


# ======================================================================================
# Rollout
# ======================================================================================


def make_rollout(agent: Any, env: Any, env_params: Any, num_envs: int, num_steps: int, greedy: bool):
    """rollout(params, key) -> per step (T, N): reward, done, and env states and frames (for GIFs)."""
    import jax
    import jax.numpy as jnp

    def rollout(params, key):
        reset_key, key = jax.random.split(key)
        frame, env_state = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(reset_key, num_envs), env_params)

        def step(carry, step_key):
            env_state, frame, agent_state = carry
            action_key, env_key = jax.random.split(step_key)
            logits, agent_state = agent.logits(params, agent_state, env_state)
            if greedy:
                action = jnp.argmax(logits, axis=-1)
            else:
                action = jax.random.categorical(action_key, logits, axis=-1)
            next_frame, next_state, reward, terminated, truncated, _ = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
                jax.random.split(env_key, num_envs), env_state, action, env_params
            )
            done = jnp.logical_or(terminated, truncated)
            agent_state = agent.observe(agent_state, next_frame, done)
            return (next_state, next_frame, agent_state), (reward, done, env_state, frame)

        carry = (env_state, frame, agent.reset(frame))
        _, outputs = jax.lax.scan(step, carry, jax.random.split(key, num_steps))
        return outputs

    return rollout


def first_episode_returns(reward, done):
    """reward, done (T, ..., N) -> the return of each env's first episode (NaN if unfinished)."""
    import jax.numpy as jnp

    before_first_end = jnp.cumsum(done, axis=0) - done == 0  # steps up to and including the first done
    finished = jnp.any(done, axis=0)
    return jnp.where(finished, jnp.sum(reward * before_first_end, axis=0), jnp.nan)


# ======================================================================================
# main
# ======================================================================================


def evaluate(run_dir: Path, episodes: int, greedy: bool, seed: int, gif: Path | None) -> int:
    if not (run_dir / "args.json").is_file() or not (run_dir / "params.msgpack").is_file():
        raise UsageError(f"{run_dir} is not a finished run dir (needs args.json and params.msgpack)")
    if gif is not None and gif.suffix.lower() != ".gif":
        raise UsageError(f"--gif {gif}: the file name must end in .gif")
    try:
        module = load_script_for_run(read_json_object(run_dir / "args.json"))
    except DamagedRunDir as error:
        raise UsageError(str(error)) from error
    except FileNotFoundError as error:
        raise UsageError(f"{run_dir}: {error}") from error
    script = Path(module.__file__).name
    missing = [name for name in SCRIPT_FUNCTIONS if not hasattr(module, name)]
    if missing:
        raise UsageError(f"{run_dir} was written by an older {script} without {', '.join(missing)}; evaluate it with that version")
    try:
        args, params = module.load_params(run_dir)
        if getattr(args, "norm_obs", False):  # the policy sees observations normalised as in training
            params = (params, module.load_obs_stats(run_dir))
    except module.ConfigError as error:  # a damaged args.json, params.msgpack or obs_stats.msgpack
        raise UsageError(str(error)) from error
    env, env_params = module.make_env(args.env_id)
    render = module.frame_renderer(args.env_id, env_params) if gif is not None else None
    if gif is not None and render is None:
        raise UsageError(f"--gif: cannot draw {args.env_id}; supported: *-MinAtar, CartPole-v1, Acrobot-v1")

    import jax
    import numpy as np

    network = module.make_network(args, env.action_space(env_params).n)
    agent = (LSTMAgent if hasattr(args, "lstm_size") else MLPAgent)(module, args, network, env, env_params)
    num_steps = module.max_eval_steps(env_params)
    seeds = [args.seed + index for index in range(args.num_seeds)]

    rollout = make_rollout(agent, env, env_params, episodes, num_steps, greedy)

    @jax.jit
    def evaluate_all(params, keys):
        """Returns (seeds, episodes), and the first seed's first env per step (for the GIF)."""
        reward, done, states, frames = jax.vmap(rollout)(params, keys)  # (S, T, N, ...)
        first_env = jax.tree.map(lambda x: x[0, :, 0], (done, states, frames))
        return jax.vmap(first_episode_returns)(reward, done), first_env

    keys = jax.random.split(jax.random.key(seed), len(seeds))
    returns, (gif_done, gif_states, gif_frames) = evaluate_all(params, keys)
    returns = np.asarray(returns)

    finished = returns[~np.isnan(returns)]
    mode = "greedy" if greedy else "sampled"
    if finished.size == 0:
        print(f"mean_return: nan (no episode finished within {num_steps} steps)")
    else:
        print(f"mean_return: {finished.mean():.2f} ± {finished.std():.2f}  ({finished.size} episodes, "
              f"{len(seeds)} seeds, {mode} actions, {args.env_id}, {script})")
    for index, run_seed in enumerate(seeds):
        per_seed = returns[index][~np.isnan(returns[index])]
        unfinished = episodes - per_seed.size
        text = f"{per_seed.mean():.2f} ± {per_seed.std():.2f}" if per_seed.size else "nan"
        print(f"  seed {run_seed}: {text}" + (f" ({unfinished} episodes unfinished)" if unfinished else ""))

    if gif is not None:
        states = jax.tree.map(np.asarray, gif_states)
        length = module.write_gif(gif, states, np.asarray(gif_frames), np.asarray(gif_done), render)
        print(f"wrote {gif} ({length} frames, seed {seeds[0]}, first episode)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    parser.add_argument("--episodes", type=int, default=10, help="episodes per seed, run in parallel")
    parser.add_argument("--greedy", action="store_true", help="argmax actions instead of sampling")
    parser.add_argument("--gif", type=Path, help="write the first seed's first episode to this .gif")
    parser.add_argument("--seed", type=int, default=0, help="seed of the evaluation episodes")
    options = parser.parse_args(argv)
    if options.episodes < 1:
        parser.error(f"--episodes must be >= 1, got {options.episodes}")
    try:
        return evaluate(options.run_dir, options.episodes, options.greedy, options.seed, options.gif)
    except UsageError as error:
        parser.error(str(error))


if __name__ == "__main__":
    sys.exit(main())
