"""Seeds and devices. Seeds are vmapped: one compiled program trains a stack of them (leading
axis of every state leaf). Devices split each seed's parallel envs under `jax.shard_map`; the
script's PPO averages gradients and metrics across them with the reductions here, which are the
identity on one device."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

from .errors import ConfigError

DEVICE_AXIS = "devices"  # the shard_map axis that splits the parallel envs across devices


def mean_over_devices(x: Any, axis_name: str | None) -> Any:
    """The mean of every device's value under shard_map; the value itself on one device."""
    return x if axis_name is None else jax.lax.pmean(x, axis_name)


def varying(params: Any, axis_name: str | None) -> Any:
    """Params to take the gradient at, under shard_map: each device's own copy. The gradient of
    replicated params comes back already summed over devices (differentiating shard_map's
    implicit broadcast inserts a psum), so mean_over_devices would then average a sum: D times
    the gradient on D devices. At varying params it is this device's own gradient."""
    return params if axis_name is None else jax.lax.pcast(params, axis_name, to="varying")


def sum_over_devices(x: Any, axis_name: str | None) -> Any:
    return x if axis_name is None else jax.lax.psum(x, axis_name)


def nanmean_or_nan(x: jax.Array, axis_name: str | None = None) -> jax.Array:
    """Mean over the non-NaN entries (finished episodes only) of every device; NaN when there
    are none."""
    count = sum_over_devices(jnp.sum(~jnp.isnan(x)), axis_name)
    total = sum_over_devices(jnp.nansum(x), axis_name)
    return jnp.where(count > 0, total / jnp.maximum(count, 1), jnp.nan)


def permute_rows(tree: Any, permutation: jax.Array) -> Any:
    """x[permutation] for every array x of the tree, exactly. On a TPU as a sort: there, gathering
    minibatches of short rows under vmap took 2/3 of a CartPole cycle (docs/accelerators.md).
    Elsewhere the gather (a CPU's is fast)."""
    if jax.default_backend() != "tpu":
        return jax.tree.map(lambda x: x[permutation], tree)
    position = jnp.argsort(permutation)  # where each row goes, once for every array

    def sorted_rows(x: jax.Array) -> jax.Array:
        keys = jnp.broadcast_to(position.reshape(-1, *(1,) * (x.ndim - 1)), x.shape)
        return jax.lax.sort((keys, x), dimension=0, num_keys=1)[1]

    return jax.tree.map(sorted_rows, tree)


