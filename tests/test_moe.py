"""The MoE's dispatch functions (jax_oc128.nn.moe) and its grouped matmul (jax_oc128.nn.grouped_matmul):
the grouped dispatches (jnp and the Pallas kernel, in interpret mode on CPU) against the dense one and an
independent float64 computation, on random, skewed, single-token, ragged and padded routings; float and
quantized (FP8, FP4; e8m0 and float32 scales) experts."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import export
from jax.experimental import pallas as pl
from quantization import abstract_quantized, quantized

from jax_oc128.nn import RuntimeConfig, grouped_matmul, moe, quant
from jax_oc128.nn.quant import FP4, FP8

EXPERTS, HIDDEN, INTERMEDIATE, K, LIMIT = 8, 64, 32, 3, 10.0
GROUPED = ("grouped_jnp", "grouped_pallas", "grouped_ragged_dot")


def experts(rng, dtype, num_experts=EXPERTS):
    """Random ``(gate_up, down)`` of ``num_experts`` experts in ``dtype`` (a name), fan-in scaled."""
    gate_up = rng.standard_normal((num_experts, 2 * INTERMEDIATE, HIDDEN)) * HIDDEN**-0.5 * 3
    down = rng.standard_normal((num_experts, HIDDEN, INTERMEDIATE)) * INTERMEDIATE**-0.5
    return jnp.asarray(gate_up, dtype), jnp.asarray(down, dtype)


def layer_config(**fields):
    """The :class:`~jax_oc128.nn.moe.MoEConfig` of this module's shapes, ``fields`` added."""
    sizes = dict(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_experts=EXPERTS, num_experts_per_tok=K
    )
    return moe.MoEConfig(**sizes, routed_scaling_factor=1.5, swiglu_limit=LIMIT, vocab_size=16, **fields)


def routed_f64(x, expert_ids, weights, gate_up, down, limit):
    """The routed experts' weighted sum in float64 numpy, pair by pair: the model's roundings to the
    weights' dtype (its input and the gated activations) applied, nothing else."""
    dtype = np.dtype(gate_up.dtype)
    rounded = lambda a: np.asarray(a).astype(dtype).astype(np.float64)  # noqa: E731
    x, gate_up, down = rounded(x), np.asarray(gate_up, np.float64), np.asarray(down, np.float64)
    expert_ids, weights = np.asarray(expert_ids), np.asarray(weights, np.float64)
    out = np.zeros(x.shape, np.float64)
    for index in np.ndindex(expert_ids.shape):
        expert, token = expert_ids[index], index[:-1]
        projected = gate_up[expert] @ x[token]
        g, u = np.minimum(projected[:INTERMEDIATE], limit), np.clip(projected[INTERMEDIATE:], -limit, limit)
        out[token] += weights[index] * (down[expert] @ rounded(g / (1 + np.exp(-g)) * u))
    return out


def routing(rng, case):
    """``(x, expert_ids, weights)`` of a routing case: x float32 ``[..., hidden]``, ids ``[..., k]``."""
    shape = {"random": (2, 5), "skewed": (300,), "one_token": (1,), "ragged": (3, 7), "padded": (4, 6)}[case]
    x = rng.standard_normal((*shape, HIDDEN)).astype(np.float32)
    ids = np.stack([rng.permutation(EXPERTS)[:K] for _ in range(int(np.prod(shape)))]).reshape(*shape, K)
    if case == "skewed":  # every token to the same experts: one expert's rows span several tiles
        ids[:] = [5, 0, 2]
    if case == "padded":  # padding rows: zero inputs, all to the same experts (as one padding token's hash)
        x[:, 4:] = 0
        ids[:, 4:] = np.arange(K)
    weights = rng.random((*shape, K)).astype(np.float32) + 0.1
    return jnp.asarray(x), jnp.asarray(ids, jnp.int32), jnp.asarray(weights)


def run(dispatch, *args):
    return jax.jit(moe.DISPATCHES[dispatch], static_argnums=5)(*args, LIMIT)


# to float32 rounding (float32 weights) and to bfloat16 rounding (bfloat16 weights), relative to max |out|
TOL = {"float32": 2e-6, "bfloat16": 2**-8}


