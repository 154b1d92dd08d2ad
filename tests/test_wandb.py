"""wandb, offline, in both scripts: one run per seed (--wandb-run-per-seed) with the seed, the
script and the git commit in its config, the group and tags; each seed's run logs exactly that
seed's rows of metrics.jsonl under the plain names; --resume continues the same runs; and
git_info outside a git checkout or without git. (The default layout, one run with seed_<n>/
keys, is tested in test_ppo_mlp.py.)"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import types
from pathlib import Path

import numpy as np
import pytest

from helpers import ROOT, read_wandb_offline_run, run_script
from ppo_support import contract, logs, provenance

# 4 cycles of 2 seeds each, checkpointed every cycle.
TINY = {
    "ppo_mlp.py": ["--num-parallel-envs", "4", "--num-env-steps-per-cycle", "16", "--num-total-env-steps", "256"],
    "ppo_lstm_impala.py": ["--env-id", "probe_envs:Memory", "--impala-channels", "4", "--torso-size", "16",
                           "--lstm-size", "16", "--num-parallel-envs", "4", "--num-env-steps-per-cycle", "10",
                           "--num-minibatches-per-epoch", "2", "--num-total-env-steps", "160"],
}
TRACK = ["--num-seeds", "2", "--checkpoint-every-cycles", "1", "--track", "--wandb-mode", "offline"]


def offline_runs(run_dir: Path) -> list[dict]:
    return [read_wandb_offline_run(folder) for folder in sorted(run_dir.glob("wandb/offline-run-*"))]


def metrics_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def head_commit() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture(scope="module")
def per_seed_run(tmp_path_factory):
    """per_seed_run(script) -> the run dir of one finished TINY run with --wandb-run-per-seed,
    seeds 7 and 8 (made once; copy it before changing anything)."""
    run_dirs = {}

    def finished_run(script: str) -> Path:
        if script not in run_dirs:
            run_dir = tmp_path_factory.mktemp("per_seed") / Path(script).stem
            result = run_script(script, *TINY[script], *TRACK, "--wandb-run-per-seed", "--wandb-tags", "tiny", "per seed",
                                "--exp-name", "probe", "--seed", "7", "--run-dir", str(run_dir))
            assert result.returncode == 0, result.stderr
            run_dirs[script] = run_dir
        return run_dirs[script]

    return finished_run


@pytest.mark.parametrize("script", sorted(TINY))
def test_one_wandb_run_per_seed_logs_that_seeds_rows_under_plain_names(script, per_seed_run):
    run_dir = per_seed_run(script)
    runs = sorted(offline_runs(run_dir), key=lambda run: run["config"]["seed"])
    assert [run["config"]["seed"] for run in runs] == [7, 8]
    env_name = "probe_envs_Memory" if script == "ppo_lstm_impala.py" else "CartPole-v1"
    rows = metrics_rows(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    for index, (seed, run) in enumerate(zip([7, 8], runs)):
        assert (run_dir / f"wandb_id_seed_{seed}.txt").read_text() == run["id"]
        assert run["name"].startswith(f"{env_name}__probe__{seed}__")
        assert run["group"] == f"{env_name}__probe"
        assert run["tags"] == ["tiny", "per seed"]
        assert run["config"]["script"] == script and run["config"]["num_seeds"] == 2
        assert run["config"]["git_commit"] == head_commit() and isinstance(run["config"]["git_dirty"], bool)
        assert run["config"]["wandb_tags"] == ["tiny", "per seed"]  # every arg is in the config
        seed_rows = [row for row in rows if row["seed"] == seed]
        assert len(run["history"]) == len(seed_rows) == 4
        for logged, row in zip(run["history"], seed_rows):
            assert logged["global_step"] == logged["_step"] == row["env_steps"]
            assert not any(name.startswith("seed_") for name in logged)
            expected = {name: value for name, value in row.items() if name not in ("cycle", "env_steps", "seed") and value is not None}
            assert {name: logged[name] for name in expected} == expected  # the same floats, exactly
        assert run["summary"]["final_episodic_return"] == summary["final_episodic_return_per_seed"][index]


def test_resume_continues_each_seeds_wandb_run(tmp_path, per_seed_run):
    run_dir = tmp_path / "resumed"
    shutil.copytree(per_seed_run("ppo_mlp.py"), run_dir)
    ids = {seed: (run_dir / f"wandb_id_seed_{seed}.txt").read_text() for seed in (7, 8)}
    for name in ["summary.json", "params.msgpack", "checkpoint-4.npz"]:  # as if killed after cycle 3's checkpoint
        (run_dir / name).unlink()
    shutil.rmtree(run_dir / "wandb")
    result = run_script("ppo_mlp.py", "--resume", str(run_dir))
    assert result.returncode == 0, result.stderr
    runs = offline_runs(run_dir)
    assert {run["config"]["seed"]: run["id"] for run in runs} == ids
    assert {(run_dir / f"wandb_id_seed_{seed}.txt").read_text() for seed in (7, 8)} == set(ids.values())
    for run in runs:  # only the cycle after the checkpoint was logged again
        assert [logged["global_step"] for logged in run["history"]] == [256]


def test_git_info_is_empty_outside_a_checkout_and_without_git(tmp_path, monkeypatch):
    assert provenance.git_info(ROOT / "ppo_mlp.py")["git_commit"] == head_commit()
    copy = tmp_path / "ppo_mlp_copy.py"
    shutil.copy(ROOT / "ppo_mlp.py", copy)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # git must not look above tmp_path
    assert provenance.git_info(copy) == {}
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert provenance.git_info(ROOT / "ppo_mlp.py") == {}


def without_wandb_login(tmp_path: Path, **variables: str) -> dict[str, str]:
    """The environment of a process with none of wandb's variables and no wandb login (an empty
    home: no ~/.netrc, no wandb settings), plus `variables`."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("WANDB_") and name != "NETRC"}
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {**env, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), **variables}


