"""Quick tests of the research scripts (plot, sweep, ablate, evaluate) at tiny budgets.

Training runs are shared through module-scoped fixtures: one sweep (two valid CartPole runs of
2 seeds and one combination the script rejects) feeds the plot, resume and evaluate tests.
"""

from __future__ import annotations

import csv
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, run_script, run_tool

sys.path.insert(0, str(ROOT / "scripts"))
from runlib import differing_labels, load_module, load_script_for_run, metric_table, read_run, script_path_for_run  # noqa: E402
from ppo_support import devices, envs

TINY = ["--num-total-env-steps", "256", "--num-seeds", "2"]
SWEEP_GRID = ["--num-parallel-envs", "4", "--num-env-steps-per-cycle", "32", "--num-minibatches-per-epoch", "1", "2", "3"]


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("sweep") / "out"
    result = run_tool("scripts/sweep.py", "--script", "ppo_mlp.py", *SWEEP_GRID, "--out-dir", str(out_dir), "--", *TINY)
    assert result.returncode == 0, result.stderr
    return out_dir


def test_sweep_writes_a_row_per_valid_combination_and_skips_the_rejected_one(sweep_dir):
    rows = list(csv.DictReader(open(sweep_dir / "sweep.csv")))
    assert [(row["num_minibatches_per_epoch"], row["status"].split(":")[0]) for row in rows] == [
        ("1", "ran"), ("2", "ran"), ("3", "rejected")]
    assert "does not divide" in rows[2]["status"]
    assert all(float(row["sps"]) > 0 and float(row["peak_rss_mb"]) > 0 for row in rows[:2])
    assert not (sweep_dir / rows[2]["run_dir"]).exists()

    table = (sweep_dir / "sweep.md").read_text()
    table_rows = [line for line in table.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [line.split("|")[1].strip() for line in table_rows] == ["1", "2"]
    assert "num_minibatches_per_epoch=3: rejected" in table
    assert (sweep_dir / "return_vs_walltime.png").stat().st_size > 0


def test_sweep_resume_skips_finished_runs_and_reruns_an_interrupted_one(sweep_dir):
    finished = sweep_dir / "envs4_steps32_mb1_ep4"
    interrupted = sweep_dir / "envs4_steps32_mb2_ep4"
    finished_mtime = (finished / "summary.json").stat().st_mtime_ns
    (interrupted / "summary.json").unlink()  # as if killed before it finished

    refused = run_script("scripts/sweep.py", "--script", "ppo_mlp.py", *SWEEP_GRID, "--out-dir", str(sweep_dir), "--", *TINY)
    assert refused.returncode == 2 and "--resume" in refused.stderr

    result = run_tool("scripts/sweep.py", "--script", "ppo_mlp.py", *SWEEP_GRID, "--out-dir", str(sweep_dir), "--resume",
                        "--", *TINY)
    assert result.returncode == 0, result.stderr
    assert "envs4_steps32_mb1_ep4 (resumed)" in result.stdout
    assert "envs4_steps32_mb2_ep4 (ran)" in result.stdout
    assert (finished / "summary.json").stat().st_mtime_ns == finished_mtime
    assert (interrupted / "summary.json").is_file()
    # One fresh metrics file, not the interrupted run's rows plus the new ones.
    cycles = [json.loads(line)["cycle"] for line in (interrupted / "metrics.jsonl").read_text().splitlines()]
    assert cycles == [1, 1, 2, 2]


def test_sweep_takes_any_flag_of_a_copy_outside_the_repository(tmp_path):
    """A copy with a float flag of its own, swept by scripts/sweep.py --script PATH (one process per
    value), with a list-valued flag beside it: each run gets its values, its folder names them."""
    copy = tmp_path / "elsewhere" / "my_ppo.py"
    copy.parent.mkdir()
    source = (ROOT / "ppo_mlp.py").read_text()
    anchor = "    ent_coef: float"
    assert source.count(anchor) == 1
    copy.write_text(source.replace(anchor, "    logit_l2_coef: float = 0.0  # a flag of the copy's own\n" + anchor))
    out_dir = tmp_path / "out"
    result = run_tool("scripts/sweep.py", "--script", str(copy), "--logit-l2-coef", "0", "0.01", "--hidden-sizes", "8,8",
                      "--num-parallel-envs", "4", "--num-env-steps-per-cycle", "32", "--out-dir", str(out_dir), "--", *TINY,
                      cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    folders = [f"envs4_steps32_mb4_ep4_logit-l2-coef={value}_hidden-sizes=8x8" for value in ["0", "0.01"]]
    assert sorted(path.name for path in out_dir.iterdir() if path.is_dir()) == sorted(folders)
    for folder, value in zip(folders, [0.0, 0.01]):
        args = json.loads((out_dir / folder / "args.json").read_text())
        assert (args["logit_l2_coef"], args["hidden_sizes"], args["script_path"]) == (value, [8, 8], str(copy.resolve()))
    rows = list(csv.DictReader(open(out_dir / "sweep.csv")))
    assert [(row["logit_l2_coef"], row["hidden_sizes"], row["status"]) for row in rows] == [("0", "8x8", "ran"), ("0.01", "8x8", "ran")]
    assert "| logit l2 coef | env steps/s |" in (out_dir / "sweep.md").read_text()


def test_plot_writes_a_png_labelled_by_the_differing_args(sweep_dir, tmp_path):
    runs = [str(sweep_dir / "envs4_steps32_mb1_ep4"), str(sweep_dir / "envs4_steps32_mb2_ep4")]
    out = tmp_path / "curves.png"
    result = run_script("scripts/plot.py", *runs, "--out", str(out), "--band", "minmax")
    assert result.returncode == 0, result.stderr
    assert out.stat().st_size > 0
    assert "num_minibatches_per_epoch=1; num_minibatches_per_epoch=2" in result.stdout

    grid = tmp_path / "grid.png"
    result = run_script("scripts/plot.py", *runs, "--out", str(grid), "--debug-grid")
    assert result.returncode == 0, result.stderr
    assert grid.stat().st_size > out.stat().st_size  # a panel per metric, not one

    bootstrap = tmp_path / "bootstrap.png"
    result = run_script("scripts/plot.py", *runs, "--out", str(bootstrap), "--ci", "bootstrap")
    assert result.returncode == 0, result.stderr
    assert bootstrap.stat().st_size > 0


def test_labels_and_null_returns():
    base = {"env_id": "CartPole-v1", "clip_eps": 0.2, "run_dir": "a", "seed": 1}
    assert differing_labels([base, {**base, "clip_eps": 0.1, "run_dir": "b"}], ["a", "b"]) == ["clip_eps=0.2", "clip_eps=0.1"]
    assert differing_labels([base, {**base, "run_dir": "b"}], ["a", "b"]) == ["a", "b"]  # only run_dir differs
    # A key only one args.json has (another script version) is not a difference.
    assert differing_labels([base, {**base, "clip_eps": 0.1, "new_flag": 3}], ["a", "b"]) == ["clip_eps=0.2", "clip_eps=0.1"]
    # The same script in two checkouts is not a difference.
    checkouts = [{**base, "script_path": "/a/ppo_mlp.py"}, {**base, "script_path": "/b/ppo_mlp.py"}]
    assert differing_labels(checkouts, ["a", "b"]) == ["a", "b"]


def test_loader_finds_the_script_that_wrote_a_run_and_keeps_same_named_files_apart(tmp_path):
    for folder, marker in [("a", 1), ("b", 2)]:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "my_ppo.py").write_text(f"MARKER = {marker}\n")
    first = load_script_for_run({"script": "my_ppo.py", "script_path": str(tmp_path / "a" / "my_ppo.py")})
    second = load_module(tmp_path / "b" / "my_ppo.py")
    assert (first.MARKER, second.MARKER) == (1, 2)
    assert load_module(tmp_path / "a" / ".." / "a" / "my_ppo.py") is first  # once per resolved path
    # A recorded path that is gone falls back to the recorded name in the repo root.
    assert script_path_for_run({"script": "ppo_mlp.py", "script_path": "/gone/ppo_mlp.py"}) == ROOT / "ppo_mlp.py"
    with pytest.raises(FileNotFoundError, match="/gone/my_ppo.py no longer exists, and there is no my_ppo.py in"):
        script_path_for_run({"script": "my_ppo.py", "script_path": "/gone/my_ppo.py"})
    # Older run dirs record no script: `lstm_size` tells the two apart.
    assert script_path_for_run({"lstm_size": 8}) == ROOT / "ppo_lstm_impala.py"
    assert script_path_for_run({"num_seeds": 1}) == ROOT / "ppo_mlp.py"


def test_null_returns_are_missing_values_not_zeros(tmp_path):
    (tmp_path / "args.json").write_text(json.dumps({"num_seeds": 2}))
    rows = [{"cycle": 1, "env_steps": 8, "seed": 1, "charts/episodic_return": None},
            {"cycle": 1, "env_steps": 8, "seed": 2, "charts/episodic_return": 10.0}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    _, values, seeds = metric_table(read_run(tmp_path), "charts/episodic_return")
    assert seeds == [1, 2] and np.isnan(values[0, 0]) and values[0, 1] == 10.0


def test_ablate_flips_normalisation_sticky_actions_and_the_torso_where_the_script_has_them():
    import ablate
    from runlib import script_defaults

    details = {detail.name: detail for detail in ablate.DETAILS}
    expected = {  # detail: (ppo_mlp.py's flags or None when skipped, ppo_lstm_impala.py's)
        "norm-obs": (["--norm-obs"], None),
        "norm-reward": (["--norm-reward"], ["--norm-reward"]),
        "sticky-actions": (["--sticky-action-prob", "0.1"], ["--sticky-action-prob", "0.1"]),
        "torso": (None, ["--torso", "nature"]),
    }
    for name, flags in expected.items():
        for script, script_flags in zip(["ppo_mlp.py", "ppo_lstm_impala.py"], flags):
            assert ablate.detail_flags(details[name], script_defaults(script))[0] == script_flags, (name, script)


def test_ablate_table_has_the_baseline_and_the_flipped_details(tmp_path):
    out_dir = tmp_path / "ablation"
    result = run_tool("scripts/ablate.py", "--script", "ppo_mlp.py", "--env-id", "CartPole-v1", "--num-seeds", "2",
                        "--out-dir", str(out_dir), "--details", "norm-adv", "clip-eps", "frame-stack", "norm-obs",
                        "--", "--num-total-env-steps", "256", "--num-env-steps-per-cycle", "32")
    assert result.returncode == 0, result.stderr
    table = (out_dir / "ablation.md").read_text()
    for row_start in ["| baseline | `(defaults)` |", "| clip-eps | `clip_eps=0.1` |", "| norm-adv | `norm_adv=False` |",
                      "| norm-obs | `norm_obs=True` |"]:
        assert row_start in table
    assert "`frame-stack`: skipped: the script has no --frame-stack" in table
    # the baseline and the details --sweep can express in one process, its points in DETAILS order; norm-obs alone
    sweep_dir = out_dir / "sweep"
    assert json.loads((sweep_dir / "args.json").read_text())["sweep"] == ["clip_eps,norm_adv=0.2:true,0.1:true,0.2:false"]
    point_args = [json.loads((sweep_dir / f"point-{index}" / "args.json").read_text()) for index in range(3)]
    assert [(args["clip_eps"], args["norm_adv"]) for args in point_args] == [(0.2, True), (0.1, True), (0.2, False)]
    assert json.loads((out_dir / "norm-obs" / "args.json").read_text())["norm_obs"] is True
    assert sorted(path.name for path in out_dir.iterdir() if path.is_dir()) == ["norm-obs", "sweep"]
    assert "| final IQM [95% CI] | P(final > baseline) |" in table and table.splitlines()[2].endswith("| finding |")
    rows = {row["detail"]: row for row in csv.DictReader(open(out_dir / "ablation.csv"))}
    assert rows["baseline"]["final_rel_pct"] == "0.0" and rows["norm-adv"]["final_mean"]
    assert rows["frame-stack"]["status"].startswith("skipped")
    assert [rows[name]["run_dir"] for name in ["baseline", "clip-eps", "norm-adv", "norm-obs"]] == [
        "sweep/point-0", "sweep/point-1", "sweep/point-2", "norm-obs"]
    # IQM and its CI for every run; P(improvement) against the baseline for the details only.
    for metric in ["final", "auc"]:
        for detail in ["baseline", "norm-adv", "clip-eps"]:
            row = rows[detail]
            low, iqm, high = (float(row[f"{metric}_iqm{suffix}"]) for suffix in ["_ci_low", "", "_ci_high"])
            assert low <= iqm <= high
        assert rows["baseline"][f"{metric}_p_improve"] == ""
        p_improve, low = (float(rows["norm-adv"][f"{metric}_p_improve{suffix}"]) for suffix in ["", "_ci_low"])
        assert 0.0 <= low <= p_improve <= 1.0
    # A finding exactly where the detail's CI excludes the baseline's IQM.
    for detail in ["norm-adv", "clip-eps"]:
        baseline_iqm, low, high = (float(rows[name][f"final_{column}"]) for name, column in
                                   [("baseline", "iqm"), (detail, "iqm_ci_low"), (detail, "iqm_ci_high")])
        assert ("final" in rows[detail]["finding"]) == (not low <= baseline_iqm <= high)
    for image in ["ablation.png", "learning_curves.png"]:
        assert (out_dir / image).stat().st_size > 0


def test_evaluate_prints_the_mean_return_per_seed_and_writes_a_minatar_gif(tmp_path):
    run_dir = tmp_path / "breakout"
    training = run_script(
        "ppo_mlp.py", "--env-id", "Breakout-MinAtar", "--num-parallel-envs", "4", "--num-env-steps-per-cycle", "32",
        "--num-total-env-steps", "128", "--num-seeds", "2", "--run-dir", str(run_dir), timeout=300,
    )
    assert training.returncode == 0, training.stderr
    gif = tmp_path / "breakout.gif"
    result = run_script("scripts/evaluate.py", str(run_dir), "--episodes", "2", "--gif", str(gif))
    assert result.returncode == 0, result.stderr
    # as the run's own evaluation plays (--eval-greedy, on by default), unless --sampled says otherwise
    assert re.search(r"^mean_return: \d+\.\d+ ± \d+\.\d+ +\(4 episodes, 2 seeds, greedy actions", result.stdout, re.MULTILINE)
    sampled = run_script("scripts/evaluate.py", str(run_dir), "--episodes", "2", "--sampled")
    assert sampled.returncode == 0 and "2 seeds, sampled actions" in sampled.stdout, sampled.stderr
    assert re.search(r"seed 1: .*\n\s+seed 2: ", result.stdout)
    from PIL import Image

    with Image.open(gif) as image:
        assert image.n_frames > 1 and image.size == (200, 200)  # 10 x 10 cells of 20 px


def test_tools_read_a_run_with_the_renamed_copy_of_the_script_that_wrote_it(tmp_path):
    """A copy of ppo_mlp.py outside the repo, trained from another folder: evaluate.py and plot.py
    load the copy, which says so when imported (the appended line runs on import only: run as a
    script, the copy exits in main() before reaching it)."""
    copy = tmp_path / "elsewhere" / "my_ppo.py"
    copy.parent.mkdir()
    copy.write_text((ROOT / "ppo_mlp.py").read_text() + '\nprint(f"imported {Path(__file__).name}")\n')
    run_dir = tmp_path / "run"
    training = run_script(copy, "--num-total-env-steps", "2048", "--num-seeds", "2", "--run-dir", str(run_dir),
                          timeout=300, cwd=tmp_path)
    assert training.returncode == 0, training.stderr
    assert "imported" not in training.stdout
    args = json.loads((run_dir / "args.json").read_text())
    assert (args["script"], args["script_path"]) == ("my_ppo.py", str(copy.resolve()))

    result = run_script("scripts/evaluate.py", str(run_dir), "--episodes", "2", timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "imported my_ppo.py" in result.stdout
    assert re.search(r"^mean_return: \d+\.\d+ ± \d+\.\d+ .*CartPole-v1, my_ppo\.py\)$", result.stdout, re.MULTILINE)

    grid = tmp_path / "grid.png"
    result = run_script("scripts/plot.py", str(run_dir), "--out", str(grid), "--debug-grid", timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "imported my_ppo.py" in result.stdout and grid.stat().st_size > 0


def test_tools_never_run_a_script_that_lies_inside_the_run_dir_and_take_one_with_script(tmp_path):
    """A shared run dir whose args.json names a file inside itself (directly, or through a symlink
    outside that points back in): evaluate.py and plot.py refuse it with one line, exit 2, and run
    none of it; with --script they load the script given instead, and say which."""
    run_dir = tmp_path / "shared"
    lstm_run_dir(run_dir)
    (run_dir / "metrics.jsonl").write_text(METRIC_ROWS)
    planted = run_dir / "ppo_lstm_impala.py"
    planted.write_text("import pathlib\npathlib.Path(__file__).with_name('ran').touch()\n")
    link = tmp_path / "looks_outside.py"
    link.symlink_to(planted)
    args = json.loads((run_dir / "args.json").read_text())
    for recorded in [planted, link]:
        (run_dir / "args.json").write_text(json.dumps({**args, "script": "ppo_lstm_impala.py", "script_path": str(recorded)}))
        for tool, *arguments in [("evaluate.py", "--episodes", "1"), ("plot.py", "--out", str(tmp_path / "x.png"), "--debug-grid")]:
            result = run_script(f"scripts/{tool}", str(run_dir), *arguments, timeout=120)
            assert result.returncode == 2, result.stderr
            error_lines = [line for line in result.stderr.splitlines() if "error:" in line]
            assert len(error_lines) == 1 and "inside the run dir" in error_lines[0] and "--script" in error_lines[0]
            assert not (run_dir / "ran").exists() and not (tmp_path / "x.png").exists()
    script = ROOT / "ppo_lstm_impala.py"
    result = run_script("scripts/evaluate.py", str(run_dir), "--episodes", "1", "--script", str(script), timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"script: {script}" in result.stdout and not (run_dir / "ran").exists()
    result = run_script("scripts/plot.py", str(run_dir), "--out", str(tmp_path / "x.png"), "--debug-grid", "--script",
                        str(script), timeout=300)
    assert result.returncode == 0 and f"script: {script}" in result.stdout, result.stderr


@pytest.mark.parametrize("payload_in", ["run1", "run0"])
def test_no_tool_imports_an_env_module_that_lies_inside_a_run_dir(tmp_path, payload_in):
    """A run dir on the import path whose args.json names a custom env module inside itself (or
    inside another run dir): evaluate.py and --resume refuse it in one line, exit 2, and import
    none of it (the payload would leave a file behind)."""
    for name in ("run0", "run1"):
        (tmp_path / "shared" / name).mkdir(parents=True)
        (tmp_path / "shared" / name / "args.json").write_text(json.dumps({"script": "ppo_mlp.py", "num_seeds": 1}))
    payload = tmp_path / "shared" / payload_in / "payload.py"
    payload.write_text("import pathlib\npathlib.Path(__file__).with_name('ran').touch()\ndef make():\n    pass\n")
    run_dir = tmp_path / "shared" / "run1"
    (run_dir / "args.json").write_text(json.dumps({"script": "ppo_mlp.py", "env_id": f"shared.{payload_in}.payload:make"}))
    (run_dir / "params.msgpack").write_bytes(b"")  # never read: the env is made first
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ["PYTHONPATH"]])}
    for command in [("scripts/evaluate.py", str(run_dir), "--episodes", "1"), ("ppo_mlp.py", "--resume", str(run_dir))]:
        result = run_script(*command, timeout=120, env=env)
        assert result.returncode == 2, result.stderr[-3000:]
        error_lines = [line for line in result.stderr.splitlines() if "error:" in line]
        assert len(error_lines) == 1 and "inside the run dir" in error_lines[0], result.stderr
        assert str(payload) in error_lines[0] and "PYTHONPATH" in error_lines[0]
        assert not (payload.parent / "ran").exists()


def test_a_loaded_script_imports_the_package_beside_it_and_the_tools_keep_theirs(tmp_path):
    """Another checkout (a copy of ppo_mlp.py with a ppo_support of its own): the loaded script
    gets that checkout's package; the tools' own stays the one beside them."""
    import shutil

    import ppo_support

    checkout = tmp_path / "other_checkout"
    shutil.copytree(ROOT / "ppo_support", checkout / "ppo_support", ignore=shutil.ignore_patterns("__pycache__"))
    init = checkout / "ppo_support" / "__init__.py"
    init.write_text(init.read_text().replace(f'__version__ = "{ppo_support.__version__}"', '__version__ = "0.0.0-other"'))
    (checkout / "my_ppo.py").write_text((ROOT / "ppo_mlp.py").read_text())
    module = load_module(checkout / "my_ppo.py")
    assert Path(module.rundir.__file__).parent == checkout / "ppo_support"
    assert module.rundir.provenance.script_info(module.Args())["ppo_support_version"] == "0.0.0-other"
    assert sys.modules["ppo_support"] is ppo_support and Path(ppo_support.__file__).parent == ROOT / "ppo_support"
    assert sys.modules["ppo_support.rundir"].__file__ == str(ROOT / "ppo_support" / "rundir.py")
    # a script beside the tools' own package shares it
    assert load_module(ROOT / "ppo_mlp.py").rundir is sys.modules["ppo_support.rundir"]


def test_a_run_whose_script_is_gone_gets_one_error_line_from_evaluate_and_plot(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "args.json").write_text(json.dumps({"script": "gone.py", "script_path": "/nowhere/gone.py"}))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"cycle": 1, "env_steps": 8, "seed": 1}) + "\n")
    (run_dir / "params.msgpack").write_bytes(b"")
    for tool, *arguments in [("evaluate.py",), ("plot.py", "--out", str(tmp_path / "x.png"), "--debug-grid")]:
        result = run_script(f"scripts/{tool}", str(run_dir), *arguments, timeout=60)
        assert result.returncode == 2, result.stderr
        error_lines = [line for line in result.stderr.splitlines() if "error:" in line]
        assert len(error_lines) == 1 and "/nowhere/gone.py no longer exists, and there is no gone.py in" in error_lines[0]
    assert not (tmp_path / "x.png").exists()


