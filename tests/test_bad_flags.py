"""A fuzz of bad flag values, over the flags of both scripts: each one gives exit code 2 and one
`error:` line that names the flag, with no traceback, nothing compiled and no run dir.

In-process (the scripts' own `main`), so the whole table takes seconds."""

from __future__ import annotations

import importlib

import pytest
from helpers import run_script

COMMON = [
    # (argv, the flag the error line must name)
    (["--learning-rate", "1e-3"], "--learning-rate is --lr here"),  # CleanRL's and PureJaxRL's names: a hint
    (["--total-timesteps", "100000"], "--total-timesteps is --num-total-env-steps here"),
    (["--num-envs", "8"], "--num-envs is --num-parallel-envs here"),
    (["--num_steps", "64"], "--num-steps is --num-env-steps-per-cycle here"),
    (["--update-epochs", "2"], "--update-epochs is --num-epochs-per-cycle here"),
    (["--num-minibatches", "2"], "--num-minibatches is --num-minibatches-per-epoch here"),
    (["--clip-coef=0.1"], "--clip-coef is --clip-eps here"),
    (["--lr", "-0.1"], "--lr"),
    (["--lr", "0"], "--lr"),
    (["--lr", "nan"], "--lr"),
    (["--lr", "inf"], "--lr"),
    (["--lr", "fast"], "--lr"),
    (["--num-seeds", "0"], "--num-seeds"),
    (["--num-seeds", "1.5"], "--num-seeds"),
    (["--seed", "-1"], "--seed"),
    (["--env-id", ""], "--env-id"),
    (["--env-id", "CartPole-v9"], "--env-id"),
    (["--env-id", "no_such_module:Env"], "--env-id"),
    (["--env-id", "probe_envs:NoSuchEnv"], "--env-id"),
    (["--num-total-env-steps", "10"], "--num-total-env-steps"),  # below one cycle
    (["--num-parallel-envs", "0"], "--num-parallel-envs"),
    (["--num-env-steps-per-cycle", "-8"], "--num-env-steps-per-cycle"),
    (["--num-epochs-per-cycle", "0"], "--num-epochs-per-cycle"),
    (["--num-minibatches-per-epoch", "0"], "--num-minibatches-per-epoch"),
    (["--num-minibatches-per-epoch", "7"], "--num-minibatches-per-epoch"),  # does not divide the batch
    (["--gamma", "1.5"], "--gamma"),
    (["--gamma", "nan"], "--gamma"),
    (["--gae-lambda", "-0.1"], "--gae-lambda"),
    (["--clip-eps", "-0.2"], "--clip-eps"),
    (["--clip-eps", "inf"], "--clip-eps"),
    (["--ent-coef", "-0.01"], "--ent-coef"),
    (["--vf-coef", "nan"], "--vf-coef"),
    (["--vf-coef", "inf"], "--vf-coef"),
    (["--adam-eps", "0"], "--adam-eps"),
    (["--max-grad-norm", "0"], "--max-grad-norm"),
    (["--max-grad-norm", "nan"], "--max-grad-norm"),
    (["--target-kl", "-0.01"], "--target-kl"),
    (["--target-kl", "nan"], "--target-kl"),
    (["--target-kl", "inf"], "--target-kl"),
    (["--num-devices", "-1"], "--num-devices"),
    (["--num-devices", "64"], "--num-devices"),  # more than this machine has
    (["--wandb-mode", "loud"], "--wandb-mode"),
    (["--wandb-project", "team/project"], "--wandb-project"),
    (["--wandb-project", ""], "--wandb-project"),
    (["--wandb-group", " "], "--wandb-group"),
    (["--wandb-group", "g" * 129], "--wandb-group"),
    (["--wandb-tags", "ok", ""], "--wandb-tags"),
    (["--wandb-tags", "t" * 65], "--wandb-tags"),
    (["--wandb-project", "mine"], "--wandb-project"),  # read only with --track
    (["--wandb-mode", "offline"], "--wandb-mode"),  # read only with --track
    (["--wandb-run-per-seed"], "--wandb-run-per-seed"),  # read only with --track
    (["--log-every-cycles", "-1"], "--log-every-cycles"),
    (["--checkpoint-every-cycles", "0"], "--checkpoint-every-cycles"),
    (["--checkpoint-every-cycles", "often"], "--checkpoint-every-cycles"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints"),
    (["--eval-every-cycles", "0"], "--eval-every-cycles"),
    (["--eval-every-cycles", "-2"], "--eval-every-cycles"),
    (["--eval-episodes", "0"], "--eval-episodes"),
    (["--eval-episodes", "-1"], "--eval-episodes"),
    (["--eval-episodes", "32"], "--eval-episodes"),  # read only with --eval-every-cycles or --capture-video
    (["--no-eval-greedy"], "--eval-greedy"),  # read only with --eval-every-cycles or --capture-video
    (["--run-dir", ""], "--run-dir"),
    (["--resume", ""], "--resume"),
    (["--resume", "no/such/run"], "--resume"),
    (["--env-params", "no_such_field=1"], "--env-params"),
    (["--env-params", "max_steps_in_episode=many"], "--env-params"),
    (["--env-params", "max_steps_in_episode"], "--env-params"),
    (["--env-params", "max_steps_in_episode=5", "max_steps_in_episode=6"], "--env-params"),
    (["--coordinator-address", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "0"], "--coordinator-address"),
    (["--process-id", "0"], "--process-id"),  # without --distributed
    (["--distributed", "--num-processes", "2"], "--num-processes"),  # the three go together
    (["--distributed", "--coordinator-address", "localhost", "--num-processes", "2", "--process-id", "0"], "--coordinator-address"),
    (["--distributed", "--coordinator-address", "h:70000", "--num-processes", "2", "--process-id", "0"], "--coordinator-address"),
    (["--distributed", "--coordinator-address", "h:1234", "--num-processes", "0", "--process-id", "0"], "--num-processes"),
    (["--distributed", "--coordinator-address", "h:1234", "--num-processes", "2", "--process-id", "2"], "--process-id"),
    (["--distributed", "--coordinator-address", "h:1234", "--num-processes", "2", "--process-id", "-1"], "--process-id"),
    (["--no-such-flag", "1"], "--no-such-flag"),
    (["--sticky-action-prob", "1"], "--sticky-action-prob"),
    (["--sticky-action-prob", "-0.1"], "--sticky-action-prob"),
    (["--sticky-action-prob", "nan"], "--sticky-action-prob"),
    (["--optimistic-reset-ratio", "0"], "--optimistic-reset-ratio"),
    (["--optimistic-reset-ratio", "1.5"], "--optimistic-reset-ratio"),
    (["--optimistic-reset-ratio", "16"], "--optimistic-reset-ratio"),  # the default env is a gymnax one
    (["--env-id", "CartPol-v1"], "did you mean CartPole-v1"),
    (["--env-id", "Breakout-MinAtr"], "did you mean Breakout-MinAtar"),
    (["--env-id", "Pendulum-v1"], "discrete actions only"),
    (["--env-id", "probe_envs:ContinuousActions"], "discrete actions only"),
    (["--num-parallel-envs", "abc"], "--num-parallel-envs"),  # tyro's errors, folded into one line
]
ONLY = {
    "ppo_mlp.py": [
        (["--hidden-sizes"], "--hidden-sizes"),
        (["--hidden-sizes", "64", "0"], "--hidden-sizes"),
        (["--activation", "sigmoid"], "--activation"),
        (["--impala-channels", "16"], "--impala-channels"),  # the other script's flag
        (["--torso", "nature"], "--torso"),  # the other script's flag
    ],
    "ppo_lstm_impala.py": [
        (["--impala-channels"], "--impala-channels"),
        (["--impala-channels", "16", "0"], "--impala-channels"),
        (["--torso-size", "0"], "--torso-size"),
        (["--lstm-size", "-1"], "--lstm-size"),
        (["--lstm-training", "tbptt"], "--lstm-training"),
        (["--frame-stack", "0"], "--frame-stack"),
        (["--num-parallel-envs", "6", "--num-minibatches-per-epoch", "4"], "--num-minibatches-per-epoch"),  # bptt
        (["--env-id", "CartPole-v1", "--torso", "impala"], "--torso"),  # vector observations need --torso mlp (or auto)
        (["--env-id", "CartPole-v1", "--torso", "nature"], "--torso"),
        (["--env-id", "CartPole-v1", "--hidden-sizes", "0"], "--hidden-sizes"),
        (["--hidden-sizes", "64", "0"], "--hidden-sizes"),  # --torso mlp's widths
        (["--activation", "sigmoid"], "--activation"),
        (["--head-hidden-sizes", "128", "0"], "--head-hidden-sizes"),
        (["--lstm-size", "0", "--prev-action-reward"], "--prev-action-reward"),  # no LSTM to feed
        (["--lstm-size", "0", "--lstm-forget-bias", "1"], "--lstm-forget-bias"),  # no forget gate
        (["--norm-obs"], "--norm-obs"),  # ppo_mlp.py's flag: image observations are not normalised
        # a torso flag away from its default that the torso in use does not read
        (["--env-id", "CartPole-v1", "--torso-size", "128"], "--torso-size"),  # auto: the mlp torso
        (["--env-id", "CartPole-v1", "--torso", "mlp", "--impala-channels", "3"], "--impala-channels"),
        (["--hidden-sizes", "7"], "--hidden-sizes"),  # auto on images: the impala torso
        (["--torso", "impala", "--activation", "relu"], "--activation"),
        (["--torso", "nature", "--impala-channels", "4", "4"], "--impala-channels"),
        (["--torso", "nature", "--torso-size", "128"], "--torso-size"),
        (["--torso", "resnet"], "--torso"),
        (["--torso", "nature", "--env-id", "probe_envs:ConstantRewardImage"], "--torso nature"),  # 3x3 images
        (["--env-id", "MiniGrid-Empty-5x5", "--optimistic-reset-ratio", "4", "--sticky-action-prob", "0.1"],
         "--optimistic-reset-ratio"),  # the sticky-action wrapper steps one env at a time
    ],
}
CASES = [(script, argv, name) for script in ONLY for argv, name in COMMON + ONLY[script]]


def test_the_fuzz_covers_at_least_30_bad_values_of_each_script():
    assert all(sum(script == case[0] for case in CASES) >= 30 for script in ONLY)
    print(f"{len(CASES)} bad values")  # the count docs/scaling.md gives


@pytest.mark.parametrize("script, argv, name", CASES, ids=[f"{script}:{' '.join(argv)}" for script, argv, _ in CASES])
def test_a_bad_flag_value_exits_2_with_one_line_that_names_it(script, argv, name, tmp_path, monkeypatch, capsys):
    module = importlib.import_module(script.removesuffix(".py"))
    monkeypatch.setattr(module, "make_train", lambda *_: pytest.fail(f"{' '.join(argv)} was accepted"))
    monkeypatch.chdir(tmp_path)  # the default run dir would go under runs/ here
    try:
        code = module.main(argv)
    except SystemExit as exit_request:
        code = exit_request.code
    out, err = capsys.readouterr()
    assert code == 2, err
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and name in err, err
    assert "Traceback" not in out + err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("script", ["ppo_mlp.py", "ppo_lstm_impala.py"])
def test_help_shows_each_flags_own_text_and_no_section_header_of_the_source(script):
    result = run_script(script, "--help", timeout=120)
    assert result.returncode == 0 and "--num-parallel-envs" in result.stdout
    assert "--- " not in result.stdout, result.stdout  # a "# --- section ---" comment of Args
