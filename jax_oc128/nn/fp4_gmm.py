"""The FP4 grouped matmul as a native op: DeepSeek-V4's released FP4 experts (e2m1 codes two a byte along K,
an e8m0 scale per 32 columns of a row; :mod:`~jax_oc128.nn.quant`) on the rows of the padded layout of
:mod:`~jax_oc128.nn.grouped_matmul`, the computation of :func:`~jax_oc128.nn.grouped_matmul.gmm_jnp`.

The native target ``oc128_fp4_gmm`` (ffi/fp4_gmm_ffi.h): on CPU a reference loop; on CUDA a memory-bound
kernel for decode sizes on the tensor cores (each block streams one routed expert's packed codes with 16-byte
loads, decodes them in registers to bfloat16, as :func:`~jax_oc128.nn.grouped_matmul.fp4_bf16_ptx` does, and
multiplies the few rows of its tile, float32 accumulation; padding rows and tiles of no expert are skipped and
written 0), bfloat16 rows only (float32 ones run the twin there), exact for the scales the loader accepts
(:func:`~jax_oc128.nn.quant.check_scales`). Both are deterministic run to run; :func:`fp4_gmm_reference` is
the jnp twin. The op takes a tile's real rows as a count (``tile_rows``, :func:`tile_rows`): the layout puts
each tile's pairs first. Subnormal x: the CPU handler runs on XLA's threads, which flush them to zero.

:func:`gmm` is the grouped matmul of the MoE's ``grouped`` dispatch: this op on CUDA for FP4 weights with
e8m0 scales at decode sizes (:func:`takes`: where it is measured no slower than the Pallas
kernel) where the CUDA module is built, else :func:`~jax_oc128.nn.grouped_matmul.gmm` (the Pallas kernel on
CUDA, the jnp loop elsewhere).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_oc128 import ops
from jax_oc128.nn import grouped_matmul, quant
from jax_oc128.nn.grouped_matmul import Groups
from jax_oc128.nn.quant import QuantizedArray

TARGET = "oc128_fp4_gmm"
#: the most rows a tile may have for :func:`gmm` to take the op on CUDA (decode sizes: the layout's tiles are
#: then of 16 rows; prefill's larger tiles go to the Pallas kernel)
MAX_BLOCK_ROWS = 16
#: :func:`gmm` takes the op on CUDA for at most this many (token, expert) pairs per expert: the largest load
#: (V4-Flash at 64 tokens) where the H100 measured it no slower than the Pallas kernel (bench/RESULTS.md
#: section 24)
PAIRS_PER_EXPERT = 1.5


def tile_rows(groups: Groups) -> jax.Array:
    """int32 ``[tiles]``: how many rows of each tile hold a pair (its first rows, :func:`group_pairs`)."""
    pairs = groups.rows.shape[0]
    holds = groups.row_pairs.reshape(-1, groups.block_rows) < pairs
    return jnp.sum(holds, axis=1, dtype=jnp.int32)


def _check(x, weights, groups: Groups, gated: bool, limit) -> None:
    """The operands of :func:`fp4_gmm`, at trace time."""
    if not isinstance(weights, QuantizedArray) or weights.fmt != quant.FP4 or weights.ndim != 3:
        got = (
            f"{weights.fmt} {weights.shape}"
            if isinstance(weights, QuantizedArray)
            else type(weights).__name__
        )
        raise TypeError(f"weights: expected an FP4 QuantizedArray [experts, N, K], got {got}")
    if weights.scales.dtype != jnp.uint8:
        raise TypeError(f"weights: the op takes e8m0 (uint8) scales, got {weights.scales.dtype}")
    _, n, k = weights.shape
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise TypeError(f"x: dtype must be float32 or bfloat16, got {x.dtype}")
    if x.shape != (groups.num_rows, k):
        raise ValueError(f"x: expected shape [{groups.num_rows}, {k}] (the layout's rows, K), got {x.shape}")
    if k % quant.GROUP[quant.FP4]:
        raise ValueError(f"weights: K must be a multiple of {quant.GROUP[quant.FP4]}, got {k}")
    if gated and n % 2:
        raise ValueError(f"weights: gated, N (gate and up rows) must be even, got {n}")
    if limit is not None and not (isinstance(limit, (int, float)) and limit > 0):
        raise ValueError(f"limit: must be a positive number or None, got {limit!r}")


def fp4_gmm(x, weights: QuantizedArray, groups: Groups, *, gated: bool = False, limit: float | None = None):
    """:func:`~jax_oc128.nn.grouped_matmul.gmm_jnp`'s product by the native op (module docstring).

    Args:
      x: ``[rows, K]`` float32 or bfloat16 (the weights' dtype): the padded layout's rows.
      weights: FP4 :class:`~jax_oc128.nn.quant.QuantizedArray` ``[experts, N, K]`` with e8m0 (uint8) scales.
      groups: the layout (:func:`~jax_oc128.nn.grouped_matmul.group_pairs`).
      gated: N holds each expert's gate then up rows; the result is their SwiGLU gate (``limit``).

    Returns:
      float32 ``[rows, N]``, or gated ``[rows, N / 2]`` in x's dtype; 0 on padding rows and unused tiles.
    """
    _check(x, weights, groups, gated, limit)
    n = weights.shape[1] // 2 if gated else weights.shape[1]
    shape = jax.ShapeDtypeStruct((groups.num_rows, n), x.dtype if gated else jnp.float32)
    codes = jax.lax.bitcast_convert_type(weights.codes, jnp.uint8)  # int8 as a checkpoint stores them
    operands = (x, codes, weights.scales, groups.tile_expert, tile_rows(groups))
    attrs = dict(gated=np.int64(gated), limit=np.float32(np.inf if limit is None else limit))
    # the CUDA kernel takes bfloat16 rows; float32 ones run the twin there
    bf16 = jnp.dtype(x.dtype) == jnp.dtype(jnp.bfloat16)
    has_native = {p: TARGET in ops.native_targets(p) and (bf16 or p == "cpu") for p in ("cpu", "cuda")}

    def native(*operands):
        return jax.ffi.ffi_call(TARGET, shape, vmap_method="sequential")(*operands, **attrs)

    def reference(x, codes, scales, tile_expert, rows):
        weights_here = dataclasses.replace(weights, codes=codes, scales=scales)
        return fp4_gmm_reference(
            x, weights_here, groups._replace(tile_expert=tile_expert), rows, gated, limit
        )

    if all(has_native.values()):
        return native(*operands)
    branches = {p: native if has else reference for p, has in has_native.items()}
    return jax.lax.platform_dependent(*operands, default=reference, **branches)


def fp4_gmm_reference(x, weights, groups: Groups, rows, gated: bool = False, limit: float | None = None):
    """The jnp twin of :func:`fp4_gmm` for a tile's count of real rows ``rows`` (int32 ``[tiles]``):
    :func:`~jax_oc128.nn.grouped_matmul.gmm_jnp` on x with every other row zeroed, those rows of the result
    zeroed too."""
    real = (jnp.arange(groups.block_rows)[None, :] < rows[:, None]).reshape(-1, 1)
    out = grouped_matmul.gmm_jnp(jnp.where(real, x, 0), weights, groups, gated=gated, limit=limit)
    return jnp.where(real, out, 0).astype(out.dtype)


def takes(x, weights, groups: Groups) -> bool:
    """Whether :func:`gmm` runs the op on CUDA for these operands: bfloat16 rows, FP4 weights with e8m0
    scales, tiles of at most :data:`MAX_BLOCK_ROWS` rows, at most :data:`PAIRS_PER_EXPERT` pairs per
    expert."""
    return (
        jnp.dtype(x.dtype) == jnp.dtype(jnp.bfloat16)
        and isinstance(weights, QuantizedArray)
        and weights.fmt == quant.FP4
        and weights.scales.dtype == jnp.uint8
        and groups.block_rows <= MAX_BLOCK_ROWS
        and groups.rows.shape[0] <= PAIRS_PER_EXPERT * weights.shape[0]
    )


def gmm(x, weights, groups: Groups, *, gated: bool = False, limit: float | None = None):
    """The MoE's grouped matmul: :func:`fp4_gmm` on CUDA where the CUDA module has the op and it
    :func:`takes` the operands, :func:`~jax_oc128.nn.grouped_matmul.gmm` otherwise (and on every other
    platform)."""
    if not (takes(x, weights, groups) and TARGET in ops.native_targets("cuda")):
        return grouped_matmul.gmm(x, weights, groups, gated=gated, limit=limit)
    return grouped_matmul.per_platform(
        fp4_gmm, grouped_matmul.gmm, x, weights, groups, gated=gated, limit=limit
    )
