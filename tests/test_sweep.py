"""--sweep: a grid of hyper-parameters x seeds trained in one compiled program (ppo_support/sweeps.py).

A point trained inside a sweep must train as the same flags do alone, swept booleans as their
flags; shape-changing keys and bad values are refused; a resumed sweep equals an uninterrupted
one; a point whose update is not finite is frozen while the others go on; each point is a wandb
run of its own."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from helpers import ROOT, read_wandb_offline_run, run_script, xla_flags
from ppo_support import rundir

# 3 cycles of 2 seeds.
TINY = {
    "ppo_mlp.py": ["--num-parallel-envs", "4", "--num-env-steps-per-cycle", "32", "--num-total-env-steps", "384",
                   "--num-seeds", "2"],
    "ppo_lstm_impala.py": ["--env-id", "probe_envs:Memory", "--impala-channels", "4", "--torso-size", "16",
                           "--lstm-size", "16", "--num-parallel-envs", "4", "--num-env-steps-per-cycle", "10",
                           "--num-minibatches-per-epoch", "2", "--num-total-env-steps", "120", "--num-seeds", "2"],
}


def rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        row.pop("charts/SPS")  # host wall-clock
    return rows


def params(script: str, run_dir: Path) -> list[np.ndarray]:
    module = importlib.import_module(Path(script).stem)
    return [np.asarray(leaf) for leaf in jax.tree.leaves(module.load_params(run_dir)[1])]


def assert_close_rows(swept: list[dict], alone: list[dict]) -> None:
    assert len(swept) == len(alone)
    for swept_row, alone_row in zip(swept, alone):
        assert swept_row.pop("sweep")
        assert swept_row.keys() == alone_row.keys()
        for name, value in alone_row.items():
            if value is None:
                assert swept_row[name] is None, name
            else:
                np.testing.assert_allclose(swept_row[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


# Two values of every sweepable key, set together by two axes (floats, switches), none of them a
# script's default: a key whose point value does not reach the algorithm leaves its point apart from
# the same flags alone. The second target-kl stops some cycles early (at each script's tiny KLs),
# max-grad-norm 0.05 clips.
FLOAT_AXIS = {"lr": ("1e-3", "3e-3"), "clip-eps": ("0.15", "0.3"), "ent-coef": ("0.02", "0.003"), "vf-coef": ("0.8", "0.3"),
              "gamma": ("0.97", "0.9"), "gae-lambda": ("0.9", "0.8"), "max-grad-norm": ("0.3", "0.05"),
              "adam-eps": ("1e-4", "1e-3")}
TARGET_KL = {"ppo_mlp.py": ("0.2", "0.002"), "ppo_lstm_impala.py": ("0.2", "2e-5")}
SWITCH_AXIS = {"norm-adv": ("false", "true"), "clip-vloss": ("false", "true"), "anneal-lr": ("false", "true"),
               "anneal-clip-eps": ("true", "false")}  # the first value of each is not its default, the second is
NORMALIZATION = {"ppo_mlp.py": ["--norm-obs", "--norm-reward"], "ppo_lstm_impala.py": ["--norm-reward"]}


def axis(values: dict[str, tuple[str, str]]) -> str:
    """KEY1,KEY2,...=A1:A2:...,B1:B2:...: one axis that sets every key together."""
    return f"{','.join(values)}={','.join(':'.join(pair[i] for pair in values.values()) for i in range(2))}"


def float_axis(script: str) -> dict[str, tuple[str, str]]:
    return {**FLOAT_AXIS, "target-kl": TARGET_KL[script]}


def flags_of(script: str, point: int) -> list[str]:
    """The flags alone that point `point` of the grid (floats axis x switches axis) stands for."""
    floats, switches = divmod(point, 2)
    flags = [word for key, pair in float_axis(script).items() for word in (f"--{key}", pair[floats])]
    return flags + [f"--{key}" if pair[switches] == "true" else f"--no-{key}" for key, pair in SWITCH_AXIS.items()]


@pytest.mark.parametrize("script", sorted(TINY))
def test_a_point_of_a_sweep_trains_as_its_flags_do_alone(tmp_path, script):
    """Every sweepable key, swept (two axes set all of them at once, with the reward and, for
    ppo_mlp.py, observation normalisation on): point 2, where every key is away from its default (the
    floats' second values, every switch flipped), trains as the same flags do alone: the same
    parameters, metrics and normalisation statistics up to float rounding (the programs batch their
    runs differently), while the four points differ from each other. A key that did not reach the
    algorithm, or a point handed another point's value of either axis, leaves point 2 apart from its
    flags alone."""
    from ppo_support import sweeps

    module = importlib.import_module(Path(script).stem)
    assert {*float_axis(script), *SWITCH_AXIS} == {sweeps.sweep_flag(name) for name in module.Args.sweepable}  # a new key too
    sweep_dir = tmp_path / "sweep"
    result = run_script(script, *TINY[script], *NORMALIZATION[script], "--sweep", axis(float_axis(script)), axis(SWITCH_AXIS),
                        "--run-dir", str(sweep_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "x 2 seeds x 4 points" in result.stdout
    # the console names each point by its values, as its rows' "sweep" tags do
    done_line = result.stdout.strip().splitlines()[-1]
    assert "return by point: lr=0.001,clip-eps=0.15," in result.stdout and "| lr=0.003,clip-eps=0.3," in done_line
    last_cycle_line = [line for line in result.stdout.splitlines() if line.startswith("cycle ")][-1]
    assert "| return by point: lr=0.001," in last_cycle_line and re.search(r"\| elapsed \d+:\d\d:\d\d \| ETA 0:00:00$", last_cycle_line)
    assert done_line.startswith("done: ") and done_line.endswith(f"| run dir: {sweep_dir}")
    summary = json.loads((sweep_dir / "summary.json").read_text())
    assert [point["sweep"]["lr"] for point in summary["points"]] == [1e-3, 1e-3, 3e-3, 3e-3]
    assert [point["sweep"]["norm-adv"] for point in summary["points"]] == [False, True, False, True]
    assert json.loads((sweep_dir / "args.json").read_text())["sweep"] == [axis(float_axis(script)), axis(SWITCH_AXIS)]
    assert sorted(path.name for path in sweep_dir.glob("checkpoint-*.npz"))
    for index, point in enumerate(summary["points"]):
        point_dir = sweep_dir / f"point-{index}"
        saved = json.loads((point_dir / "args.json").read_text())
        assert saved["sweep"] == [] and saved["max_grad_norm"] == point["sweep"]["max-grad-norm"]
        assert all(row["sweep"] == point["sweep"] for row in rows(point_dir))
        assert json.loads((point_dir / "summary.json").read_text())["num_seeds"] == 2
    epochs_run = [row["losses/epochs_run"] for index in (1, 2) for row in rows(sweep_dir / f"point-{index}")]
    assert min(epochs_run) < max(epochs_run)  # the second target-kl stopped some cycles: its value matters

    point_dir, alone_dir = sweep_dir / "point-2", tmp_path / "alone-2"
    result = run_script(script, *TINY[script], *NORMALIZATION[script], *flags_of(script, 2), "--run-dir", str(alone_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_close_rows(rows(point_dir), rows(alone_dir))
    for swept, alone in zip(params(script, point_dir), params(script, alone_dir), strict=True):
        np.testing.assert_allclose(swept, alone, rtol=1e-5, atol=1e-6)
    if "--norm-obs" in NORMALIZATION[script]:  # each point keeps its own statistics, as evaluate.py reads them
        for swept, alone in zip(jax.tree.leaves(module.load_obs_stats(point_dir)),
                                jax.tree.leaves(module.load_obs_stats(alone_dir)), strict=True):
            np.testing.assert_allclose(swept, alone, rtol=1e-5, atol=1e-6)
    # every point trained with its own values: no two points end with the same parameters
    ends = [np.concatenate([leaf.ravel() for leaf in params(script, sweep_dir / f"point-{index}")]) for index in range(4)]
    assert min(np.abs(a - b).max() for i, a in enumerate(ends) for b in ends[i + 1:]) > 1e-4


def test_a_flag_added_to_a_copy_is_swept_once_it_joins_args_sweepable(tmp_path):
    """A researcher's path: a new float flag in a copy of ppo_mlp.py, used in the loss. Swept, it
    is refused in one line that names Args.sweepable; once added there (the copy alone is edited),
    the points train with their values: point 0 (0.0) as the copy without the flag's term."""
    text = (ROOT / "ppo_mlp.py").read_text()
    edits = [("    vf_coef: float = 0.5", "    logit_l2_coef: float = 0.0  # a penalty on the logits' size\n    vf_coef: float = 0.5"),
             ("+ args.vf_coef * value_loss\n", "+ args.vf_coef * value_loss + args.logit_l2_coef * (logits ** 2).mean()\n")]
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    copy = tmp_path / "my_ppo.py"
    copy.write_text(text)
    sweep = ["--sweep", "logit-l2-coef=0,0.5", "--run-dir", str(tmp_path / "sweep")]
    result = run_script(copy, *TINY["ppo_mlp.py"], *sweep, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: --sweep logit-l2-coef: --logit-l2-coef is not in the script's Args.sweepable, the flags one program can vary "
        "(values only: no array shape and no Python `if` depends on them); add it there if that holds for it, or sweep it "
        "with scripts/sweep.py, one process per value"]
    assert not (tmp_path / "sweep").exists()

    old = '"norm_adv", "clip_vloss", "anneal_lr", "anneal_clip_eps",\n'
    assert text.count(old) == 1
    copy.write_text(text.replace(old, old.rstrip("\n") + ' "logit_l2_coef",\n'))
    result = run_script(copy, *TINY["ppo_mlp.py"], *sweep, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = [json.loads((tmp_path / "sweep" / f"point-{index}" / "args.json").read_text()) for index in range(2)]
    assert [point["logit_l2_coef"] for point in saved] == [0.0, 0.5]
    alone = run_script(ROOT / "ppo_mlp.py", *TINY["ppo_mlp.py"], "--run-dir", str(tmp_path / "alone"), cwd=tmp_path)
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert_close_rows(rows(tmp_path / "sweep" / "point-0"), rows(tmp_path / "alone"))
    differs = rows(tmp_path / "sweep" / "point-1")[-1]["losses/policy_loss"] != rows(tmp_path / "alone")[-1]["losses/policy_loss"]
    assert differs  # the flag's value reached the loss


def call_main(script: str, argv: list[str]) -> int:
    try:
        return importlib.import_module(Path(script).stem).main(argv)
    except SystemExit as exit_request:
        return exit_request.code


@pytest.mark.parametrize("script, argv, message", [
    ("ppo_mlp.py", ["--sweep", "num-parallel-envs=4,8"], "--num-parallel-envs is not in the script's Args.sweepable"),
    ("ppo_lstm_impala.py", ["--sweep", "lstm-size=16,32"], "--lstm-size is not in the script's Args.sweepable"),
    ("ppo_lstm_impala.py", ["--sweep", "torso=mlp,impala"], "--torso is not in the script's Args.sweepable"),
    ("ppo_mlp.py", ["--sweep", "hidden-sizes=64,128"], "scripts/sweep.py"),
    ("ppo_mlp.py", ["--sweep", "learning-rate=1e-3,3e-3"], "--sweep learning-rate: no such flag; sweepable: lr, clip-eps"),
    ("ppo_mlp.py", ["--sweep", "lr=1e-3,abc"], "--sweep lr: 'abc' is not a number"),
    ("ppo_mlp.py", ["--sweep", "lr=1e-3,inf"], "not a finite number"),
    ("ppo_mlp.py", ["--sweep", "lr=-1e-3,1e-3"], "--sweep lr=-0.001: --lr must be a finite number > 0"),
    ("ppo_mlp.py", ["--sweep", "gamma=0.9,1.5"], "--gamma must be in [0, 1]"),
    ("ppo_mlp.py", ["--sweep", "lr=1e-3,,3e-3"], "--sweep lr: empty value"),
    ("ppo_mlp.py", ["--sweep", "lr="], "--sweep lr: empty value"),
    ("ppo_mlp.py", ["--sweep", "lr=1e-3,0.001"], "the same value"),
    ("ppo_mlp.py", ["--sweep", "lr=1e-3", "lr=3e-3"], "--sweep lr: given twice"),
    ("ppo_mlp.py", ["--sweep", "lr=1e-3,3e-3", "--lr", "1e-3"], "--lr is also swept by --sweep lr"),
    ("ppo_lstm_impala.py", ["--no-norm-adv", "--sweep", "norm-adv=true,false"], "--no-norm-adv is also swept"),
    ("ppo_mlp.py", ["--sweep", "norm-adv=true,maybe"], "--sweep norm-adv: 'maybe' is not true or false"),
    ("ppo_mlp.py", ["--sweep", "target-kl=none,0.01"], "--sweep target-kl: none (off) cannot be swept with numbers"),
    ("ppo_mlp.py", ["--sweep", "lr"], "--sweep takes KEY=V1,V2,..., got 'lr'"),
    ("ppo_mlp.py", ["--sweep", "lr,ent-coef=1e-3:0.01,3e-3"], "--sweep lr,ent-coef: '3e-3' gives 1 values for 2 keys"),
    ("ppo_mlp.py", ["--sweep", "lr=1e-3,3e-3", "ent-coef,lr=0:1e-3"], "--sweep ent-coef,lr: given twice"),
    ("ppo_mlp.py", ["--sweep", "lr,num-seeds=1e-3:1"], "--num-seeds is not in the script's Args.sweepable"),
])
def test_bad_sweeps_are_refused_with_one_line_and_nothing_written(tmp_path, capsys, script, argv, message):
    assert call_main(script, [*argv, "--run-dir", str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "never").exists()


def test_the_grid_is_the_product_of_its_axes_and_an_axis_may_set_several_keys_together():
    import ppo_mlp
    from ppo_support import sweeps

    grid = sweeps.parse(ppo_mlp.Args(sweep=("lr,ent-coef=1e-3:0.01,3e-4:0", "norm-adv=true,false")))
    assert grid.keys == ("lr", "ent_coef", "norm_adv")
    assert grid.points == (
        {"lr": 1e-3, "ent_coef": 0.01, "norm_adv": True}, {"lr": 1e-3, "ent_coef": 0.01, "norm_adv": False},
        {"lr": 3e-4, "ent_coef": 0.0, "norm_adv": True}, {"lr": 3e-4, "ent_coef": 0.0, "norm_adv": False},
    )
    assert sweeps.parse(ppo_mlp.Args()) is None


NAN_SWEEP = [*TINY["ppo_mlp.py"][:4], "--num-total-env-steps", str(128 * 8), "--checkpoint-every-cycles", "2",
             "--norm-obs", "--norm-reward", "--sweep", "lr=1e-3,1e38"]  # lr 1e38 overflows the parameters in the first cycle


def test_a_failed_point_is_frozen_the_others_go_on_and_a_resumed_sweep_is_bit_identical(tmp_path):
    """lr 1e38: that point's update is not finite in cycle 1, so it keeps its initial parameters;
    the other point trains on, checkpoints go on, and the exit code is 0. A copy resumed from its
    older checkpoint ends bit for bit as the uninterrupted sweep, point by point, the observation
    and reward statistics included (--norm-obs --norm-reward)."""
    whole = tmp_path / "whole"
    result = run_script("ppo_mlp.py", *NAN_SWEEP, "--run-dir", str(whole))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.startswith("warning: point 1 (lr=1e+38): seed 1: non-finite loss at cycle 1")
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["failures"] == {"point-1": {"1": {"cycle": 1, "non_finite": "loss"}}}
    assert not summary["every_point_failed"] and summary["points"][0]["failures"] == {}
    assert json.loads((whole / "point-1" / "summary.json").read_text())["failures"] == {"1": {"cycle": 1, "non_finite": "loss"}}
    newest = rundir.read_checkpoint(whole / "checkpoint-8.npz")
    assert int(newest["cycle"]) == 8  # checkpoints went on after the failure, and hold finite values only
    assert all(np.all(np.isfinite(leaf)) for leaf in newest.values() if leaf.dtype.kind == "f")
    assert [row["losses/epochs_run"] for row in rows(whole / "point-1")][1:] == [0] * 7  # nothing applied after cycle 1
    assert all(row["losses/epochs_run"] == 4 for row in rows(whole / "point-0"))

    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    (resumed / "checkpoint-8.npz").unlink()
    for path in [resumed / "summary.json", *resumed.glob("point-*/summary.json"), *resumed.glob("point-*/*.msgpack")]:
        path.unlink()
    result = run_script("ppo_mlp.py", "--resume", str(resumed))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming {resumed} from cycle 6" in result.stdout
    for index in range(2):
        for name in ["params.msgpack", "obs_stats.msgpack"]:
            assert (resumed / f"point-{index}" / name).read_bytes() == (whole / f"point-{index}" / name).read_bytes(), name
        assert rows(resumed / f"point-{index}") == rows(whole / f"point-{index}")
    assert (resumed / "checkpoint-8.npz").read_bytes() == (whole / "checkpoint-8.npz").read_bytes()

    every = tmp_path / "every"
    result = run_script("ppo_mlp.py", *NAN_SWEEP[:-1], "lr=1e37,1e38", "--run-dir", str(every))
    assert result.returncode == 1
    assert [line.split(":")[0] for line in result.stderr.splitlines()] == ["error", "error"]
    assert json.loads((every / "summary.json").read_text())["every_point_failed"]


def test_each_point_is_a_wandb_run_with_its_values_in_its_config_and_name(tmp_path):
    """Also evaluates during training: each point's evaluation is its own."""
    run_dir = tmp_path / "run"
    result = run_script("ppo_mlp.py", *TINY["ppo_mlp.py"], "--sweep", "ent-coef=0,0.01", "clip-vloss=true,false", "--track",
                        "--wandb-mode", "offline", "--eval-every-cycles", "3", "--eval-episodes", "2", "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert all(point["final_eval_return"] is not None for point in summary["points"])
    for index in range(4):
        evaluated = [row["eval/episodic_return"] for row in rows(run_dir / f"point-{index}") if row["cycle"] == 3]
        assert len(evaluated) == 2 and all(value is not None for value in evaluated)
    runs = [read_wandb_offline_run(next((run_dir / f"point-{index}").glob("wandb/offline-run-*"))) for index in range(4)]
    assert len({run["id"] for run in runs}) == 4 and {run["group"] for run in runs} == {"run"}
    for index, (run, (ent_coef, clip_vloss)) in enumerate(zip(runs, [(0, True), (0, False), (0.01, True), (0.01, False)])):
        assert run["config"]["sweep"] == {"ent-coef": ent_coef, "clip-vloss": clip_vloss}
        assert (run["config"]["ent_coef"], run["config"]["clip_vloss"]) == (ent_coef, clip_vloss)
        assert run["name"] == f"run__ent-coef={ent_coef:g},clip-vloss={clip_vloss}"
        # each run logs its point's rows: per cycle, the mean over its two seeds
        point_rows = rows(run_dir / f"point-{index}")
        expected = [np.mean([row["losses/value_loss"] for row in point_rows if row["cycle"] == cycle]) for cycle in (1, 2, 3)]
        assert [row["losses/value_loss"] for row in run["history"]] == pytest.approx(expected, rel=1e-6)


def test_a_point_of_a_sweep_on_two_devices_trains_as_its_flags_do_alone_on_two(tmp_path):
    """--num-devices 2 splits every run's envs across the devices (each device drawing its own
    random numbers, so not the 1-device run): a point trains as its flags do alone on 2 devices."""
    two_devices = {**os.environ, "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=2")}
    flags = [*TINY["ppo_mlp.py"], "--num-devices", "2"]
    sweep = run_script("ppo_mlp.py", *flags, "--sweep", "lr=1e-3,3e-3", "--run-dir", str(tmp_path / "sweep"), env=two_devices)
    alone = run_script("ppo_mlp.py", *flags, "--lr", "3e-3", "--run-dir", str(tmp_path / "alone"), env=two_devices)
    for result in (sweep, alone):
        assert result.returncode == 0, result.stderr[-3000:]
        assert "on 2 devices" in result.stdout
    assert_close_rows(rows(tmp_path / "sweep" / "point-1"), rows(tmp_path / "alone"))
    for swept, alone in zip(params("ppo_mlp.py", tmp_path / "sweep" / "point-1"), params("ppo_mlp.py", tmp_path / "alone"),
                            strict=True):
        np.testing.assert_allclose(swept, alone, rtol=1e-5, atol=1e-6)