def take_along_last_axis(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[..., index] for each row: x (..., K), index (...) -> (...), exactly. On a TPU as a masked
    sum: there, this gather and its gradient's scatter took 17% of a CartPole cycle at 64 seeds
    (docs/accelerators.md). Elsewhere the gather (a CPU's masked sum is slower)."""
    if jax.default_backend() != "tpu":
        return jnp.take_along_axis(x, index[..., None], axis=-1)[..., 0]
    return jnp.where(index[..., None] == jnp.arange(x.shape[-1]), x, 0.0).sum(-1)


def per_device(key: jax.Array, axis_name: str | None) -> jax.Array:
    """Different random numbers on each device (only when there are several)."""
    if axis_name is None or jax.lax.axis_size(axis_name) == 1:
        return key
    return jax.random.fold_in(key, jax.lax.axis_index(axis_name))


def vmap_over_seeds(fn_of_one_seed: Callable) -> Callable:
    """fn of every seed: vmapped over the leading axis of its arguments and results (the seeds;
    with --sweep, every point's seeds). One seed runs unvmapped: vmap over a size-1 axis turns
    every matmul into a batched one, which XLA:CPU runs slower."""
    return over_seeds(fn_of_one_seed, jax.vmap(fn_of_one_seed))


def map_over_seeds(fn_of_one_seed: Callable) -> Callable:
    """fn of every seed as vmap_over_seeds gives it, but one seed after another (jax.lax.map):
    each seed runs the unbatched program."""
    return over_seeds(fn_of_one_seed, lambda *trees: jax.lax.map(lambda one_seed: fn_of_one_seed(*one_seed), trees))


def over_seeds(fn_of_one_seed: Callable, fn_of_several: Callable) -> Callable:
    """fn_of_several for a leading axis of two seeds or more; fn_of_one_seed, unbatched, for one."""

    def every_seed(*trees: Any) -> Any:
        if jax.tree.leaves(trees)[0].shape[0] > 1:
            return fn_of_several(*trees)
        return jax.tree.map(lambda x: x[None], fn_of_one_seed(*jax.tree.map(lambda x: x[0], trees)))

    return every_seed


def on_host_cpu(make: Callable[[], Any]) -> Any:
    """make() computed on the host's CPU when JAX's default backend is an accelerator, its result
    then put on the default device; elsewhere make() itself. For the seeds' init: XLA compiles
    the orthogonal initializers' QR factorizations in seconds for a CPU, in tens of seconds for a
    TPU (docs/performance.md)."""
    if jax.default_backend() == "cpu":
        return make()
    try:
        host = jax.devices("cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS leaves the CPU out
        return make()
    with jax.default_device(host):
        result = make()
    return jax.device_put(result, jax.local_devices()[0])


def stack_seeds(trees: list[Any]) -> Any:
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def state_partition_specs(state_type: type) -> Any:
    """How a stack of states (a NamedTuple with an `env` field) lies across devices: the envs
    (axis 1 of every `env` leaf, after the seed axis) are split, everything else is replicated."""
    return state_type(*([P()] * len(state_type._fields)))._replace(env=P(None, DEVICE_AXIS))


def shard_over_devices(cycle_of_every_seed: Callable, mesh: jax.sharding.Mesh, state_type: type) -> Callable:
    """Each device steps its share of the envs; the metrics come back replicated."""
    specs = state_partition_specs(state_type)
    return jax.shard_map(cycle_of_every_seed, mesh=mesh, in_specs=(specs,), out_specs=(specs, P()))


def state_shardings(states: Any, mesh: jax.sharding.Mesh) -> Any:
    """Each leaf's NamedSharding (state_partition_specs)."""
    return jax.tree.map(
        lambda spec, subtree: jax.tree.map(lambda _: jax.sharding.NamedSharding(mesh, spec), subtree),
        state_partition_specs(type(states)),
        states,
        is_leaf=lambda node: isinstance(node, P),
    )


def shapes_on_mesh(shapes: Any, mesh: jax.sharding.Mesh | None) -> Any:
    """The states' jax.ShapeDtypeStructs (jax.eval_shape's) with their shardings (place_on_mesh's)."""
    if mesh is None:
        return shapes
    return jax.tree.map(lambda shape, sharding: jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding),
                        shapes, state_shardings(shapes, mesh))


def place_on_mesh(states: Any, mesh: jax.sharding.Mesh | None) -> Any:
    if mesh is None:
        return states
    shardings = state_shardings(states, mesh)
    if jax.process_count() == 1:
        return jax.device_put(states, shardings)
    return jax.tree.map(global_array, states, shardings)


def global_array(value: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
    """--distributed: an array over every process's devices, from the whole value, which every
    process holds (the same seeds' init, or the same checkpoint); each puts its own devices' shards."""
    if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
        data = global_array(jax.random.key_data(value), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(value))
    whole = np.asarray(value)
    return jax.make_array_from_callback(whole.shape, sharding, lambda index: whole[index])


def wait_for_every_process(name: str) -> None:
    """--distributed: a barrier; each process goes on once every process has reached it."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def check_same_on_every_process(value: int, what: str) -> None:
    """--distributed: every process must have read the same `value` (an int)."""
    if jax.process_count() == 1:
        return
    values = [int(v) for v in multihost_utils.process_allgather(np.int32(value))]
    if len(set(values)) > 1:
        raise ConfigError(f"{what} differs between processes ({values}, by process): every process must see the same files")


def key_data_or_array(leaf: jax.Array) -> jax.Array:
    """A PRNG key array as its raw data, any other array as it is: what a checkpoint holds and what
    a gather across processes takes."""
    return jax.random.key_data(leaf) if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key) else leaf


def fetch(tree: Any) -> Any:
    """The arrays of a tree in this process's memory, where np.asarray can read them: with
    --distributed, every process gathers the shards of every other (PRNG keys as their key data)."""
    if jax.process_count() == 1:
        return tree
    return multihost_utils.process_allgather(jax.tree.map(key_data_or_array, tree), tiled=True)


def start_distributed(args: Any) -> None:
    """--distributed: joins this process to the run's others (jax.distributed.initialize), before
    anything starts JAX's backend. The coordinator is process 0's --coordinator-address; without
    the three flags JAX detects them from the cluster (SLURM, Open MPI). On CPU the processes'
    collectives go over gloo. A process that stops is noticed by the others' next collective, or
    within HEARTBEAT_SECONDS by the coordinator; they then stop too (cli.main names the lost one)."""
    if not args.distributed:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # only the CPU backend reads it
    try:
        jax.distributed.initialize(
            coordinator_address=args.coordinator_address,
            num_processes=args.num_processes,
            process_id=args.process_id,
            heartbeat_timeout_seconds=HEARTBEAT_SECONDS,
        )
    except Exception as error:  # no coordinator in time, no cluster detected, a bad address...
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"--distributed: could not join the run's processes ({reason})") from None


HEARTBEAT_SECONDS = 20  # a process not heard from for this long is lost, and the run stops


class ProcessLost(Exception):
    """--distributed: another process of the run stopped (cli.main exits at once, with code 1)."""


def raise_if_a_process_was_lost(error: Exception) -> None:
    """--distributed: a collective that failed because its peer's connection closed means that
    another process stopped. With two processes that is the other one; with more, JAX's
    coordinator (process 0) logs which stopped sending heartbeats."""
    if jax.process_count() == 1 or not any(sign in str(error) for sign in LOST_PEER_SIGNS):
        return
    others = [index for index in range(jax.process_count()) if index != jax.process_index()]
    lost = f"process {others[0]}" if len(others) == 1 else f"one of processes {', '.join(map(str, others))}"
    reason = str(error).strip().splitlines()[0]
    raise ProcessLost(
        f"--distributed: lost {lost} of {jax.process_count()} ({reason}); process {jax.process_index()} stops too. "
        "--resume RUN_DIR continues from the last checkpoint"
    ) from None


LOST_PEER_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Connection refused", "Socket closed")


def check_minibatches(args: Any, num_devices: int = 1, sequence_length: int = 1) -> None:
    """--num-minibatches-per-epoch divides what each device cuts its minibatches from: its share of
    the batch's transitions (sequence_length 1), or of its whole env sequences (ppo_lstm_impala.py's
    bptt, sequence_length = --num-env-steps-per-cycle)."""
    share = args.batch_size // num_devices // sequence_length
    if share % args.num_minibatches_per_epoch == 0:
        return
    envs = "--num-parallel-envs" if num_devices == 1 else "--num-parallel-envs / --num-devices"
    whose = "the batch's" if num_devices == 1 else "each device's"
    what = (f"{share} transitions ({envs} x --num-env-steps-per-cycle)" if sequence_length == 1
            else f"{share} whole env sequences ({envs}: --lstm-training bptt cuts minibatches of whole sequences)")
    raise ConfigError(f"--num-minibatches-per-epoch {args.num_minibatches_per_epoch} does not divide {whose} {what}")


def make_mesh(args: Any, sequence_length: int = 1) -> jax.sharding.Mesh | None:
    """The devices the envs are split across; None for one device (no shard_map at all). Each
    device cuts its own minibatches from its share of the batch: from its transitions
    (sequence_length 1), or from its whole env sequences (ppo_lstm_impala.py's bptt). With
    --distributed, every device of every process."""
    devices = jax.devices()
    if args.distributed and args.num_devices not in (0, len(devices)):
        raise ConfigError(
            f"--num-devices {args.num_devices} with --distributed: a run spans every device of its "
            f"{jax.process_count()} process(es), {len(devices)} here; use --num-devices 0"
        )
    num_devices = args.num_devices or len(devices)
    if num_devices > len(devices):
        raise ConfigError(
            f"--num-devices {num_devices}: only {len(devices)} {devices[0].platform} device(s) here "
            "(on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N simulates N)"
        )
    if args.num_parallel_envs % num_devices != 0:
        raise ConfigError(f"--num-parallel-envs {args.num_parallel_envs} does not split evenly across {num_devices} devices (--num-devices)")
    check_minibatches(args, num_devices, sequence_length)
    if num_devices == 1:
        return None
    return jax.make_mesh((num_devices,), (DEVICE_AXIS,), devices=devices[:num_devices])


def description() -> str:
    """The devices this process trains on, as summary.json names them: "1 x TPU v5 lite"."""
    return f"{jax.device_count()} x {jax.devices()[0].device_kind}"


def peak_device_memory_mb() -> float | None:
    """The accelerator's peak memory in use by this process (None where the backend does not tell,
    as on CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats["peak_bytes_in_use"] / 2**20 if "peak_bytes_in_use" in stats else None
