"""The command line of both scripts: parsing the flags (tyro), the checks on the flags that both
scripts have, and the exit codes of `main`: 2 for bad input (one `error:` line, nothing written),
1 when a seed failed or the run dir could not be written, else 0."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable

import jax
import tyro

from . import contract, devices, rundir, sweeps
from .errors import ConfigError, Interrupted, WriteError, flag

# Flags of both scripts that must be positive integers.
POSITIVE_INTS = (
    "num_seeds", "num_total_env_steps", "num_parallel_envs", "num_env_steps_per_cycle", "num_epochs_per_cycle",
    "num_minibatches_per_epoch", "log_every_cycles", "keep_checkpoints", "eval_episodes",
)
WANDB_NAME_LIMIT = 128  # characters in a wandb project or group name
WANDB_TAG_LIMIT = 64  # characters in a wandb tag
WANDB_PROJECT_FORBIDDEN = "/\\#?%:"  # characters wandb refuses in a project name


def check_common_args(args: Any, more_positive_ints: tuple[str, ...] = ()) -> None:
    """The checks on the flags both scripts have, before anything is compiled or written; each
    script's validate_args adds its own. A ConfigError names the flag."""
    for name in POSITIVE_INTS + more_positive_ints:
        if getattr(args, name) <= 0:
            raise ConfigError(f"{flag(name)} must be a positive integer, got {getattr(args, name)}")
    if args.num_devices < 0:
        raise ConfigError(f"--num-devices must be >= 0 (0 = every device), got {args.num_devices}")
    if args.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {args.seed}")
    devices.check_minibatches(args)
    if args.num_cycles == 0:
        raise ConfigError(
            f"--num-total-env-steps {args.num_total_env_steps} is smaller than one cycle "
            f"(--num-parallel-envs x --num-env-steps-per-cycle = {args.batch_size})"
        )
    for name in ["lr", "clip_eps", "max_grad_norm", "adam_eps"]:
        if not 0 < getattr(args, name) < math.inf:
            raise ConfigError(f"{flag(name)} must be a finite number > 0, got {getattr(args, name)}")
    for name in ["ent_coef", "vf_coef"]:
        if not 0 <= getattr(args, name) < math.inf:
            raise ConfigError(f"{flag(name)} must be a finite number >= 0, got {getattr(args, name)}")
    for name in ["gamma", "gae_lambda"]:
        if not 0 <= getattr(args, name) <= 1:
            raise ConfigError(f"{flag(name)} must be in [0, 1], got {getattr(args, name)}")
    for name in ["eval_every_cycles", "checkpoint_every_cycles"]:
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ConfigError(f"{flag(name)} must be a positive integer, got {getattr(args, name)}")
    if args.target_kl is not None and not 0 < args.target_kl < math.inf:
        raise ConfigError(f"--target-kl must be a finite number > 0 when set, got {args.target_kl}")
    for name in ["run_dir", "resume"]:
        if getattr(args, name) is not None and not getattr(args, name).strip():
            raise ConfigError(f"{flag(name)} must name a folder, got {getattr(args, name)!r}")
    check_wandb_args(args)
    if not 0 <= args.sticky_action_prob < 1:
        raise ConfigError(f"--sticky-action-prob must be in [0, 1), got {args.sticky_action_prob}")
    if args.optimistic_reset_ratio < 1:
        raise ConfigError(f"--optimistic-reset-ratio must be at least 1, got {args.optimistic_reset_ratio}")
    check_distributed_args(args)
    check_unread_flags(args)
    check_sweep(args, more_positive_ints)


WANDB_FLAGS = ("wandb_project", "wandb_entity", "wandb_group", "wandb_tags", "wandb_run_per_seed", "wandb_mode")
EVAL_FLAGS = ("eval_episodes", "eval_greedy")


