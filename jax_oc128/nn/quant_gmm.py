"""The quantized grouped matmul as a native op: DeepSeek-V4's released quantized weights
(:mod:`~jax_oc128.nn.quant`; FP4: e2m1 codes two a byte along K, an e8m0 scale per 32 columns of a row; FP8:
e4m3 codes, a scale per 128 columns of a row, e8m0 or float32) on the rows of the padded layout of
:mod:`~jax_oc128.nn.grouped_matmul`, the computation of :func:`~jax_oc128.nn.grouped_matmul.gmm_jnp`: the
routed experts, and the model's linear layers (each weight group one expert,
:func:`~jax_oc128.nn.linear.linear_op`).

The native target ``oc128_quant_gmm`` (ffi/quant_gmm_ffi.h), the format named by the codes' dtype: on CPU a
reference loop; on CUDA a memory-bound kernel for decode sizes on the tensor cores (each block streams its
tile's expert's codes with 16-byte loads, decodes them in registers to bfloat16, FP4 as
:func:`~jax_oc128.nn.grouped_matmul.fp4_bf16_ptx` does, and multiplies the few rows of its tile, float32
accumulation; padding rows and tiles of no expert are skipped and written 0; where its blocks would not fill
the GPU, K is split into parts, :func:`splits`, whose sums a second kernel adds in order), bfloat16 rows and
e8m0 scales only (:func:`kernel_takes`; other operands run the twin there), exact for the scales the loader
accepts (:func:`~jax_oc128.nn.quant.check_scales`). A weight is its code's value times its scale in float32
rounded to x's dtype, as :func:`~jax_oc128.nn.quant.dequantize` makes it; an e4m3 NaN code (0x7F, 0xFF) is
NaN, so its products are. Both are deterministic run to run; :func:`quant_gmm_reference` is the jnp twin. The
op takes a tile's real rows as a count (``tile_rows``, :func:`tile_rows`): the layout puts each tile's pairs
first. Subnormal x: the CPU handler runs on XLA's threads, which flush them to zero.

:func:`gmm` is the grouped matmul of the MoE's ``grouped`` dispatch: this op on CUDA for FP4 experts with e8m0
scales at decode sizes (:func:`takes`: where it is measured no slower than the Pallas kernel) where the CUDA
module is built, else :func:`~jax_oc128.nn.grouped_matmul.gmm` (the Pallas kernel on CUDA, the jnp loop
elsewhere).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_oc128 import ops
from jax_oc128.nn import grouped_matmul
from jax_oc128.nn.grouped_matmul import Groups
from jax_oc128.nn.quant import FP4, FP8, QuantizedArray

TARGET = "oc128_quant_gmm"
#: K must be a multiple of this: FP4 whole 32-column scale groups, FP8 whole 16-byte loads of a row (the CUDA
#: kernel's)
K_MULTIPLE = {FP4: 32, FP8: 16}
#: the most rows a tile may have for :func:`gmm` to take the op on CUDA (decode sizes: the layout's tiles are
#: then of 16 rows; prefill's larger tiles go to the Pallas kernel)
MAX_BLOCK_ROWS = 16
#: :func:`gmm` takes the op on CUDA for at most this many (token, expert) pairs per expert: the largest load
#: (V4-Flash at 64 tokens) where the H100 measured it no slower than the Pallas kernel (bench/RESULTS.md
#: section 24)
PAIRS_PER_EXPERT = 1.5
#: the CUDA kernel's blocks (ffi/quant_gmm_cuda.cu): output columns a block (gated: half as many), its warps,
#: each a chunk of a row's codes at a time (64 bytes: FP4 128 columns, FP8 64)
BLOCK_COLUMNS, BLOCK_WARPS, CHUNK_BYTES = 32, 8, 64
#: the most 16-byte loads of codes an expert the CUDA kernel addresses (32-bit offsets; a load holds
#: :data:`K_MULTIPLE` columns of a row)
MAX_EXPERT_LOADS = 2**32 - 1
#: the blocks a split of K aims at: two per multiprocessor of an H100 or an H200 (132)
SPLIT_BLOCKS = 264
MAX_SPLITS = 16


def tile_rows(groups: Groups) -> jax.Array:
    """int32 ``[tiles]``: how many rows of each tile hold a pair (its first rows, :func:`group_pairs`)."""
    pairs = groups.rows.shape[0]
    holds = groups.row_pairs.reshape(-1, groups.block_rows) < pairs
    return jnp.sum(holds, axis=1, dtype=jnp.int32)


def kernel_takes(dtype, weights) -> bool:
    """Whether the CUDA kernel takes rows of ``dtype`` by ``weights`` (``[experts, N, K]``): bfloat16 rows, a
    :class:`~jax_oc128.nn.quant.QuantizedArray` (FP4 or FP8) with e8m0 (uint8) scales, K a multiple of
    :data:`K_MULTIPLE`, an expert of at most :data:`MAX_EXPERT_LOADS` loads."""
    if not (isinstance(weights, QuantizedArray) and weights.fmt in K_MULTIPLE):
        return False
    n, k = weights.shape[-2:]
    return (
        jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16)
        and weights.scales.dtype == jnp.uint8
        and k % K_MULTIPLE[weights.fmt] == 0
        and n * (k // K_MULTIPLE[weights.fmt]) <= MAX_EXPERT_LOADS
    )


def splits(fmt: str, n: int, k: int, tiles: int, gated: bool) -> int:
    """How many parts the CUDA kernel splits K into for ``tiles`` tiles by ``[experts, N, K]`` weights in
    ``fmt``: enough that its blocks, one per (tile, :data:`BLOCK_COLUMNS` outputs, part), come to at most
    :data:`SPLIT_BLOCKS`, with a chunk of K for each of a block's warps a part, at most :data:`MAX_SPLITS`; 1
    (no split) where the blocks fill the GPU without one (the MoE's experts at decode sizes)."""
    blocks = tiles * -(-(n // (1 + gated)) // (BLOCK_COLUMNS // (1 + gated)))
    chunks = -(-k // (CHUNK_BYTES * (2 if fmt == FP4 else 1)))
    return max(1, min(MAX_SPLITS, SPLIT_BLOCKS // max(blocks, 1), chunks // BLOCK_WARPS))


def _check(x, weights, groups: Groups, gated: bool, limit) -> None:
    """The operands of :func:`quant_gmm`, at trace time."""
    if not isinstance(weights, QuantizedArray) or weights.fmt not in K_MULTIPLE or weights.ndim != 3:
        got = (
            f"{weights.fmt} {weights.shape}"
            if isinstance(weights, QuantizedArray)
            else type(weights).__name__
        )
        raise TypeError(f"weights: expected an FP4 or FP8 QuantizedArray [experts, N, K], got {got}")
    float_scales = weights.fmt == FP8 and weights.scales.dtype == jnp.float32
    if weights.scales.dtype != jnp.uint8 and not float_scales:
        allowed = "e8m0 (uint8) scales" + (" or float32 ones" if weights.fmt == FP8 else "")
        raise TypeError(f"weights: the op takes {allowed} for {weights.fmt}, got {weights.scales.dtype}")
    _, n, k = weights.shape
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise TypeError(f"x: dtype must be float32 or bfloat16, got {x.dtype}")
    if x.shape != (groups.num_rows, k):
        raise ValueError(f"x: expected shape [{groups.num_rows}, {k}] (the layout's rows, K), got {x.shape}")
    if k % K_MULTIPLE[weights.fmt]:
        multiple = K_MULTIPLE[weights.fmt]
        raise ValueError(f"weights: K must be a multiple of {multiple} for {weights.fmt}, got {k}")
    if gated and n % 2:
        raise ValueError(f"weights: gated, N (gate and up rows) must be even, got {n}")
    if limit is not None and not (isinstance(limit, (int, float)) and limit > 0):
        raise ValueError(f"limit: must be a positive number or None, got {limit!r}")


def quant_gmm(x, weights: QuantizedArray, groups: Groups, *, gated: bool = False, limit: float | None = None):
    """:func:`~jax_oc128.nn.grouped_matmul.gmm_jnp`'s product by the native op (module docstring).

    Args:
      x: ``[rows, K]`` float32 or bfloat16 (the weights' dtype): the padded layout's rows.
      weights: :class:`~jax_oc128.nn.quant.QuantizedArray` ``[experts, N, K]``: FP4 with e8m0 (uint8) scales,
        or FP8 with e8m0 or float32 scales; K a multiple of :data:`K_MULTIPLE`.
      groups: the layout (:func:`~jax_oc128.nn.grouped_matmul.group_pairs`).
      gated: N holds each expert's gate then up rows; the result is their SwiGLU gate (``limit``).

    Returns:
      float32 ``[rows, N]``, or gated ``[rows, N / 2]`` in x's dtype; 0 on padding rows and unused tiles.
    """
    _check(x, weights, groups, gated, limit)
    n = weights.shape[1] // 2 if gated else weights.shape[1]
    shape = jax.ShapeDtypeStruct((groups.num_rows, n), x.dtype if gated else jnp.float32)
    # FP4: the packed bytes as uint8 (a checkpoint stores them as int8); FP8: float8_e4m3fn, the format's name
    codes = weights.codes if weights.fmt == FP8 else jax.lax.bitcast_convert_type(weights.codes, jnp.uint8)
    operands = (x, codes, weights.scales, groups.tile_expert, tile_rows(groups))
    attrs = dict(gated=np.int64(gated), limit=np.float32(np.inf if limit is None else limit))
    has_native = {
        "cpu": TARGET in ops.native_targets("cpu"),
        "cuda": TARGET in ops.native_targets("cuda") and kernel_takes(x.dtype, weights),
    }

    def native(*operands, parts):
        size = parts * groups.num_rows * weights.shape[1] if parts > 1 else 0  # each part's products
        workspace = jax.ShapeDtypeStruct((size,), jnp.float32)
        call = jax.ffi.ffi_call(TARGET, (shape, workspace), vmap_method="sequential")
        return call(*operands, **attrs)[0]

    def reference(x, codes, scales, tile_expert, rows):
        weights_here = dataclasses.replace(weights, codes=codes, scales=scales)
        return quant_gmm_reference(
            x, weights_here, groups._replace(tile_expert=tile_expert), rows, gated, limit
        )

    parts = {"cpu": 1, "cuda": splits(weights.fmt, *weights.shape[1:], groups.tile_expert.shape[0], gated)}
    branches = {
        p: functools.partial(native, parts=parts[p]) if has else reference for p, has in has_native.items()
    }
    return jax.lax.platform_dependent(*operands, default=reference, **branches)


def quant_gmm_reference(x, weights, groups: Groups, rows, gated: bool = False, limit: float | None = None):
    """The jnp twin of :func:`quant_gmm` for a tile's count of real rows ``rows`` (int32 ``[tiles]``):
    :func:`~jax_oc128.nn.grouped_matmul.gmm_jnp` on x with every other row zeroed, those rows of the result
    zeroed too."""
    real = (jnp.arange(groups.block_rows)[None, :] < rows[:, None]).reshape(-1, 1)
    out = grouped_matmul.gmm_jnp(jnp.where(real, x, 0), weights, groups, gated=gated, limit=limit)
    return jnp.where(real, out, 0).astype(out.dtype)


def takes(x, weights, groups: Groups) -> bool:
    """Whether :func:`gmm` runs the op on CUDA for these operands: FP4 weights the kernel takes
    (:func:`kernel_takes`), tiles of at most :data:`MAX_BLOCK_ROWS` rows, at most :data:`PAIRS_PER_EXPERT`
    pairs per expert (FP8 experts, unmeasured against the Pallas kernel, keep it)."""
    return (
        kernel_takes(x.dtype, weights)
        and weights.fmt == FP4
        and groups.block_rows <= MAX_BLOCK_ROWS
        and groups.rows.shape[0] <= PAIRS_PER_EXPERT * weights.shape[0]
    )


def gmm(x, weights, groups: Groups, *, gated: bool = False, limit: float | None = None):
    """The MoE's grouped matmul: :func:`quant_gmm` on CUDA where the CUDA module has the op and it
    :func:`takes` the operands, :func:`~jax_oc128.nn.grouped_matmul.gmm` otherwise (and on every other
    platform)."""
    if not (takes(x, weights, groups) and TARGET in ops.native_targets("cuda")):
        return grouped_matmul.gmm(x, weights, groups, gated=gated, limit=limit)
    return grouped_matmul.per_platform(
        quant_gmm, grouped_matmul.gmm, x, weights, groups, gated=gated, limit=limit
    )
