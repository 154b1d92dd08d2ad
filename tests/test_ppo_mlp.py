"""Tests for ppo_mlp.py: pure functions against slow references, probe environments with known
answers, the run-dir outputs, bad input, and learning on CartPole-v1."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ppo_mlp
import ppo_support
from helpers import ROOT, read_wandb_offline_run, record_second_cycle, run_script
from reference import gae_reference, ppo_loss_reference
from ppo_support import devices, envs, provenance

SCRIPT = Path(ppo_mlp.__file__)


def train_in_process(args: ppo_mlp.Args):
    """Trains without writing anything; returns (final states, metrics (cycles, seeds))."""
    env, env_params = envs.make_env(args.env_id)
    init, train = ppo_mlp.make_train(args, env, env_params)
    states = devices.stack_seeds([init(args.seed + i) for i in range(args.num_seeds)])
    states, metrics = jax.jit(train)(states)
    return states, {name: np.asarray(value) for name, value in metrics.items()}


def evaluate_network(args: ppo_mlp.Args, states, obs):
    """Logits and values of seed 0's final parameters on a batch of observations."""
    env, env_params = envs.make_env(args.env_id)
    network = ppo_mlp.make_network(args, env.action_space(env_params).n)
    params = jax.tree.map(lambda x: x[0], states.params)
    return network.apply(params, jnp.asarray(obs, jnp.float32))


