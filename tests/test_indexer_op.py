"""The lightning indexer's scores op (jax_oc128.indexer_op): native (CPU handler; CUDA kernel on a GPU) == jnp
twin == an independent float64 computation on random bfloat16 data, -inf exactly where a query does not see a
key (keys it does not see are NaN: a kernel that lets one reach a seen score fails), and its misuse errors.

Bounds (derived): every product of two bfloat16 values is exact in float32, so the only error is float32
summation, over dim products per head and then the heads' weighted relus (relu is 1-Lipschitz): at most
``(dim + heads + 2) u M`` with ``u = 2**-24`` and ``M = scale sum_h |w_h| sum_d |q_hd k_d|`` (any order of
summation). The CUDA kernel's tensor cores may truncate where they add instead of rounding (up to 2 u an add):
twice that, times 2 for margin."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_oc128 import indexer_op
from jax_oc128.indexer_op import indexer_scores, indexer_scores_reference

CPU = jax.devices("cpu")[0]  # the CPU handler's tests pin it (on a GPU machine the default is the kernel)
HEADS, DIM = 64, 128  # V4's index heads and index_head_dim
SCALE = DIM**-0.5
U = 2.0**-24


def case(seed, batch, tokens, count, heads=HEADS, dim=DIM):
    """Operands with limits 0, 1, a partial tile, every key and beyond E, negative, and random; keys past what
    any query of a row sees NaN; weights of both signs."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((batch, tokens, heads, dim)), jnp.bfloat16)
    keys = rng.standard_normal((batch, count, dim)).astype(np.float32)
    weights = rng.standard_normal((batch, tokens, heads)).astype(np.float32)
    limit = rng.integers(0, count + 1, (batch, tokens)).astype(np.int32)
    limit[:, :6] = [0, 1, count // 2 + 3, count, count + 5, -2][: min(6, tokens)]
    limit[-1] = np.minimum(limit[-1], count - 70)  # the last row: its last keys never seen
    for b in range(batch):
        keys[b, max(limit[b].max(), 0) :] = np.nan
    return q, jnp.asarray(keys, jnp.bfloat16), jnp.asarray(weights), jnp.asarray(limit)


def float64(q, keys, weights, limit, scale):
    """(scores, M): the scores in float64 (-inf where unseen; NaN keys read as 0 there) and the bound's M."""
    q, keys, weights = (np.asarray(x, np.float64) for x in (q, keys, weights))
    seen = np.arange(keys.shape[1]) < np.asarray(limit)[..., None]
    keys = np.nan_to_num(keys)
    dots, size = (
        np.matmul(f(q), np.swapaxes(f(keys), 1, 2)[:, None]) for f in (np.asarray, np.abs)
    )  # [b, l, h, e]
    score = np.einsum("blh,blhe->ble", weights, np.maximum(dots, 0.0)) * scale
    size = np.einsum("blh,blhe->ble", np.abs(weights), size)
    return np.where(seen, score, -np.inf), size * abs(scale)


def assert_within(got, want, bound, what):
    """-inf exactly where want is, finite elsewhere, and |got - want| <= bound there."""
    got = np.asarray(got, np.float64)
    unseen = np.isneginf(want)
    np.testing.assert_array_equal(np.isneginf(got), unseen, err_msg=f"{what}: -inf where unseen")
    assert np.isfinite(got[~unseen]).all(), what
    excess = np.abs(got[~unseen] - want[~unseen]) - bound[~unseen]
    assert excess.max() <= 0, f"{what}: exceeds the bound by {excess.max()}"


@pytest.fixture(scope="module")
def small_case():
    return case(0, 2, 40, 300)


def test_cpu_handler_equals_twin_and_float64(small_case):
    """The CPU handler and the twin (both float32 sums on the bfloat16 inputs) within float32 rounding of the
    float64 scores and of each other, -inf exactly where unseen; the handler is the lowered call."""
    assert indexer_op.TARGET in indexer_op.ops.native_targets("cpu")
    operands = jax.device_put(small_case, CPU)
    fn = jax.jit(indexer_scores, static_argnames="scale")
    assert indexer_op.TARGET in fn.lower(*operands, scale=SCALE).as_text()
    want, size = float64(*small_case, SCALE)
    bound = (DIM + HEADS + 2) * U * size
    native = np.asarray(fn(*operands, scale=SCALE))
    twin = np.asarray(jax.jit(indexer_scores_reference, static_argnames="scale")(*operands, scale=SCALE))
    assert_within(native, want, bound, "cpu vs float64")
    assert_within(twin, want, bound, "twin vs float64")
    assert_within(native, np.where(np.isneginf(want), -np.inf, twin), 2 * bound, "cpu vs twin")
    # the case's limits: none, all, past E, negative
    limit = np.asarray(small_case[3])
    assert (limit <= 0).any() and (limit >= 300).any() and ((limit > 0) & (limit < 300)).any()


# operands of a valid call: (dtype, shape) by name, in the op's order
VALID = {
    "q": ("bfloat16", (1, 4, 8, 16)),
    "keys": ("bfloat16", (1, 5, 16)),
    "weights": ("float32", (1, 4, 8)),
    "limit": ("int32", (1, 4)),
}


@pytest.mark.parametrize(
    "name, bad, match",
    [
        ("q", ("float32", (1, 4, 8, 16)), "q: dtype"),
        ("q", ("bfloat16", (4, 8, 16)), "q: expected rank 4"),
        ("keys", ("float32", (1, 5, 16)), "keys: dtype"),
        ("keys", ("bfloat16", (1, 5, 12)), "keys: expected"),
        ("weights", ("float32", (1, 4, 7)), "weights: expected"),
        ("weights", ("bfloat16", (1, 4, 8)), "weights: expected"),
        ("limit", ("float32", (1, 4)), "limit: expected"),
        ("limit", ("int32", (4,)), "limit: expected"),
    ],
)
def test_bad_operands_name_the_argument(name, bad, match):
    args = [jnp.zeros(shape, dtype) for dtype, shape in {**VALID, name: bad}.values()]
    with pytest.raises((TypeError, ValueError), match=match):
        indexer_scores(*args, scale=0.5)


def test_bad_scale_is_refused(small_case):
    with pytest.raises(TypeError, match="scale: must be a finite Python number"):
        indexer_scores(*small_case, scale=float("nan"))


@pytest.mark.cuda
def test_cuda_kernel_at_v4_shapes():
    """2 rows, L 512, E 4096 + 77 (a partial key tile), 64 heads of 128: within the bound of float64 (a query
    in 8) and of the twin (every query, on the GPU), -inf exactly where unseen (NaN keys past every limit)."""
    assert indexer_op.TARGET in indexer_op.ops.native_targets("cuda")
    gpu = jax.devices("gpu")[0]
    operands = case(1, 2, 512, 4096 + 77)
    on_gpu = jax.jit(indexer_scores, static_argnames="scale")
    device_operands = jax.device_put(operands, gpu)
    assert indexer_op.TARGET in on_gpu.lower(*device_operands, scale=SCALE).as_text()
    got = np.asarray(on_gpu(*device_operands, scale=SCALE), np.float64)
    some = slice(None, None, 8)
    subset = (operands[0][:, some], operands[1], operands[2][:, some], operands[3][:, some])
    want, size = float64(*subset, SCALE)
    bound = 4 * (DIM + HEADS + 2) * U * size
    assert_within(got[:, some], want, bound, "cuda vs float64")
    twin = jax.jit(indexer_scores_reference, static_argnames="scale")(*device_operands, scale=SCALE)
    # every query: within the sum of both bounds of the twin, M bounded by Cauchy-Schwarz (cheap)
    q, keys, weights = (np.asarray(x, np.float64) for x in operands[:3])
    norms = np.einsum("blh,blh->bl", np.abs(weights), np.linalg.norm(q, axis=-1))
    size = SCALE * norms[..., None] * np.linalg.norm(np.nan_to_num(keys), axis=-1)[:, None]
    want = np.where(np.isneginf(twin), -np.inf, np.asarray(twin, np.float64))
    assert_within(got, want, 5 * (DIM + HEADS + 2) * U * size, "cuda vs twin")


@pytest.mark.cuda
def test_other_shapes_run_the_twin_on_the_gpu():
    """dim 64 and 8 heads: the GPU runs the twin (the kernel takes dim 128, heads a multiple of 16), whose
    handler, called directly, refuses them naming q."""
    gpu = jax.devices("gpu")[0]
    operands = case(2, 1, 8, 100, heads=8, dim=64)  # (100 keys: the case's last row sees up to 30)
    device_operands = jax.device_put(operands, gpu)
    assert (
        indexer_op.TARGET
        not in jax.jit(indexer_scores, static_argnames="scale").lower(*device_operands, scale=SCALE).as_text()
    )
    want, size = float64(*operands, SCALE)
    got = indexer_scores(*device_operands, scale=SCALE)
    assert_within(got, want, (64 + 8 + 2) * U * size, "twin on the gpu vs float64")
    out = jax.ShapeDtypeStruct((1, 8, 100), jnp.float32)
    call = jax.ffi.ffi_call(indexer_op.TARGET, out)
    with pytest.raises(Exception, match="q: the CUDA kernel takes dim 128"):
        np.asarray(jax.jit(lambda *a: call(*a, scale=np.float32(SCALE)))(*device_operands))
