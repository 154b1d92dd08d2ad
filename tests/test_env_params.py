"""--env-params KEY=VALUE: fields of the env's params from the command line, in both scripts,
wherever an env is built (training, evaluation inside the jit, scripts/evaluate.py, --resume)."""

from __future__ import annotations

import json
import re

import jax
import pytest

import ppo_lstm_impala
import ppo_mlp
from helpers import run_script
from ppo_support import cli, envs
from ppo_support.errors import ConfigError


def test_values_are_parsed_as_their_fields_types():
    _, params = envs.make_env("MemoryChain-bsuite", param_values=("memory_length=30",))
    assert params.memory_length == 30 and type(params.memory_length) is int
    _, params = envs.make_env("CartPole-v1", param_values=("max_steps_in_episode=20", "gravity=4.5"))
    assert (params.max_steps_in_episode, params.gravity) == (20, 4.5) and type(params.gravity) is float
    assert envs.make_env("CartPole-v1")[1].max_steps_in_episode == 500  # nothing else changes



@pytest.mark.parametrize("memory_length", [3, 30])
def test_memory_chain_episodes_last_memory_length_plus_one_steps(memory_length):
    """The behaviour follows the field: the episode ends at step memory_length + 1 (default 5:
    6 steps), the only reward, +1 or -1, comes at its last step, and the next episode goes the same."""
    env, params = envs.make_env("MemoryChain-bsuite", param_values=(f"memory_length={memory_length}",))
    step = jax.jit(env.step)
    key = jax.random.key(0)
    _, state = env.reset(key, params)
    ends, rewards = [], []
    for t in range(1, 2 * (memory_length + 1) + 1):
        _, state, reward, terminated, truncated, _ = step(jax.random.fold_in(key, t), state, t % 2, params)
        rewards.append(float(reward))
        assert not truncated
        if terminated:
            ends.append(t)
    assert ends == [memory_length + 1, 2 * (memory_length + 1)]
    assert [t for t, reward in enumerate(rewards, start=1) if reward != 0.0] == ends and set(rewards) <= {-1.0, 0.0, 1.0}

@pytest.mark.parametrize("values, message", [
    (("memory_lenght=30",), "has no field 'memory_lenght'; its fields: max_steps_in_episode, memory_length"),
    (("memory_length=abc",), "memory_length is a int, got 'abc'"),
    (("memory_length=1.5",), "memory_length is a int, got '1.5'"),
    (("memory_length",), "takes KEY=VALUE"),
    (("memory_length=3", "memory_length=4"), "sets memory_length twice"),
])
def test_unknown_fields_and_bad_values_are_refused_with_the_valid_fields(values, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        envs.make_env("MemoryChain-bsuite", param_values=values)


def test_craftax_and_xland_minigrid_params_are_set_too():
    pytest.importorskip("craftax")
    pytest.importorskip("xminigrid")
    _, params = envs.make_env("Craftax-Classic-Symbolic-v1", param_values=("max_timesteps=100",))
    assert params.max_timesteps == 100
    env, params = envs.make_env("MiniGrid-Empty-5x5", param_values=("max_steps=7", "view_size=5"))
    assert int(params.max_steps) == 7 and env.observation_space(params).shape[:2] == (5, 5)  # the view follows
    with pytest.raises(ConfigError, match="its fields: .*max_steps"):
        envs.make_env("MiniGrid-Empty-5x5", param_values=("max_step=7",))


@pytest.mark.parametrize("script", ["ppo_mlp.py", "ppo_lstm_impala.py"])
def test_a_run_trains_evaluates_and_resumes_with_its_env_params(tmp_path, script):
    """A time limit of 6 steps: every episode, in training and in both evaluations, ends by step 6
    (default: 500 in CartPole, 10,000 in Breakout-MinAtar)."""
    run_dir = tmp_path / "run"
    flags = ["--env-params", "max_steps_in_episode=6", "--num-parallel-envs", "4", "--num-env-steps-per-cycle", "16",
             "--num-minibatches-per-epoch", "2", "--num-total-env-steps", "192", "--eval-every-cycles", "3",
             "--eval-episodes", "4", "--run-dir", str(run_dir)]
    if script == "ppo_lstm_impala.py":
        flags += ["--impala-channels", "4", "--torso-size", "16", "--lstm-size", "16"]
    training = run_script(script, *flags, timeout=600)
    assert training.returncode == 0, training.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lengths = [row["charts/episodic_length"] for row in rows if row["charts/episodic_length"] is not None]
    eval_lengths = [row["eval/episodic_length"] for row in rows if row.get("eval/episodic_length") is not None]
    assert lengths and max(lengths) <= 6 and eval_lengths and max(eval_lengths) <= 6
    assert json.loads((run_dir / "args.json").read_text())["env_params"] == ["max_steps_in_episode=6"]

    evaluated = run_script("scripts/evaluate.py", str(run_dir), "--episodes", "3", timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    returns = [float(value) for value in re.findall(r"^mean_return: (-?\d+\.\d+)", evaluated.stdout, re.MULTILINE)]
    if script == "ppo_mlp.py":  # CartPole: 1 per step, so at most 6
        assert returns and returns[0] <= 6

    module = ppo_mlp if script == "ppo_mlp.py" else ppo_lstm_impala
    resumed_args = cli.parse_args(module.Args, ["--resume", str(run_dir)])
    assert resumed_args.env_params == ("max_steps_in_episode=6",)  # args.json's, so --resume honours them
