"""The grouped matmul of a mixture of experts: rows sorted by expert, each expert's weights on its rows.

Layout (:func:`group_pairs`): the (token, expert) pairs are sorted by expert and each expert's rows padded to
whole tiles of ``block_rows`` rows, so that every tile holds the rows of one expert (``tile_expert``). A
grouped matmul (``[rows, K]`` by one ``[N, K]`` weight per tile) then reads one expert's weights per tile:
an expert with ``r`` rows is read ``ceil(r / block_rows)`` times and an expert no token picked never.
``block_rows`` follows the mean rows per expert (16 up to the weights' format's :func:`max_block_rows`: 256
for bfloat16 weights, 128 for the others), so at decode sizes each picked expert is one tile. The layout
holds at most ``pairs + min(experts, pairs) * block_rows`` rows: memory O(tokens x k), never O(tokens x
experts), and no capacity (every token may pick the same expert). The layout's rows are the tokens'
(:func:`gather_rows`: at prefill sizes on CUDA a Pallas kernel that skips the unused tiles, whose rows no
pair maps to).

Gated (``gated=True``, the gate/up projection of an expert): the weights hold each expert's gate and up
projections stacked (``[experts, 2 * I, K]``) and the result is their SwiGLU gate
(:func:`~jax_oc128.nn.functional.swiglu_gate`, float32) in x's dtype, ``[rows, I]``: the kernel applies it to
its float32 accumulators before the store, so that no ``[rows, 2 * I]`` float32 product goes through memory.

Implementations of one computation: :func:`gmm_jnp` (a loop over tiles, every platform), :func:`gmm_pallas`
(a Pallas kernel, Triton on GPUs, interpret mode elsewhere), a grid over (output column blocks, tiles) in
which each program reads only its tile's expert's weights, through a weight reader per format: float
weights as they are (:func:`read_weight_tile`), quantized ones (:class:`~jax_oc128.nn.quant.QuantizedArray`:
FP8 codes, FP4 packed codes, their per-row e8m0 or float32 scales) dequantized in registers
(:func:`read_fp8_tile`, :func:`read_fp4_tiles`, by :mod:`~jax_oc128.nn.quant`'s own elementwise decoders),
so that only the codes and scales are read from memory; and :func:`gmm_ragged_dot` (XLA's ragged dot, for
comparison and for TPUs). :func:`gmm` picks the kernel on CUDA and the jnp loop elsewhere, per lowering
platform. The dequantized values are exact (a code times a power of two), so every implementation computes
the matmul of the same float matrices and they differ by float32 rounding of the accumulation order.

The model's linear layers (:mod:`~jax_oc128.nn.linear`) run a large quantized weight at decode sizes through
this kernel as a grouped matmul of one group per weight group.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jax_oc128.nn import quant
from jax_oc128.nn.functional import FULL, linear_jnp, swiglu_gate
from jax_oc128.nn.quant import QuantizedArray, matrix

MIN_BLOCK_ROWS = 16  # the smallest tensor-core matmul Triton emits
MAX_BLOCK_ROWS = 128  # the most rows of a tile but for bfloat16 weights (:func:`max_block_rows`)
MIN_BLOCK = 16  # the smallest block of output columns or of the stored reduction the kernel takes


class Blocks(NamedTuple):
    """The tiling of :func:`gmm_pallas`: each program's ``n`` columns of the product (gated: ``n / 2`` of the
    gate's and the same of the up projection's, the same matmul work), ``k`` stored columns of the
    reduction per step (FP4: bytes, two columns each), both powers of two (the largest power of two up to
    them that divides the shape is taken), Triton's ``num_warps`` and ``num_stages``, and ``swap``: the
    weight tile as the matmul's left operand (``[n, k] x [k, rows]``, the block transposed at its store),
    so that a tile dequantized in registers enters the tensor cores from there and a tile of few rows is
    the short side of the product."""

    n: int = 128
    k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = False


#: the tiling by (weights' format, :func:`weight_format`; the least rows of the tiles it is for): a tile of
#: ``block_rows`` rows takes the entry of the most rows up to ``block_rows`` (:func:`default_blocks`). The
#: fastest of bench/sweep_gmm.py on the H200 at DeepSeek-V4-Flash's expert shapes over both matmuls of an
#: expert (the gate/up gated), by the kernels' time on the device: at 8 and 512 tokens (tiles of 16 rows),
#: 2048 (64 rows) and 8192 (128 rows; bfloat16: 256, of which 128,64,4,3 is 6x slower); bench/RESULTS.md
#: section 9. float32 and FP8 take bfloat16's tilings up to 128 rows (not swept).
DEFAULT_BLOCKS = {
    ("bfloat16", 16): Blocks(128, 128, 8, 3),
    ("bfloat16", 64): Blocks(128, 64, 4, 3, swap=True),
    ("bfloat16", 256): Blocks(128, 64, 8, 4, swap=True),
    ("float32", 16): Blocks(128, 128, 8, 3),
    ("float32", 64): Blocks(128, 64, 4, 3, swap=True),
    (quant.FP8, 16): Blocks(128, 128, 8, 3),
    (quant.FP8, 64): Blocks(128, 64, 4, 3, swap=True),
    (quant.FP4, 16): Blocks(128, 64, 4, 3),
    (quant.FP4, 64): Blocks(128, 64, 4, 3, swap=True),
}


class Groups(NamedTuple):
    """Where the (token, expert) pairs lie in the padded layout of a grouped matmul.

    Attributes:
      rows: int32 ``[pairs]``, each pair's row (pairs in routing order: pair ``p`` is token ``p // k``'s
        ``p % k``-th pick); ``num_rows`` for a pair of no expert here.
      row_pairs: int32 ``[num_rows]``, each row's pair (the inverse of ``rows``); ``pairs`` for a padding
        row, so that a gather by it fills the padding.
      tile_expert: int32 ``[tiles]``, each tile's expert; -1 for the tiles past the last used one.
      block_rows: rows per tile (a static int).
    """

    rows: jax.Array
    row_pairs: jax.Array
    tile_expert: jax.Array
    block_rows: int

    @property
    def num_rows(self) -> int:
        """Rows of the padded layout (tiles x block_rows, static)."""
        return self.tile_expert.shape[0] * self.block_rows


def _check_power_of_two(name: str, value: int, least: int) -> None:
    """A ValueError naming ``name`` unless ``value`` is a power of two of at least ``least``."""
    if value < least or value & (value - 1):
        raise ValueError(f"{name}: must be a power of two of at least {least}, got {value}")


def weight_format(weights) -> str:
    """The format of ``weights``: a :class:`~jax_oc128.nn.quant.QuantizedArray`'s (``quant.FP8``,
    ``quant.FP4``) or the float dtype's name (``"bfloat16"``, ``"float32"``)."""
    return weights.fmt if isinstance(weights, QuantizedArray) else jnp.dtype(weights.dtype).name


