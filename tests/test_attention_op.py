"""The attention op (jax_oc128.attention_op): native (CPU handler; CUDA kernel on a GPU) == jnp twin == an
independent float64 computation, on random data at V4-Flash's attention shapes (64 heads, head_dim 512, a
window of 128, HCA entries, top-512 CSA picks) with the keys laid out as the model lays them out: the ring by
index (-1 where out of the window), the chunk's own keys and the HCA entries by range, the CSA picks by index
(-1 padded). Every pool row no query names is NaN: a read of one fails the comparison."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from models import MODEL_CONFIG, MODEL_RUNTIME

from jax_oc128 import attention_op
from jax_oc128.attention_op import attention, attention_reference
from jax_oc128.controller import ForwardMode
from jax_oc128.engine import GPU_LOOP_OPTIONS
from jax_oc128.nn import (
    CSA,
    HCA,
    SLIDING,
    DeepseekV4Attention,
    ForwardBatch,
    RuntimeConfig,
    SpeculativeModel,
    attend,
    csa,
    kv_cache,
    prepare_forward,
)

HEADS, DIM, WINDOW, TOPK, RATE_HCA, RATE_CSA = 64, 512, 128, 512, 128, 4
SCALE = DIM**-0.5
# The CPU handler and the twin both compute in float32 over the same (possibly bf16-rounded) inputs: they
# differ in summation order and in exp's rounding, over at most ~800 keys.
FP32 = 2e-5
# The CUDA kernel rounds q and kv (float32 inputs) and the softmax weights to bfloat16 (8 significant bits,
# relative error <= 2**-9 each): a logit (~N(0, 1) here) moves by ~2**-9 * its size, a weight by ~2**-9
# relative, so an output (a weighted mean of values ~N(0, 1)) by a few 2**-9; 2**-5 leaves room for the
# tail of 64 heads x 512 channels.
CUDA = 2**-5
# the seam tests' layers: the forward tests' model with an indexer (CSA) and a window of 16
CPU = jax.devices("cpu")[0]  # the CPU handler's tests pin it (on a GPU machine the default is the kernel)
SEAM_CONFIG = dataclasses.replace(
    MODEL_CONFIG, index_n_heads=2, index_head_dim=16, index_topk=8, sliding_window=16
)


def v4_case(rng, starts, tokens, dtype, heads=HEADS, dim=DIM, topk=TOPK):
    """Operands of one call: rows b at positions ``starts[b] + t`` (t < tokens). Pool of row b: [ring of
    WINDOW rows (row r at position start - WINDOW + r) | the tokens' own keys | HCA entries | CSA entries],
    the rows past what row b's queries may see NaN, and ring row 0 (out of every query's window) NaN."""
    batch = len(starts)
    hca = max(s + tokens for s in starts) // RATE_HCA
    csa = max(s + tokens for s in starts) // RATE_CSA
    pool = WINDOW + tokens + hca + csa
    kv = rng.standard_normal((batch, pool, dim)).astype(np.float32)
    q = rng.standard_normal((batch, tokens, heads, dim)).astype(np.float32)
    index = np.full((batch, tokens, WINDOW + topk), -1, np.int32)
    ranges = np.zeros((batch, tokens, 2, 2), np.int32)
    for b, start in enumerate(starts):
        seen_hca, seen_csa = (start + tokens) // RATE_HCA, (start + tokens) // RATE_CSA
        kv[b, 0] = np.nan
        kv[b, WINDOW + tokens + seen_hca : WINDOW + tokens + hca] = np.nan
        kv[b, WINDOW + tokens + hca + seen_csa :] = np.nan
        for t in range(tokens):
            position = start + t
            ring = np.arange(WINDOW)
            index[b, t, :WINDOW] = np.where(start - WINDOW + ring > position - WINDOW, ring, -1)
            ranges[b, t, 0] = (WINDOW + max(t - WINDOW + 1, 0), WINDOW + t + 1)  # the chunk's, in the window
            ranges[b, t, 1] = (WINDOW + tokens, WINDOW + tokens + (position + 1) // RATE_HCA)
            closed = (position + 1) // RATE_CSA
            picks = rng.choice(closed, min(topk, closed), replace=False)
            index[b, t, WINDOW : WINDOW + len(picks)] = WINDOW + tokens + hca + picks
    sinks = rng.standard_normal(heads).astype(np.float32)
    q, kv = (jnp.asarray(x, dtype) for x in (q, kv))
    return q, kv, jnp.asarray(index), jnp.asarray(ranges), jnp.asarray(sinks)


def float64(q, kv, index, ranges, sinks, scale=SCALE):
    """The op in float64 numpy, one query at a time over its listed keys."""
    q, kv, index, ranges, sinks = (np.asarray(x, np.float64) for x in (q, kv, index, ranges, sinks))
    (batch, tokens), pool = q.shape[:2], kv.shape[1]
    out = np.zeros(q.shape)
    for b in range(batch):
        for t in range(tokens):
            rows = [int(i) for i in index[b, t] if 0 <= i < pool]
            for begin, end in ranges[b, t].astype(int):
                rows += range(max(begin, 0), min(end, pool))
            logits = q[b, t] @ kv[b, rows].T * scale  # [heads, keys]
            top = np.maximum(logits.max(axis=1, initial=-np.inf), sinks)
            weights = np.exp(logits - top[:, None])
            norm = weights.sum(axis=1) + np.exp(sinks - top)
            out[b, t] = weights @ kv[b, rows] / norm[:, None]
    return out


def assert_close(got, want, tol, what):
    got = np.asarray(got, np.float64)
    assert np.all(np.isfinite(got)), f"{what}: non-finite output (a NaN-poisoned row was read)"
    err = np.max(np.abs(got - want))
    assert err <= tol, f"{what}: max |error| {err:.3g} > {tol:.3g}"


@pytest.fixture(scope="module", params=[jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def decode_case(request):
    """Two rows at 32k and 5k tokens of context, 4 tokens each (a verify of a chain of 4)."""
    return v4_case(np.random.default_rng(0), (32_000, 5_003), 4, request.param)


def test_native_twin_and_float64_agree(decode_case):
    want = float64(*decode_case)
    case = jax.device_put(decode_case, CPU)
    native = jax.jit(attention, static_argnames="scale")(*case, scale=SCALE)
    twin = jax.jit(attention_reference, static_argnames="scale")(*case, scale=SCALE)
    assert native.dtype == jnp.float32 and native.shape == decode_case[0].shape
    assert_close(native, want, FP32, "native")
    assert_close(twin, want, FP32, "twin")


def test_a_chunk_of_small_heads():
    """A prefill-like chunk (16 tokens, causal ranges) of a smaller layer: 4 heads, head_dim 64."""
    case = v4_case(np.random.default_rng(1), (300, 0), 16, jnp.float32, heads=4, dim=64, topk=32)
    want = float64(*case)
    case = jax.device_put(case, CPU)
    assert_close(attention(*case, scale=SCALE), want, FP32, "native")
    assert_close(attention_reference(*case, scale=SCALE), want, FP32, "twin")


def small_case():
    """Query 0 names no key, queries 1 and 2 the same q and the same multiset of keys (row 1 twice)."""
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 3, 2, 32)).astype(np.float32)
    q[0, 2] = q[0, 1]
    q = jnp.asarray(q)
    kv = jnp.asarray(rng.standard_normal((1, 4, 32)), jnp.float32)
    index = jnp.asarray([[[-1, 7], [1, 1], [1, -5]]], jnp.int32)  # out of the pool: no key
    ranges = jnp.asarray([[[[3, 2]], [[0, 0]], [[1, 2]]]], jnp.int32)  # empty, empty, row 1 again
    sinks = jnp.asarray([0.5, -1.0], jnp.float32)
    return q, kv, index, ranges, sinks


def test_no_key_gives_zero_and_a_key_named_twice_counts_twice():
    case = small_case()
    for fn in (attention, attention_reference):
        out = np.asarray(fn(*jax.device_put(case, CPU), scale=0.5))
        np.testing.assert_array_equal(out[0, 0], 0.0)
        np.testing.assert_allclose(out[0, 1], out[0, 2], rtol=1e-6)
        np.testing.assert_allclose(out, float64(*case, 0.5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"q": jnp.zeros((1, 2, 2))}, "q: expected rank 4"),
        ({"q": jnp.zeros((1, 2, 2, 32), jnp.float16)}, "q: dtype"),
        ({"kv": jnp.zeros((1, 4, 32), jnp.bfloat16)}, "kv: dtype"),
        ({"kv": jnp.zeros((1, 4, 16))}, "kv: expected shape"),
        ({"index": jnp.zeros((1, 3, 1), jnp.int32)}, "index: expected shape"),
        ({"index": jnp.zeros((1, 2, 1), jnp.float32)}, "index: dtype"),
        ({"ranges": jnp.zeros((1, 2, 1, 3), jnp.int32)}, "ranges: expected shape"),
        ({"sinks": jnp.zeros(3)}, "sinks: expected"),
    ],
)
def test_bad_operands_are_refused_naming_them(change, match):
    args = {
        "q": jnp.zeros((1, 2, 2, 32)),
        "kv": jnp.zeros((1, 4, 32)),
        "index": jnp.zeros((1, 2, 1), jnp.int32),
        "ranges": jnp.zeros((1, 2, 0, 2), jnp.int32),
        "sinks": jnp.zeros(2),
    }
    with pytest.raises((ValueError, TypeError), match=match):
        attention(**{**args, **change}, scale=1.0)
    with pytest.raises(TypeError, match="scale"):
        attention(**args, scale=float("nan"))


@pytest.mark.cuda
def test_cuda_kernel_matches_twin_and_float64(decode_case):
    assert attention_op.TARGET in attention_op.ops.native_targets("cuda")
    gpu = jax.devices("gpu")[0]
    want = float64(*decode_case)
    on_gpu = jax.jit(attention, static_argnames="scale")
    operands = jax.device_put(decode_case, gpu)
    assert attention_op.TARGET in on_gpu.lower(*operands, scale=SCALE).as_text()
    got = on_gpu(*operands, scale=SCALE)
    assert_close(got, want, CUDA, "cuda vs float64")
    twin = attention_reference(*jax.device_put(decode_case, CPU), scale=SCALE)
    assert_close(got, np.asarray(twin, np.float64), CUDA, "cuda vs twin")


@pytest.mark.cuda
@pytest.mark.parametrize("parts", [1, 3, 16])
def test_cuda_kernel_split_over_keys(decode_case, parts, monkeypatch):
    """The kernel with each query's keys in 1 (one pass), 3 or 16 parts (flash-decoding: partial results
    combined with the sink) against float64, at V4-Flash's shapes and on the small case (parts without a
    key: query 0's, and most of the 16 parts of 2 keys)."""
    monkeypatch.setattr(attention_op, "splits", lambda *shape: parts)
    gpu = jax.devices("gpu")[0]
    got = attention(*jax.device_put(decode_case, gpu), scale=SCALE)
    assert_close(got, float64(*decode_case), CUDA, f"cuda in {parts} parts")
    small = small_case()
    got = np.asarray(attention(*jax.device_put(small, gpu), scale=0.5))
    np.testing.assert_array_equal(got[0, 0], 0.0)
    assert_close(got, float64(*small, 0.5), CUDA, f"cuda in {parts} parts, small case")