def test_unset_wandb_flags_defer_to_wandbs_variables_and_a_flag_given_wins(tmp_path):
    tiny = [*TINY["ppo_mlp.py"], "--track"]
    env = without_wandb_login(tmp_path, WANDB_MODE="offline", WANDB_PROJECT="from-env", WANDB_RUN_GROUP="group-env",
                              WANDB_TAGS="a,b")
    result = run_script("ppo_mlp.py", *tiny, "--run-dir", str(tmp_path / "env"), env=env)
    assert result.returncode == 0, result.stderr
    (run,) = offline_runs(tmp_path / "env")
    assert (run["project"], run["group"], run["tags"]) == ("from-env", "group-env", ["a", "b"])
    assert run["config"]["wandb_mode"] is None and run["config"]["wandb_project"] is None  # the flags as given
    env = without_wandb_login(tmp_path, WANDB_MODE="online", WANDB_PROJECT="from-env")
    result = run_script("ppo_mlp.py", *tiny, "--wandb-mode", "offline", "--wandb-project", "from-flag", "--wandb-group", "g",
                        "--run-dir", str(tmp_path / "flags"), env=env)
    assert result.returncode == 0, result.stderr
    (run,) = offline_runs(tmp_path / "flags")
    assert (run["project"], run["group"]) == ("from-flag", "g")


@pytest.mark.parametrize("script", sorted(TINY))
@pytest.mark.parametrize("mode", [{}, {"WANDB_MODE": "online"}])
def test_track_online_without_an_api_key_fails_before_compiling_in_one_line(script, mode, tmp_path):
    result = run_script(script, *TINY[script], "--track", "--run-dir", str(tmp_path / "run"), cwd=tmp_path,
                        env=without_wandb_login(tmp_path, **mode))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --track: ") and "`wandb login`" in lines[0], lines
    assert "WANDB_MODE=offline" in lines[0]
    assert "compiling" not in result.stdout
    assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()


def test_a_malformed_wandb_variable_is_one_line(tmp_path):
    result = run_script("ppo_mlp.py", *TINY["ppo_mlp.py"], "--track", "--run-dir", str(tmp_path / "run"), cwd=tmp_path,
                        env=without_wandb_login(tmp_path, WANDB_MODE="loud"))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --track: wandb cannot start") and "loud" in lines[0], lines
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("script", sorted(TINY))
def test_cleanrls_names_are_logged_beside_ours_with_the_same_values(script, per_seed_run):
    run_dir = per_seed_run(script)
    rows = metrics_rows(run_dir)
    history = [logged for run in offline_runs(run_dir) for logged in run["history"]]
    assert len(rows) == len(history) == 8
    for logged in [*rows, *history]:
        for cleanrl_name, ours in contract.CLEANRL_NAMES.items():
            assert logged[cleanrl_name] == logged[ours] and logged[ours] is not None, (cleanrl_name, logged)


def test_one_wandb_run_gets_cleanrls_names_as_means_and_per_seed_and_the_console_line_is_unchanged(tmp_path, capsys):
    names = ("charts/episodic_return", "losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/actor_approxkl1",
             "losses/actor_approxkl3", "losses/actor_clipfrac")
    args = types.SimpleNamespace(seed=3, num_seeds=2, batch_size=10, num_cycles=1, wandb_run_per_seed=False)

    class WandbRun:
        def __init__(self):
            self.logged = []

        def log(self, values, step=None):
            self.logged.append(values)

    wandb_run = WandbRun()
    logger = logs.MetricsLogger(args, tmp_path, names)
    logger.start(0, [wandb_run])
    values = np.arange(len(names) * 2, dtype=np.float64).reshape(1, len(names), 2)  # (rows, metrics, seeds)
    logger([1], values, now=1.0)
    logger.close()
    rows = metrics_rows(tmp_path)
    (logged,) = wandb_run.logged
    for cleanrl_name, ours in contract.CLEANRL_NAMES.items():
        assert [row[cleanrl_name] for row in rows] == [row[ours] for row in rows] == list(values[0, names.index(ours)])
        assert logged[cleanrl_name] == logged[ours] == values[0, names.index(ours)].mean()
        assert logged[f"seed_3/{cleanrl_name}"] == logged[f"seed_3/{ours}"] and logged[f"seed_4/{cleanrl_name}"] == logged[f"seed_4/{ours}"]
    line = capsys.readouterr().out
    assert "approx_kl" not in line and "clipfrac" not in line and "approxkl3 " in line


@pytest.mark.parametrize("script", sorted(TINY))
def test_each_wandb_run_gets_the_script_as_it_ran_as_its_code(script, per_seed_run):
    run_dir = per_seed_run(script)
    copy = run_dir / "code" / script
    assert copy.read_bytes() == (ROOT / script).read_bytes()
    md5 = base64.b64encode(hashlib.md5(copy.read_bytes()).digest()).decode()
    for run in offline_runs(run_dir):
        (artifact,) = run["artifacts"]
        assert artifact["type"] == "code" and artifact["files"] == {script: md5}