def lstm_run_dir(run_dir: Path, num_seeds: int = 2, env_id: str = "Breakout-MinAtar"):
    """A run dir as ppo_lstm_impala.py writes it (args.json, params.msgpack of freshly initialised
    seeds), made with the script's own functions, without compiling a training run."""
    import dataclasses

    import flax.serialization
    import jax
    import ppo_lstm_impala as lstm

    args = lstm.Args(env_id=env_id, num_seeds=num_seeds, impala_channels=(4,), torso_size=16, lstm_size=8,
                     frame_stack=2, run_dir=str(run_dir))
    env, env_params = envs.make_env(args.env_id)
    network = lstm.make_network(args, env.action_space(env_params).n)
    obs_shape = lstm.stacked_obs_shape(env, env_params, args.frame_stack)
    params = devices.stack_seeds([lstm.init_params(network, jax.random.key(seed), args, obs_shape) for seed in range(num_seeds)])
    run_dir.mkdir(parents=True)
    (run_dir / "args.json").write_text(json.dumps(dataclasses.asdict(args)))
    (run_dir / "params.msgpack").write_bytes(flax.serialization.to_bytes(params))
    return lstm, args, env, env_params, network, params


@pytest.mark.skipif(not (ROOT / "ppo_lstm_impala.py").is_file(), reason="ppo_lstm_impala.py is not in the repo")
def test_evaluate_uses_the_lstm_script_and_resets_the_carry_at_episode_starts(tmp_path):
    """evaluate.py plays the script's own eval_step: it threads the LSTM carry on, ignores the
    incoming carry where an episode starts, and starts the next step's episode where this one ended."""
    import jax
    import jax.numpy as jnp
    from ppo_support import evaluation

    lstm, args, env, env_params, network, params = lstm_run_dir(tmp_path / "lstm")
    result = run_script("scripts/evaluate.py", str(tmp_path / "lstm"), "--episodes", "2")
    assert result.returncode == 0, result.stderr
    assert f"script: {ROOT / 'ppo_lstm_impala.py'}" in result.stdout
    assert "ppo_lstm_impala.py" in result.stdout and re.search(r"^mean_return: ", result.stdout, re.MULTILINE)

    policy = lstm.make_evaluation(network, env, env_params, args)
    state = lstm.TrainState(**dict.fromkeys(lstm.TrainState._fields))._replace(params=jax.tree.map(lambda x: x[0], params))
    carry = evaluation.start_evaluation(jax.random.key(0), policy, 3)
    assert carry.env.obs.shape[-1] == 2 * env.observation_space(env_params).shape[-1]  # the frame stack
    assert bool(carry.env.episode_start.all()) and not carry.env.lstm_carry.any()
    step = jax.jit(policy.step)
    stepped = step(state, carry)
    assert stepped.env.lstm_carry.any()  # the carry is threaded on
    # Where an episode starts, whatever carry came in is ignored; elsewhere it matters.
    noisy = carry._replace(env=carry.env._replace(lstm_carry=jax.random.normal(jax.random.key(1), carry.env.lstm_carry.shape)))
    assert jnp.allclose(step(state, noisy).env.lstm_carry, stepped.env.lstm_carry)
    going_on = noisy._replace(env=noisy.env._replace(episode_start=jnp.zeros(3, bool)))
    assert not jnp.allclose(step(state, going_on).env.lstm_carry, stepped.env.lstm_carry)
    # the next step's episode_start is this step's done (Breakout's first step ends no episode)
    assert not stepped.env.episode_start.any() and not stepped.finished.any()


