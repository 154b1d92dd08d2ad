"""Quick tests of the tools in scripts/ (tiny budgets; they only check that the tools work)."""

from __future__ import annotations

from helpers import run_script


def test_benchmark_prints_a_markdown_row_per_config(tmp_path):
    out = tmp_path / "bench.md"
    result = run_script(
        "scripts/benchmark.py", "--script", "ppo_mlp.py", "--configs", "cartpole", "cartpole-8-seeds", "--out", str(out),
        "--", "--num-total-env-steps", "2048", timeout=300,
    )
    assert result.returncode == 0, result.stderr
    rows = [line for line in out.read_text().splitlines() if line.startswith("| cartpole")]
    assert len(rows) == 2
    assert rows[1].startswith("| cartpole-8-seeds | `--num-seeds 8 --num-total-env-steps 2048`")
    assert all(row.endswith(" h |") and row.count("|") == 9 for row in rows)  # ... | peak device MB | default run |


def test_benchmark_rejects_an_unknown_config():
    result = run_script("scripts/benchmark.py", "--script", "ppo_mlp.py", "--configs", "nope", timeout=60)
    assert result.returncode == 2 and "--configs" in result.stderr


def test_profile_cycle_splits_a_cycle_and_compares_with_the_bare_network():
    result = run_script("scripts/profile_cycle.py", "--script", "ppo_mlp.py", "--cycles", "2", "--repeats", "1", timeout=300)
    assert result.returncode == 0, result.stderr
    for row in ["| cycle |", "| rollout + GAE |", "| update (epochs x minibatches) |", "| bare network"]:
        assert row in result.stdout, row
    assert "overhead of the loop" in result.stdout
