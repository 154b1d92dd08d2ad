"""scripts/compare.py on run dirs written by hand (a --sweep's among them), against slow reference
computations written here as plain Python loops: the final score per seed, the IQM, the
probability of improvement and their percentile bootstrap intervals; and its bad input."""

from __future__ import annotations

import json
import math
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, run_script, write_run_dir

sys.path.insert(0, str(ROOT / "scripts"))  # the tools and runlib

NUM_CYCLES = 20  # the final score averages the last 10%: cycles 19 and 20


def random_returns(rng: random.Random, num_seeds: int, level: float) -> dict[int, list[float | None]]:
    """Per seed, one return per cycle around `level`, None (no finished episode) now and then."""
    return {seed: [None if rng.random() < 0.15 else level + rng.gauss(0, 10) for _ in range(NUM_CYCLES)]
            for seed in range(1, num_seeds + 1)}


@pytest.fixture
def run_dirs(tmp_path) -> tuple[list[Path], list[dict]]:
    """A baseline of 5 seeds, a run of 4, and a --sweep's run dir of two points (3 and 6 seeds):
    the folders to pass, and each run's returns per seed, in order."""
    rng = random.Random(7)
    baseline, other = random_returns(rng, 5, 100.0), random_returns(rng, 4, 110.0)
    points = [random_returns(rng, 3, 90.0), random_returns(rng, 6, 120.0)]
    args = {"env_id": "CartPole-v1", "lr": 3e-4}
    write_run_dir(tmp_path / "baseline", args, baseline)
    write_run_dir(tmp_path / "other", {**args, "lr": 1e-3}, other)
    sweep = tmp_path / "sweep"
    for index, returns in enumerate(points):
        write_run_dir(sweep / f"point-{index}", {**args, "lr": [1e-4, 3e-3][index]}, returns)
    (sweep / "args.json").write_text(json.dumps({**args, "sweep": ["lr=1e-4,3e-3"]}))
    return [tmp_path / "baseline", tmp_path / "other", sweep], [baseline, other, *points]


# --- slow references ----------------------------------------------------------------------------


def final_by_loop(returns: dict[int, list[float | None]]) -> list[float]:
    """Per seed, the mean over the last 10% of cycles of the cycles with a return."""
    last = math.ceil(0.1 * NUM_CYCLES)
    finals = []
    for values in returns.values():
        kept = [value for value in values[-last:] if value is not None]
        if kept:
            finals.append(sum(kept) / len(kept))
    return finals


def iqm_by_loop(scores: list[float]) -> float:
    ordered = sorted(scores)
    cut = len(ordered) // 4
    middle = ordered[cut : len(ordered) - cut]
    return sum(middle) / len(middle)


def improvement_by_loop(scores: list[float], baseline: list[float]) -> float:
    total = 0.0
    for x in scores:
        for y in baseline:
            total += 1.0 if x > y else 0.5 if x == y else 0.0
    return total / (len(scores) * len(baseline))


def percentile_by_sorting(draws: list[float], percent: float) -> float:
    """numpy's default (linear) percentile, by hand."""
    ordered = sorted(draws)
    position = percent / 100 * (len(ordered) - 1)
    below = int(math.floor(position))
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def bootstrap_by_loop(statistic, *samples: list[float], num_resamples: int = 2000) -> tuple[float, float]:
    """The 95% percentile interval of the statistic over resamples drawn with replacement (seed 0,
    each sample's indices drawn in turn from one generator)."""
    rng = np.random.default_rng(0)
    indices = [rng.integers(0, len(sample), size=(num_resamples, len(sample))) for sample in samples]
    draws = []
    for draw in range(num_resamples):
        resampled = [[sample[index] for index in sample_indices[draw]] for sample, sample_indices in zip(samples, indices)]
        draws.append(statistic(*resampled))
    return percentile_by_sorting(draws, 2.5), percentile_by_sorting(draws, 97.5)


# --- the tests -----------------------------------------------------------------------------------


