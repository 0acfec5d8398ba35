"""The quantized grouped matmul op (jax_oc128.nn.quant_gmm): the native CPU handler, the jnp twin and (on a
GPU) the CUDA kernel against an independent float64 numpy computation, FP4 and FP8 weights, on a layout with
empty experts, an expert over several tiles, padding rows (NaN in x: never read) and unused tiles; every e2m1
and every e4m3 code (FP8's NaN codes: NaN products) and every e8m0 exponent the loader accepts, FP8's float32
scales; float32 and bfloat16 rows, plain and gated; V4-Flash's FP8 linear layers as the op's one-tile layouts
(the CUDA kernel's split of K)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_oc128 import ops
from jax_oc128.nn import grouped_matmul, linear, quant, quant_gmm
from jax_oc128.nn.quant import FP4, FP8, QuantizedArray

LIMIT = 7.0
#: the e2m1 values of codes 0..7, written out (the float64 computation's own decoding)
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
#: the e4m3 codes that are not NaN (magnitude 0x7F is)
E4M3_NUMBERS = np.setdiff1d(np.arange(256), [0x7F, 0xFF]).astype(np.uint8)
WINDOW = 8  # e8m0 exponents per expert: experts cover [low, high] in windows
#: the CUDA kernel's largest e8m0 exponent scaled by one multiply a pair of weights (above it, two; a warp
#: takes two where one of its lanes needs them)
ONE_MULTIPLY = {FP4: 128, FP8: 134}


def e4m3_f64(codes):
    """float64 values of e4m3fn codes (uint8, any shape), decoded here: sign bit 7, exponent bits 6-3 (bias
    7), mantissa bits 2-0, exponent 0 subnormal (2^-6 * m / 8), magnitude 0x7F NaN."""
    codes = np.asarray(codes).astype(np.int64)
    exponent, mantissa = (codes >> 3) & 15, codes & 7
    magnitude = np.where(exponent > 0, np.ldexp(1.0 + mantissa / 8, exponent - 7), np.ldexp(mantissa / 8, -6))
    magnitude = np.where((codes & 0x7F) == 0x7F, np.nan, magnitude)
    return np.where(codes & 0x80, -magnitude, magnitude)


def make_case(rng, experts, n, k, dtype, rows_per_expert, block_rows=16, fmt=FP4, scales="e8m0"):
    """``(x, weights, groups)``: weights in ``fmt`` whose expert e has e8m0 exponents in its window of
    :data:`WINDOW` (the windows cover every exponent the loader accepts, each of its window's exponents at
    least once per expert; ``scales`` "float32": FP8's float32 scales, each 2^(e - 127) times a random
    factor in [1, 2) within the loader's range), random codes (FP4 random bytes; FP8 every code but NaN), the
    layout of ``rows_per_expert`` pairs each, and x on the layout's rows scaled by its tile's expert (so that
    every x and every product is a normal float32 number and every sum finite), NaN on padding rows and
    unused tiles."""
    low, high = quant.EXPONENTS[fmt]
    if fmt == FP4:
        codes = rng.integers(0, 256, (experts, n, k // 2), dtype=np.uint8)
    else:
        codes = rng.choice(E4M3_NUMBERS, (experts, n, k)).view(ml_dtypes.float8_e4m3fn)
    first = low + (np.arange(experts) * WINDOW) % (high - low + 1 - WINDOW)
    first[-1] = high - WINDOW + 1  # the last expert reaches the top exponent
    groups_per_row = -(-k // quant.GROUP[fmt])
    spread = np.resize(np.arange(WINDOW), n * groups_per_row)
    offsets = np.stack([rng.permutation(spread).reshape(n, groups_per_row) for _ in range(experts)])
    exponents = (first[:, None, None] + offsets).astype(np.uint8)
    if scales == "float32":
        factor = 1 + rng.uniform(0, 1, exponents.shape)
        values = np.minimum(
            np.ldexp(factor, exponents.astype(np.int64) - quant.E8M0_BIAS), 2.0 ** (high - 127)
        )
        exponents = values.astype(np.float32)
    weights = QuantizedArray(jnp.asarray(codes), jnp.asarray(exponents), fmt, dtype)
    ids = np.repeat(np.arange(experts), rows_per_expert)
    groups = grouped_matmul.group_pairs(jnp.asarray(rng.permutation(ids), jnp.int32), experts, block_rows)
    middle = np.ldexp(1.0, quant.E8M0_BIAS - (first + WINDOW // 2))  # 1 / each expert's middle scale
    return layout_rows(rng, groups, k, middle, dtype), weights, groups


def layout_rows(rng, groups, k, magnitude, dtype):
    """x on the layout's rows: |x| within a factor 2 of ``magnitude`` of the row's tile's expert, never
    subnormal (XLA's CPU threads flush those, CUDA does not); NaN on padding rows and unused tiles."""
    tile_expert = np.asarray(groups.tile_expert)
    real = np.asarray(groups.row_pairs) < groups.rows.shape[0]
    magnitude = magnitude[np.repeat(tile_expert, groups.block_rows)]
    x = rng.choice([-1.0, 1.0], (groups.num_rows, k)) * np.exp2(rng.uniform(-1, 1, (groups.num_rows, k)))
    x = x * magnitude[:, None]
    x = np.where(real[:, None], x, np.nan)
    return jnp.asarray(x, dtype)


def dequantized_f64(weights):
    """float64 ``[experts, N, K]`` of the weights, decoded here from the codes and scales: each code's value
    times its scale in float32, rounded to the weights' dtype (exact for e8m0 scales)."""
    codes = np.asarray(weights.codes).view(np.uint8)
    if weights.fmt == FP4:
        nibbles = np.stack([codes & 15, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1)
        values = np.where(nibbles & 8, -1.0, 1.0) * E2M1[nibbles & 7]
    else:
        values = e4m3_f64(codes)
    scales = np.asarray(weights.scales)
    if scales.dtype == np.uint8:
        scales = np.ldexp(1.0, scales.astype(np.int64) - quant.E8M0_BIAS)
    scales = np.repeat(scales, quant.GROUP[weights.fmt], axis=-1)[..., : values.shape[-1]]
    product = values.astype(np.float32) * scales.astype(np.float32)  # float32's rounding
    return product.astype(ml_dtypes.bfloat16 if weights.dtype == jnp.bfloat16 else np.float32).astype(
        np.float64
    )


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
    # rows of no pair 0 (a NaN weight times their zeros would be NaN)
    product, magnitude = (np.where(real[:, None], a, 0.0) for a in (product, magnitude))
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


def twin(x, weights, groups, gated):
    """The jnp twin's result, jitted."""
    rows = quant_gmm.tile_rows(groups)
    return jax.jit(lambda x, w: quant_gmm.quant_gmm_reference(x, w, groups, rows, gated, LIMIT))(x, weights)


def assert_op_equals_twin_and_float64(x, weights, groups, gated, what, call=None):
    """The op (jitted, on x's device) == float64 == the twin."""
    want, bound = float64_product(x, weights, groups, gated)
    call = call or jax.jit(lambda x, w: quant_gmm.quant_gmm(x, w, groups, gated=gated, limit=LIMIT))
    assert quant_gmm.TARGET in call.lower(x, weights).as_text()
    got = call(x, weights)
    assert got.dtype == (x.dtype if gated else jnp.float32)
    assert_matches(got, want, bound, f"{what} vs float64")
    expected = twin(x, weights, groups, gated)
    assert_matches(expected, want, bound, "twin vs float64")
    assert_matches(got, np.asarray(expected.astype(jnp.float32), np.float64), 2 * bound, f"{what} vs twin")
    return got


CASES = [("float32", False), ("float32", True), ("bfloat16", False), ("bfloat16", True)]
#: FP8 weights' cases: (dtype, gated, scales)
FP8_CASES = [(dtype, gated, "e8m0") for dtype, gated in CASES] + [
    ("float32", False, "float32"),
    ("bfloat16", False, "float32"),
    ("bfloat16", True, "float32"),
]


def expert_rows(rng):
    """Rows per expert of 32: 1 to 3, expert 3 none, expert 7 21 (over two tiles of 16)."""
    rows = rng.integers(1, 4, 32)
    rows[3], rows[7] = 0, 21
    return rows


@pytest.fixture(scope="module")
def cases():
    """FP4 cases by (dtype, gated): 32 experts (one with no row, one over two tiles), N 48, K 128."""
    made = {}
    for dtype, gated in CASES:
        rng = np.random.default_rng(len(made))
        made[dtype, gated] = make_case(rng, 32, 48, 128, dtype, expert_rows(rng))
    return made


@pytest.fixture(scope="module")
def fp8_cases():
    """FP8 cases by (dtype, gated, scales): 32 experts as :func:`cases`, N 48, K 272 (a partial last
    128-column scale group, 17 16-byte loads a row)."""
    made = {}
    for i, (dtype, gated, scales) in enumerate(FP8_CASES):
        rng = np.random.default_rng(100 + i)
        made[dtype, gated, scales] = make_case(
            rng, 32, 48, 272, dtype, expert_rows(rng), fmt=FP8, scales=scales
        )
    return made


def test_e4m3_decoding_is_ml_dtypes():
    """The float64 computation's e4m3 decoding (every code: -0, subnormals, NaN) is ml_dtypes' and jnp's."""
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    np.testing.assert_array_equal(e4m3_f64(codes), want)
    np.testing.assert_array_equal(np.signbit(e4m3_f64(codes)), np.signbit(want))
    jnp_values = np.asarray(jnp.asarray(codes.view(ml_dtypes.float8_e4m3fn)).astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(jnp_values, want)


def assert_experts_on_both_scalings(weights):
    """Experts whose exponents are all within :data:`ONE_MULTIPLY`, all above it, and both."""
    exponents = np.asarray(weights.scales).reshape(weights.scales.shape[0], -1).astype(np.int64)
    one = ONE_MULTIPLY[weights.fmt]
    low, high = exponents.min(axis=1), exponents.max(axis=1)
    assert (high <= one).any() and (low > one).any() and ((low <= one) & (high > one)).any()


def test_cases_hold_every_code_and_exponent(cases, fp8_cases):
    _, weights, groups = cases["bfloat16", True]
    assert_experts_on_both_scalings(weights)
    codes = np.asarray(weights.codes)
    assert set(np.concatenate([codes & 15, codes >> 4]).ravel()) == set(range(16))
    low, high = quant.EXPONENTS[FP4]
    assert set(np.asarray(weights.scales).ravel()) == set(range(low, high + 1))
    rows, tile_expert = np.asarray(quant_gmm.tile_rows(groups)), np.asarray(groups.tile_expert)
    assert (tile_expert < 0).any() and 3 not in tile_expert  # unused tiles, an expert of no row
    assert (rows[tile_expert >= 0] < groups.block_rows).any()  # padding rows
    assert (rows == groups.block_rows).any()  # a full tile
    for (_, _, scales), (_, weights, _) in fp8_cases.items():
        assert set(np.asarray(weights.codes).view(np.uint8).ravel()) == set(E4M3_NUMBERS)  # -0 included
        low, high = quant.EXPONENTS[FP8]
        if scales == "e8m0":
            assert set(np.asarray(weights.scales).ravel()) == set(range(low, high + 1))
            assert_experts_on_both_scalings(weights)
        quant.check_scales(np.asarray(weights.scales), FP8, "scales")  # what the loader accepts


def on_cpu(x, weights):
    """x and the weights on the CPU (the CPU handler, on a GPU machine too)."""
    return jax.device_put((x, weights), jax.devices("cpu")[0])


@pytest.mark.parametrize("dtype, gated", CASES)
def test_cpu_handler_equals_twin_and_float64(cases, dtype, gated):
    assert quant_gmm.TARGET in ops.native_targets("cpu")
    x, weights, groups = cases[dtype, gated]
    assert_op_equals_twin_and_float64(*on_cpu(x, weights), groups, gated, "cpu handler")


@pytest.mark.parametrize("dtype, gated, scales", FP8_CASES)
def test_cpu_handler_on_fp8_equals_twin_and_float64(fp8_cases, dtype, gated, scales):
    x, weights, groups = fp8_cases[dtype, gated, scales]
    assert_op_equals_twin_and_float64(*on_cpu(x, weights), groups, gated, "cpu handler")


def test_float32_scales_are_rounded_to_bfloat16_weights(fp8_cases):
    """FP8 with float32 scales in a bfloat16 model: the weights are the products rounded to bfloat16 (as the
    model dequantizes them), which differ from the float32 products: the op is not the float32 weights'."""
    x, weights, groups = fp8_cases["bfloat16", False, "float32"]
    rounded = dequantized_f64(weights)
    unrounded = dequantized_f64(dataclasses.replace(weights, dtype_name="float32"))
    assert (rounded != unrounded).mean() > 0.5
    x, weights = on_cpu(x, weights)
    got = np.asarray(quant_gmm.quant_gmm(x, weights, groups))
    real = np.asarray(groups.row_pairs) < groups.rows.shape[0]
    want, bound = float64_product(x, weights, groups, False)
    other, _ = float64_product(x, dataclasses.replace(weights, dtype_name="float32"), groups, False)
    assert (np.abs(got - other)[real] > bound[real]).any()  # the float32 weights' result is out of bounds
    assert_matches(jnp.asarray(got), want, bound, "cpu handler vs float64")


def nan_codes(weights, rng, count=6):
    """``(weights, columns)``: FP8 weights with NaN codes (0x7F, 0xFF) at ``count`` random places of each
    expert, and the output columns (weight rows) of each expert they fall in."""
    codes = np.asarray(weights.codes).view(np.uint8).copy()
    experts, n, k = codes.shape
    columns = np.zeros((experts, n), bool)
    for e in range(experts):
        rows, cols = rng.integers(0, n, count), rng.integers(0, k, count)
        codes[e, rows, cols] = rng.choice([0x7F, 0xFF], count)
        columns[e, rows] = True
    return dataclasses.replace(weights, codes=jnp.asarray(codes.view(ml_dtypes.float8_e4m3fn))), columns


def assert_nan_columns(got, want, bound, groups, columns, what):
    """The outputs of a NaN code's weight row are NaN on each real row of its expert's tiles; every other one
    is finite and within the bound (padding rows 0)."""
    got = np.asarray(got, np.float64)
    real = np.asarray(groups.row_pairs) < groups.rows.shape[0]
    row_expert = np.repeat(np.asarray(groups.tile_expert), groups.block_rows)
    nan = real[:, None] & columns[np.maximum(row_expert, 0)] & (row_expert >= 0)[:, None]
    assert nan.any() and (~nan).any()
    np.testing.assert_array_equal(np.isnan(got), nan, err_msg=what)
    assert_matches(jnp.asarray(np.where(nan, 0, got)), np.where(nan, 0, want), np.where(nan, 0, bound), what)


def test_fp8_nan_codes_give_nan_products(fp8_cases):
    """An e4m3 NaN code is NaN (jnp's conversion, the policy of every platform): the CPU handler's and the
    twin's outputs of its weight row are NaN, the rest as float64."""
    x, weights, groups = fp8_cases["bfloat16", False, "e8m0"]
    weights, columns = nan_codes(weights, np.random.default_rng(7))
    want, bound = float64_product(x, weights, groups, False)
    x, weights = on_cpu(x, weights)
    assert_nan_columns(quant_gmm.quant_gmm(x, weights, groups), want, bound, groups, columns, "cpu handler")
    assert_nan_columns(twin(x, weights, groups, False), want, bound, groups, columns, "twin")


#: V4-Flash's FP8 linear layers (ModelConfig.deepseek_v4_flash): (name, out, in, groups)
V4_LINEARS = [
    ("q_a", 1024, 4096, None),
    ("kv", 512, 4096, None),
    ("q_b", 32768, 1024, None),
    ("o_a", 8192, 4096, 8),
    ("shared_down", 4096, 2048, None),
]


def linear_case(rng, out, width, groups, rows, block_rows=None):
    """``(x, weights, layout)``: a V4-Flash FP8 linear layer as the op takes it (:func:`linear.linear_op`),
    each group one expert on a tile of ``rows`` rows (``block_rows`` more: padding rows, NaN), every e4m3 code
    but NaN, a checkpoint's 128 x 128 blocks of e8m0 scales (exponents 117-125: weights of magnitude 2^-10 to
    1) and x of magnitude 1."""
    count = groups or 1
    codes = rng.choice(E4M3_NUMBERS, (count, out // count, width)).view(ml_dtypes.float8_e4m3fn)
    exponents = rng.integers(117, 126, (-(-out // 128), -(-width // 128))).astype(np.uint8)
    scales = quant.row_scales(exponents, out).reshape(count, out // count, -1)
    weights = QuantizedArray(jnp.asarray(codes), jnp.asarray(scales), FP8, "bfloat16")
    layout = linear.linear_layout(count, rows, block_rows=block_rows or rows)
    return layout_rows(rng, layout, width, np.ones(count), "bfloat16"), weights, layout


@pytest.mark.parametrize("rows", [8, 64])
def test_cpu_handler_at_v4_flash_linear_shapes(rows):
    """q_a (N 1024, K 4096) and kv (N 512) at 8 and 64 rows as one-tile layouts: CPU handler == twin ==
    float64."""
    rng = np.random.default_rng(rows)
    for name, out, width, groups in V4_LINEARS[:2]:
        x, weights, layout = linear_case(rng, out, width, groups, rows)
        assert_op_equals_twin_and_float64(*on_cpu(x, weights), layout, False, f"cpu handler, {name}")


def test_rows_of_no_pair_are_zero_and_limit_binds(cases):
    x, weights, groups = cases["float32", True]
    x, weights = on_cpu(x, weights)
    got = np.asarray(quant_gmm.quant_gmm(x, weights, groups, gated=True, limit=LIMIT))
    real = np.asarray(groups.row_pairs) < groups.rows.shape[0]
    assert np.isfinite(got).all() and (got[~real] == 0).all() and (got[real] != 0).any()
    unlimited = np.asarray(quant_gmm.quant_gmm(x, weights, groups, gated=True))
    assert np.abs(unlimited - got).max() > 1.0  # the products reach past the limit


def test_misuse_is_refused_naming_the_argument(cases, fp8_cases):
    x, weights, groups = cases["float32", False]
    with pytest.raises(TypeError, match=r"^weights"):
        quant_gmm.quant_gmm(x, quant.dequantize(weights), groups)
    with pytest.raises(TypeError, match=r"^weights: the op takes e8m0"):
        quant_gmm.quant_gmm(
            x, dataclasses.replace(weights, scales=quant.scale_values(weights.scales)), groups
        )
    with pytest.raises(ValueError, match=r"^x: expected shape"):
        quant_gmm.quant_gmm(x[:, :64], weights, groups)
    with pytest.raises(TypeError, match=r"^x: dtype"):
        quant_gmm.quant_gmm(x.astype(jnp.float16), weights, groups)
    with pytest.raises(ValueError, match=r"^limit"):
        quant_gmm.quant_gmm(x, weights, groups, gated=True, limit=0.0)
    x, weights, groups = fp8_cases["float32", False, "e8m0"]
    with pytest.raises(TypeError, match=r"^weights: the op takes e8m0 \(uint8\) scales or float32"):
        quant_gmm.quant_gmm(x, dataclasses.replace(weights, scales=weights.scales.astype(jnp.int32)), groups)
    narrow = jax.tree.map(lambda a: a[..., :8], weights)  # K 8: not whole 16-byte loads
    with pytest.raises(ValueError, match=r"^weights: K must be a multiple of 16 for fp8"):
        quant_gmm.quant_gmm(x[:, :8], narrow, groups)


def test_splits_fill_the_gpu_at_v4_flash_linear_shapes():
    """The CUDA kernel's split of K: none where the blocks fill the GPU (q_b, o_a, the MoE's experts at 8
    tokens), enough parts for the small layers (q_a, kv, the shared expert), a chunk of K for each warp a
    part."""

    def splits(out, width, tiles=1, gated=False, fmt=FP8):
        return quant_gmm.splits(fmt, out, width, tiles, gated)

    assert splits(32768, 1024) == 1 and splits(1024, 4096, tiles=8) == 1  # q_b, o_a
    # the MoE's experts at 8 tokens: gate/up (4096 x 4096) and down (4096 x 2048) on 51 tiles
    assert splits(4096, 4096, tiles=51, gated=True, fmt=FP4) == splits(4096, 2048, tiles=51, fmt=FP4) == 1
    assert splits(1024, 4096) == 8 and splits(512, 4096) == 8  # q_a, kv: 64 chunks of 64 bytes, 8 a part
    assert splits(2048, 4096) == 4 and splits(4096, 2048) == 2  # the shared expert's gate (up) and down
    assert splits(4096, 8192) == 2  # o_b
    assert splits(1024, 256) == 1  # 4 chunks: fewer than a block's warps


def test_gmm_takes_the_op_on_cuda_at_decode_sizes_only(cases, fp8_cases):
    _, weights, _ = cases["bfloat16", True]
    few = grouped_matmul.group_pairs(jnp.asarray([3, 9, 9, 20, 31, 0], jnp.int32), 32)  # 6 pairs, 32 experts
    x = jnp.zeros((few.num_rows, 128), jnp.bfloat16)
    assert quant_gmm.takes(x, weights, few)
    assert not quant_gmm.takes(x.astype(jnp.float32), weights, few)
    float_scales = dataclasses.replace(weights, scales=quant.scale_values(weights.scales))
    assert not quant_gmm.takes(x, float_scales, few)
    _, fp8_weights, _ = fp8_cases["bfloat16", True, "e8m0"]
    assert not quant_gmm.takes(jnp.zeros((few.num_rows, 272), jnp.bfloat16), fp8_weights, few)  # unmeasured
    assert quant_gmm.kernel_takes(jnp.bfloat16, fp8_weights)
    k = 2**19  # FP8: 2^15 16-byte loads a row; 2^17 rows make 2^32, past the kernel's 32-bit offsets

    def expert(n):
        codes = jax.ShapeDtypeStruct((1, n, k), jnp.float8_e4m3fn)
        return QuantizedArray(codes, jax.ShapeDtypeStruct((1, n, k // 128), jnp.uint8), FP8, "bfloat16")

    assert quant_gmm.kernel_takes(jnp.bfloat16, expert(2**17 - 1))
    assert not quant_gmm.kernel_takes(jnp.bfloat16, expert(2**17))
    most = grouped_matmul.group_pairs(jnp.arange(48, dtype=jnp.int32) % 32, 32)  # 48 pairs: 1.5 an expert
    assert quant_gmm.takes(jnp.zeros((most.num_rows, 128), jnp.bfloat16), weights, most)
    many = grouped_matmul.group_pairs(jnp.arange(49, dtype=jnp.int32) % 32, 32)  # 49: past 1.5 an expert
    assert not quant_gmm.takes(jnp.zeros((many.num_rows, 128), jnp.bfloat16), weights, many)
    large = grouped_matmul.group_pairs(jnp.zeros((8,), jnp.int32), 32, 64)
    assert not quant_gmm.takes(jnp.zeros((large.num_rows, 128), jnp.bfloat16), weights, large)
    if quant_gmm.TARGET not in ops.native_targets("cuda"):
        return
    call = jax.jit(lambda x, w: quant_gmm.gmm(x, w, few, gated=True, limit=LIMIT))
    lowered = call.trace(x, weights).lower(lowering_platforms=("cuda",)).as_text()
    assert quant_gmm.TARGET in lowered and "triton" not in lowered
    call = jax.jit(lambda x, w: quant_gmm.quant_gmm(x, w, few))
    lowered = call.trace(x.astype(jnp.float32), weights).lower(lowering_platforms=("cuda",)).as_text()
    assert quant_gmm.TARGET not in lowered  # float32 rows: the twin on CUDA
    x, weights, groups = fp8_cases["bfloat16", False, "float32"]
    call = jax.jit(lambda x, w: quant_gmm.quant_gmm(x, w, groups))
    assert quant_gmm.TARGET not in call.trace(x, weights).lower(lowering_platforms=("cuda",)).as_text()


def on_gpu(x, weights):
    """x and the weights on the GPU (the layout stays a closure's constants)."""
    return jax.device_put((x, weights), jax.devices("gpu")[0])


@pytest.mark.cuda
@pytest.mark.parametrize("gated", [False, True])
def test_cuda_kernel_equals_twin_and_float64(cases, gated):
    assert quant_gmm.TARGET in ops.native_targets("cuda")
    x, weights, groups = cases["bfloat16", gated]
    call = jax.jit(lambda x, w: quant_gmm.quant_gmm(x, w, groups, gated=gated, limit=LIMIT))
    x, weights = on_gpu(x, weights)
    got = assert_op_equals_twin_and_float64(x, weights, groups, gated, "cuda", call)
    np.testing.assert_array_equal(np.asarray(call(x, weights)), np.asarray(got))  # deterministic


@pytest.mark.cuda
@pytest.mark.parametrize("gated", [False, True])
def test_cuda_kernel_on_fp8_equals_twin_and_float64(fp8_cases, gated):
    """FP8 every code but NaN and every exponent, K 272 (a partial chunk and scale group), on the MoE's
    layout."""
    x, weights, groups = fp8_cases["bfloat16", gated, "e8m0"]
    call = jax.jit(lambda x, w: quant_gmm.quant_gmm(x, w, groups, gated=gated, limit=LIMIT))
    x, weights = on_gpu(x, weights)
    got = assert_op_equals_twin_and_float64(x, weights, groups, gated, "cuda", call)
    np.testing.assert_array_equal(np.asarray(call(x, weights)), np.asarray(got))  # deterministic


@pytest.mark.cuda
def test_cuda_fp8_nan_codes_give_nan_products(fp8_cases):
    x, weights, groups = fp8_cases["bfloat16", False, "e8m0"]
    weights, columns = nan_codes(weights, np.random.default_rng(7))
    want, bound = float64_product(x, weights, groups, False)
    got = quant_gmm.quant_gmm(*on_gpu(x, weights), groups)
    assert_nan_columns(got, want, bound, groups, columns, "cuda")


@pytest.mark.cuda
def test_operands_the_kernel_does_not_take_run_the_twin_on_gpu(cases, fp8_cases):
    """float32 rows (FP4 and FP8) and FP8's float32 scales in a bfloat16 model run the twin on the GPU."""
    for key, (x, weights, groups) in [
        (("float32", False), cases["float32", False]),
        (("float32", True, "e8m0"), fp8_cases["float32", True, "e8m0"]),
        (("bfloat16", True, "float32"), fp8_cases["bfloat16", True, "float32"]),
    ]:
        gated = key[1]
        want, bound = float64_product(x, weights, groups, gated)
        op = functools.partial(quant_gmm.quant_gmm, groups=groups, gated=gated, limit=LIMIT)
        call = jax.jit(op)
        x, weights = on_gpu(x, weights)
        assert quant_gmm.TARGET not in call.lower(x, weights).as_text(), key
        assert_matches(call(x, weights), want, bound, f"{key} on the GPU vs float64")


@pytest.mark.cuda
@pytest.mark.parametrize("gated", [False, True])
def test_cuda_kernel_at_v4_flash_widths(gated):
    """K 4096 (8 warps of four 128-column chunks), N 1032 (a partial last block of columns), 8 experts of up
    to 21 rows in tiles of 32 (passes of 16 rows, the MMA's 8 twice; 8 rows or fewer: once; a partial last
    pass)."""
    rng = np.random.default_rng(5)
    x, weights, groups = make_case(rng, 8, 1032, 4096, "bfloat16", [0, 1, 2, 3, 8, 9, 13, 21], block_rows=32)
    want, bound = float64_product(x, weights, groups, gated)
    call = jax.jit(lambda x, w: quant_gmm.quant_gmm(x, w, groups, gated=gated, limit=LIMIT))
    assert_matches(call(*on_gpu(x, weights)), want, bound, "cuda vs float64")


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [8, 64])
def test_cuda_kernel_at_v4_flash_linear_shapes(rows):
    """V4-Flash's FP8 linear layers as the op's one-tile layouts at 8 and 64 rows (passes of 16 rows), the
    small ones with K split (q_a, kv: 8 parts; shared down: 2), o_a's 8 groups, q_b's 1024 blocks; then kv
    on a tile of 16 more rows than it holds (padding rows NaN, never read) and gated (its rows as gate and
    up halves): kernel == twin == float64, bit-identical on a second run."""
    rng = np.random.default_rng(rows + 1)
    for name, out, width, groups in V4_LINEARS:
        x, weights, layout = linear_case(rng, out, width, groups, rows)
        call = jax.jit(lambda x, w, layout=layout: quant_gmm.quant_gmm(x, w, layout))
        x, weights = on_gpu(x, weights)
        got = assert_op_equals_twin_and_float64(x, weights, layout, False, f"cuda, {name}", call)
        np.testing.assert_array_equal(np.asarray(call(x, weights)), np.asarray(got))  # deterministic
    x, weights, layout = linear_case(rng, 512, 4096, None, rows, block_rows=rows + 16)
    assert quant_gmm.splits(FP8, 512, 4096, 1, True) > 1
    for gated in (False, True):
        call = jax.jit(lambda x, w, g=gated: quant_gmm.quant_gmm(x, w, layout, gated=g, limit=LIMIT))
        assert_op_equals_twin_and_float64(*on_gpu(x, weights), layout, gated, "cuda, kv padded", call)
