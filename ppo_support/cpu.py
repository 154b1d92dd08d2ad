"""CPU settings, applied by each script's run() before JAX starts its backend: XLA's scheduler
flag against a deadlock, the unrolled threefry PRNG, and for ppo_lstm_impala.py the 3x3
convolution its network uses on CPU and its seeds trained in turn. They change how fast training
runs, not what it does."""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp

from . import devices


def avoid_cpu_qr_deadlock() -> None:
    """jaxlib 0.10 on CPU can deadlock in executables with several batched QR factorizations
    (flax's orthogonal init under vmap; init_params also runs one seed at a time for this). This
    CPU-only scheduler flag avoids it at full speed. XLA reads XLA_FLAGS when JAX first starts a
    backend, so this must run before any computation; it leaves a user's own setting alone."""
    add_xla_flag("--xla_cpu_enable_concurrency_optimized_scheduler", "false")


def add_xla_flag(name: str, value: str) -> None:
    """Adds `name=value` to XLA_FLAGS unless XLA_FLAGS already sets `name`."""
    if name not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {name}={value}".strip()


def seeds_in_turn_on_cpu(fn_of_one_seed: Callable) -> Callable:
    """ppo_lstm_impala.py's cycle of every seed (and --sweep point): on CPU one seed after another
    (devices.map_over_seeds), as XLA:CPU trains vmapped seeds' networks about half as fast per seed
    (docs/performance.md); elsewhere vmapped (devices.vmap_over_seeds)."""
    if jax.default_backend() == "cpu":
        return devices.map_over_seeds(fn_of_one_seed)
    return devices.vmap_over_seeds(fn_of_one_seed)


def use_unrolled_threefry_on_cpu() -> None:
    """JAX lowers its threefry PRNG to a rolled 5-iteration loop on CPU (to save compile time),
    and every env step draws random numbers inside our sequential rollout loop. The unrolled
    lowering that GPUs use gives the same bits and runs faster (docs/performance.md). This
    touches a private JAX API, so it is skipped silently when that API moves."""
    try:
        from jax._src.interpreters import mlir
        from jax._src.random import threefry2x32

        rule = threefry2x32._threefry2x32_lowering_rule
        mlir.register_lowering(threefry2x32.threefry2x32_p, rule, platform="cpu")
    except (ImportError, AttributeError):
        pass


# Why conv3x3_for_cpu: XLA:CPU rewrites convolutions into the one layout its libraries take
# (NHWC, HWIO) only in the program's entry computation, not inside a loop body; there, the
# backward convolutions stay in other layouts and run as naive loops (docs/performance.md). Here every
# convolution, forward and both gradients, is written in that layout already.

NHWC_HWIO = ("NHWC", "HWIO", "NHWC")


def nhwc_conv(x: jax.Array, kernel: jax.Array, padding: Any) -> jax.Array:
    return jax.lax.conv_general_dilated(x, kernel, (1, 1), padding, dimension_numbers=NHWC_HWIO)


CONV3X3_PADS = {"SAME": 1, "VALID": 0}  # zeros added on each side of a 3x3 stride-1 convolution's input


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def nhwc_conv_3x3(x: jax.Array, kernel: jax.Array, pad: int) -> jax.Array:
    """A 3x3 stride-1 convolution with `pad` zeros on each side: 1 is SAME, 0 is VALID."""
    return nhwc_conv(x, kernel, ((pad, pad), (pad, pad)))


def nhwc_conv_3x3_forward(x: jax.Array, kernel: jax.Array, pad: int):
    return nhwc_conv_3x3(x, kernel, pad), (x, kernel)


def nhwc_conv_3x3_backward(pad: int, residuals, d_out):
    x, kernel = residuals
    d_x = nhwc_conv(d_out, jnp.flip(kernel, (0, 1)).swapaxes(2, 3), ((2 - pad, 2 - pad), (2 - pad, 2 - pad)))
    # the kernel gradient as a convolution with the input channels as batch and the batch as features
    d_kernel = nhwc_conv(x.transpose(3, 1, 2, 0), d_out.transpose(1, 2, 0, 3), ((pad, pad), (pad, pad)))
    return d_x, d_kernel.transpose(1, 2, 0, 3)


nhwc_conv_3x3.defvjp(nhwc_conv_3x3_forward, nhwc_conv_3x3_backward)


def shifted_matmul_3x3(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """A 3x3 SAME convolution as 9 shifted slices and one matmul."""
    height, width = x.shape[1:3]
    padded = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    columns = jnp.concatenate([padded[:, i:i + height, j:j + width] for i in range(3) for j in range(3)], axis=-1)
    return columns @ kernel.reshape(-1, kernel.shape[-1])


def conv3x3_for_cpu(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                    dimension_numbers=None, feature_group_count=1, precision=None) -> jax.Array:
    """nn.Conv's convolution on CPU, for its 3x3 stride-1 convs, SAME (IMPALA) or VALID (Nature):
    fast inside loops (see above). At 2x2 or less XLA swaps a SAME convolution's operands into a
    naive form: a matmul then."""
    assert rhs.shape[:2] == (3, 3) and tuple(window_strides) == (1, 1) and feature_group_count == 1
    pad = CONV3X3_PADS.get(padding) if isinstance(padding, str) else None
    if pad == 1 and min(lhs.shape[1:3]) <= 2:
        return shifted_matmul_3x3(lhs, rhs)
    if pad is None or jax.typeof(lhs).manual_axis_type.varying:  # under shard_map (simulated CPU devices): XLA's own
        return jax.lax.conv_general_dilated(lhs, rhs, window_strides, padding, dimension_numbers=NHWC_HWIO)
    return nhwc_conv_3x3(lhs, rhs, pad)


def convolution(kernel: int, stride: int) -> Callable | None:
    """nn.Conv's conv_general_dilated for a kernel and stride: conv3x3_for_cpu for a 3x3 stride-1
    conv on the CPU (the same parameters, faster there), else None (XLA's own)."""
    return conv3x3_for_cpu if jax.default_backend() == "cpu" and (kernel, stride) == (3, 1) else None