@pytest.mark.parametrize("case", ["random", "skewed", "one_token", "ragged", "padded"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_equals_dense_and_float64(case, dtype):
    rng = np.random.default_rng(abs(hash((case, dtype))) % 2**32)
    x, ids, weights = routing(rng, case)
    gate_up, down = experts(rng, dtype)
    oracle = routed_f64(x, ids, weights, gate_up, down, LIMIT)
    scale = np.abs(oracle).max()
    dense = run("dense", x, ids, weights, gate_up, down)
    assert dense.shape == x.shape and dense.dtype == jnp.float32
    assert np.abs(np.asarray(dense) - oracle).max() < TOL[dtype] * scale
    for dispatch in GROUPED:
        out = np.asarray(run(dispatch, x, ids, weights, gate_up, down))
        assert np.abs(out - oracle).max() < TOL[dtype] * scale, dispatch
        assert np.abs(out - np.asarray(dense)).max() < TOL[dtype] * scale, dispatch


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", [None, FP8, FP4])
@pytest.mark.parametrize("case", ["random", "skewed"])
def test_default_dispatch_runs_the_triton_kernel_on_gpu(case, fmt):
    """On a GPU the default dispatch is the Triton kernel (quant_gmm.takes: these cases have more pairs than
    the op takes FP4 experts at, and it takes no others), and it equals the float64 computation (on the
    dequantized experts for quantized ones)."""
    rng = np.random.default_rng(11)
    x, ids, weights = routing(rng, case)
    if fmt is None:
        gate_up, down = experts(rng, "bfloat16")
        oracle = routed_f64(x, ids, weights, gate_up, down, LIMIT)
    else:
        gate_up, down = (quantized(w, fmt, "e8m0", "bfloat16") for w in experts(rng, "float32"))
        oracle = routed_f64(x, ids, weights, quant.dequantize(gate_up), quant.dequantize(down), LIMIT)
    fn = jax.jit(moe.DISPATCHES["grouped"], static_argnums=5)
    assert "__gpu$xla.gpu.triton" in fn.lower(x, ids, weights, gate_up, down, LIMIT).as_text()
    out = np.asarray(fn(x, ids, weights, gate_up, down, LIMIT))
    assert np.abs(out - oracle).max() < TOL["bfloat16"] * np.abs(oracle).max()


def test_limit_clamps():
    """With large inputs the SwiGLU limit binds (the clamp is exercised, not only the matmuls)."""
    rng = np.random.default_rng(1)
    x, ids, weights = routing(rng, "random")
    gate_up, down = experts(rng, "float32")
    x = x * 20
    unlimited = routed_f64(x, ids, weights, gate_up, down, np.inf)
    oracle = routed_f64(x, ids, weights, gate_up, down, LIMIT)
    assert np.abs(unlimited - oracle).max() > 0.1 * np.abs(oracle).max()
    for dispatch in GROUPED:
        out = np.asarray(run(dispatch, x, ids, weights, gate_up, down))
        assert np.abs(out - oracle).max() < TOL["float32"] * np.abs(oracle).max(), dispatch


@pytest.mark.parametrize("block_rows", [None, 16, 64])
@pytest.mark.parametrize("pairs", [1, 6, 48, 900])
def test_layout(pairs, block_rows):
    """Each pair has a row of its own in a tile of its expert, within the memory bound, and each row its
    pair (``row_pairs``, the inverse; ``pairs`` for the padding rows); unused tiles are marked -1 and come
    after the used ones; with the default tile rows or given ones."""
    rng = np.random.default_rng(pairs)
    ids = rng.integers(0, EXPERTS, pairs) if pairs < 900 else np.full(pairs, 3)
    groups = grouped_matmul.group_pairs(jnp.asarray(ids, jnp.int32), EXPERTS, block_rows)
    assert groups.block_rows == (block_rows or grouped_matmul.block_rows_for(pairs, EXPERTS))
    rows, tile_expert = np.asarray(groups.rows), np.asarray(groups.tile_expert)
    assert len(set(rows)) == pairs
    np.testing.assert_array_equal(tile_expert[rows // groups.block_rows], ids)
    row_pairs = np.asarray(groups.row_pairs)
    np.testing.assert_array_equal(row_pairs[rows], np.arange(pairs))
    assert (np.delete(row_pairs, rows) == pairs).all()
    assert groups.num_rows <= pairs + min(EXPERTS, pairs) * groups.block_rows
    used = tile_expert >= 0
    assert used.sum() == sum(-(-np.sum(ids == e) // groups.block_rows) for e in range(EXPERTS))
    assert not used[used.argmin() :].any() or used.all()


def test_layout_runs_no_loop():
    """The layout is straight-line code (sorts, scatters, comparisons): no while loop, whose condition a GPU
    would copy to the host at every step of a decode-sized MoE layer."""
    ids = jax.ShapeDtypeStruct((48,), jnp.int32)
    layout = jax.jit(lambda ids: tuple(grouped_matmul.group_pairs(ids, EXPERTS)[:3]))
    assert "stablehlo.while" not in layout.trace(ids).lower(lowering_platforms=("cuda",)).as_text()


#: one unit in the last place of a bfloat16 value, relative to it: 2^-8 to 2^-7 (8 significant bits)
BF16_ULP = 2**-7
WEIGHT_FORMATS = [(None, None), (FP8, "e8m0"), (FP8, "float32"), (FP4, "e8m0"), (FP4, "float32")]


@pytest.mark.parametrize(
    "interpret", [True, pytest.param(False, marks=pytest.mark.cuda)], ids=["interpret", "triton"]
)
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("swap", [False, True], ids=["x_left", "weights_left"])
@pytest.mark.parametrize("fmt, scales", WEIGHT_FORMATS, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pallas_kernel_equals_jnp_loop(fmt, scales, dtype, swap, gated, interpret):
    """The kernel (interpret mode; on a GPU also compiled by Triton) and the jnp loop on one layout with
    several column and K blocks, float or quantized weights (K = 192: FP8's last 128-column scale group
    partial, FP4's six 32-column groups read two per K step), the rows or the weight tile as the matmul's
    left operand (``Blocks.swap``), the product or its SwiGLU gate (gated, the limit reached by some
    values); the rows of unused tiles poisoned with NaN."""
    rng = np.random.default_rng(7)
    ids = jnp.asarray(rng.integers(0, EXPERTS, 40), jnp.int32)
    groups = grouped_matmul.group_pairs(ids, EXPERTS)
    weights = rng.standard_normal((EXPERTS, 320, 192)) / 14
    weights = jnp.asarray(weights, dtype) if fmt is None else quantized(weights, fmt, scales, dtype)
    blocks = grouped_matmul.default_blocks(weights, groups.block_rows)._replace(swap=swap)
    want = assert_kernel_equals_jnp_loop(rng, groups, weights, dtype, gated, interpret, blocks)
    if gated:
        assert (np.abs(want) > 0.25).any()  # silu(1) * 1 = 0.73 at the limit: some values clamped


def assert_kernel_equals_jnp_loop(rng, groups, weights, dtype, gated, interpret, blocks=None):
    """:func:`gmm_pallas` (``blocks``; default its own) equals :func:`gmm_jnp` on random ``[rows, 192]``
    rows in ``dtype`` of ``groups``' layout, those of unused tiles poisoned with NaN, gated (limit 1) or
    not; returns the jnp loop's used rows (float32)."""
    used = np.repeat(np.asarray(groups.tile_expert) >= 0, groups.block_rows)
    x = np.where(used[:, None], rng.standard_normal((groups.num_rows, 192)), np.nan)
    x = jnp.asarray(x, dtype)
    kwargs = dict(gated=gated, limit=1.0)
    want = np.asarray(grouped_matmul.gmm_jnp(x, weights, groups, **kwargs).astype(jnp.float32))
    got = grouped_matmul.gmm_pallas(x, weights, groups, **kwargs, blocks=blocks, interpret=interpret)
    assert got.dtype == (x.dtype if gated else jnp.float32)
    # gated bfloat16 results are rounded to bfloat16: a float32 difference of the accumulation order may
    # round them one unit in the last place apart (BF16_ULP)
    rtol = BF16_ULP if gated and dtype == "bfloat16" else 0
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32))[used], want[used], rtol=rtol, atol=2e-5)
    return want[used]


@pytest.mark.parametrize(
    "interpret", [True, pytest.param(False, marks=pytest.mark.cuda)], ids=["interpret", "triton"]
)
@pytest.mark.parametrize("block_rows", [16, 256])
def test_gather_rows_kernel_equals_jnp(block_rows, interpret):
    """The rows' gather as a Pallas kernel gives XLA's gather's rows on every used tile (each row its pair's
    token, 0 for the padding rows), over several column blocks, with tiles unused (left unwritten: not
    compared)."""
    rng = np.random.default_rng(5)
    k, tokens, hidden = 2, 150, 96
    ids = jnp.asarray(rng.integers(0, EXPERTS, (tokens, k)), jnp.int32)
    groups = grouped_matmul.group_pairs(ids, EXPERTS, block_rows)
    used = np.repeat(np.asarray(groups.tile_expert) >= 0, groups.block_rows)
    assert not used.all()  # some tiles unused
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.bfloat16)
    want = np.asarray(grouped_matmul.gather_rows_jnp(x, groups, k).astype(jnp.float32))
    got = grouped_matmul.gather_rows_pallas(x, groups, k, block_h=32, interpret=interpret)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32))[used], want[used])
    padding = used & (np.asarray(groups.row_pairs) == tokens * k)
    assert padding.any() and (want[padding] == 0).all()


