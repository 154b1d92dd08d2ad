"""Evaluates the final policy of every seed of a run dir, and optionally writes a GIF.

    python scripts/evaluate.py runs/cartpole --episodes 32 --sampled
    python scripts/evaluate.py runs/breakout --gif breakout.gif
    python scripts/evaluate.py runs/shared --script ppo_mlp.py   # not the script args.json names

Reads RUN_DIR/args.json and RUN_DIR/params.msgpack with the training script that wrote them: the
file args.json records (a renamed copy too), else the file of that name in the repo root, or the
one --script names (`script_path_for_run` in runlib.py). It prints that script's path, and never
imports one that lies inside the run dir. The policy is played by the script's own evaluation
(its make_evaluation, as in --eval-every-cycles): each seed plays --episodes episodes in parallel
fresh envs (vmapped over seeds, one jit), and the return of each env's first episode counts.
Actions are chosen as the run's own evaluation chose them (its --eval-greedy, on by default: the
argmax), unless --greedy or --sampled says otherwise.
Prints `mean_return: X ± Y` (std over all episodes of all seeds), then one line per seed.

As in training: the LSTM's carry is threaded through the steps and reset where an episode
starts, frames are stacked, invalid actions are masked where the env has an `action_mask`, and a
`ppo_mlp.py --norm-obs` run's observations are normalised with its saved final statistics. The
env has no sticky actions (whatever --sticky-action-prob the run trained with).
--gif records the first episode of the first seed's first env with the script's own renderers
(those of its --capture-video): MinAtar channels as coloured cells, CartPole and Acrobot as a
line drawing of the state.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runlib import UnsafeScript, load_script_for_run, rundir  # noqa: E402


class UsageError(ValueError):
    """Printed as one `error: ...` line, exit code 2."""


def load_policy(run_dir: Path, script: Path | None) -> tuple[ModuleType, Any, Any]:
    """The script that wrote the run (or --script), the run's Args, and every seed's state as the
    script's evaluation reads it: a TrainState holding the final params (and, for a --norm-obs
    run, the final observation statistics)."""
    try:
        module = load_script_for_run(rundir.read_json_object(run_dir / "args.json"), run_dir, script)
    except (rundir.DamagedFile, UnsafeScript) as error:
        raise UsageError(str(error)) from error
    except FileNotFoundError as error:
        raise UsageError(f"{run_dir}: {error}") from error
    name = Path(module.__file__).name
    if not hasattr(module, "make_evaluation"):
        raise UsageError(f"{run_dir} was written by an older {name} without make_evaluation; evaluate it with that version")
    try:
        args, params = module.load_params(run_dir)
        states = module.TrainState(**dict.fromkeys(module.TrainState._fields))._replace(params=params)
        if getattr(args, "norm_obs", False):  # the policy sees observations normalised as in training
            states = states._replace(obs_stats=module.load_obs_stats(run_dir))
    except module.cli.ConfigError as error:  # a damaged args.json, params.msgpack or obs_stats.msgpack
        raise UsageError(str(error)) from error
    return module, args, states


def evaluate(run_dir: Path, episodes: int, greedy: bool | None, seed: int, gif: Path | None, script: Path | None) -> int:
    if not (run_dir / "args.json").is_file() or not (run_dir / "params.msgpack").is_file():
        raise UsageError(f"{run_dir} is not a finished run dir (needs args.json and params.msgpack)")
    if gif is not None and gif.suffix.lower() != ".gif":
        raise UsageError(f"--gif {gif}: the file name must end in .gif")
    module, args, states = load_policy(run_dir, script)
    greedy = args.eval_greedy if greedy is None else greedy  # the run's own evaluation, unless told otherwise
    args = dataclasses.replace(args, eval_episodes=episodes, eval_greedy=greedy)
    env, env_params = module.envs.make_env(args.env_id, param_values=args.env_params)
    videos = module.sessions.videos  # the script's own package's videos (its sessions records with them)
    render = videos.frame_renderer(args.env_id, env_params) if gif is not None else None
    if gif is not None and render is None:
        raise UsageError(f"--gif: cannot draw {args.env_id}; supported: *-MinAtar, CartPole-v1, Acrobot-v1")

    import jax
    import jax.numpy as jnp
    import numpy as np

    evaluation = module.evaluation  # the script's own package: the one it plays its policy with
    network = module.make_network(args, env.action_space(env_params).n)
    policy = module.make_evaluation(network, env, env_params, args)
    num_steps = evaluation.max_eval_steps(env_params)
    seeds = [args.seed + index for index in range(args.num_seeds)]

    @jax.jit
    def evaluate_all(states, keys):
        """The first episode's return of every env (NaN if unfinished), (seeds, episodes), and
        the first seed's first env played again step by step (for the GIF)."""

        def first_returns(state, key):
            start = evaluation.start_evaluation(key, policy, episodes)
            carry = evaluation.play_first_episodes(policy, state, start, num_steps)
            return jnp.where(carry.finished, carry.env.episode_return, jnp.nan)

        video = None
        if gif is not None:
            first_seed = jax.tree.map(lambda x: x[0], states)
            video = evaluation.record_video_episode(policy, first_seed, evaluation.start_evaluation(keys[0], policy, episodes))
        return jax.vmap(first_returns)(states, keys), video

    keys = jax.random.split(jax.random.key(seed), len(seeds))
    returns, video = evaluate_all(states, keys)
    returns = np.asarray(returns)

    finished = returns[~np.isnan(returns)]
    mode = "greedy" if greedy else "sampled"
    if finished.size == 0:
        print(f"mean_return: nan (no episode finished within {num_steps} steps)")
    else:
        print(f"mean_return: {finished.mean():.2f} ± {finished.std():.2f}  ({finished.size} episodes, "
              f"{len(seeds)} seeds, {mode} actions, {args.env_id}, {Path(module.__file__).name})")
    for index, run_seed in enumerate(seeds):
        per_seed = returns[index][~np.isnan(returns[index])]
        unfinished = episodes - per_seed.size
        text = f"{per_seed.mean():.2f} ± {per_seed.std():.2f}" if per_seed.size else "nan"
        print(f"  seed {run_seed}: {text}" + (f" ({unfinished} episodes unfinished)" if unfinished else ""))

    if gif is not None:
        env_states, frames, done = jax.tree.map(np.asarray, video)
        length = videos.write_gif(gif, env_states, frames, done, render)
        print(f"wrote {gif} ({length} frames, seed {seeds[0]}, first episode)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    parser.add_argument("--episodes", type=int, default=10, help="episodes per seed, run in parallel")
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--greedy", action="store_const", const=True, default=None,
                        help="argmax actions (default: as the run's --eval-greedy, on unless it trained with --no-eval-greedy)")
    choice.add_argument("--sampled", dest="greedy", action="store_const", const=False, help="sample actions, as in training")
    parser.add_argument("--gif", type=Path, help="write the first seed's first episode to this .gif")
    parser.add_argument("--seed", type=int, default=0, help="seed of the evaluation episodes")
    parser.add_argument("--script", type=Path, help="the training script to load (default: the one args.json records)")
    options = parser.parse_args(argv)
    if options.episodes < 1:
        parser.error(f"--episodes must be >= 1, got {options.episodes}")
    try:
        return evaluate(options.run_dir, options.episodes, options.greedy, options.seed, options.gif, options.script)
    except UsageError as error:
        parser.error(str(error))


if __name__ == "__main__":
    sys.exit(main())