@pytest.mark.cuda
def test_cuda_kernel_in_the_decode_loops_cuda_graph(decode_case):
    """The op (split over keys: few queries) in a ``lax.while_loop`` compiled as ``Engine.decode`` compiles
    its loop (``GPU_LOOP_OPTIONS``: the loop one CUDA graph, the handler traced into it) equals the same
    steps called one by one, each step's q the last step's output."""
    gpu = jax.devices("gpu")[0]
    q, kv, index, ranges, sinks = jax.device_put(decode_case, gpu)
    assert attention_op.splits(q.shape[0] * q.shape[1], HEADS, index.shape[2] + 2 * kv.shape[1]) > 1

    def step(_, q):
        return attention(q, kv, index, ranges, sinks, scale=SCALE).astype(q.dtype)

    loop = jax.jit(lambda q: jax.lax.fori_loop(0, 3, step, q), compiler_options=GPU_LOOP_OPTIONS)
    one = jax.jit(functools.partial(step, 0))
    want = q
    for _ in range(3):
        want = one(want)
    for _ in range(2):  # the first run records the graph, the second replays it
        got = jax.block_until_ready(loop(q))
        assert_close(got, np.asarray(want, np.float64), 0.0, "the loop's graph vs step by step")


def test_splits_fill_the_gpu_only_where_queries_are_few():
    """One pass for a prefill's queries; for decode rows enough parts for about SPLIT_BLOCKS blocks, bounded
    by MAX_SPLITS and by the keys a query may have."""
    assert attention_op.splits(2048, HEADS, 640) == 1
    assert attention_op.splits(64, HEADS, 640) == 2
    assert attention_op.splits(8, HEADS, 9000) == attention_op.MAX_SPLITS
    assert attention_op.splits(8, 2 * HEADS, 9000) == 8  # two head tiles: twice the blocks
    assert attention_op.splits(1, HEADS, 3 * attention_op.SPLIT_KEYS + 1) == 3