def test_tile_rows_by_weight_format():
    """bfloat16 experts take tiles of up to 256 rows at prefill sizes, with the tiling measured for them; the
    other formats tiles of up to 128 rows; each tile size the tiling of its format's entry up to it."""
    shape = (EXPERTS, 64, 32)
    bf16, f32 = jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.float32)
    fp4 = quantized(np.ones(shape), FP4, "e8m0", "bfloat16")
    pairs = 8192 * 6  # V4-Flash's 256 experts at 8192 tokens: 192 rows an expert
    assert [grouped_matmul.max_block_rows(w) for w in (bf16, f32, fp4)] == [256, 128, 128]
    assert grouped_matmul.block_rows_for(pairs, 256, grouped_matmul.max_block_rows(bf16)) == 256
    assert grouped_matmul.block_rows_for(pairs, 256) == 128
    table = grouped_matmul.DEFAULT_BLOCKS
    assert grouped_matmul.default_blocks(bf16, 256) == table["bfloat16", 256]
    assert grouped_matmul.default_blocks(bf16, 128) == table["bfloat16", 64]
    assert grouped_matmul.default_blocks(bf16, 32) == table["bfloat16", 16]
    assert grouped_matmul.default_blocks(fp4, 128) == table[FP4, 64]


@pytest.mark.parametrize(
    "interpret", [True, pytest.param(False, marks=pytest.mark.cuda)], ids=["interpret", "triton"]
)
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_pallas_kernel_on_256_row_tiles(gated, interpret):
    """bfloat16 experts on tiles of 256 rows under their tiling (8 warps, 4 stages, the weights the left
    operand): the kernel equals the jnp loop on a layout of full and partial tiles; the rows of unused tiles
    poisoned with NaN."""
    rng = np.random.default_rng(11)
    ids = jnp.asarray(np.concatenate([np.full(300, 2), rng.integers(0, EXPERTS, 200)]), jnp.int32)
    groups = grouped_matmul.group_pairs(ids, EXPERTS, 256)
    weights = jnp.asarray(rng.standard_normal((EXPERTS, 256, 192)) / 14, jnp.bfloat16)
    assert grouped_matmul.default_blocks(weights, 256) == grouped_matmul.Blocks(128, 64, 8, 4, swap=True)
    assert_kernel_equals_jnp_loop(rng, groups, weights, "bfloat16", gated, interpret)