@pytest.mark.skipif(not (ROOT / "ppo_lstm_impala.py").is_file(), reason="ppo_lstm_impala.py is not in the repo")
def test_evaluate_masks_invalid_actions_of_the_lstm_policy_as_in_training(tmp_path):
    """MaskedActionsImage: action 0 pays 1 but is always invalid, so no episode may return 1:
    evaluate.py's policy, loaded from the run dir and sampling, returns 0.5 or 0."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from evaluate import load_policy

    lstm_run_dir(tmp_path / "masked", env_id="probe_envs:MaskedActionsImage")
    module, args, states = load_policy(tmp_path / "masked", None)
    args = dataclasses.replace(args, eval_greedy=False)
    env, env_params = module.envs.make_env(args.env_id)
    policy = module.make_evaluation(module.make_network(args, env.action_space(env_params).n), env, env_params, args)
    evaluation = module.evaluation

    @jax.jit
    def returns(state, key):
        carry = evaluation.play_first_episodes(policy, state, evaluation.start_evaluation(key, policy, 64), 8)
        return jnp.where(carry.finished, carry.env.episode_return, jnp.nan)

    played = returns(jax.tree.map(lambda x: x[0], states), jax.random.key(0))
    assert played.shape == (64,) and set(played.tolist()) == {0.0, 0.5}  # action 1 (0.5) and 2 (0) taken, action 0 never


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["plot.py", "no/such/run", "--out", "x.png"], "not a run dir"),
        (["plot.py", "--out", "x.png"], "RUN_DIR"),
        (["plot.py", ".", "--out", "x.png", "--band", "wide"], "--band"),
        (["plot.py", ".", "--out", "x.png", "--ci", "normal"], "--ci"),
        (["plot.py", ".", "--out", "x.png", "--ci", "bootstrap", "--band", "minmax"], "--ci bootstrap and --band minmax"),
        (["sweep.py", "--num-parallel-envs", "0", "--out-dir", "unused"], "--num-parallel-envs"),
        (["sweep.py", "--script", "nope.py", "--out-dir", "unused"], "--script"),
        (["sweep.py", "--script", "no/such/copy.py", "--out-dir", "unused"], "--script no/such/copy.py"),
        (["sweep.py", "--no-such-flag", "1", "2", "--out-dir", "unused"], "--no-such-flag"),
        (["sweep.py", "--norm-adv", "maybe", "--out-dir", "unused"], "--norm-adv"),
        (["sweep.py", "--ent-coef", "--out-dir", "unused"], "--ent-coef"),
        (["sweep.py", "--lr", "1e-3", "--lr", "3e-4", "--out-dir", "unused"], "--lr is given twice"),
        (["ablate.py", "--script", "no/such/copy.py", "--out-dir", "unused"], "--script no/such/copy.py"),
        (["ablate.py", "--details", "nope", "--out-dir", "unused"], "--details"),
        (["ablate.py", "--num-seeds", "0", "--out-dir", "unused"], "--num-seeds"),
        (["evaluate.py", "no/such/run"], "not a finished run dir"),
        (["evaluate.py", ".", "--episodes", "0"], "--episodes"),
    ],
)
def test_bad_arguments_exit_2_with_one_error_line(arguments, message, tmp_path):
    result = run_script(f"scripts/{arguments[0]}", *arguments[1:], timeout=60, cwd=tmp_path)
    assert result.returncode == 2
    error_lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and message in error_lines[0], result.stderr
    assert not (tmp_path / "unused").exists() and not (tmp_path / "x.png").exists()


METRIC_ROWS = "".join(
    json.dumps({"cycle": cycle, "env_steps": 8 * cycle, "seed": seed, "charts/episodic_return": float(cycle)}) + "\n"
    for cycle in (1, 2) for seed in (1, 2)
)
# (tool, file, its damaged content (None: cut to half its size), what the one error line names)
DAMAGED_FILES = [
    ("evaluate", "args.json", "{not json", "args.json is unreadable"),
    ("evaluate", "params.msgpack", None, "params.msgpack is damaged"),
    ("plot", "args.json", "[1, 2]", "args.json is damaged"),
    ("plot", "metrics.jsonl", "garbage\n" + METRIC_ROWS, "metrics.jsonl line 1 is damaged"),
    ("plot", "metrics.jsonl", METRIC_ROWS.replace("\n", "\n{\"cycle\": 3, ", 1), "metrics.jsonl line 2 is damaged"),
    ("plot", "summary.json", '{"sps": ', "summary.json is unreadable"),
]


@pytest.fixture(scope="module")
def tool_run_dir(tmp_path_factory) -> Path:
    """A finished-looking run dir (args.json, params.msgpack, metrics.jsonl, summary.json)."""
    run_dir = tmp_path_factory.mktemp("tools") / "run"
    lstm_run_dir(run_dir)
    (run_dir / "metrics.jsonl").write_text(METRIC_ROWS)
    (run_dir / "summary.json").write_text(json.dumps({"compile_seconds": 1.0}))
    return run_dir


@pytest.mark.skipif(not (ROOT / "ppo_lstm_impala.py").is_file(), reason="ppo_lstm_impala.py is not in the repo")
@pytest.mark.parametrize("tool, name, content, message", DAMAGED_FILES, ids=[f"{t}:{n}" for t, n, _, _ in DAMAGED_FILES])
def test_a_damaged_file_gets_one_error_line_from_evaluate_and_plot(tool, name, content, message, tool_run_dir, tmp_path, capsys):
    import shutil

    import evaluate
    import plot

    run_dir = tmp_path / "run"
    shutil.copytree(tool_run_dir, run_dir)
    path = run_dir / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2]) if content is None else path.write_text(content)
    arguments = [str(run_dir), "--episodes", "1"] if tool == "evaluate" else [str(run_dir), "--out", str(tmp_path / "x.png")]
    with pytest.raises(SystemExit) as exit_request:
        {"evaluate": evaluate, "plot": plot}[tool].main(arguments)
    err = capsys.readouterr().err
    assert exit_request.value.code == 2 and "Traceback" not in err
    error_lines = [line for line in err.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and f"{path.parent}/{message}" in error_lines[0], err
    assert not (tmp_path / "x.png").exists()


def test_plot_skips_a_torn_last_metrics_line(tmp_path):
    """A kill mid-write leaves a last line without its newline: it is left out, not an error."""
    (tmp_path / "args.json").write_text(json.dumps({"num_seeds": 2}))
    (tmp_path / "metrics.jsonl").write_text(METRIC_ROWS + '{"cycle": 3, "env_st')
    assert [row["cycle"] for row in read_run(tmp_path).rows] == [1, 1, 2, 2]
    result = run_script("scripts/plot.py", str(tmp_path), "--out", str(tmp_path / "curves.png"), timeout=120)
    assert result.returncode == 0 and (tmp_path / "curves.png").stat().st_size > 0, result.stderr


@pytest.mark.parametrize("value, label", [
    (0, "0"), (500, "500"), (0.25, "0.25"), (2500, "2.5k"), (100_000, "100k"), (120_000, "120k"), (1_000_000, "1M"),
    (1_500_000, "1.5M"), (20_000_000, "20M"), (2_000_000_000, "2B"), (-50_000, "-50k"),
])
def test_tick_labels_are_short(value, label):
    """Ticks at 100000, 120000, 140000 read 100k, 120k, 140k, not digits that run together."""
    from runlib import format_steps

    assert format_steps(value) == label


def draw_with(monkeypatch, module, arguments: list[str]):
    """Runs a tool's main in this process and returns the figures it would have written (the
    figures stay open, for the test to read; nothing is written)."""
    import runlib

    figures = []
    monkeypatch.setattr(runlib, "save_figure", lambda figure, out: figures.append(figure))
    assert module.main(arguments) == 0
    return figures


def curves_run_dirs(tmp_path: Path) -> list[Path]:
    """Two hand-written CartPole run dirs of 3 seeds over 1.2M env steps, differing in lr."""
    from helpers import write_run_dir

    returns = {seed: [float(cycle * seed) for cycle in range(1, 61)] for seed in (1, 2, 3)}
    return [write_run_dir(tmp_path / name, {"env_id": "CartPole-v1", "lr": lr}, returns, env_steps_per_cycle=20_000)
            for name, lr in [("a", 1e-3), ("b", 3e-4)]]


def test_plot_title_labels_axes_ticks_and_a_legend_below_the_curves(tmp_path, monkeypatch):
    import plot

    runs = [str(path) for path in curves_run_dirs(tmp_path)]
    (default,) = draw_with(monkeypatch, plot, [*runs, "--out", str(tmp_path / "a.png")])
    (ax,) = default.axes
    assert default._suptitle.get_text() == "CartPole-v1"  # the env id
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("env steps (per seed)", "charts/episodic_return")
    assert [text.get_text() for text in default.legends[0].get_texts()] == ["lr=0.001 (3 seeds)", "lr=0.0003 (3 seeds)"]
    default.canvas.draw()
    assert {label.get_text() for label in ax.get_xticklabels()} >= {"0", "400k", "800k"}
    legend_box, axes_box = default.legends[0].get_window_extent(), ax.get_window_extent()
    assert legend_box.y1 <= axes_box.y0  # below the axes: it covers no curve

    (titled,) = draw_with(monkeypatch, plot, [*runs, "--out", str(tmp_path / "b.pdf"), "--title", "PPO on CartPole",
                                              "--labels", "fast", "slow"])
    assert titled._suptitle.get_text() == "PPO on CartPole"
    assert [text.get_text() for text in titled.legends[0].get_texts()] == ["fast (3 seeds)", "slow (3 seeds)"]


def test_a_metric_is_read_under_either_of_its_names_also_in_an_old_run_dir(tmp_path, monkeypatch):
    """CleanRL's `losses/approx_kl` is our `losses/actor_approxkl3`: an old run dir (ours only) and
    one that has only CleanRL's name give the same table under either name."""
    import plot
    from helpers import write_run_dir
    from runlib import METRIC_ALIASES

    from ppo_support import contract

    assert METRIC_ALIASES["losses/approx_kl"] == "losses/actor_approxkl3" and len(METRIC_ALIASES) == 2 * len(contract.CLEANRL_NAMES)
    kl = {1: [0.01, 0.02], 2: [0.03, 0.04]}
    returns = {1: [1.0, 2.0], 2: [3.0, 4.0]}
    old = write_run_dir(tmp_path / "old", {"env_id": "CartPole-v1"}, returns, more={"losses/actor_approxkl3": kl})
    cleanrl_only = write_run_dir(tmp_path / "cleanrl", {"env_id": "CartPole-v1"}, returns, more={"losses/approx_kl": kl})
    for run_dir in [old, cleanrl_only]:
        for name in ["losses/approx_kl", "losses/actor_approxkl3"]:
            steps, values, seeds = metric_table(read_run(run_dir), name)
            np.testing.assert_array_equal(values, [[0.01, 0.03], [0.02, 0.04]])
    (figure,) = draw_with(monkeypatch, plot, [str(old), "--out", str(tmp_path / "kl.png"), "--metric", "losses/approx_kl"])
    assert figure.axes[0].get_ylabel() == "losses/approx_kl" and len(figure.axes[0].get_lines()) == 1
    _, values, _ = metric_table(read_run(old), "losses/clipfrac")  # neither name logged: all NaN
    assert np.isnan(values).all()
