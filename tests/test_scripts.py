"""Quick tests of the tools in scripts/ (tiny budgets; they only check that the tools work), and
of their layering: each has --help, and none imports another (what they share is runlib.py)."""

from __future__ import annotations

import ast
import re

import pytest
from helpers import ROOT, run_script, run_tool

from ppo_support import cli

LIBRARY = "runlib"  # scripts/runlib.py: what the tools share; not a tool
TOOLS = sorted(path.stem for path in (ROOT / "scripts").glob("*.py") if path.stem != LIBRARY)


def imported_names(path) -> set[str]:
    """The top-level name of every module a file imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.partition(".")[0])
    return names


def test_no_tool_imports_another_tool():
    assert len(TOOLS) >= 10 and {"plot", "ablate", "sweep", "benchmark", "compare"} <= set(TOOLS)
    for path in (ROOT / "scripts").glob("*.py"):
        other_tools = imported_names(path) & (set(TOOLS) - {path.stem})
        assert not other_tools, f"{path.name} imports {sorted(other_tools)}"


@pytest.mark.parametrize("tool", [*TOOLS, LIBRARY])
def test_every_tool_prints_a_usage_on_help(tool):
    result = run_script(f"scripts/{tool}.py", "--help", timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: ") and len(result.stdout.splitlines()) > 3, result.stdout


def test_benchmark_prints_a_markdown_row_per_config(tmp_path):
    out = tmp_path / "bench.md"
    result = run_tool(  # (it fails if its own process takes the device, which its runs need on a TPU)
        "scripts/benchmark.py", "--script", "ppo_mlp.py", "--configs", "cartpole", "cartpole-8-seeds", "--out", str(out),
        "--", "--num-total-env-steps", "2048", timeout=300,
    )
    assert result.returncode == 0, result.stderr
    rows = [line for line in out.read_text().splitlines() if line.startswith("| cartpole")]
    assert len(rows) == 2
    assert rows[1].startswith("| cartpole-8-seeds | `--num-seeds 8 --num-total-env-steps 2048`")
    assert all(row.endswith(" h |") and row.count("|") == 9 for row in rows)  # ... | peak device MB | default run |
    assert " | 1 x cpu | jax " in out.read_text().splitlines()[0]  # the devices its runs trained on


def test_benchmark_rejects_an_unknown_config():
    result = run_script("scripts/benchmark.py", "--script", "ppo_mlp.py", "--configs", "nope", timeout=60)
    assert result.returncode == 2 and "--configs" in result.stderr
    result = run_script("scripts/benchmark.py", "--script", "ppo_mlp.py", "--against", str(ROOT / "docs"), timeout=60)
    assert result.returncode == 2 and "--against" in result.stderr


def test_benchmark_runs_a_copy_outside_the_repository_on_the_configs_it_names(tmp_path):
    """--script takes the path of a copy; --configs-of names whose configs it runs (a copy's own
    name says nothing); a missing file or a copy without --configs-of: one line, exit 2."""
    copy = tmp_path / "my_ppo.py"
    copy.write_text((ROOT / "ppo_mlp.py").read_text())
    for arguments, named in [(["--script", str(copy), "--configs", "cartpole"], "--configs-of"),
                             (["--script", str(tmp_path / "nope.py")], "--script")]:
        result = run_script("scripts/benchmark.py", *arguments, timeout=60)
        assert result.returncode == 2 and named in result.stderr.splitlines()[-1], result.stderr
    out = tmp_path / "bench.md"
    result = run_tool("scripts/benchmark.py", "--script", str(copy), "--configs-of", "ppo_mlp.py", "--configs", "cartpole",
                      "--out", str(out), "--", "--num-total-env-steps", "2048", timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert text.startswith("`my_ppo.py` on ") and "\n| cartpole | `--num-total-env-steps 2048` | " in text


def test_benchmark_against_another_checkout_alternates_rounds_and_gives_their_ratios(tmp_path):
    """Here the other checkout is this one: the row has both medians, the median ratio and the
    lowest and highest round's."""
    out = tmp_path / "ab.md"
    result = run_tool(
        "scripts/benchmark.py", "--script", "ppo_mlp.py", "--configs", "cartpole", "--repeats", "2", "--against", str(ROOT),
        "--out", str(out), "--", "--num-total-env-steps", "2048", timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert [line.split(":")[0] for line in result.stderr.splitlines()] == ["cartpole round 1", "cartpole round 2"]
    (row,) = [line for line in out.read_text().splitlines() if line.startswith("| cartpole")]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert len(cells) == 7 and re.fullmatch(r"\d+\.\d{3}x", cells[4]), row
    low, high = (float(value.rstrip("x")) for value in cells[5].split("-"))
    assert low <= float(cells[4].rstrip("x")) <= high


# A stand-in for a PureJaxRL checkout: its ppo.py steps CartPole through `gymnax.make` expecting
# the old 5-tuple step (so it fails without the shim), and its wrappers import brax.
FAKE_PUREJAXRL_PPO = """
import gymnax, jax, jax.numpy as jnp
from purejaxrl import wrappers


def make_train(config):
    config["NUM_UPDATES"] = config["TOTAL_TIMESTEPS"] // config["NUM_STEPS"] // config["NUM_ENVS"]
    env, params = gymnax.make(config["ENV_NAME"])

    def train(key):
        _, state = env.reset(key, params)

        def step(loop, _):
            state, episode_return = loop
            _, state, reward, done, info = env.step(key, state, 0, params)
            return (state, jnp.where(done, 0.0, episode_return + reward)), (done, episode_return + reward)

        shape = (int(config["NUM_UPDATES"]), config["NUM_STEPS"])  # PureJaxRL's metrics: (updates, steps, ...)
        _, (done, returns) = jax.lax.scan(step, (state, 0.0), None, shape[0] * shape[1])
        return {"metrics": {"returned_episode": done.reshape(shape), "returned_episode_returns": returns.reshape(shape)}}

    return train
"""


# Its ppo_rnn.py: the same stand-in, as upstream imports its wrappers (`from wrappers import ...`,
# which imports brax's training wrappers and navix), and with upstream's "metric" key.
FAKE_PUREJAXRL_PPO_RNN = FAKE_PUREJAXRL_PPO.replace("from purejaxrl import wrappers", "from wrappers import LogWrapper").replace(
    'return {"metrics":', 'return {"metric":')


@pytest.fixture
def fake_purejaxrl_checkout(tmp_path):
    package = tmp_path / "checkout" / "purejaxrl"
    package.mkdir(parents=True)
    (package / "ppo.py").write_text(FAKE_PUREJAXRL_PPO)
    (package / "ppo_rnn.py").write_text(FAKE_PUREJAXRL_PPO_RNN)
    (package / "wrappers.py").write_text(
        "from brax import envs\nfrom brax.envs.wrappers.training import EpisodeWrapper\nimport navix as nx\n\n\nclass LogWrapper:\n    pass\n"
    )
    return package.parent


def test_vs_purejaxrl_runs_both_and_prints_their_row(tmp_path, fake_purejaxrl_checkout):
    out = tmp_path / "vs.md"
    result = run_tool(
        "scripts/vs_purejaxrl.py", "--purejaxrl-dir", str(fake_purejaxrl_checkout), "--seeds", "2", "--repeats", "1",
        "--num-total-env-steps", "2048", "--out", str(out), timeout=300,
    )
    assert result.returncode == 0, result.stderr
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| 2 |")]
    assert len(rows) == 1
    row = rows[0]
    ours, theirs, ratio = (float(cell.replace(",", "").rstrip("x")) for cell in row[1:4])
    assert ours > 0 and theirs > 0 and ratio == pytest.approx(ours / theirs, rel=0.02, abs=0.005)  # printed as 0.00x
    their_return = float(row[5].split(" / ")[1].rstrip(" |"))
    assert 5 < their_return < 20  # always pushing left ends a CartPole episode in about 9 steps


def test_vs_purejaxrl_rnn_runs_ppo_rnn_against_the_lstm_script(tmp_path, fake_purejaxrl_checkout):
    """--rnn: ppo_lstm_impala.py on ppo_rnn.py's config (its own row header), against the
    checkout's ppo_rnn.py (upstream's "metric" key, its wrappers imported as `wrappers`)."""
    result = run_tool(
        "scripts/vs_purejaxrl.py", "--purejaxrl-dir", str(fake_purejaxrl_checkout), "--rnn", "--seeds", "1",
        "--repeats", "1", "--num-total-env-steps", "1024", timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "| ppo_lstm_impala.py env steps/s | PureJaxRL ppo_rnn.py env steps/s |" in result.stdout
    (row,) = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| 1 |")]
    ours, theirs = (float(cell.replace(",", "")) for cell in row[1:3])
    assert ours > 0 and theirs > 0 and 5 < float(row[5].split(" / ")[1].rstrip(" |")) < 20
    refused = run_script("scripts/vs_purejaxrl.py", "--purejaxrl-dir", str(fake_purejaxrl_checkout), "--rnn",
                         "--compiled-loops", timeout=60)
    assert refused.returncode == 2 and "--rnn" in refused.stderr and "Traceback" not in refused.stderr

def test_vs_purejaxrl_compiled_loops_prints_a_median_ratio_within_its_rounds(fake_purejaxrl_checkout):
    result = run_script(
        "scripts/vs_purejaxrl.py", "--purejaxrl-dir", str(fake_purejaxrl_checkout), "--compiled-loops", "--seeds", "2",
        "--repeats", "3", "--num-total-env-steps", "2048", timeout=300,
    )
    assert result.returncode == 0, result.stderr
    rows = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| 2 |")]
    assert len(rows) == 1
    ours, theirs, ratio = (float(cell.replace(",", "").rstrip("x")) for cell in rows[0][1:4])
    lowest, highest = (float(cell.rstrip("x")) for cell in rows[0][4].split("x-"))
    logged, logged_over_theirs, logging_cost = (float(cell.replace(",", "").rstrip(" |x")) for cell in rows[0][5:8])
    assert ours > 0 and theirs > 0 and logged > 0 and lowest <= ratio <= highest
    assert logged_over_theirs >= 0 and logging_cost > 0  # the stand-in is far faster than ours: 0.00x
    table_lines = [line for line in result.stdout.splitlines() if line.startswith("|") or "vs_purejaxrl.py" in line]
    assert len(table_lines) == len(result.stdout.strip().splitlines()) - 1  # and one blank line: no console lines


def test_bench_sweep_times_the_sweep_in_one_process_against_a_process_per_point(tmp_path):
    out = tmp_path / "sweep.md"
    result = run_tool("scripts/bench_sweep.py", "--script", "ppo_mlp.py", "--sweep", "lr=1e-3,3e-4", "--out", str(out),
                      "--", "--num-total-env-steps", "2048", timeout=600)
    assert result.returncode == 0, result.stderr
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[1:]] == ["| `--sweep`, one process", "| 2 processes in a row", "| ratio"]


def test_the_guard_fails_a_tool_that_takes_the_device_itself(tmp_path):
    """tests/support/no_backend.py, which the tool tests run under, can fail."""
    tool = tmp_path / "greedy_tool.py"
    tool.write_text("import jax\nprint('importing JAX is fine')\njax.devices()\nprint('never printed')\n")
    result = run_tool(str(tool))
    assert result.returncode == 3 and result.stdout == "importing JAX is fine\n"
    assert result.stderr == f"error: {tool} started a JAX backend in its own process\n"


def test_vs_purejaxrl_refuses_a_folder_without_purejaxrl(tmp_path):
    result = run_script("scripts/vs_purejaxrl.py", "--purejaxrl-dir", str(tmp_path), timeout=60)
    assert result.returncode == 2 and "--purejaxrl-dir" in result.stderr and "Traceback" not in result.stderr


PROFILE_TINY = {
    "ppo_mlp.py": ["--num-parallel-envs", "4", "--num-env-steps-per-cycle", "8", "--num-minibatches-per-epoch", "2",
                   "--num-epochs-per-cycle", "2"],
    "ppo_lstm_impala.py": ["--env-id", "probe_envs:Memory", "--impala-channels", "4", "--torso-size", "16", "--lstm-size", "16",
                           "--num-parallel-envs", "4", "--num-env-steps-per-cycle", "10", "--num-minibatches-per-epoch", "2",
                           "--num-epochs-per-cycle", "2"],
}


@pytest.mark.parametrize("script", sorted(PROFILE_TINY))
def test_profile_cycle_prints_each_standalone_part_their_sum_the_cycle_and_the_ratio(script):
    result = run_script("scripts/profile_cycle.py", "--script", script, "--part-calls", "2", "--", *PROFILE_TINY[script],
                        timeout=300)
    assert result.returncode == 0, result.stderr
    rows = {line.split(" | ")[0].strip("| "): line for line in result.stdout.splitlines() if line.startswith("| ")}
    milliseconds = {name: float(line.rstrip(" |").rsplit("| ", 1)[1]) for name, line in rows.items() if name[:1] in "(sfr"}
    envs, steps, updates = (4, 8, 4) if script == "ppo_mlp.py" else (4, 10, 4)
    assert f"one policy forward on {envs} observations x {steps}" in rows["(a) rollout forwards"]
    assert f"one env.step vmapped over {envs} envs x {steps}" in rows["(a) env steps"]
    assert f"the batched forward over the {envs * steps} transitions x 1" in rows["(b) post-rollout forward"]
    assert f"value_and_grad of loss_fn on {envs * steps // 2} transitions x {updates}" in rows["(c) minibatch fwd+bwd"]
    parts = [value for name, value in milliseconds.items() if name.startswith("(")]
    assert len(parts) == 4 and all(value > 0 for value in parts)
    assert milliseconds["sum of parts"] == pytest.approx(sum(parts), abs=0.26)  # 5 numbers printed to 0.1 ms: up to 5 x 0.05 apart
    cycle, total = milliseconds["full cycle"], milliseconds["sum of parts"]  # each within 0.05 ms of the true value
    lowest, highest = (cycle - 0.05) / (total + 0.05), (cycle + 0.05) / (total - 0.05)
    assert lowest - 0.005 <= milliseconds["ratio cycle / sum of parts"] <= highest + 0.005  # printed to 0.01


def test_profile_cycle_refuses_bad_flags():
    result = run_script("scripts/profile_cycle.py", "--script", "ppo_mlp.py", "--", "--num-minibatches-per-epoch", "7",
                        timeout=120)
    assert result.returncode == 2 and "--num-minibatches-per-epoch" in result.stderr


@pytest.mark.parametrize("script", ["ppo_mlp.py", "ppo_lstm_impala.py"])
def test_benchmark_gpu_configs_are_valid_flags_of_their_script(script, monkeypatch):
    """The GPU set cannot run here; its flags must at least parse and pass the script's checks."""
    import importlib

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    benchmark = importlib.import_module("benchmark")
    module = importlib.import_module(script.removesuffix(".py"))
    assert benchmark.GPU_CONFIGS[script]
    for name in benchmark.GPU_CONFIGS[script]:
        args = cli.parse_args(module.Args, benchmark.CONFIGS[script][name])
        module.validate_args(args)
        assert args.num_total_env_steps >= args.batch_size, name  # at least one cycle