@pytest.mark.parametrize("fmt, scales", WEIGHT_FORMATS[1:], ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_on_quantized_experts_equals_dense(fmt, scales, dtype):
    """Quantized experts: each grouped dispatch (the Pallas kernel in interpret mode; the quantized grouped
    matmul op too, which takes every format but FP4 with float32 scales) gives the dense dispatch's result
    on the same experts and the float64 computation on their dequantized values."""
    rng = np.random.default_rng(abs(hash((fmt, scales, dtype))) % 2**32)
    x, ids, weights = routing(rng, "random")
    gate_up, down = (quantized(w, fmt, scales, dtype) for w in experts(rng, "float32"))
    oracle = routed_f64(x, ids, weights, quant.dequantize(gate_up), quant.dequantize(down), LIMIT)
    scale = np.abs(oracle).max()
    dense = np.asarray(run("dense", x, ids, weights, gate_up, down))
    assert np.abs(dense - oracle).max() < TOL[dtype] * scale
    for dispatch in GROUPED + (("grouped_quant_op",) if (fmt, scales) != (FP4, "float32") else ()):
        out = np.asarray(run(dispatch, x, ids, weights, gate_up, down))
        assert np.abs(out - oracle).max() < TOL[dtype] * scale, dispatch
        assert np.abs(out - dense).max() < TOL[dtype] * scale, dispatch


def test_bf16_scales_are_the_e8m0_scales():
    """The bfloat16 scales the PTX decoder takes (quant's float32 scales cast) are exact at every accepted
    exponent."""
    exponents = jnp.arange(quant.EXPONENTS[FP4][0], quant.EXPONENTS[FP4][1] + 1, dtype=jnp.uint8)
    scales = quant.scale_values(exponents)
    got = scales.astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(scales))


