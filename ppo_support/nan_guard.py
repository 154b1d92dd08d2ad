"""The NaN guard. A seed whose loss, gradient or parameters stop being finite keeps its last good
parameters and applies no update from then on; run() reports it and exits with code 1. The
script's minibatch update records the first failed check (first_non_finite); its cycle ends with
guard_non_finite. The state is the script's own: a NamedTuple with params, opt_state, cycle,
non_finite and non_finite_cycle."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from . import contract

NON_FINITE_CHECKS = ("none", "loss", "gradient", "parameters")  # code 0: every check passed


def first_non_finite(non_finite: jax.Array, loss: jax.Array, grad_norm: jax.Array) -> jax.Array:
    """The code already set, else that of the first check that fails now (0: all finite)."""
    code = jnp.where(
        ~jnp.isfinite(loss),
        NON_FINITE_CHECKS.index("loss"),
        jnp.where(~jnp.isfinite(grad_norm), NON_FINITE_CHECKS.index("gradient"), 0),
    )
    return jnp.where(non_finite > 0, non_finite, code)


def guard_non_finite(state: Any, params: Any, opt_state: Any, non_finite: jax.Array) -> Any:
    """The state after a cycle's update: the whole cycle is undone if any check failed in it (or
    failed before: a failed seed never changes again), and the seed's first failure is recorded
    with its cycle. One select per cycle, not per minibatch."""
    params_finite = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(params)]))
    non_finite = jnp.where(non_finite > 0, non_finite, jnp.where(params_finite, 0, NON_FINITE_CHECKS.index("parameters")))
    params, opt_state = jax.tree.map(
        lambda new, old: jnp.where(non_finite == 0, new, old), (params, opt_state), (state.params, state.opt_state)
    )
    newly_failed = (state.non_finite == 0) & (non_finite > 0)
    return state._replace(
        params=params,
        opt_state=opt_state,
        non_finite=non_finite,
        non_finite_cycle=jnp.where(newly_failed, state.cycle + 1, state.non_finite_cycle),
    )


def skip_when_every_seed_failed(cycle_of_every_seed: Callable, metric_names: tuple[str, ...]) -> Callable:
    """Once every seed has failed, a cycle only counts itself and logs NaN (costs nothing). The
    cycle's metrics must be metric_names, no more, no fewer (contract.check_computed_metrics)."""

    def skip(states: Any) -> tuple[Any, dict[str, jax.Array]]:
        nan = jnp.full(states.cycle.shape, jnp.nan)
        return states._replace(cycle=states.cycle + 1), {name: nan for name in metric_names}

    def checked_cycle(states: Any) -> tuple[Any, dict[str, jax.Array]]:
        states, metrics = cycle_of_every_seed(states)
        contract.check_computed_metrics(metrics, metric_names, "METRIC_NAMES (or the env's names)")  # while tracing
        return states, metrics

    def cycle(states: Any) -> tuple[Any, dict[str, jax.Array]]:
        return jax.lax.cond(jnp.all(states.non_finite > 0), skip, checked_cycle, states)

    return cycle


def failures(states: Any, first_seed: int) -> dict[int, dict[str, Any]]:
    """The seeds the guard stopped, after training: {seed: {"cycle": the cycle whose update was
    not finite, "non_finite": the check that failed}}."""
    cycles, checks = np.asarray(states.non_finite_cycle), np.asarray(states.non_finite)
    return {
        first_seed + index: {"cycle": int(cycle), "non_finite": NON_FINITE_CHECKS[int(check)]}
        for index, (cycle, check) in enumerate(zip(cycles, checks))
        if cycle > 0
    }