def check_unread_flags(args: Any) -> None:
    """A flag set away from its default that this configuration never reads is refused, rather
    than accepted and ignored: the wandb flags without --track, the evaluation's without
    --eval-every-cycles or --capture-video. (The scripts check their own, e.g. the torso's.)"""
    defaults = {field.name: field.default for field in dataclasses.fields(args)}
    unread = {name: "--track" for name in WANDB_FLAGS if not args.track}
    if args.eval_every_cycles is None and not args.capture_video:
        unread.update({name: "--eval-every-cycles K (or --capture-video)" for name in EVAL_FLAGS})
    for name, needed in unread.items():
        if getattr(args, name) != defaults[name]:
            raise ConfigError(f"{flag(name)} is read only with {needed}, which this run does not have")


def check_sweep(args: Any, more_positive_ints: tuple[str, ...]) -> None:
    """--sweep: its keys and values (sweeps.parse), and each point's values as their own flags'."""
    grid = sweeps.parse(args)
    for point in grid.points if grid else []:
        try:
            check_common_args(sweeps.point_args(dataclasses.replace(args, sweep=()), point), more_positive_ints)
        except ConfigError as error:
            raise ConfigError(f"--sweep {sweeps.point_label(point)}: {error}") from None


def check_distributed_args(args: Any) -> None:
    """--coordinator-address, --num-processes and --process-id: with --distributed, all three or
    none (JAX then detects them from SLURM or Open MPI)."""
    given = [name for name in DISTRIBUTED_FLAGS if getattr(args, name) is not None]
    if given and not args.distributed:
        raise ConfigError(f"{flag(given[0])} needs --distributed")
    if given and len(given) < len(DISTRIBUTED_FLAGS):
        raise ConfigError(
            "--coordinator-address, --num-processes and --process-id go together (or none: JAX detects them "
            f"from SLURM or Open MPI); got only {', '.join(flag(name) for name in given)}"
        )
    if not given:
        return
    host, _, port = args.coordinator_address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--coordinator-address must be HOST:PORT (process 0's), got {args.coordinator_address!r}")
    if args.num_processes < 1:
        raise ConfigError(f"--num-processes must be a positive integer, got {args.num_processes}")
    if not 0 <= args.process_id < args.num_processes:
        raise ConfigError(f"--process-id must be 0 to --num-processes - 1 = {args.num_processes - 1}, got {args.process_id}")


DISTRIBUTED_FLAGS = ("coordinator_address", "num_processes", "process_id")


def check_wandb_args(args: Any) -> None:
    """The limits wandb.init and its server put on names, checked before anything is compiled."""
    project = args.wandb_project
    if project is not None and (
        not project.strip() or len(project) > WANDB_NAME_LIMIT or any(char in project for char in WANDB_PROJECT_FORBIDDEN)
    ):
        raise ConfigError(
            f"--wandb-project must be 1 to {WANDB_NAME_LIMIT} characters, none of {' '.join(WANDB_PROJECT_FORBIDDEN)}; "
            f"got {project!r}"
        )
    group = args.wandb_group
    if group is not None and (not group.strip() or len(group) > WANDB_NAME_LIMIT):
        raise ConfigError(f"--wandb-group must be 1 to {WANDB_NAME_LIMIT} characters when set, got {group!r}")
    for tag in args.wandb_tags:
        if not tag.strip() or len(tag) > WANDB_TAG_LIMIT:
            raise ConfigError(f"--wandb-tags: each tag must be 1 to {WANDB_TAG_LIMIT} characters, got {tag!r}")


# CleanRL's flag names (ppo.py, ppo_atari_lstm.py) and PureJaxRL's config keys, as flags, for ours.
OTHER_NAMES = {
    "--learning-rate": "--lr", "--total-timesteps": "--num-total-env-steps", "--num-envs": "--num-parallel-envs",
    "--num-steps": "--num-env-steps-per-cycle", "--update-epochs": "--num-epochs-per-cycle",
    "--num-minibatches": "--num-minibatches-per-epoch", "--clip-coef": "--clip-eps", "--wandb-project-name": "--wandb-project",
    "--env-name": "--env-id",
}


def did_you_mean(argv: list[str], args_class: type) -> str:
    """' (--learning-rate is --lr here; ...: docs/flags.md ...)' for the CleanRL or PureJaxRL names
    in argv that this script's Args has under another name; '' when there are none."""
    fields = {flag(field.name) for field in dataclasses.fields(args_class)}
    given = {word.partition("=")[0].replace("_", "-").lower() for word in argv if word.startswith("--")}
    hints = [f"{name} is {ours} here" for name, ours in OTHER_NAMES.items() if name in given and ours in fields]
    return f" ({'; '.join(hints)}: docs/flags.md maps CleanRL's and PureJaxRL's names)" if hints else ""


def parse_args(args_class: type, argv: list[str] | None = None) -> Any:
    """The script's Args from the command line (tyro), with tyro's boxed parse errors folded into
    the one-line `error: ...` (exit code 2). With --resume RUN_DIR, the run's args.json gives the
    defaults."""
    try:
        contract.check_args_class(args_class)  # a copy that dropped a field the package reads
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    argv = sys.argv[1:] if argv is None else list(argv)
    default = None
    for index, word in enumerate(argv):
        resume_dir = argv[index + 1] if word == "--resume" and index + 1 < len(argv) else None
        resume_dir = word.partition("=")[2] if word.startswith("--resume=") else resume_dir
        if resume_dir and (Path(resume_dir) / "args.json").exists():
            saved = rundir.args_from_json(Path(resume_dir) / "args.json", args_class)
            default = dataclasses.replace(saved, resume=resume_dir)
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            args = tyro.cli(args_class, args=argv, default=default)
    except SystemExit as exit_request:
        if exit_request.code in (0, None):
            raise
        # The box is: a title line, the message, a rule, then help text. Keep the message.
        lines = [line.strip(" │╭╮╰╯") for line in captured.getvalue().splitlines()]
        is_rule = lambda text: set(text) <= set("-─")  # noqa: E731
        body = [text for text in lines[1:] if text]
        body = body[1:] if body and is_rule(body[0]) else body
        message = " ".join(itertools.takewhile(lambda text: not is_rule(text), body))
        print(f"error: {message or captured.getvalue().strip()}{did_you_mean(argv, args_class)}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        sweeps.check_not_also_flags(sweeps.parse(args), argv)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    return args


def main(parse_and_run: Callable[[], dict[str, Any]]) -> int:
    """The exit code of `parse_and_run()`, which returns the run's summary: 2 for bad input, 1
    when the run dir could not be written, a seed failed (summary["failures"]) or, with
    --distributed, another process was lost; 130 (SIGINT) or 143 (SIGTERM) when a signal stopped
    training (the run saved for --resume) or came before it (nothing written); else 0."""
    try:
        summary = parse_and_run()
    except ConfigError as error:  # bad input: nothing was written
        return leave(2, error)
    except (WriteError, OSError, devices.ProcessLost) as error:  # an unwritable run dir (disk full, ...), a lost process
        return leave(1, error)
    except Interrupted as stopped:  # Ctrl-C or SIGTERM while training: saved for --resume, in every process
        print(stopped, file=sys.stderr, flush=True)
        return leave(stopped.exit_code)
    except KeyboardInterrupt:  # Ctrl-C before training started (a compile ends before Python sees it)
        return leave(130, KeyboardInterrupt("interrupted (SIGINT) before training started; nothing was written"))
    failed = summary["every_point_failed"] if "every_point_failed" in summary else bool(summary["failures"])  # --sweep
    return leave(1 if failed else 0)


def leave(code: int, error: Exception | None = None) -> int:
    """The exit code, after one `error:` line. --distributed: processes whose run finished leave
    the coordinator together (jax.distributed.shutdown); one that stops on an error exits at
    once, as JAX's exit would wait for every other process to leave too."""
    if error is not None:
        print(f"error: {error}", file=sys.stderr, flush=True)
    if jax.distributed.is_initialized() and error is None:  # the run finished, in every process
        jax.distributed.shutdown()
    elif jax.distributed.is_initialized():
        sys.stdout.flush()
        os._exit(code)
    return code
