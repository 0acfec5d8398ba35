"""The FP4 grouped matmul op (jax_oc128.nn.fp4_gmm): the native CPU handler, the jnp twin and (on a GPU) the
CUDA kernel against an independent float64 numpy computation, on a layout with empty experts, an expert over
several tiles, padding rows (NaN in x: never read) and unused tiles; every e2m1 code and every e8m0 exponent
the loader accepts; float32 and bfloat16 rows, plain and gated."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_oc128 import ops
from jax_oc128.nn import fp4_gmm, grouped_matmul, quant
from jax_oc128.nn.quant import FP4, QuantizedArray

LIMIT = 7.0
#: the e2m1 values of codes 0..7, written out (the float64 computation's own decoding)
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
LOW, HIGH = quant.EXPONENTS[FP4]
WINDOW = 8  # e8m0 exponents per expert: experts cover [LOW, HIGH] in windows


def make_case(rng, experts, n, k, dtype, rows_per_expert, block_rows=16):
    """``(x, weights, groups)``: FP4 weights whose expert e has e8m0 exponents in its window of
    :data:`WINDOW` (the windows cover every accepted exponent, each of its window's exponents at least once
    per expert), random packed bytes (every code), the layout of ``rows_per_expert`` pairs each, and x on the
    layout's rows scaled by its tile's expert (so that every x and every product is a normal float32 number
    and every sum finite), NaN on padding rows and unused tiles."""
    codes = rng.integers(0, 256, (experts, n, k // 2), dtype=np.uint8)
    first = LOW + (np.arange(experts) * WINDOW) % (HIGH - LOW + 1 - WINDOW)
    first[-1] = HIGH - WINDOW + 1  # the last expert reaches the top exponent
    spread = np.resize(np.arange(WINDOW), n * (k // 32))
    offsets = np.stack([rng.permutation(spread).reshape(n, k // 32) for _ in range(experts)])
    exponents = (first[:, None, None] + offsets).astype(np.uint8)
    weights = QuantizedArray(jnp.asarray(codes), jnp.asarray(exponents), FP4, dtype)
    ids = np.repeat(np.arange(experts), rows_per_expert)
    groups = grouped_matmul.group_pairs(jnp.asarray(rng.permutation(ids), jnp.int32), experts, block_rows)
    tile_expert = np.asarray(groups.tile_expert)
    real = np.asarray(groups.row_pairs) < len(ids)
    row_expert = np.repeat(tile_expert, groups.block_rows)
    magnitude = np.ldexp(1.0, quant.E8M0_BIAS - (first[row_expert] + WINDOW // 2))  # 1 / the middle scale
    # |x| within a factor 2 of the magnitude, never subnormal (XLA's CPU threads flush those, CUDA does not)
    x = rng.choice([-1.0, 1.0], (groups.num_rows, k)) * np.exp2(rng.uniform(-1, 1, (groups.num_rows, k)))
    x = x * magnitude[:, None]
    x = np.where(real[:, None], x, np.nan)
    return jnp.asarray(x, dtype), weights, groups


def dequantized_f64(weights):
    """float64 ``[experts, N, K]`` of FP4 weights, decoded here from the bytes and exponents."""
    codes = np.asarray(weights.codes)
    nibbles = np.stack([codes & 15, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1)
    values = np.where(nibbles & 8, -1.0, 1.0) * E2M1[nibbles & 7]
    scales = np.ldexp(1.0, np.asarray(weights.scales).astype(np.int64) - quant.E8M0_BIAS)
    return values * np.repeat(scales, 32, axis=-1)


def float64_product(x, weights, groups, gated):
    """``(want, bound)``: the op's result in float64 (rows of no pair 0) and a bound on a float32
    accumulation's error (K units of float32 rounding of the products' magnitudes, through the gate; gated
    results also to a rounding to the weights' dtype)."""
    w = dequantized_f64(weights)
    x = np.nan_to_num(np.asarray(x.astype(jnp.float32), np.float64), nan=0.0)
    real = np.asarray(groups.row_pairs) < groups.rows.shape[0]
    product, magnitude = np.zeros((x.shape[0], w.shape[1])), np.zeros((x.shape[0], w.shape[1]))
    for tile, expert in enumerate(np.asarray(groups.tile_expert)):
        rows = slice(tile * groups.block_rows, (tile + 1) * groups.block_rows)
        if expert >= 0:
            tile_x = x[rows] * real[rows, None]
            product[rows], magnitude[rows] = tile_x @ w[expert].T, np.abs(tile_x) @ np.abs(w[expert]).T
    error = magnitude * x.shape[1] * 2.0**-24
    if not gated:
        return product, error
    i = product.shape[1] // 2
    g, u = np.minimum(product[:, :i], LIMIT), np.clip(product[:, i:], -LIMIT, LIMIT)
    silu = g * 0.5 * (1 + np.tanh(g / 2))  # g * sigmoid(g), without overflow
    want = silu * u
    rounding = 2.0**-8 if weights.dtype == jnp.bfloat16 else 2.0**-23
    return want, 1.2 * np.abs(u) * error[:, :i] + np.abs(silu) * error[:, i:] + rounding * np.abs(want)


