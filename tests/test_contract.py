"""The contract between a script and the package (ppo_support/contract.py): the package reads only
the Args fields it lists, recorded in real runs of both scripts; a copy that drops one of them, or
renames a metric the package reads, gets one line and exit code 2 before anything is compiled or
written."""

from __future__ import annotations

import ast
import dataclasses
import sys
import tempfile

import pytest
from helpers import ROOT, run_script

import ppo_lstm_impala
import ppo_mlp
from ppo_support import cli, contract

RECORDED_RUNS = {  # tiny runs that reach every part of the package a run uses: eval, videos, a sweep, checkpoints
    ppo_mlp: ["--num-parallel-envs", "4", "--num-env-steps-per-cycle", "16", "--num-total-env-steps", "256", "--num-seeds", "2",
              "--eval-every-cycles", "2", "--capture-video", "--sweep", "lr=1e-3,2e-3", "--checkpoint-every-cycles", "2"],
    ppo_lstm_impala: ["--env-id", "probe_envs:Memory", "--impala-channels", "4", "--torso-size", "16", "--lstm-size", "16",
                      "--num-parallel-envs", "4", "--num-env-steps-per-cycle", "10", "--num-minibatches-per-epoch", "2",
                      "--num-total-env-steps", "160", "--num-seeds", "2", "--eval-every-cycles", "2", "--capture-video"],
}


def names_in_the_package() -> set[str]:
    """Every attribute name and string constant in ppo_support's source: a field the package reads
    by a name of its own. (A name the script hands it, as validate_args's more_positive_ints, is not.)"""
    names = set()
    for path in (ROOT / "ppo_support").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)
    return names


@pytest.mark.parametrize("script", list(RECORDED_RUNS), ids=lambda module: module.__name__)
def test_the_package_reads_only_the_args_fields_the_contract_lists(script):
    fields = {field.name for field in dataclasses.fields(script.Args)} | {"batch_size", "num_cycles", "num_gradient_steps"}
    read_by_the_package = set()

    class RecordingArgs(script.Args):
        def __getattribute__(self, name):
            if name in fields and sys._getframe(1).f_globals.get("__name__", "").startswith("ppo_support"):
                read_by_the_package.add(name)
            return object.__getattribute__(self, name)

    with tempfile.TemporaryDirectory() as folder:
        args = cli.parse_args(RecordingArgs, [*RECORDED_RUNS[script], "--run-dir", f"{folder}/run"])
        script.run(args)
    assert {"lr", "num_seeds", "wandb_project", "checkpoint_every_cycles"} <= read_by_the_package  # the recording works
    by_its_own_names = read_by_the_package & names_in_the_package()
    assert by_its_own_names <= set(contract.ARGS_FIELDS), sorted(by_its_own_names - set(contract.ARGS_FIELDS))
    contract.check_args_class(script.Args)  # and the script has every one of them
    assert set(contract.METRICS) <= set(script.run_metric_names(*script.envs.make_env(args.env_id)))


@pytest.mark.parametrize("script", ["ppo_mlp.py", "ppo_lstm_impala.py"])
@pytest.mark.parametrize("edit, named", [
    (lambda text: text.replace("\n    adam_eps: float = 1e-5", "\n"), "adam_eps"),  # the field dropped
    (lambda text: text.replace('"losses/policy_loss"', '"losses/pg_loss"'), "losses/policy_loss"),  # the metric renamed
    (lambda text: text.replace("    sweepable: ClassVar", "    sweeps: ClassVar"), "sweepable"),  # --sweep's flags, renamed
])
def test_a_copy_without_a_field_or_a_metric_the_package_reads_gets_one_line_and_exit_2(script, edit, named, tmp_path):
    text = (ROOT / script).read_text()
    copy = tmp_path / "my_ppo.py"
    copy.write_text(edit(text))
    assert copy.read_text() != text
    result = run_script(copy, "--num-parallel-envs", "8", "--num-env-steps-per-cycle", "16", "--num-total-env-steps", "256",
                        "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: my_ppo.py: ") and named in lines[0], lines
    assert not (tmp_path / "run").exists()


TINY = {
    "ppo_mlp.py": ["--num-parallel-envs", "4", "--num-env-steps-per-cycle", "16", "--num-total-env-steps", "256"],
    "ppo_lstm_impala.py": ["--env-id", "probe_envs:Memory", "--impala-channels", "4", "--torso-size", "16", "--lstm-size", "16",
                           "--num-parallel-envs", "4", "--num-env-steps-per-cycle", "10", "--num-minibatches-per-epoch", "2",
                           "--num-total-env-steps", "160"],
}
ADD_TO_THE_LOSS = ("    return total, metrics\n",
                   '    metrics["losses/logit_l2"] = (logits ** 2).mean()\n    return total, metrics\n')
DECLARE_ONLY = ('"losses/actor_approxkl3", "losses/grad_norm")', '"losses/actor_approxkl3", "losses/grad_norm", "losses/logit_l2")')
ADD_TO_THE_CYCLE = ('    metrics["losses/explained_variance"] = ',
                    '    metrics["losses/logit_l2"] = jnp.float32(0.0)\n    metrics["losses/explained_variance"] = ')


@pytest.mark.parametrize("script", ["ppo_mlp.py", "ppo_lstm_impala.py"])
@pytest.mark.parametrize("edit, expected", [
    (ADD_TO_THE_LOSS, "the metric losses/logit_l2 is computed but not declared in MINIBATCH_METRIC_NAMES"),
    (DECLARE_ONLY, "MINIBATCH_METRIC_NAMES declares losses/logit_l2, which is never computed"),
    (ADD_TO_THE_CYCLE, "the metric losses/logit_l2 is computed but not declared in METRIC_NAMES"),
], ids=["computed-not-declared", "declared-not-computed", "cycle-metric-not-declared"])
def test_a_copy_whose_metrics_differ_from_its_declared_names_gets_one_line_naming_the_metric(script, edit, expected, tmp_path):
    text = (ROOT / script).read_text()
    assert text.count(edit[0]) == 1
    copy = tmp_path / "my_ppo.py"
    copy.write_text(text.replace(*edit))
    result = run_script(copy, *TINY[script], "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
    assert not (tmp_path / "run").exists()