def test_compare_matches_slow_loops_for_any_number_of_seeds_and_a_sweeps_points(run_dirs, capsys):
    import compare
    from runlib import read_runs

    folders, all_returns = run_dirs
    runs = [run for folder in folders for run in read_runs(folder)]
    assert len(runs) == 4 and [run.path.name for run in runs] == ["baseline", "other", "point-0", "point-1"]
    rows = compare.compare_runs(runs, ["a", "b", "c", "d"], "charts/episodic_return")
    baseline = final_by_loop(all_returns[0])
    for index, (row, returns) in enumerate(zip(rows, all_returns)):
        finals = final_by_loop(returns)
        assert sorted(row.scores.tolist()) == pytest.approx(sorted(finals))
        assert row.comparison.iqm == pytest.approx(iqm_by_loop(finals))
        assert row.comparison.iqm_ci == pytest.approx(bootstrap_by_loop(iqm_by_loop, finals))
        if index == 0:
            assert math.isnan(row.comparison.p_improve)
            continue
        assert row.comparison.p_improve == pytest.approx(improvement_by_loop(finals, baseline))
        assert row.comparison.p_improve_ci == pytest.approx(bootstrap_by_loop(improvement_by_loop, finals, baseline))
        low, high = row.comparison.iqm_ci
        excluded = iqm_by_loop(baseline) < low or iqm_by_loop(baseline) > high
        assert row.comparison.finding == ("" if not excluded else "higher" if iqm_by_loop(baseline) < low else "lower")

    assert compare.main([str(folder) for folder in folders]) == 0
    table = {line.split(" | ")[1]: line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")}
    assert set(table) >= {"lr=0.0003, num_seeds=5", "lr=0.001, num_seeds=4", "lr=0.0001, num_seeds=3",
                          "lr=0.003, num_seeds=6"}  # the args that differ
    cells = [cell.strip() for cell in table["lr=0.003, num_seeds=6"].strip("| ").split(" | ")]
    finals = final_by_loop(all_returns[3])
    assert cells[2] == str(len(finals))
    assert cells[4] == f"{iqm_by_loop(finals):.4g} [{rows[3].comparison.iqm_ci[0]:.4g}, {rows[3].comparison.iqm_ci[1]:.4g}]"
    assert cells[5].startswith(f"{improvement_by_loop(finals, baseline):.2f} [")


def test_compare_draws_its_plot_with_the_title_labels_and_either_metric_name(run_dirs, tmp_path, monkeypatch):
    """--out draws curves, IQMs and probabilities; --title and --labels reach the figure; CleanRL's
    `losses/approx_kl` reads an old run dir's `losses/actor_approxkl3`."""
    import compare
    import runlib

    figures = []
    monkeypatch.setattr(compare, "save_figure", lambda figure, out: figures.append(figure))
    folders, _ = run_dirs
    labels = ["PPO", "PPO, lr 1e-3", "lr 1e-4", "lr 3e-3"]
    assert compare.main([*map(str, folders), "--out", str(tmp_path / "c.png"), "--title", "my title", "--labels", *labels]) == 0
    (figure,) = figures
    curves, iqms, improvements = figure.axes
    assert figure._suptitle.get_text() == "my title"
    assert [text.get_text() for text in figure.legends[0].get_texts()] == [
        "PPO (5 seeds)", "PPO, lr 1e-3 (4 seeds)", "lr 1e-4 (3 seeds)", "lr 3e-3 (6 seeds)"]
    positions = {label.get_text(): position for label, position in zip(iqms.get_yticklabels(), iqms.get_yticks())}
    assert sorted(positions, key=positions.get, reverse=True) == labels  # the first run on top
    assert curves.get_ylabel() == "charts/episodic_return"

    kl = {seed: [0.01 * seed] * NUM_CYCLES for seed in (1, 2)}
    old = [write_run_dir(tmp_path / name, {"env_id": "CartPole-v1"}, {1: [1.0] * NUM_CYCLES, 2: [2.0] * NUM_CYCLES},
                         more={"losses/actor_approxkl3": kl}) for name in ["old-a", "old-b"]]
    rows = compare.compare_runs([runlib.read_run(path) for path in old], ["a", "b"], "losses/approx_kl")
    assert sorted(rows[1].scores.tolist()) == pytest.approx([0.01, 0.02]) and rows[1].comparison.p_improve == 0.5
    assert compare.main([*map(str, old), "--metric", "losses/approx_kl"]) == 0


def unfinished(folder: Path) -> Path:
    (folder / "summary.json").unlink()
    return folder


# (tool, arguments with {a}, {b} and {sweep} for run dirs, the flag or value the one error line names)
BAD_INPUT = [
    ("compare.py", ["{a}"], "give two or more run dirs"),
    ("compare.py", ["{a}", "{b}", "--labels", "one"], "--labels: 1 labels for 2 runs"),
    ("compare.py", ["{a}", "{sweep}", "--labels", "x", "y"], "--labels: 2 labels for 3 runs"),  # the sweep's 2 points
    ("compare.py", ["{a}", "{b}", "--metric", "losses/nope"], "--metric losses/nope is not in"),
    ("compare.py", ["{a}", "{b}", "--out", "x.jpg"], "--out x.jpg"),
    ("compare.py", ["{a}", "no/such/run"], "no/such/run is not a run dir"),
    ("compare.py", ["{a}", "{unfinished}"], "is unfinished (no summary.json)"),
    ("plot.py", ["{a}", "{b}", "--out", "x.png", "--labels", "one", "two", "three"], "--labels: 3 labels for 2 runs"),
]


@pytest.mark.parametrize("tool, arguments, message", BAD_INPUT, ids=[" ".join([tool, *arguments]) for tool, arguments, _ in BAD_INPUT])
def test_bad_input_exits_2_with_one_line_that_names_it(tool, arguments, message, run_dirs, tmp_path):
    folders, _ = run_dirs
    shutil.copytree(folders[1], tmp_path / "unfinished")
    names = {"a": folders[0], "b": folders[1], "sweep": folders[2], "unfinished": unfinished(tmp_path / "unfinished")}
    result = run_script(f"scripts/{tool}", *[argument.format(**names) for argument in arguments], timeout=120, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    error_lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and message in error_lines[0], result.stderr
    assert not list(tmp_path.glob("x.*")) and result.stdout == ""