def assert_matches(got, want, bound, what):
    got = np.asarray(got.astype(jnp.float32), np.float64)
    excess = np.abs(got - want) - bound
    at = np.unravel_index(excess.argmax(), excess.shape)
    assert excess.max() <= 0, f"{what}: off by {excess.max()} beyond the bound at {at}"


CASES = [("float32", False), ("float32", True), ("bfloat16", False), ("bfloat16", True)]


@pytest.fixture(scope="module")
def cases():
    """The case of each (dtype, gated): 32 experts (one with no row, one over two tiles), N 48, K 128."""
    made = {}
    for dtype, gated in CASES:
        rng = np.random.default_rng(len(made))
        rows = rng.integers(1, 4, 32)
        rows[3], rows[7] = 0, 21  # an empty expert, an expert over two tiles
        made[dtype, gated] = make_case(rng, 32, 48, 128, dtype, rows)
    return made


def test_cases_hold_every_code_and_exponent(cases):
    _, weights, groups = cases["bfloat16", True]
    codes = np.asarray(weights.codes)
    assert set(np.concatenate([codes & 15, codes >> 4]).ravel()) == set(range(16))
    assert set(np.asarray(weights.scales).ravel()) == set(range(LOW, HIGH + 1))
    rows, tile_expert = np.asarray(fp4_gmm.tile_rows(groups)), np.asarray(groups.tile_expert)
    assert (tile_expert < 0).any() and 3 not in tile_expert  # unused tiles, an expert of no row
    assert (rows[tile_expert >= 0] < groups.block_rows).any()  # padding rows
    assert (rows == groups.block_rows).any()  # a full tile


@pytest.mark.parametrize("dtype, gated", CASES)
def test_cpu_handler_equals_twin_and_float64(cases, dtype, gated):
    assert fp4_gmm.TARGET in ops.native_targets("cpu")
    x, weights, groups = cases[dtype, gated]
    want, bound = float64_product(x, weights, groups, gated)
    x, weights = jax.device_put((x, weights), jax.devices("cpu")[0])  # the CPU handler, on a GPU machine too
    call = jax.jit(lambda x, w: fp4_gmm.fp4_gmm(x, w, groups, gated=gated, limit=LIMIT))
    assert fp4_gmm.TARGET in call.lower(x, weights).as_text()
    got = call(x, weights)
    assert got.dtype == (jnp.dtype(dtype) if gated else jnp.float32)
    assert_matches(got, want, bound, "cpu handler vs float64")
    rows = fp4_gmm.tile_rows(groups)
    twin = jax.jit(lambda x, w: fp4_gmm.fp4_gmm_reference(x, w, groups, rows, gated, LIMIT))(x, weights)
    assert_matches(twin, want, bound, "twin vs float64")
    assert_matches(got, np.asarray(twin.astype(jnp.float32), np.float64), 2 * bound, "cpu handler vs twin")


def test_rows_of_no_pair_are_zero_and_limit_binds(cases):
    x, weights, groups = cases["float32", True]
    x, weights = jax.device_put((x, weights), jax.devices("cpu")[0])
    got = np.asarray(fp4_gmm.fp4_gmm(x, weights, groups, gated=True, limit=LIMIT))
    real = np.asarray(groups.row_pairs) < groups.rows.shape[0]
    assert np.isfinite(got).all() and (got[~real] == 0).all() and (got[real] != 0).any()
    unlimited = np.asarray(fp4_gmm.fp4_gmm(x, weights, groups, gated=True))
    assert np.abs(unlimited - got).max() > 1.0  # the products reach past the limit


def test_misuse_is_refused_naming_the_argument(cases):
    x, weights, groups = cases["float32", False]
    with pytest.raises(TypeError, match=r"^weights"):
        fp4_gmm.fp4_gmm(x, quant.dequantize(weights), groups)
    with pytest.raises(TypeError, match=r"^weights: the op takes e8m0"):
        fp4_gmm.fp4_gmm(x, dataclasses.replace(weights, scales=quant.scale_values(weights.scales)), groups)
    with pytest.raises(ValueError, match=r"^x: expected shape"):
        fp4_gmm.fp4_gmm(x[:, :64], weights, groups)
    with pytest.raises(TypeError, match=r"^x: dtype"):
        fp4_gmm.fp4_gmm(x.astype(jnp.float16), weights, groups)
    with pytest.raises(ValueError, match=r"^limit"):
        fp4_gmm.fp4_gmm(x, weights, groups, gated=True, limit=0.0)