def test_the_handler_refuses_a_workspace_of_no_split():
    """The workspace (the CUDA kernel's partial results) must be empty or a whole number of splits."""
    q = jnp.zeros((1, 2, 2, 32))
    operands = (q, jnp.zeros((1, 4, 32)), jnp.zeros((1, 2, 1), jnp.int32), jnp.zeros((1, 2, 0, 2), jnp.int32))
    results = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct((5,), jnp.float32))
    call = jax.ffi.ffi_call(attention_op.TARGET, results)
    with jax.default_device(CPU), pytest.raises(Exception, match="workspace: expected"):
        jax.block_until_ready(call(*operands, jnp.zeros(2), scale=np.float32(1.0)))


@pytest.mark.cuda
@pytest.mark.parametrize("dim", [32, 64, 128, 256])
def test_cuda_kernel_other_head_dims(dim):
    """The kernel's other head dims, 4 heads (one block of 64 rows mostly padding), a 40-token chunk."""
    case = v4_case(np.random.default_rng(dim), (1000, 37), 40, jnp.float32, heads=4, dim=dim, topk=64)
    got = attention(*jax.device_put(case, jax.devices("gpu")[0]), scale=dim**-0.5)
    assert_close(got, float64(*case, scale=dim**-0.5), CUDA, f"cuda head_dim {dim}")


