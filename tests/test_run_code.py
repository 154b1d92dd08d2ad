"""Every run dir keeps the code that produced it: the script as it ran in RUN_DIR/code/, its
SHA-256 and a hash of ppo_support's files in args.json. --resume keeps the saved copy and warns in
one line when the script has changed; load_params, when params.msgpack does not load into a
changed script, says the script changed and names both files instead of "damaged"; old run dirs,
without these fields, load as before."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

from helpers import ROOT, run_script
from ppo_support import rundir
from ppo_support.errors import ConfigError

TINY = ["--num-parallel-envs", "4", "--num-env-steps-per-cycle", "16", "--num-total-env-steps", "256",
        "--checkpoint-every-cycles", "1"]
LAYER_NORM = ("            x = activation(dense(width, HIDDEN_GAIN, self.orthogonal_init)(x))",
              "            x = activation(nn.LayerNorm()(dense(width, HIDDEN_GAIN, self.orthogonal_init)(x)))")


@pytest.fixture(scope="module")
def copy_run(tmp_path_factory) -> tuple[Path, Path, bytes]:
    """A copy of ppo_mlp.py (my_ppo.py) and one finished TINY run of it: (copy, run dir, the copy's
    bytes as it ran). Copy the run dir and the script before changing either."""
    folder = tmp_path_factory.mktemp("code")
    copy = folder / "my_ppo.py"
    shutil.copy(ROOT / "ppo_mlp.py", copy)
    result = run_script(copy, *TINY, "--run-dir", str(folder / "run"), cwd=folder)
    assert result.returncode == 0, result.stderr
    return copy, folder / "run", copy.read_bytes()


def import_script(path: Path):
    """The script at `path` as a module of its own (a fresh one each call)."""
    spec = importlib.util.spec_from_file_location(f"{path.stem}_{len(sys.modules)}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def changed_copy(tmp_path: Path, copy_run, edit: tuple[str, str]) -> tuple[Path, Path]:
    """The run dir and the script, both copied into tmp_path, the script edited."""
    copy, run_dir, source = copy_run
    text = source.decode()
    assert text.count(edit[0]) == 1
    script = tmp_path / copy.name
    script.write_text(text.replace(*edit))
    shutil.copytree(run_dir, tmp_path / "run")
    return script, tmp_path / "run"


def test_a_run_dir_keeps_its_script_as_it_ran_and_the_hashes_of_its_code(copy_run):
    copy, run_dir, source = copy_run
    assert (run_dir / "code" / "my_ppo.py").read_bytes() == source
    saved = json.loads((run_dir / "args.json").read_text())
    assert saved["script"] == "my_ppo.py" and saved["script_sha256"] == hashlib.sha256(source).hexdigest()
    digest = hashlib.sha256()
    for path in sorted((ROOT / "ppo_support").glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    assert saved["ppo_support_sha256"] == digest.hexdigest()
    assert saved["ppo_support_commit"]  # the checkout's commit, as before
    assert sorted(path.name for path in (run_dir / "code").iterdir()) == ["my_ppo.py"]


def test_params_that_do_not_load_into_a_changed_script_say_the_script_changed_and_name_both_files(tmp_path, copy_run):
    script, run_dir = changed_copy(tmp_path, copy_run, LAYER_NORM)
    with pytest.raises(ConfigError) as error:
        import_script(script).load_params(run_dir)
    message = str(error.value)
    assert "damaged" not in message and "has changed since the run" in message, message
    assert str(script) in message and str(run_dir / "code" / "my_ppo.py") in message
    # the same run dir made before run dirs kept their code: "damaged", as before
    saved = json.loads((run_dir / "args.json").read_text())
    for name in ["script_sha256", "ppo_support_sha256"]:
        del saved[name]
    (run_dir / "args.json").write_text(json.dumps(saved))
    shutil.rmtree(run_dir / "code")
    with pytest.raises(ConfigError, match="params.msgpack is damaged"):
        import_script(script).load_params(run_dir)


def test_an_old_run_dir_loads_as_before(tmp_path, copy_run):
    copy, run_dir, _ = copy_run
    shutil.copytree(run_dir, tmp_path / "run")
    saved = json.loads((tmp_path / "run" / "args.json").read_text())
    old = {name: value for name, value in saved.items() if name not in ("script_sha256", "ppo_support_sha256")}
    (tmp_path / "run" / "args.json").write_text(json.dumps(old))
    shutil.rmtree(tmp_path / "run" / "code")
    args, params = import_script(copy).load_params(tmp_path / "run")
    assert args.num_total_env_steps == 256 and params is not None
    assert rundir.script_change(tmp_path / "run", type(args)) is None


def test_resume_with_a_changed_script_warns_in_one_line_and_keeps_the_saved_copy(tmp_path, copy_run):
    script, run_dir = changed_copy(tmp_path, copy_run, ("# --- Args ---", "# --- Args (fixed) ---"))
    for name in ["summary.json", "params.msgpack", "checkpoint-4.npz"]:  # as if killed after cycle 3's checkpoint
        (run_dir / name).unlink()
    saved_args = (run_dir / "args.json").read_text()
    result = run_script(script, "--resume", str(run_dir), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "has changed since the run" in warnings[0], result.stderr
    assert str(script) in warnings[0] and str(run_dir / "code" / "my_ppo.py") in warnings[0]
    assert (run_dir / "code" / "my_ppo.py").read_bytes() == copy_run[2]  # the copy the run started with
    assert (run_dir / "args.json").read_text() == saved_args
    assert (run_dir / "summary.json").exists()