def max_block_rows(weights) -> int:
    """The most rows a tile of the layout takes for ``weights``: 256 for bfloat16 (its kernel is 7% faster
    on 256-row tiles than on 128-row ones at 8192 tokens), 128 otherwise (FP4's kernel is 2.7x slower on 256
    rows; float32 and FP8 not measured there)."""
    return 2 * MAX_BLOCK_ROWS if weight_format(weights) == "bfloat16" else MAX_BLOCK_ROWS


def block_rows_for(pairs: int, experts: int, most: int = MAX_BLOCK_ROWS) -> int:
    """Rows per tile: the mean rows per expert rounded up to a power of two, within [16, ``most``]
    (:func:`max_block_rows`)."""
    mean = -(-pairs // experts)
    return min(most, max(MIN_BLOCK_ROWS, 1 << (mean - 1).bit_length()))


def group_pairs(expert_ids, num_experts: int, block_rows: int | None = None, *, weights=None) -> Groups:
    """The layout of the pairs of ``expert_ids`` (int32 ``[..., k]``) in tiles of ``block_rows`` rows (a
    power of two of at least 16; default :func:`block_rows_for`, up to the :func:`max_block_rows` of the
    experts' ``weights`` the layout is for, or :data:`MAX_BLOCK_ROWS`). An id outside ``[0, num_experts)``
    is a pair of no expert here (one of another device's, :func:`~jax_oc128.nn.moe.expert_parallel`): it
    gets no row (its ``rows`` entry is ``num_rows``, out of range) and no tile."""
    ids = expert_ids.reshape(-1).astype(jnp.int32)
    pairs = ids.shape[0]
    if block_rows is None:
        most = MAX_BLOCK_ROWS if weights is None else max_block_rows(weights)
        block_rows = block_rows_for(pairs, num_experts, most)
    else:
        _check_power_of_two("block_rows", block_rows, MIN_BLOCK_ROWS)
    tiles = pairs // block_rows + min(num_experts, pairs)  # >= sum over experts of ceil(rows / block_rows)
    here = (ids >= 0) & (ids < num_experts)
    keys = jnp.where(here, ids, num_experts)  # the pairs of no expert here sort last
    sizes = jnp.bincount(keys, length=num_experts + 1)  # rows per expert (and the pairs of none last)
    expert_tiles = -(-sizes[:num_experts] // block_rows)
    tile_end = jnp.cumsum(expert_tiles)  # one past each expert's last tile
    order = jnp.argsort(keys, stable=True)  # the pairs sorted by expert
    sorted_keys = keys[order]
    rank = jnp.arange(pairs) - (jnp.cumsum(sizes) - sizes)[sorted_keys]  # a pair's place among its expert's
    first_row = jnp.append(tile_end - expert_tiles, tiles) * block_rows  # the last: num_rows, no row
    sorted_rows = jnp.where(sorted_keys < num_experts, first_row[sorted_keys] + rank, tiles * block_rows)
    sorted_rows = sorted_rows.astype(jnp.int32)
    rows = jnp.zeros((pairs,), jnp.int32).at[order].set(sorted_rows)
    row_pairs = jnp.full((tiles * block_rows,), pairs, jnp.int32).at[sorted_rows].set(order, mode="drop")
    tile = jnp.arange(tiles)
    # each tile's expert: how many experts' tiles end at or before it, one comparison each (a fused reduction;
    # searchsorted's default bisection is a while loop, whose condition a GPU hands to the host every step)
    tile_expert = jnp.searchsorted(tile_end, tile, side="right", method="compare_all").astype(jnp.int32)
    return Groups(rows, row_pairs, jnp.where(tile < tile_end[-1], tile_expert, -1), block_rows)


def gate(product, dtype, limit):
    """The gated result of a ``[rows, 2 * I]`` float32 gate/up ``product``: its SwiGLU gate (``limit``: the
    SwiGLU limit or None) in ``dtype``, ``[rows, I]``."""
    i = product.shape[-1] // 2
    return swiglu_gate(product[..., :i], product[..., i:], limit).astype(dtype)


def gmm_jnp(x, weights, groups: Groups, *, gated: bool = False, limit: float | None = None):
    """``x`` ``[rows, K]`` (the padded layout, in the weights' dtype) by each tile's expert of ``weights``
    ``[experts, N, K]`` (``[out, in]`` per expert; a quantized one's tile's expert dequantized, read once per
    tile) -> float32 ``[rows, N]``: a loop over the tiles, each one matmul of its rows by its expert's weights
    (accumulated in float32; full float32 for float32 weights). ``gated``: each tile's product gated
    (:func:`gate`, ``limit``) -> ``[rows, N / 2]`` in x's dtype. The rows of unused tiles are zero."""
    n = weights.shape[1] // 2 if gated else weights.shape[1]
    dtype = x.dtype if gated else jnp.float32
    tiles = x.reshape(-1, groups.block_rows, x.shape[1])

    def tile(args):
        rows, expert = args

        def product():
            out = linear_jnp(rows, weights[jnp.maximum(expert, 0)])
            return gate(out, dtype, limit) if gated else out

        return jax.lax.cond(expert >= 0, product, lambda: jnp.zeros((groups.block_rows, n), dtype))

    return jax.lax.map(tile, (tiles, groups.tile_expert)).reshape(-1, n)


def gmm_ragged_dot(x, weights, groups: Groups, *, gated: bool = False, limit: float | None = None):
    """:func:`gmm_jnp` by XLA's ``jax.lax.ragged_dot_general`` (each expert's group: its tiles' rows, padding
    included), however XLA lowers it (a grouped matmul on TPUs; on GPUs a dense matmul over group-masked
    operands, every expert's FLOPs; quantized weights dequantized whole), gated after it. The rows of unused
    tiles (past every group) are zero."""
    weights = matrix(weights)
    used = jnp.where(groups.tile_expert >= 0, groups.tile_expert, weights.shape[0])
    group_sizes = jnp.bincount(used, length=weights.shape[0]) * groups.block_rows
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
    )
    out = jax.lax.ragged_dot_general(
        x, weights, group_sizes.astype(jnp.int32), numbers, precision=FULL, preferred_element_type=jnp.float32
    )
    return gate(out, x.dtype, limit) if gated else out


def read_weight_tile(weights_ref, expert, rows, cols):
    """The weight reader of unquantized (float32 / bfloat16) weights: ``(tile,)``, the ``[block_n, block_k]``
    tile ``weights[expert, rows, cols]`` of an ``[experts, N, K]`` ref."""
    return (weights_ref[expert, rows, cols],)


def read_fp8_tile(codes_ref, scales_ref, expert, rows, cols):
    """The weight reader of FP8 weights (codes float8_e4m3fn ``[experts, N, K]``, scales ``[experts, N,
    ceil(K / 128)]``): ``(tile,)``, float32 ``[block_n, block_k]``, each code times its row's scale (exact).
    ``cols`` lies within one 128-column scale group."""
    group = jax.lax.div(cols.start, quant.GROUP[quant.FP8])
    scales = quant.scale_values(scales_ref[expert, rows, pl.ds(group, 1)])  # [block_n, 1]
    return (codes_ref[expert, rows, cols].astype(jnp.float32) * scales,)


def read_fp4_tiles(codes_ref, scales_ref, expert, rows, cols, *, ptx: bool = False):
    """The weight reader of FP4 weights (packed codes uint8 ``[experts, N, K / 2]``, scales ``[experts, N,
    K / 32]``): ``(even, odd)``, ``[block_n, block_k]`` each, the low and the high nibbles of the packed
    columns ``cols`` (the weights' even and odd columns) times their row's scales (exact), against x's even
    and odd columns: float32 by :mod:`~jax_oc128.nn.quant`'s decoders, or with ``ptx`` (Triton, e8m0 scales)
    bfloat16 by :func:`fp4_bf16_ptx`, the same values. ``cols`` spans whole 16-byte (32-column) scale groups:
    the codes and their ``block_k / 16`` scales are read in one load each, the scales' values taken on that
    small tile (with ``ptx`` cast to bfloat16: exact, powers of two that the loader keeps normal) and
    broadcast over their groups' bytes (a byte's two codes share a group)."""
    per_scale = quant.GROUP[quant.FP4] // 2  # bytes per scale
    groups = cols.size // per_scale
    scales = quant.scale_values(scales_ref[expert, rows, pl.ds(jax.lax.div(cols.start, per_scale), groups)])
    block_n = scales.shape[0]

    def per_byte(scales):  # [block_n, groups] -> [block_n, cols.size]
        return jnp.broadcast_to(scales[:, :, None], (block_n, groups, per_scale)).reshape(block_n, cols.size)

    codes = codes_ref[expert, rows, cols]
    if ptx:
        return fp4_bf16_ptx(codes, per_byte(scales.astype(jnp.bfloat16)))
    scales = per_byte(scales)
    low, high = quant.nibbles(codes)
    return quant.e2m1_code_values(low) * scales, quant.e2m1_code_values(high) * scales


def _fp4_bf16_ptx(nibbles: str) -> str:
    """PTX of one call of :func:`fp4_bf16_ptx`: four packed bytes ($2) and their bfloat16 scales in pairs
    ($3: bytes 0 and 1, $4: bytes 2 and 3) -> the bfloat16 values of their ``nibbles`` (``"low"`` or
    ``"high"``) codes, in pairs ($0, $1). An e2m1 code ``s e1 e0 m`` read as the bfloat16 bits ``s`` (15),
    ``e1 e0`` (the exponent's low bits, 8-7) and ``m`` (the mantissa's first, 6) is its value times 2^-126,
    the subnormal codes included (0.5: the bfloat16 subnormal 2^-127): a multiply by 2^126 makes the value
    and one by the scale the weight, both exact (powers of two; the loader keeps every weight normal). Each
    ``prmt`` puts two bytes at bits 8-15 and 24-31 of a pair, so that their high nibbles lie at 12-15 and
    28-31 (the low nibbles there after a shift by 4): the sign bits stay and the magnitudes shift by 6 to
    bits 6-8 (``and`` keeps them, ``lop3`` joins the signs). 3-3.5 instructions a value. The outputs are
    written last (an output may share an input's register)."""
    shift = "shl.b32 q0, q0, 4;\nshl.b32 q1, q1, 4;\n" if nibbles == "low" else ""
    return f"""{{
.reg .b32 q0, q1, t0, t1, k;
mov.b32 k, 0x7E807E80;
prmt.b32 q0, $2, 0, 0x1404;
prmt.b32 q1, $2, 0, 0x3424;
{shift}shr.b32 t0, q0, 6;
shr.b32 t1, q1, 6;
and.b32 t0, t0, 0x01C001C0;
and.b32 t1, t1, 0x01C001C0;
lop3.b32 t0, q0, 0x80008000, t0, 0xEA;
lop3.b32 t1, q1, 0x80008000, t1, 0xEA;
mul.rn.bf16x2 t0, t0, k;
mul.rn.bf16x2 t1, t1, k;
mul.rn.bf16x2 $0, t0, $3;
mul.rn.bf16x2 $1, t1, $4;
}}"""


#: the PTX of :func:`fp4_bf16_ptx` by nibble (:func:`_fp4_bf16_ptx`)
FP4_BF16_PTX = {nibbles: _fp4_bf16_ptx(nibbles) for nibbles in ("low", "high")}


def fp4_bf16_ptx(codes, scales):
    """``(low, high)``: bfloat16 values of the low and the high nibbles of packed e2m1 codes (uint8, any
    shape) times their scales (bfloat16, the same shape):
    :func:`read_fp4_tiles`'s values, in a Triton kernel only (:data:`FP4_BF16_PTX`; one call per nibble, as
    Pallas lowers an inline assembly of one result only)."""
    values = jax.ShapeDtypeStruct(codes.shape, jnp.bfloat16)
    return tuple(
        pltriton.elementwise_inline_asm(
            FP4_BF16_PTX[nibbles],
            args=[codes, scales],
            constraints="=r,=r,r,r,r",
            pack=4,
            result_shape_dtypes=[values],
        )[0]
        for nibbles in ("low", "high")
    )


def _operands(x, weights, *, triton: bool):
    """``(x_parts, arrays, read, span)`` of :func:`gmm_pallas`: the ``[rows, width]`` parts of ``x``
    that ``read``'s tiles multiply (``x`` itself; FP4: its even and its odd columns, so that the kernel never
    interleaves the nibbles), the arrays ``read`` reads and the most columns one read covers (FP8: its
    128-column scale group; None: any). FP4 in a bfloat16 matmul with e8m0 scales compiled by Triton
    (``triton``) decodes by :func:`fp4_bf16_ptx`."""
    if not isinstance(weights, QuantizedArray):
        return (x,), (weights,), read_weight_tile, None
    arrays = (weights.codes, weights.scales)
    if weights.fmt == quant.FP8:
        return (x,), arrays, read_fp8_tile, quant.GROUP[quant.FP8]
    ptx = triton and x.dtype == jnp.bfloat16 and weights.scales.dtype == jnp.uint8
    return (x[:, 0::2], x[:, 1::2]), arrays, functools.partial(read_fp4_tiles, ptx=ptx), None


def default_blocks(weights, block_rows: int) -> Blocks:
    """The tiling :func:`gmm_pallas` takes for ``weights`` (float, or a
    :class:`~jax_oc128.nn.quant.QuantizedArray`) and tiles of ``block_rows`` rows: :data:`DEFAULT_BLOCKS`'
    entry of their format for the most rows up to ``block_rows``."""
    fmt = weight_format(weights)
    least = max(rows for f, rows in DEFAULT_BLOCKS if f == fmt and rows <= block_rows)
    return DEFAULT_BLOCKS[fmt, least]


def _block(size: int, preferred: int, name: str) -> int:
    """The largest power of two up to ``preferred`` that divides ``size``, at least :data:`MIN_BLOCK`; a
    ValueError naming the dimension otherwise."""
    block = preferred
    while block >= MIN_BLOCK:
        if size % block == 0:
            return block
        block //= 2
    raise ValueError(f"{name}: the Pallas grouped matmul needs a multiple of {MIN_BLOCK}, got {size}")


def _widths(weights, gated: bool) -> tuple[int, int]:
    """``(n, width)``: the columns of the result (N; gated: N / 2, each of the gate's and the up projection's)
    and the width of the weights' stored rows (K; FP4: K / 2 bytes), the width of :func:`_operands`' parts."""
    stored = weights.codes if isinstance(weights, QuantizedArray) else weights
    return stored.shape[1] // (1 + gated), stored.shape[-1]


def pallas_fits(x, weights, *, gated: bool = False) -> bool:
    """Whether :func:`gmm_pallas` takes these shapes (N, gated N / 2, and K multiples of 16; FP4: K of 32)."""
    return all(size % MIN_BLOCK == 0 for size in _widths(weights, gated))


def gmm_pallas(
    x,
    weights,
    groups: Groups,
    *,
    gated: bool = False,
    limit: float | None = None,
    blocks: Blocks | None = None,
    interpret: bool = False,
):
    """:func:`gmm_jnp` as a Pallas kernel (Triton on GPUs; ``interpret=True`` runs it anywhere).

    A grid over (N / block_n, tiles): program ``(j, t)`` computes the ``[block_rows, block_n]`` block of tile
    ``t`` against columns ``j * block_n`` of tile ``t``'s expert, looping over K in ``block_k`` steps; the
    programs of unused tiles return at once (their rows are left unwritten: no pair maps to them). The column
    blocks are the grid's fastest axis, so that the programs of a tile run together and read its rows from
    memory once, sharing them through L2 (with the tiles fastest, every column block re-read every tile's
    rows from memory: at prefill sizes more bytes than the weights). Gated, the grid is over (N / 2 /
    block_n, tiles) and program ``(j, t)`` accumulates columns ``j * block_n`` of the
    gate and of the up projection (``N / 2`` further) on the same rows and stores their gate. A weight
    reader loads the step's weight tiles, ``[block_n, block_k]`` (FP8: in reads of one 128-column scale group
    at most): :func:`read_weight_tile` (float weights), :func:`read_fp8_tile` and :func:`read_fp4_tiles` (a
    :class:`~jax_oc128.nn.quant.QuantizedArray`, the tile dequantized in registers by
    :mod:`~jax_oc128.nn.quant`'s elementwise decoders, exactly, then cast to x's dtype: only the codes and
    scales are read from memory). FP4 steps over the packed bytes (``block_k`` of the K / 2), multiplying x's
    even columns by the low nibbles and its odd columns by the high ones (x split outside the kernel).
    ``blocks`` is the tiling (default :func:`default_blocks`). N and the stored width (K; FP4: K / 2 bytes)
    must be multiples of 16."""
    x_parts, arrays, read, span = _operands(x, weights, triton=not interpret)
    n, width = _widths(weights, gated)
    blocks = blocks or default_blocks(weights, groups.block_rows)
    _check_power_of_two("blocks.n", blocks.n, MIN_BLOCK * (1 + gated))
    _check_power_of_two("blocks.k", blocks.k, MIN_BLOCK)
    n_name = (
        "N / 2 (each of the gate's and the up projection's outputs)" if gated else "N (the weights' outputs)"
    )
    block_n = _block(n, blocks.n // (1 + gated), n_name)
    block_k = _block(width, blocks.k, "K (the rows' width; FP4: K / 2)")
    read_k = min(block_k, span or block_k)  # the blocks and the scale groups are powers of two
    block_rows, num_k, parts = groups.block_rows, width // block_k, len(x_parts)

    def kernel(tile_expert_ref, *refs):
        x_refs, weight_refs, out_ref = refs[:parts], refs[parts:-1], refs[-1]
        col, tile = pl.program_id(0), pl.program_id(1)
        expert = tile_expert_ref[tile]
        rows = pl.ds(tile * block_rows, block_rows)
        # each accumulator's weight rows: the block's columns (gated: the gate's and the up projection's)
        weight_rows = [pl.ds(col * block_n + part * n, block_n) for part in range(1 + gated)]
        dims = (((1,), (1,)), ((), ()))  # x @ weights.T (swapped: weights @ x.T)

        @pl.when(expert >= 0)
        def _():
            def step(kb, accs):
                for r in range(block_k // read_k):
                    cols = pl.ds(pl.multiple_of(kb * block_k + r * read_k, read_k), read_k)
                    xs = [x_ref[rows, cols] for x_ref in x_refs]
                    for a, out_rows in enumerate(weight_rows):
                        tiles = read(*weight_refs, expert, out_rows, cols)
                        for ws, x_part in zip(tiles, xs, strict=True):
                            ws = ws.astype(x_part.dtype)
                            pair = (ws, x_part) if blocks.swap else (x_part, ws)
                            # each product added to its accumulator as it comes (Triton folds the add into
                            # the tensor-core instruction; a sum of products first would hold a second tile)
                            accs[a] += jax.lax.dot_general(
                                *pair, dims, precision=FULL, preferred_element_type=jnp.float32
                            )
                return accs

            shape = (block_n, block_rows) if blocks.swap else (block_rows, block_n)
            accs = jax.lax.fori_loop(0, num_k, step, [jnp.zeros(shape, jnp.float32)] * len(weight_rows))
            accs = [acc.T if blocks.swap else acc for acc in accs]
            out_ref[...] = swiglu_gate(*accs, limit).astype(out_ref.dtype) if gated else accs[0]

    whole = pl.BlockSpec()  # the whole array, indexed in the kernel
    return pl.pallas_call(
        kernel,
        grid=(n // block_n, groups.tile_expert.shape[0]),
        in_specs=[whole] * (1 + parts + len(arrays)),
        out_specs=pl.BlockSpec((block_rows, block_n), lambda col, tile: (tile, col)),
        out_shape=jax.ShapeDtypeStruct((groups.num_rows, n), x.dtype if gated else jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
    )(groups.tile_expert, *x_parts, *arrays)


def gather_rows_jnp(x, groups: Groups, k: int):
    """The padded layout's rows of ``x`` ``[tokens, H]`` (the tokens of ``k`` pairs each, pairs in routing
    order): ``[num_rows, H]``, each row its pair's token, 0 for the padding rows and the rows of unused tiles
    (one gather by ``row_pairs``)."""
    return x.at[groups.row_pairs // k].get(mode="fill", fill_value=0)


def gather_rows_pallas(x, groups: Groups, k: int, *, block_h: int | None = None, interpret: bool = False):
    """:func:`gather_rows_jnp` as a Pallas kernel (Triton on GPUs; ``interpret=True`` anywhere): a program per
    (tile, ``block_h`` columns; default: 16384 elements a block, at most 512 columns) gathers its tile's
    tokens' columns and stores them (0 for padding rows). The programs of unused tiles return at once, so
    their rows are left unwritten: no pair maps to them, and the layout bounds its rows by ``pairs + experts
    x block_rows`` (at prefill sizes more rows than pairs, which XLA's gather writes all). H must be a
    multiple of 16."""
    block_rows, pairs = groups.block_rows, groups.rows.shape[0]
    block_h = _block(x.shape[1], block_h or min(512, 16384 // block_rows), "H (the rows' width)")

    def kernel(tile_expert_ref, row_pairs_ref, x_ref, out_ref):
        tile, col = pl.program_id(0), pl.program_id(1)

        @pl.when(tile_expert_ref[tile] >= 0)
        def _():
            row_pairs = row_pairs_ref[pl.ds(tile * block_rows, block_rows)]
            paired = row_pairs < pairs  # not a padding row
            rows = x_ref[jnp.where(paired, row_pairs // k, 0), pl.ds(col * block_h, block_h)]
            out_ref[...] = jnp.where(paired[:, None], rows, jnp.zeros_like(rows))  # padding rows: 0

    whole = pl.BlockSpec()  # the whole array, indexed in the kernel
    return pl.pallas_call(
        kernel,
        grid=(groups.tile_expert.shape[0], x.shape[1] // block_h),
        in_specs=[whole] * 3,
        out_specs=pl.BlockSpec((block_rows, block_h), lambda tile, col: (tile, col)),
        out_shape=jax.ShapeDtypeStruct((groups.num_rows, x.shape[1]), x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
    )(groups.tile_expert, groups.row_pairs, x)


#: the least tile rows at which :func:`gather_rows` skips the unused tiles on CUDA: at prefill sizes their
#: rows are many and skipping them beats XLA's gather; at decode sizes few, and the extra kernel costs more
#: than it saves (bench/RESULTS.md section 9)
GATHER_KERNEL_ROWS = 64


def gather_rows(x, groups: Groups, k: int):
    """The padded layout's rows of the lowering platform: :func:`gather_rows_pallas` on CUDA for tiles of at
    least :data:`GATHER_KERNEL_ROWS` rows (H a multiple of 16), :func:`gather_rows_jnp` otherwise."""
    if groups.block_rows < GATHER_KERNEL_ROWS or x.shape[1] % MIN_BLOCK:
        return gather_rows_jnp(x, groups, k)
    return per_platform(gather_rows_pallas, gather_rows_jnp, x, groups, k)


def per_platform(cuda, default, *args, **kwargs):
    """``cuda(*args, **kwargs)`` when lowered for CUDA, ``default(...)`` on every other platform."""
    return jax.lax.platform_dependent(
        cuda=lambda: cuda(*args, **kwargs), default=lambda: default(*args, **kwargs)
    )


def gmm(x, weights, groups: Groups, *, gated: bool = False, limit: float | None = None):
    """The grouped matmul of the lowering platform: :func:`gmm_pallas` on CUDA (float or quantized weights,
    for the shapes it takes, :func:`pallas_fits`), :func:`gmm_jnp` elsewhere."""
    if not pallas_fits(x, weights, gated=gated):
        return gmm_jnp(x, weights, groups, gated=gated, limit=limit)
    return per_platform(gmm_pallas, gmm_jnp, x, weights, groups, gated=gated, limit=limit)


def gmm_pallas_anywhere(x, weights, groups: Groups, *, gated: bool = False, limit: float | None = None):
    """:func:`gmm_pallas` on every platform: compiled by Triton on CUDA, in interpret mode elsewhere."""
    interpreted = functools.partial(gmm_pallas, interpret=True)
    return per_platform(gmm_pallas, interpreted, x, weights, groups, gated=gated, limit=limit)