def test_gmm_takes_the_op_on_cuda_at_decode_sizes_only(cases):
    _, weights, _ = cases["bfloat16", True]
    few = grouped_matmul.group_pairs(jnp.asarray([3, 9, 9, 20, 31, 0], jnp.int32), 32)  # 6 pairs, 32 experts
    x = jnp.zeros((few.num_rows, 128), jnp.bfloat16)
    assert fp4_gmm.takes(x, weights, few)
    assert not fp4_gmm.takes(x.astype(jnp.float32), weights, few)
    float_scales = dataclasses.replace(weights, scales=quant.scale_values(weights.scales))
    assert not fp4_gmm.takes(x, float_scales, few)
    most = grouped_matmul.group_pairs(jnp.arange(48, dtype=jnp.int32) % 32, 32)  # 48 pairs: 1.5 an expert
    assert fp4_gmm.takes(jnp.zeros((most.num_rows, 128), jnp.bfloat16), weights, most)
    many = grouped_matmul.group_pairs(jnp.arange(49, dtype=jnp.int32) % 32, 32)  # 49: past 1.5 an expert
    assert not fp4_gmm.takes(jnp.zeros((many.num_rows, 128), jnp.bfloat16), weights, many)
    large = grouped_matmul.group_pairs(jnp.zeros((8,), jnp.int32), 32, 64)
    assert not fp4_gmm.takes(jnp.zeros((large.num_rows, 128), jnp.bfloat16), weights, large)
    if fp4_gmm.TARGET not in ops.native_targets("cuda"):
        return
    call = jax.jit(lambda x, w: fp4_gmm.gmm(x, w, few, gated=True, limit=LIMIT))
    lowered = call.trace(x, weights).lower(lowering_platforms=("cuda",)).as_text()
    assert fp4_gmm.TARGET in lowered and "triton" not in lowered
    call = jax.jit(lambda x, w: fp4_gmm.fp4_gmm(x, w, few))
    lowered = call.trace(x.astype(jnp.float32), weights).lower(lowering_platforms=("cuda",)).as_text()
    assert fp4_gmm.TARGET not in lowered  # float32 rows: the twin on CUDA


def on_gpu(x, weights):
    """x and the weights on the GPU (the layout stays a closure's constants)."""
    return jax.device_put((x, weights), jax.devices("gpu")[0])


@pytest.mark.cuda
@pytest.mark.parametrize("gated", [False, True])
def test_cuda_kernel_equals_twin_and_float64(cases, gated):
    assert fp4_gmm.TARGET in ops.native_targets("cuda")
    x, weights, groups = cases["bfloat16", gated]
    want, bound = float64_product(x, weights, groups, gated)
    x, weights = on_gpu(x, weights)
    call = jax.jit(lambda x, w: fp4_gmm.fp4_gmm(x, w, groups, gated=gated, limit=LIMIT))
    assert fp4_gmm.TARGET in call.lower(x, weights).as_text()
    got = call(x, weights)
    assert_matches(got, want, bound, "cuda vs float64")
    rows = fp4_gmm.tile_rows(groups)
    twin = jax.jit(lambda x, w: fp4_gmm.fp4_gmm_reference(x, w, groups, rows, gated, LIMIT))(x, weights)
    assert_matches(got, np.asarray(twin.astype(jnp.float32), np.float64), 2 * bound, "cuda vs twin")
    np.testing.assert_array_equal(np.asarray(call(x, weights)), np.asarray(got))  # deterministic


@pytest.mark.cuda
def test_float32_rows_run_the_twin_on_gpu(cases):
    x, weights, groups = cases["float32", False]
    want, bound = float64_product(x, weights, groups, False)
    assert_matches(fp4_gmm.fp4_gmm(*on_gpu(x, weights), groups), want, bound, "float32 on the GPU vs float64")


@pytest.mark.cuda
@pytest.mark.parametrize("gated", [False, True])
def test_cuda_kernel_at_v4_flash_widths(gated):
    """K 4096 (8 warps of four 128-column chunks), N 1032 (a partial last block of columns), 8 experts of up
    to 21 rows in tiles of 32 (passes of 16 rows, the MMA's 8 twice; 8 rows or fewer: once; a partial last
    pass)."""
    rng = np.random.default_rng(5)
    x, weights, groups = make_case(rng, 8, 1032, 4096, "bfloat16", [0, 1, 2, 3, 8, 9, 13, 21], block_rows=32)
    want, bound = float64_product(x, weights, groups, gated)
    call = jax.jit(lambda x, w: fp4_gmm.fp4_gmm(x, w, groups, gated=gated, limit=LIMIT))
    assert_matches(call(*on_gpu(x, weights)), want, bound, "cuda vs float64")