# ---------------------------------------------------------------------------------------------------------
# The seam (nn.attend): a layer's attention by the op equals the jnp path's


def layer_outputs(layer, chunks):
    """A layer's outputs over chunks of random inputs from position 0, row 1 3 tokens shorter per chunk: the
    valid ones of each row concatenated."""
    graphdef, params = nnx.split(layer)

    @jax.jit
    def step(caches, x, first, lengths):
        positions = first[:, None] + jnp.arange(x.shape[1], dtype=jnp.int32)
        fb = ForwardBatch.create(positions, lengths=lengths, mode=ForwardMode.EXTEND)
        y, cache, compressed = nnx.merge(graphdef, params)(x, caches[0], prepare_forward(caches[1], fb), fb)
        return y, (cache, compressed)

    rng = np.random.default_rng(5)
    caches, rows, first = (layer.init_cache(2), layer.init_compressed(2)), [[], []], np.zeros(2, np.int32)
    for tokens in chunks:
        x = jnp.asarray(rng.standard_normal((2, tokens, SEAM_CONFIG.hidden_size)), jnp.float32)
        lengths = np.asarray([tokens, max(tokens - 3, 1)], np.int32)
        y, caches = step(caches, x, jnp.asarray(first), jnp.asarray(lengths))
        for row in range(2):
            rows[row].append(np.asarray(y[row, : lengths[row]]))
        first += lengths
    return [np.concatenate(row) for row in rows]