# --------------------------------------------------------------------------------------
# GAE and losses against slow references
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("bootstrap_truncated", [True, False])
def test_compute_gae_matches_reference(bootstrap_truncated):
    rng = np.random.default_rng(0)
    num_steps, num_envs = 13, 5
    reward = rng.normal(size=(num_steps, num_envs))
    value = rng.normal(size=(num_steps, num_envs))
    next_value = rng.normal(size=(num_steps, num_envs))
    terminated = rng.random((num_steps, num_envs)) < 0.15
    truncated = (rng.random((num_steps, num_envs)) < 0.15) & ~terminated
    terminated[-1, 0] = True  # termination at the last step: no bootstrap
    truncated[-1, 1] = True  # truncation at the last step: bootstrap from V(final obs)
    terminated[-1, 2] = truncated[-1, 2] = False  # plain rollout end: bootstrap from V(next obs)
    assert terminated.any() and truncated.any()

    done = terminated | truncated
    stops = terminated if bootstrap_truncated else done
    advantage, target = ppo_mlp.compute_gae(
        jnp.asarray(reward, jnp.float32),
        jnp.asarray(value, jnp.float32),
        jnp.asarray(next_value, jnp.float32),
        jnp.asarray(stops, jnp.float32),
        jnp.asarray(done),
        0.97,
        0.9,
    )
    expected_advantage, expected_target = gae_reference(
        reward, value, next_value, terminated, truncated, 0.97, 0.9, bootstrap_truncated
    )
    np.testing.assert_allclose(advantage, expected_advantage, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(target, expected_target, rtol=1e-5, atol=1e-5)
    # the last step of a plain rollout end bootstraps from next_value
    np.testing.assert_allclose(advantage[-1, 2], reward[-1, 2] + 0.97 * next_value[-1, 2] - value[-1, 2], rtol=1e-5)
    # the last step of a termination does not
    np.testing.assert_allclose(advantage[-1, 0], reward[-1, 0] - value[-1, 0], rtol=1e-5)


@pytest.mark.parametrize("clip_vloss", [True, False])
@pytest.mark.parametrize("norm_adv", [True, False])
def test_ppo_loss_terms_match_reference(clip_vloss, norm_adv):
    rng = np.random.default_rng(1)
    size = 64
    old_logp = rng.normal(-1.0, 0.3, size)
    new_logp = old_logp + rng.normal(0.0, 0.3, size)  # many ratios outside (0.8, 1.2)
    old_value = rng.normal(size=size)
    new_value = old_value + rng.normal(0.0, 0.3, size)
    advantage = rng.normal(1.0, 2.0, size)
    target = rng.normal(size=size)
    entropy = rng.random(size)
    batch = ppo_mlp.Batch(
        obs=jnp.zeros((size, 1)),
        action=jnp.zeros(size, jnp.int32),
        logp=jnp.asarray(old_logp, jnp.float32),
        value=jnp.asarray(old_value, jnp.float32),
        advantage=jnp.asarray(advantage, jnp.float32),
        target=jnp.asarray(target, jnp.float32),
        action_mask=None,
    )
    policy_loss, value_loss, metrics = ppo_mlp.ppo_loss_terms(
        jnp.asarray(new_logp, jnp.float32),
        jnp.asarray(entropy, jnp.float32),
        jnp.asarray(new_value, jnp.float32),
        batch,
        0.2,
        clip_vloss,
        norm_adv,
    )
    expected = ppo_loss_reference(
        new_logp, entropy, new_value, old_logp, old_value, advantage, target, 0.2, clip_vloss, norm_adv
    )
    assert 0.1 < expected["losses/actor_clipfrac"] < 0.9  # the clipping paths are exercised
    assert 0.1 < expected["losses/critic_clipfrac"] < 0.9
    for name, value in expected.items():
        np.testing.assert_allclose(float(metrics[name]), value, rtol=1e-4, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(float(policy_loss), expected["losses/policy_loss"], rtol=1e-4)
    np.testing.assert_allclose(float(value_loss), expected["losses/value_loss"], rtol=1e-4)


def test_log_prob_and_entropy_match_distrax():
    import distrax  # the reference: an independent categorical implementation

    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(0.0, 3.0, (64, 5)), jnp.float32)
    mask = jnp.asarray(rng.random((64, 5)) < 0.7).at[:, 0].set(True)
    for action_mask in [None, mask]:
        masked_logits = ppo_mlp.masked(logits, action_mask)
        valid = np.ones((64, 5), bool) if action_mask is None else np.asarray(action_mask)
        action = jnp.asarray([rng.choice(np.flatnonzero(row)) for row in valid])
        log_prob, entropy = ppo_mlp.log_prob_and_entropy(masked_logits, action)
        reference = distrax.Categorical(logits=masked_logits)
        np.testing.assert_allclose(log_prob, reference.log_prob(action), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(entropy, reference.entropy(), rtol=1e-5, atol=1e-6)
        grads = jax.grad(lambda x: sum(v.sum() for v in ppo_mlp.log_prob_and_entropy(x, action)))(masked_logits)
        assert np.all(np.isfinite(grads))


# --------------------------------------------------------------------------------------
# Update mechanics: ratio 1 at the start, target-KL, schedules, shuffling
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("shared_network", [False, True])
def test_first_minibatch_has_ratio_one_and_tiny_target_kl_stops_after_it(shared_network):
    # With a tiny target the cycle stops after its first minibatch, so the logged metrics are
    # those of the first minibatch of the first epoch, where the ratio must be exactly 1.
    args = ppo_mlp.Args(num_total_env_steps=3 * 512, target_kl=1e-12, shared_network=shared_network, num_seeds=2)
    _, metrics = train_in_process(args)
    for name in ["losses/actor_approxkl1", "losses/actor_approxkl3", "losses/actor_clipfrac", "losses/critic_clipfrac"]:
        assert np.all(metrics[name] == 0.0), name
    np.testing.assert_array_equal(metrics["losses/epochs_run"], 1 / args.num_minibatches_per_epoch)


def test_without_target_kl_every_epoch_runs():
    args = ppo_mlp.Args(num_total_env_steps=3 * 512)
    _, metrics = train_in_process(args)
    np.testing.assert_array_equal(metrics["losses/epochs_run"], args.num_epochs_per_cycle)
    assert np.all(metrics["losses/actor_approxkl3"] > 0)  # later minibatches moved the policy


def test_linear_schedule_reaches_zero_exactly_at_the_last_step_and_never_goes_below():
    num_steps = 37
    schedule = ppo_mlp.annealed(2.5e-4, True, num_steps)
    values = np.asarray([schedule(jnp.int32(step)) for step in range(num_steps + 5)])
    assert values[0] == pytest.approx(2.5e-4)
    assert values[num_steps - 1] == 0.0
    assert np.all(values[: num_steps - 1] > 0)
    assert np.all(values >= 0)
    assert np.all(np.diff(values) <= 0)


def test_logged_lr_and_clip_eps_anneal_to_zero_at_the_last_cycle():
    args = ppo_mlp.Args(num_total_env_steps=5 * 512, anneal_lr=True, anneal_clip_eps=True)
    _, metrics = train_in_process(args)
    for name, start in [("charts/learning_rate", args.lr), ("charts/clip_eps", args.clip_eps)]:
        values = metrics[name][:, 0]
        assert values[-1] == 0.0
        assert np.all(values >= 0) and np.all(np.diff(values) < 0)
        assert values[0] < start
    args = ppo_mlp.Args(num_total_env_steps=3 * 512, anneal_lr=False)
    _, metrics = train_in_process(args)
    np.testing.assert_array_equal(metrics["charts/learning_rate"], np.float32(args.lr))
    np.testing.assert_array_equal(metrics["charts/clip_eps"], np.float32(args.clip_eps))


def test_minibatch_permutation_differs_across_epochs_and_cycles(monkeypatch):
    recorded = []
    original = jax.random.permutation

    def recording_permutation(key, batch_size):
        permutation = original(key, batch_size)
        jax.debug.callback(lambda p: recorded.append(np.asarray(p)), permutation, ordered=True)
        return permutation

    monkeypatch.setattr(jax.random, "permutation", recording_permutation)
    args = ppo_mlp.Args(num_total_env_steps=3 * 512, num_epochs_per_cycle=3)
    train_in_process(args)
    assert len(recorded) == 3 * 3  # cycles x epochs
    for permutation in recorded:
        np.testing.assert_array_equal(np.sort(permutation), np.arange(args.batch_size))
    distinct = {tuple(p) for p in recorded}
    assert len(distinct) == len(recorded)


# --------------------------------------------------------------------------------------
# The value targets the update used (its learning rate, clip range and metrics: test_update_values.py)
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("norm_obs, bootstrap_truncated", [(True, True), (False, False)])
def test_the_value_targets_the_update_used_match_a_python_loop_gae(monkeypatch, norm_obs, bootstrap_truncated):
    # The second cycle's batch, as update_cycle received it, against gae_reference over V of the
    # rollout's observations normalised with the statistics frozen at the cycle's start (not the
    # ones updated from this rollout), a truncated step bootstrapping from V(final_obs) (Clock:
    # a time limit ends on observation 1.0, the reset shows 0.0), or not at all without
    # --bootstrap-truncated.
    args = ppo_mlp.Args(env_id="probe_envs:Clock", num_parallel_envs=8, num_env_steps_per_cycle=8, num_total_env_steps=128,
                        num_minibatches_per_epoch=2, num_epochs_per_cycle=1, gamma=0.9, gae_lambda=0.8, norm_obs=norm_obs,
                        bootstrap_truncated=bootstrap_truncated)
    transitions, used, state, network = record_second_cycle(monkeypatch, ppo_mlp, args)
    assert transitions.truncated.any() and transitions.terminated.any()

    def normalized(obs):
        if state.obs_stats is None:
            return obs
        stats = jax.tree.map(np.asarray, state.obs_stats)
        return np.clip((obs - stats.mean) / np.sqrt(stats.var + 1e-8), -10.0, 10.0)

    def value_of(obs):  # the network takes a flat batch (it flattens each observation)
        flat = normalized(obs).reshape(-1, *obs.shape[2:])
        return np.asarray(network.apply(used["params"], jnp.asarray(flat))[1]).reshape(obs.shape[:2])

    value, next_value = value_of(transitions.obs), value_of(transitions.final_obs)  # (T, N)
    _, target = gae_reference(transitions.reward, value, next_value, transitions.terminated, transitions.truncated,
                              args.gamma, args.gae_lambda, bootstrap_truncated)
    batch = used["batch"]
    np.testing.assert_allclose(batch.obs, normalized(transitions.obs).reshape(batch.obs.shape), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(batch.value, value.reshape(-1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(batch.target, target.reshape(-1), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------
# Probe environments with known answers
# --------------------------------------------------------------------------------------

PROBE = dict(num_total_env_steps=16_384, lr=1e-3, gamma=0.9, num_parallel_envs=8, num_env_steps_per_cycle=32)


def test_probe_constant_reward_value_learns_one():
    args = ppo_mlp.Args(env_id="probe_envs:ConstantReward", **PROBE)
    states, _ = train_in_process(args)
    _, value = evaluate_network(args, states, [[0.0]])
    assert float(value[0]) == pytest.approx(1.0, abs=0.05)


def test_probe_observation_dependent_reward_value_learns_the_observation():
    args = ppo_mlp.Args(env_id="probe_envs:ObsDependentReward", **PROBE)
    states, _ = train_in_process(args)
    _, value = evaluate_network(args, states, [[1.0], [-1.0]])
    np.testing.assert_allclose(value, [1.0, -1.0], atol=0.1)


def test_probe_action_dependent_reward_policy_picks_the_best_action():
    args = ppo_mlp.Args(env_id="probe_envs:ActionDependentReward", **PROBE)
    states, metrics = train_in_process(args)
    logits, value = evaluate_network(args, states, [[0.0]])
    assert float(jax.nn.softmax(logits)[0, 0]) > 0.95
    assert float(value[0]) == pytest.approx(1.0, abs=0.15)
    assert np.nanmean(metrics["charts/episodic_return"][-5:]) > 0.9


def test_probe_time_limit_bootstraps_truncated_steps_from_the_final_observation():
    # Reward 1 forever, truncated after 5 steps, constant observation: with bootstrapping the
    # value is the infinite-horizon 1 / (1 - gamma) = 10; treating the time limit as a
    # termination gives at most 1 + 0.9 + ... + 0.9^4 = 4.1.
    args = ppo_mlp.Args(env_id="probe_envs:TimeLimit", **{**PROBE, "num_total_env_steps": 65_536})
    states, metrics = train_in_process(args)
    _, value = evaluate_network(args, states, [[0.0]])
    assert float(value[0]) == pytest.approx(10.0, rel=0.1)
    # every finished episode returns exactly 5: the mean never mixes in unfinished episodes
    returns = metrics["charts/episodic_return"]
    np.testing.assert_array_equal(returns[~np.isnan(returns)], 5.0)

    args = ppo_mlp.Args(env_id="probe_envs:TimeLimit", bootstrap_truncated=False, **{**PROBE, "num_total_env_steps": 65_536})
    states, _ = train_in_process(args)
    _, value = evaluate_network(args, states, [[0.0]])
    assert float(value[0]) < 4.2


def test_invalid_actions_are_never_taken_when_the_env_masks_them():
    # Action 0 would pay 1 but is always invalid; the best valid action pays 0.5.
    args = ppo_mlp.Args(env_id="probe_envs:MaskedActions", **PROBE)
    states, metrics = train_in_process(args)
    returns = metrics["charts/episodic_return"]
    assert np.nanmax(returns) <= 0.5  # action 0 was never sampled, in any cycle
    assert np.nanmean(returns[-5:]) > 0.45
    logits, _ = evaluate_network(args, states, [[0.0]])
    assert float(jax.nn.softmax(logits)[0, 1]) > float(jax.nn.softmax(logits)[0, 2])
    # without masking the policy learns the (invalid) action 0
    _, metrics = train_in_process(ppo_mlp.Args(env_id="probe_envs:MaskedActions", mask_invalid_actions=False, **PROBE))
    assert np.nanmean(metrics["charts/episodic_return"][-5:]) > 0.9


def test_masked_run_still_starts_each_cycle_with_ratio_one():
    args = ppo_mlp.Args(env_id="probe_envs:MaskedActions", num_total_env_steps=3 * 512, target_kl=1e-12)
    _, metrics = train_in_process(args)
    assert np.all(metrics["losses/actor_approxkl3"] == 0.0)
    assert np.all(np.isfinite(metrics["losses/entropy"]))


# --------------------------------------------------------------------------------------
# Determinism
# --------------------------------------------------------------------------------------


def test_same_seed_gives_identical_metrics_and_different_seeds_differ():
    args = ppo_mlp.Args(num_total_env_steps=4 * 512)
    _, first = train_in_process(args)
    _, second = train_in_process(args)
    for name in first:
        np.testing.assert_array_equal(first[name], second[name], err_msg=name)
    _, other = train_in_process(ppo_mlp.Args(num_total_env_steps=4 * 512, seed=2))
    assert not np.array_equal(first["losses/value_loss"], other["losses/value_loss"])


def test_a_seed_trains_the_same_alone_or_vmapped_with_others():
    _, alone = train_in_process(ppo_mlp.Args(num_total_env_steps=3 * 512, seed=2))
    _, together = train_in_process(ppo_mlp.Args(num_total_env_steps=3 * 512, seed=1, num_seeds=2))
    np.testing.assert_allclose(together["losses/value_loss"][:, 1], alone["losses/value_loss"][:, 0], rtol=1e-4)
    assert not np.allclose(together["losses/value_loss"][:, 0], together["losses/value_loss"][:, 1])


# --------------------------------------------------------------------------------------
# The command line and the run dir
# --------------------------------------------------------------------------------------


def test_run_dir_holds_args_metrics_summary_and_loadable_params(tmp_path):
    run_dir = tmp_path / "run"
    # 2-step cycles: many cycles finish no CartPole episode, and must log null, not 0
    result = run_script(
        SCRIPT, "--num-total-env-steps", "1024", "--num-env-steps-per-cycle", "2", "--num-minibatches-per-epoch", "2",
        "--num-seeds", "2", "--run-dir", str(run_dir),
    )
    assert result.returncode == 0, result.stderr
    assert "SPS" in result.stdout and "cycle 128/128" in result.stdout
    # the console line ends with the time since training started and what is left: 0 at the end
    assert re.search(r"^cycle 128/128 \|.* \| elapsed \d+:\d\d:\d\d \| ETA 0:00:00$", result.stdout, re.MULTILINE), result.stdout
    args = json.loads((run_dir / "args.json").read_text())
    assert args["num_env_steps_per_cycle"] == 2 and args["num_seeds"] == 2
    # beside the script that wrote it: the version of ppo_support and the commit of its checkout
    assert (args["script"], args["script_path"]) == ("ppo_mlp.py", str(SCRIPT.resolve()))
    assert args["ppo_support_version"] == ppo_support.__version__
    assert args["ppo_support_commit"].removesuffix("-dirty") == provenance.git_info(ROOT)["git_commit"]

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 128 * 2
    assert {row["seed"] for row in rows} == {1, 2}
    assert [row["env_steps"] for row in rows[::2]] == [8 * cycle for cycle in range(1, 129)]
    for name in ppo_mlp.METRIC_NAMES + ("charts/SPS", "cycle", "env_steps", "seed"):
        assert name in rows[0], name
    episodic = [row["charts/episodic_return"] for row in rows]
    assert None in episodic and 0 not in episodic and 0.0 not in episodic
    assert all(value is None or value >= 1 for value in episodic)

    summary = json.loads((run_dir / "summary.json").read_text())
    for name in ["sps", "compile_seconds", "total_seconds", "final_episodic_return", "final_episodic_return_per_seed"]:
        assert name in summary, name
    assert len(summary["final_episodic_return_per_seed"]) == 2
    assert summary["sps"] > 0
    assert summary["peak_device_memory_mb"] is None  # CPU: no device memory statistics

    loaded_args, params = ppo_mlp.load_params(run_dir)
    assert loaded_args.num_seeds == 2
    leaves = jax.tree.leaves(params)
    assert all(leaf.shape[0] == 2 for leaf in leaves)
    assert not np.array_equal(leaves[0][0], leaves[0][1])


def test_a_second_run_of_the_same_configuration_loads_its_train_program_from_the_compilation_cache(tmp_path):
    """A fresh cache folder: the first run compiles the train program with XLA and keeps it; the
    second (another run dir, the same configuration) loads it, in under a third of the time, and
    trains the same."""
    flags = ["--num-total-env-steps", "2048", "--compilation-cache-dir", str(tmp_path / "cache")]
    runs = []
    for name in ("first", "second"):
        result = run_script(SCRIPT, *flags, "--run-dir", str(tmp_path / name))
        assert result.returncode == 0, result.stderr
        runs.append((result.stdout, json.loads((tmp_path / name / "summary.json").read_text())))
    (first_out, first), (second_out, second) = runs
    assert not first["program_from_cache"] and "the train program XLA compiled in" in first_out
    assert second["program_from_cache"] and "the train program loaded from the compilation cache in" in second_out
    assert second["program_compile_seconds"] < first["program_compile_seconds"] / 3
    assert any(path.name.startswith("jit_segment-") for path in (tmp_path / "cache").iterdir())
    assert (tmp_path / "second" / "params.msgpack").read_bytes() == (tmp_path / "first" / "params.msgpack").read_bytes()


def test_compilation_cache_off_holds_even_after_jax_has_compiled_with_the_cache_on(tmp_path):
    """--compilation-cache-dir off. JAX decides once per process whether it uses its cache, at the
    first compile: `use_cache("off")` after a compile (a script's env or checks may compile first)
    must still keep programs out of it (here: out of $JAX_COMPILATION_CACHE_DIR's folder)."""
    code = """
import jax
def before(x): return x + 1
def after(x): return x * 3 - 1
jax.jit(before)(1)  # compiled with $JAX_COMPILATION_CACHE_DIR's cache on
from ppo_support import compilation
compilation.use_cache("off")
jax.jit(after)(2.0)
"""
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    written = {path.name.split("-")[0] for path in (tmp_path / "cache").iterdir()}
    assert "jit_before" in written and "jit_after" not in written, written


def test_log_every_cycles_writes_every_kth_cycle_and_the_last(tmp_path):
    result = run_script(SCRIPT, "--num-total-env-steps", "5120", "--log-every-cycles", "4", "--run-dir", str(tmp_path / "r"))
    assert result.returncode == 0, result.stderr
    cycles = [json.loads(line)["cycle"] for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert cycles == [4, 8, 10]


def test_bad_input_exits_2_with_one_line(tmp_path):
    """A whole process, refused once the env is made: the fuzz of bad values (test_bad_flags.py)
    runs the scripts' main in-process."""
    run_dir = tmp_path / "never"
    result = run_script(SCRIPT, "--env-id", "Pendulum-v1", "--run-dir", str(run_dir), timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "discrete actions only" in lines[0], result.stderr
    assert not run_dir.exists()  # nothing half-written


def test_track_offline_writes_a_wandb_run_with_the_metrics(tmp_path):
    run_dir = tmp_path / "tracked"
    result = run_script(
        SCRIPT, "--num-total-env-steps", "2048", "--num-seeds", "2", "--track", "--wandb-mode", "offline",
        "--run-dir", str(run_dir),
    )
    assert result.returncode == 0, result.stderr
    (folder,) = run_dir.glob("wandb/offline-run-*")  # one run for every seed
    run = read_wandb_offline_run(folder)
    assert run["name"] == "tracked" and run["group"] == "CartPole-v1__ppo_mlp" and run["tags"] == []
    assert run["config"]["seed"] == 1 and run["config"]["script"] == "ppo_mlp.py" and "git_commit" in run["config"]
    assert (run_dir / "wandb_id.txt").read_text() == run["id"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for logged in run["history"]:
        seed_rows = [row for row in rows if row["env_steps"] == logged["global_step"]]
        for name in ["charts/episodic_return", "losses/actor_approxkl3", "losses/value_loss"]:
            assert [logged[f"seed_{row['seed']}/{name}"] for row in seed_rows] == [row[name] for row in seed_rows]
            assert logged[name] == pytest.approx(np.mean([row[name] for row in seed_rows]))
        assert "charts/SPS" in logged


# --------------------------------------------------------------------------------------
# Learning
# --------------------------------------------------------------------------------------


def test_cartpole_default_flags_reach_475_with_several_seeds(tmp_path):
    summary = ppo_mlp.run(ppo_mlp.Args(num_seeds=4, run_dir=str(tmp_path / "cartpole")))
    assert summary["final_episodic_return"] >= 475, summary
    assert math.isfinite(summary["sps"])


def test_the_last_line_gives_each_seeds_final_returns_and_the_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    result = run_script("ppo_mlp.py", "--num-parallel-envs", "4", "--num-env-steps-per-cycle", "16", "--num-total-env-steps",
                        "256", "--num-seeds", "2", "--eval-every-cycles", "4", "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    last = result.stdout.strip().splitlines()[-1]
    for name, label in (("final_episodic_return", "final return"), ("final_eval_return", "final eval return")):
        seeds = ", ".join("-" if value is None else f"{value:.4g}" for value in summary[f"{name}_per_seed"])
        assert f"{label} {summary[name]:.4g} (seeds: {seeds})" in last, last
    assert last.startswith("done: ") and last.endswith(f" | run dir: {run_dir}")