@pytest.mark.cuda
def test_fp4_ptx_decodes_as_quant():
    """``fp4_bf16_ptx`` in a Triton kernel: every byte (both its codes, each sign, the subnormal 0.5
    included) times every exponent the loader accepts (as bfloat16 scales), the exponents differing
    between neighbouring bytes, equals quant's float32 decoding cast to bfloat16 (exact both: an e2m1 value
    times a power of two)."""
    low, high = quant.EXPONENTS[FP4]
    rows = np.arange(256)[:, None]
    codes = ((rows + np.arange(256)) % 256).astype(np.uint8)  # each row every byte, shifted
    exponents = (low + (rows * 7 + np.arange(256) * 3) % (high - low + 1)).astype(np.uint8)
    spec = pl.BlockSpec((16, 256), lambda i: (i, 0))
    values = jax.ShapeDtypeStruct(codes.shape, jnp.bfloat16)

    def kernel(codes_ref, exponents_ref, low_ref, high_ref):
        scales = quant.scale_values(exponents_ref[...]).astype(jnp.bfloat16)
        low_ref[...], high_ref[...] = grouped_matmul.fp4_bf16_ptx(codes_ref[...], scales)

    got = pl.pallas_call(
        kernel, grid=(16,), in_specs=[spec, spec], out_specs=[spec, spec], out_shape=[values, values]
    )(jnp.asarray(codes), jnp.asarray(exponents))
    scales = quant.scale_values(jnp.asarray(exponents))
    for nibbles, decoded in zip(quant.nibbles(jnp.asarray(codes)), got, strict=True):
        want = (quant.e2m1_code_values(nibbles) * scales).astype(jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(decoded, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize(
    "dtype, scales, ptx",
    [("bfloat16", "e8m0", True), ("float32", "e8m0", False), ("bfloat16", "float32", False)],
)
def test_fp4_kernel_for_cuda_decodes_by_ptx(dtype, scales, ptx):
    """The kernel lowered for CUDA (here, without a GPU) decodes FP4 by inline PTX for bfloat16 matmuls
    with e8m0 scales, and by quant's float32 decoders otherwise."""
    weights = quantized(np.zeros((EXPERTS, 64, 64)), FP4, scales, dtype)
    groups = grouped_matmul.group_pairs(jnp.zeros((4,), jnp.int32), EXPERTS)
    x = jax.ShapeDtypeStruct((groups.num_rows, 64), dtype)
    kernel = jax.jit(lambda x, weights: grouped_matmul.gmm_pallas(x, weights, groups))
    lowered = kernel.trace(x, weights).lower(lowering_platforms=("cuda",))
    assert ("elementwise_inline_asm" in lowered.as_text()) == ptx


def test_pallas_kernel_refuses_shapes_and_tilings_it_cannot_take():
    for block_rows in (8, 48):
        with pytest.raises(ValueError, match="block_rows: must be a power of two of at least 16"):
            grouped_matmul.group_pairs(jnp.zeros((4,), jnp.int32), EXPERTS, block_rows)
    groups = grouped_matmul.group_pairs(jnp.zeros((4,), jnp.int32), EXPERTS)
    with pytest.raises(ValueError, match="N \\(the weights' outputs\\)"):
        grouped_matmul.gmm_pallas(jnp.zeros((groups.num_rows, 64)), jnp.zeros((EXPERTS, 24, 64)), groups)
    with pytest.raises(ValueError, match="N / 2 \\(each of the gate's and the up projection's outputs\\)"):
        x, weights = jnp.zeros((groups.num_rows, 64)), jnp.zeros((EXPERTS, 48, 64))
        grouped_matmul.gmm_pallas(x, weights, groups, gated=True)
    x, weights = jnp.zeros((groups.num_rows, 64)), jnp.zeros((EXPERTS, 32, 64))
    for blocks, name in [(grouped_matmul.Blocks(n=48), "blocks.n"), (grouped_matmul.Blocks(k=8), "blocks.k")]:
        with pytest.raises(ValueError, match=f"{name}: must be a power of two of at least 16"):
            grouped_matmul.gmm_pallas(x, weights, groups, blocks=blocks)


def lowers_to_triton(tokens, k, gate_up, down):
    """How many Triton kernels the default dispatch of ``tokens`` tokens of ``k`` picks each on the
    (abstract) experts ``gate_up`` and ``down`` runs, lowered for CUDA here (no GPU needed)."""
    hidden = down.shape[1]
    args = [
        jax.ShapeDtypeStruct(s, d) for s, d in [((tokens, hidden), jnp.float32), ((tokens, k), jnp.int32)]
    ]
    args += [jax.ShapeDtypeStruct((tokens, k), jnp.float32), gate_up, down]
    triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    fn = jax.jit(functools.partial(moe.grouped, limit=LIMIT))
    exported = export.export(fn, platforms=["cuda"], disabled_checks=[triton])(*args)
    return exported.mlir_module().count("@__gpu$xla.gpu.triton")


@pytest.mark.parametrize("fmt", [None, FP8, FP4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_lowers_to_triton_for_cuda(fmt, dtype):
    """The default dispatch, lowered for CUDA here, runs its two matmuls as Triton kernels (float experts
    and quantized ones, dequantized in the kernel), and the rows' gather too at prefill sizes (tiles of 64
    rows: 96 pairs an expert)."""
    shapes = [(EXPERTS, 2 * INTERMEDIATE, HIDDEN), (EXPERTS, HIDDEN, INTERMEDIATE)]
    if fmt is None:
        gate_up, down = (jax.ShapeDtypeStruct(shape, dtype) for shape in shapes)
    else:
        gate_up, down = (abstract_quantized(fmt, shape, dtype) for shape in shapes)
    assert lowers_to_triton(5, K, gate_up, down) == 2
    assert lowers_to_triton(256, K, gate_up, down) == 3


@pytest.mark.parametrize("fmt", [FP8, FP4])
def test_quantized_experts_lower_to_triton_at_v4_flash_shapes(fmt):
    """DeepSeek-V4-Flash's released experts (256 of hidden 4096, intermediate 2048; FP4: gate_up codes
    uint8 [256, 4096, 2048], down [256, 4096, 1024]) lower to the two Triton kernels, 64 tokens of 6 picks."""
    experts, hidden, intermediate = 256, 4096, 2048
    gate_up = abstract_quantized(fmt, (experts, 2 * intermediate, hidden), "bfloat16")
    down = abstract_quantized(fmt, (experts, hidden, intermediate), "bfloat16")
    assert lowers_to_triton(64, 6, gate_up, down) == 2


def test_unknown_dispatch_is_named():
    with pytest.raises(ValueError, match="dispatch: must be one of"):
        layer_config(hash_routed=False, dispatch="sparse")
    with pytest.raises(ValueError, match="moe_dispatch: must be one of"):
        RuntimeConfig(moe_dispatch="sparse")


@pytest.mark.parametrize("hash_routed", [False, True], ids=["top_k", "hash"])
def test_model_layer_dispatches_agree(hash_routed):
    """One MoE module (routing, shared expert, routed scaling): the default (grouped) dispatch gives the dense
    one's output."""
    config = layer_config(hash_routed=hash_routed, dispatch="dense")
    layer = moe.MoE(config, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 9, HIDDEN)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 16, (2, 9)), jnp.int32)
    ids, weights = layer.route(x, tokens)
    assert ids.shape == weights.shape == (2, 9, K) and ids.dtype == jnp.int32
    np.testing.assert_allclose(weights.sum(-1), 1.5, rtol=1e-6)
    dense = np.asarray(layer(x, tokens))
    layer.config = dataclasses.replace(config, dispatch="grouped")
    grouped = np.asarray(layer(x, tokens))
    np.testing.assert_allclose(grouped, dense, rtol=0, atol=TOL["float32"] * np.abs(dense).max())


@pytest.mark.parametrize("experts_format", ["float", FP4])
def test_bench_moe_runs_tiny(tmp_path, experts_format):
    """bench/bench_moe.py end to end at toy shapes on this platform: a JSON row per token count; FP4 experts
    (of hidden and intermediate 32) floored by their codes' and scales' bytes; float experts also timed in a
    loop (``--loop``): a per-call time for each dispatch that ran."""
    out = tmp_path / "bench_moe.json"
    bench = pathlib.Path(__file__).resolve().parent.parent / "bench" / "bench_moe.py"
    tiny = "--experts 8 --hidden 32 --intermediate 16 --top-k 2 --iters 1 --rounds 1 --bandwidth-iters 1"
    command = [sys.executable, str(bench), *tiny.split(), "--tokens", "1", "5", "--copy-mib", "1"]
    command += ["--dispatches", "dense", "grouped", "--dense-max-tokens", "1", "--out", str(out)]
    if experts_format != FP4:
        command += ["--loop", "3"]
    if experts_format == FP4:
        command += [
            "--experts-format",
            FP4,
            "--intermediate",
            "32",
            "--blocks",
            "16:32,16,4,3,swap",
            "64:64,32,4,3",
        ]
    subprocess.run(command, check=True, capture_output=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    results = json.loads(out.read_text())
    rows = results["rows"]
    assert [row["tokens"] for row in rows] == [1, 5]
    assert rows[0]["dense_ms"] > 0 and rows[1]["grouped_ms"] > 0 and "dense_ms" not in rows[1]
    assert all(row["floor_ms"] > 0 and 1 <= row["distinct_experts"] <= 8 for row in rows)
    float_bytes = 3 * 32 * 16 * 2  # gate, up and down of hidden 32, intermediate 16, bfloat16
    fp4_bytes = 3 * 32 * 32 // 2 + 3 * 32 * 32 // 32  # half a byte a parameter, a scale byte per 32
    assert results["expert_bytes"] == (fp4_bytes if experts_format == FP4 else float_bytes)
    assert results["blocks"] == (["16:32,16,4,3,swap", "64:64,32,4,3"] if experts_format == FP4 else None)
    looped = {key for row in rows for key in row if key.endswith("_loop_ms")}
    assert looped == (set() if experts_format == FP4 else {"dense_loop_ms", "grouped_loop_ms"})
    assert all(np.isfinite(row[key]) for row in rows for key in looped & row.keys())


def test_sweep_gmm_runs_tiny(tmp_path):
    """bench/sweep_gmm.py end to end at toy shapes (Pallas interpret mode): a timed cell per matmul and
    tiling, a tiling Triton could not take recorded as failed rather than ending the sweep."""
    out = tmp_path / "sweep_gmm.json"
    bench = pathlib.Path(__file__).resolve().parent.parent / "bench" / "sweep_gmm.py"
    tiny = "--tokens 4 --experts 8 --hidden 64 --intermediate 32 --top-k 2 --iters 1 --copy-mib 1 --interpret"
    base = [sys.executable, str(bench), *tiny.split(), "--formats", "fp4", "--out", str(out)]
    command = [*base, "--blocks", "32,16,4,3,swap", "32,24,4,3", "--block-rows", "16", "32"]
    subprocess.run(command, check=True, capture_output=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    rows = json.loads(out.read_text())["rows"]
    assert [(row["matrix"], row["block_rows"]) for row in rows] == [
        ("gate_up", 16),
        ("gate_up", 32),
        ("down", 16),
        ("down", 32),
    ]
    for row in rows:
        assert row["ms"]["32,16,4,3,swap"] > 0 and row["ms"]["32,24,4,3"].startswith("failed: ValueError")
        assert row["device_ms"] == {}  # no GPU kernel ran: host times only
    # --once (under a profiler): each cell called once and recorded as such, nothing timed
    once = [*base, "--blocks", "32,16,4,3", "--once"]
    subprocess.run(once, check=True, capture_output=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert [row["ms"] for row in json.loads(out.read_text())["rows"]] == [{"32,16,4,3": "called once"}] * 2
