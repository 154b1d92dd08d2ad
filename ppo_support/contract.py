"""What the package reads from a script, in one place: the fields of its `Args` (and
`Args.sweepable`, the flags --sweep may vary) and the metric names. The package reads these by name and nothing else of the script's (a test records every
field it reads in real runs). A copy that drops or renames one of them is refused before anything
is compiled or written, in one line that names it (exit code 2), instead of failing later.

Why a list checked at start-up, not a base dataclass the scripts' `Args` extend: every flag of a
run stays written in the script's own `Args`, where a researcher reads and changes them.

A script declares for itself what only it knows: its metric names (`run_metric_names`), and the
state fields nan_guard and sessions read are its `TrainState`'s (STATE_FIELDS)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Iterable

from .errors import ConfigError, flag

ARGS_FIELDS = (
    # the run: seeds, the env, the run dir, --resume, --sweep
    "seed", "num_seeds", "env_id", "exp_name", "run_dir", "resume", "sweep", "sticky_action_prob", "optimistic_reset_ratio",
    # the batch and the number of cycles (batch_size, num_cycles and num_gradient_steps may be properties)
    "num_total_env_steps", "num_parallel_envs", "num_env_steps_per_cycle", "num_epochs_per_cycle", "num_minibatches_per_epoch",
    "batch_size", "num_cycles", "num_gradient_steps",
    # PPO's settings that cli checks and --sweep varies
    "lr", "clip_eps", "ent_coef", "vf_coef", "gamma", "gae_lambda", "max_grad_norm", "adam_eps", "target_kl",
    "norm_adv", "clip_vloss", "anneal_lr", "anneal_clip_eps",
    # evaluation, logging, checkpoints, the compilation cache
    "eval_every_cycles", "eval_episodes", "eval_greedy", "capture_video", "log_every_cycles", "checkpoint_every_cycles",
    "keep_checkpoints", "compilation_cache_dir",
    # wandb
    "track", "wandb_project", "wandb_entity", "wandb_group", "wandb_tags", "wandb_run_per_seed", "wandb_mode",
    # devices and processes
    "num_devices", "distributed", "coordinator_address", "num_processes", "process_id",
)

# Metrics the package reads from a run's rows: the summary's return and the console line's losses.
METRICS = ("charts/episodic_return", "losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/actor_approxkl3")

# CleanRL's names for three of ours (its ppo*.py files), logged beside ours so that CleanRL
# dashboards line up; the tools accept either name, on run dirs logged before these were too.
CLEANRL_NAMES = {
    "losses/approx_kl": "losses/actor_approxkl3",
    "losses/old_approx_kl": "losses/actor_approxkl1",
    "losses/clipfrac": "losses/actor_clipfrac",
}

# TrainState fields the package reads or sets (nan_guard, sessions, sweeps): the script's state has them.
STATE_FIELDS = ("params", "opt_state", "key", "cycle", "non_finite", "non_finite_cycle", "sweep")


def script_name(args_class: type) -> str:
    module = sys.modules.get(args_class.__module__)
    return Path(getattr(module, "__file__", None) or args_class.__module__).name


def check_args_class(args_class: type) -> None:
    """Every field of ARGS_FIELDS is a field or a property of the script's Args, and Args.sweepable
    (the flags --sweep may vary, sweeps.py) is there."""
    fields = {field.name for field in dataclasses.fields(args_class)}
    missing = [name for name in ARGS_FIELDS if name not in fields and not isinstance(getattr(args_class, name, None), property)]
    if not isinstance(getattr(args_class, "sweepable", None), tuple):
        raise ConfigError(
            f"{script_name(args_class)}: its Args has no `sweepable` (a ClassVar tuple of the flags --sweep may vary), "
            "which ppo_support reads: put it back (ppo_support/contract.py lists what the package reads)"
        )
    unknown = [name for name in args_class.sweepable if name not in fields]
    if unknown:
        raise ConfigError(f"{script_name(args_class)}: Args.sweepable names {', '.join(unknown)}, which Args does not have")
    if missing:
        raise ConfigError(
            f"{script_name(args_class)}: its Args has no {', '.join(missing)} ({', '.join(flag(name) for name in missing)}), "
            "which ppo_support reads: put it back (ppo_support/contract.py lists what the package reads)"
        )


def check_metric_names(metric_names: tuple[str, ...], args: Any) -> None:
    """Every metric of METRICS is among the script's metric names."""
    missing = [name for name in METRICS if name not in metric_names]
    if missing:
        raise ConfigError(
            f"{script_name(type(args))}: its metric names lack {', '.join(missing)}, which ppo_support reads (the summary "
            "and the console line): log it under that name (ppo_support/contract.py lists what the package reads)"
        )


def check_computed_metrics(computed: Iterable[str], declared: tuple[str, ...], declared_in: str, script: str = "") -> None:
    """The metrics a script computes are the ones it declares (`declared_in`: the name of its
    tuple), checked on the dict while the train program is traced, before XLA compiles it: a
    metric added to the loss but not to its names, or named but never computed, would otherwise
    fail deep inside JAX as two pytrees that differ."""
    computed = list(computed)
    undeclared = [name for name in computed if name not in declared]
    not_computed = [name for name in declared if name not in computed]
    prefix = f"{script}: " if script else ""
    if undeclared:
        raise ConfigError(
            f"{prefix}the metric {', '.join(undeclared)} is computed but not declared in {declared_in}: add it there, "
            "so that it is logged"
        )
    if not_computed:
        raise ConfigError(
            f"{prefix}{declared_in} declares {', '.join(not_computed)}, which is never computed: compute it or take it "
            f"out of {declared_in}"
        )