@pytest.mark.parametrize("layer_type", [SLIDING, HCA, CSA])
def test_layer_with_the_op_equals_the_jnp_path(layer_type, monkeypatch):
    """Chunks of 140 (a banded window, its two blocks in a loop) and 1 (decode) tokens: the outputs by the op
    (its CPU handler) equal the jnp path's within float32 rounding. The CSA indexer stays on its jnp path here
    (its kernel path rounds to bfloat16, which moves near-tied picks: test_csa_indexer tests it)."""
    monkeypatch.setattr(attend, "LOOP_QUERIES", 128)
    select = csa.CSACompressor.select
    monkeypatch.setattr(
        csa.CSACompressor, "select", lambda self, *args, impl: select(self, *args, impl="jnp")
    )
    outputs = {}
    for impl in ("jnp", "kernel"):
        config = SEAM_CONFIG.attention(layer_type)
        with jax.default_device(CPU):
            layer = DeepseekV4Attention(
                config, max_draft=MODEL_RUNTIME.max_draft, attention_impl=impl, rngs=nnx.Rngs(6)
            )
            outputs[impl] = layer_outputs(layer, (140, 1))
    for row in range(2):
        assert np.isfinite(outputs["kernel"][row]).all()
        np.testing.assert_allclose(outputs["kernel"][row], outputs["jnp"][row], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["float32", "fp8"])
def test_csa_picks_by_index_equal_picks_gathered(fmt):
    """A CSA layer's picks on the kernel path: the pool holding the entries with the picks as indices (a
    prefill's form) and the pool holding each query's gathered picks (a decode's) give the same outputs bit
    for bit, within float32 rounding of the jnp path's; the entries never picked (and a pick of -1's row)
    NaN-poisoned, the outputs finite. Stored entries float32 or FP8 (decoded once for the pool)."""
    rng = np.random.default_rng(11)
    batch, tokens, heads, dim, width, count, k = 2, 6, 2, 64, 8, 20, 5
    q = jnp.asarray(rng.standard_normal((batch, tokens, heads, dim)), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((batch, 1, width, dim)), jnp.float32)
    visible = jnp.asarray(np.tril(np.ones((8, width), bool))[None, None].repeat(batch, 0))
    picks = np.stack([rng.permutation(count - 4)[:k] for _ in range(batch * tokens)])
    picks = picks.reshape(batch, tokens, k)
    picks[0, 2, 3:] = -1  # fewer visible entries than k
    values = rng.standard_normal((batch, count, dim)).astype(np.float32)
    values[:, count - 4 :] = np.nan  # never picked
    stored = kv_cache.encode(jnp.asarray(values), kv_cache.zeros((batch, count, dim), fmt, rope_dim=16))
    entries = kv_cache.SlotEntries(stored, None, None, count)
    sinks = jnp.asarray(rng.standard_normal(heads), jnp.float32)
    picks = jnp.asarray(picks, jnp.int32)
    with jax.default_device(CPU):
        by_index = attend.attend(
            q, keys, visible, entries, None, sinks, 0.125, impl="kernel", entries_prefix=True, picks=picks
        )
        own_rows = attend.gather(entries, picks), picks >= 0
        gathered = attend._kernel(q, keys, visible, *own_rows, sinks, 0.125, True)
        jnp_path = attend.attend(
            q, keys, visible, entries, None, sinks, 0.125, impl="jnp", entries_prefix=True, picks=picks
        )
    assert tokens * k > count  # attend's own choice for these shapes is the index form
    assert np.isfinite(by_index).all()
    np.testing.assert_array_equal(by_index, gathered)
    np.testing.assert_allclose(by_index, jnp_path, rtol=1e-5, atol=1e-5)


def test_the_setting_is_checked_and_resolved():
    """The setting is one of jnp | kernel | auto, named when not, the model's layers take the runtime's
    (default jnp), and auto resolves to the kernel only on a GPU with the CUDA module built."""
    with pytest.raises(ValueError, match="attention_impl"):
        DeepseekV4Attention(SEAM_CONFIG.attention(SLIDING), attention_impl="fast", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="attention_impl"):
        RuntimeConfig(attention_impl="fast")
    assert RuntimeConfig().attention_impl == "jnp"
    runtime = dataclasses.replace(MODEL_RUNTIME, attention_impl="kernel")
    model = nnx.eval_shape(lambda: SpeculativeModel(SEAM_CONFIG, runtime, rngs=nnx.Rngs(0)))
    assert {block.attn.attention_impl for block in model.target.blocks} == {"kernel"}
    gpu = jax.default_backend() == "gpu" and attention_op.TARGET in attention_op.ops.native_targets("cuda")
    assert attend.resolve("auto") == ("kernel" if gpu else "jnp")
