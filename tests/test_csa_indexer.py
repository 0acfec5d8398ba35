"""The CSA lightning indexer streamed over its keys (nn.csa.CSACompressor.select): scores made KEY_CHUNK keys
at a time and merged into a running top k pick exactly the entries the whole ``[L, index_heads, E]``
computation picks (ties to the lower index, as ``lax.top_k``), with fewer visible entries than k and NaN
past what a query sees; and a CSA layer whose picks are made per query group in the loop
(nn.attend.by_query_blocks) equals the same layer computed at once (one chunk of every key, one group of
every query); at V4-Flash's shapes its prefill temporaries stay under the issue's bound."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import window_memory
from flax import nnx
from harness import run_layer_chunks
from models import MODEL_CONFIG, MODEL_RUNTIME

from jax_oc128.nn import CSA, DeepseekV4Attention, attend, csa, kv_cache
from jax_oc128.nn.functional import FULL
from jax_oc128.nn.linear import linear

CONFIG = dataclasses.replace(
    MODEL_CONFIG, index_n_heads=4, index_head_dim=16, index_topk=8, sliding_window=16
)
LAYER_CONFIG = CONFIG.attention(CSA, MODEL_RUNTIME)
CPU = jax.devices("cpu")[0]  # the kernel path's test pins it: its CPU handler (any dim)
# keys per chunk of the streamed indexer: the top k's size, so that every merge can replace every pick
SMALL_CHUNK = LAYER_CONFIG.indexer.topk


def index_queries(compressor, q_res, positions):
    """The indexer's queries ``[batch, L, index_heads, index_head_dim]`` float32, as ``select`` makes them."""
    c = compressor.indexer
    q = linear(q_res, compressor.indexer_q_b_proj[...]).reshape(*q_res.shape[:2], c.num_heads, c.head_dim)
    return compressor.rope.apply(q, positions)


def whole_select(compressor, q_res, positions, queries, keys):
    """The indexer's picks as one tensor (the computation before the streaming): every query's scores over
    every key, ``[batch, L, index_heads, E]``, masked by what it sees, then ``lax.top_k``: the picks ``[batch,
    L, k]`` (-1 where unseen) and their scores."""
    c, limit, nodes = compressor.indexer, queries.limit, queries.nodes
    q = index_queries(compressor, q_res, positions)
    keys = kv_cache.decode(keys)
    relu = jax.nn.relu(jnp.einsum("bthi,bei->bthe", q, keys, precision=FULL)) * c.head_dim**-0.5
    scores = jnp.einsum("bth,bthe->bte", queries.head_weights, relu, precision=FULL)
    stored = keys.shape[1] - (0 if nodes is None else nodes.shape[2])
    visible = jnp.arange(stored) < limit[..., None]
    if nodes is not None:
        visible = jnp.concatenate([visible, nodes], axis=2)
    top, picks = jax.lax.top_k(jnp.where(visible, scores, -jnp.inf), min(c.topk, keys.shape[1]))
    return jnp.where(top > -jnp.inf, picks, -1), top


def indexer_inputs(seed, tokens, stored, nodes):
    """Random inputs of :meth:`select` for 2 rows: row 0 sees from 2 entries (fewer than k) to all of its
    ``stored``, row 1 at most 5 of them; every key past what its row's queries see NaN. Ties: keys
    0-9 repeat as keys 20-29 (scores equal across chunks) and keys 10-14 are zero (score 0). The last 8 stored
    keys are larger (the last chunk, which ends at the last key, rescores some of them)."""
    rng = np.random.default_rng(seed)
    c = LAYER_CONFIG.indexer
    count = stored + nodes
    keys = rng.standard_normal((2, count, c.head_dim)).astype(np.float32)
    keys[:, 20:30] = keys[:, 0:10]
    keys[:, 10:15] = 0.0
    keys[:, stored - 8 : stored] *= 4  # the last stored keys picked first where seen
    limit = np.stack([np.linspace(2, stored, tokens).astype(np.int32), rng.integers(0, 6, tokens)])
    for row in range(2):
        keys[row, limit[row].max() : stored] = np.nan
    node_mask = None if nodes == 0 else rng.random((2, tokens, nodes)) < 0.5
    return (
        jnp.asarray(rng.standard_normal((2, tokens, LAYER_CONFIG.q_lora_rank)), jnp.float32),
        jnp.asarray(rng.integers(0, 4 * stored, (2, tokens)), jnp.int32),
        csa.IndexerQueries(
            # positive: relu's zeros tie at 0
            head_weights=jnp.asarray(rng.random((2, tokens, c.num_heads)), jnp.float32),
            limit=jnp.asarray(limit),
            nodes=None if node_mask is None else jnp.asarray(node_mask),
        ),
        jnp.asarray(keys),
    )


@pytest.mark.parametrize("stored, nodes", [(61, 0), (40, 3)], ids=["chain", "tree"])
def test_streamed_picks_equal_whole(stored, nodes, monkeypatch):
    """A chain's 61 entries (8 chunks of 8, the last padded) and a tree's 40 stored entries and 3 nodes'
    (nodes seen by a random mask), 12 queries: the picks (-1 past the visible ones) equal the whole
    tensor's."""
    layer = DeepseekV4Attention(LAYER_CONFIG, max_draft=MODEL_RUNTIME.max_draft, rngs=nnx.Rngs(1))
    compressor = layer.compressor
    inputs = indexer_inputs(5, 12, stored, nodes)
    monkeypatch.setattr(csa, "KEY_CHUNK", SMALL_CHUNK)
    monkeypatch.setattr(csa, "SCORE_BYTES", 0)  # KEY_CHUNK keys a chunk
    picks = jax.jit(compressor.select)(*inputs)
    want, top = jax.jit(whole_select, static_argnums=0)(compressor, *inputs)
    np.testing.assert_array_equal(picks, want)
    # the cases exist: fewer visible entries than k, and equal scores among a query's picks
    valid = np.asarray(picks) >= 0
    assert not valid.all() and valid.any()
    top = np.asarray(top)
    assert ((top[..., 1:] == top[..., :-1]) & valid[..., 1:]).any()


@pytest.mark.parametrize("stored, nodes", [(61, 0), (40, 3)], ids=["chain", "tree"])
def test_kernel_path_picks_equal_jnp_path(stored, nodes, monkeypatch):
    """``impl="kernel"`` (the indexer op, its CPU handler) rounds q and the keys to bfloat16: each product
    moves by at most 2**-8 (+ 2**-18) of its size, so a score by at most ``2**-8 M`` (relu is 1-Lipschitz;
    ``M = scale sum_h |w_h| sum_d |q_hd k_d|``), plus float32 sums: bound ``2**-7 M``. Where a query's k-th
    and (k+1)-th scores (float64) differ by more than both their bounds, or it sees at most k entries, its
    picks equal the jnp path's as a set; which picks are -1 equal everywhere; chunks of k keys (several
    merges)."""
    layer = DeepseekV4Attention(LAYER_CONFIG, max_draft=MODEL_RUNTIME.max_draft, rngs=nnx.Rngs(1))
    compressor = layer.compressor
    inputs = indexer_inputs(7, 32, stored, nodes)
    q_res, positions, queries, keys = inputs
    head_weights, limit, node_mask = queries
    monkeypatch.setattr(csa, "KEY_CHUNK", SMALL_CHUNK)
    monkeypatch.setattr(csa, "SCORE_BYTES", 0)  # KEY_CHUNK keys a chunk
    monkeypatch.setattr(csa, "KERNEL_KEY_CHUNK", SMALL_CHUNK)
    with jax.default_device(CPU):
        want = np.asarray(jax.jit(compressor.select)(*inputs))
        got = np.asarray(jax.jit(functools.partial(compressor.select, impl="kernel"))(*inputs))
    np.testing.assert_array_equal(got >= 0, want >= 0)
    # float64 scores, their bounds and what each query sees
    c = compressor.indexer
    q = np.asarray(index_queries(compressor, q_res, positions), np.float64)
    keys64, weights = np.nan_to_num(np.asarray(keys, np.float64)), np.asarray(head_weights, np.float64)
    dots = np.einsum("blhd,bed->blhe", q, keys64)
    scores = np.einsum("blh,blhe->ble", weights, np.maximum(dots, 0)) * c.head_dim**-0.5
    size = np.einsum("blh,blhe->ble", np.abs(weights), np.einsum("blhd,bed->blhe", np.abs(q), np.abs(keys64)))
    bound = 2.0**-7 * size * c.head_dim**-0.5
    seen = np.arange(stored + nodes) < np.minimum(np.asarray(limit), stored)[..., None]
    if nodes:
        seen[..., stored:] = np.asarray(node_mask)
    scores = np.where(seen, scores, -np.inf)
    order = np.argsort(-scores, axis=-1, kind="stable")
    kth, next_ = (
        np.take_along_axis(a, order[..., c.topk - 1 : c.topk + 1], axis=-1) for a in (scores, bound)
    )
    few = seen.sum(-1) <= c.topk
    with np.errstate(invalid="ignore"):  # -inf - -inf where few
        separated = few | (kth[..., 0] - kth[..., 1] > next_[..., 0] + next_[..., 1])
    got, want = (np.sort(x, axis=-1) for x in (got, want))
    np.testing.assert_array_equal(got[separated], want[separated])
    assert (separated & ~few).sum() >= 5, "too few queries with more than k entries and a gap to test"


def test_layer_in_the_loop_equals_at_once(monkeypatch):
    """Chunks of 300 (2 groups of 256 queries, the last padded) and 40 tokens from position 0, row 1 7 fewer,
    the cache's entries and indexer keys NaN until written: with the indexer in chunks of 8 keys the outputs
    and caches equal those of the whole computation (every key in one chunk, every query in one group), bit
    for bit, and are finite."""
    layer = DeepseekV4Attention(LAYER_CONFIG, max_draft=MODEL_RUNTIME.max_draft, rngs=nnx.Rngs(4))
    cache = layer.init_cache(2)
    nan = jax.tree.map(lambda a: jnp.full_like(a, jnp.nan), (cache.entries, cache.index_keys))
    caches = (dataclasses.replace(cache, entries=nan[0], index_keys=nan[1]), None)
    monkeypatch.setattr(attend, "LOOP_QUERIES", 256)
    monkeypatch.setattr(csa, "KEY_CHUNK", SMALL_CHUNK)
    monkeypatch.setattr(csa, "SCORE_BYTES", 0)  # KEY_CHUNK keys a chunk
    looped, looped_caches = run_layer_chunks(layer, (300, 40), caches)
    monkeypatch.setattr(attend, "LOOP_QUERIES", 1 << 30)
    monkeypatch.setattr(csa, "KEY_CHUNK", 1 << 30)
    whole, whole_caches = run_layer_chunks(layer, (300, 40), caches)
    for row in range(2):
        assert np.isfinite(looped[row]).all()
        np.testing.assert_array_equal(looped[row], whole[row], err_msg=f"row {row}")
    jax.tree.map(np.testing.assert_array_equal, looped_caches, whole_caches)


def test_indexer_memory_at_128k_context():
    """bench/window_memory.py's V4-Flash CSA layer (compiled from shapes): a prefill chunk of 8192 at a 128k
    context needs under 2 GiB of temporaries (the issue's bound; 128 GiB with the indexer's scores over every
    entry for the whole chunk at once)."""
    assert 0 < window_memory.temp_bytes(8192, "csa") < 2 * 2**30


# V4-Flash's indexer: 64 heads of 128 channels
V4_HEADS, V4_DIM = 64, 128


def v4_keys(seed, fmt):
    """Random V4-shaped queries ``[2, 3, 64, 128]`` float32 (rotated queries' scale, a few far smaller) and
    stored keys ``[2, 256, 128]`` of ``fmt`` (every value a bfloat16)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, 3, V4_HEADS, V4_DIM)) * np.exp2(rng.integers(-20, 4, (2, 3, V4_HEADS, 1)))
    keys = jnp.asarray(rng.standard_normal((2, 256, V4_DIM)), jnp.float32)
    return jnp.asarray(q, jnp.float32), kv_cache.encode(keys, kv_cache.zeros(keys.shape, fmt))


def test_split_bf16_is_exact():
    """hi + mid + lo (float64) equals q for float32 of every exponent from 2^-110 up, and zero."""
    rng = np.random.default_rng(3)
    q = (rng.standard_normal(4096) * np.exp2(rng.integers(-100, 100, 4096))).astype(np.float32)
    q[:8] = [0.0, -0.0, 2.0**-110, -(2.0**-110) * 1.75, 1.0 + 2.0**-23, -(2.0**100), 3.0, 1 / 3]
    parts = np.asarray(csa.split_bf16(jnp.asarray(q)).astype(jnp.float32), np.float64).reshape(3, -1)
    np.testing.assert_array_equal(parts.sum(0), q.astype(np.float64))


@pytest.mark.parametrize("fmt", ["bfloat16", "fp4", "fp8"])
def test_key_products_are_float32_exact(fmt):
    """V4's shapes, bfloat16 / FP4 / FP8 keys: the keys' values are bfloat16s (bf16_keys), and the three-part
    tensor-core product equals the float64 q·k within float32's accumulation bound, ``g_n Σ|q_i k_i|``
    (``n = 3 * 128`` exact products summed, ``g_n = n u / (1 - n u)``, ``u = 2^-24``); q rounded to bfloat16
    once (one part) breaks that bound."""
    q, stored = v4_keys(11, fmt)
    keys64 = np.asarray(kv_cache.decode(stored), np.float64)
    np.testing.assert_array_equal(np.asarray(csa.bf16_keys(stored), np.float64), keys64)
    q64 = np.asarray(q, np.float64)
    exact = np.einsum("bthi,bei->bthe", q64, keys64)
    n, u = 3 * V4_DIM, 2.0**-24
    bound = n * u / (1 - n * u) * np.einsum("bthi,bei->bthe", np.abs(q64), np.abs(keys64))
    got = np.asarray(jax.jit(csa.key_products)(q, stored), np.float64)
    assert (np.abs(got - exact) <= bound).all(), np.max(np.abs(got - exact) / bound)
    one_part = np.einsum("bthi,bei->bthe", np.asarray(q.astype(jnp.bfloat16), np.float64), keys64)
    assert (np.abs(one_part - exact) > bound).any()


def test_float32_keys_keep_the_float32_product():
    """float32 keys (not bfloat16 values) take the float32 product: equal to it bit for bit."""
    q, _ = v4_keys(12, "bfloat16")
    keys = jnp.asarray(np.random.default_rng(12).standard_normal((2, 256, V4_DIM)), jnp.float32)
    assert csa.bf16_keys(keys) is None
    want = jnp.einsum("bthi,bei->bthe", q, keys, precision=FULL)
    np.testing.assert_array_equal(jax.jit(csa.key_products)(q, keys), want)


def test_bf16_keys_pick_as_float32():
    """The streamed picks over bfloat16 keys (three-part products, chunks of k keys) equal the whole float32
    computation's over the same values (ties and all)."""
    layer = DeepseekV4Attention(LAYER_CONFIG, max_draft=MODEL_RUNTIME.max_draft, rngs=nnx.Rngs(1))
    *inputs, keys = indexer_inputs(5, 12, 61, 0)
    keys = keys.astype(jnp.bfloat16)
    picks = jax.jit(layer.compressor.select)(*inputs, keys)
    want, _ = jax.jit(whole_select, static_argnums=0)(layer.compressor, *inputs, keys)
    np.testing.assert_array_equal(picks, want)


@pytest.mark.parametrize(
    "batch, tokens, count, want",
    [
        (64, 1, 8192, 8192),
        (64, 2, 8192, 8192),
        (64, 5, 8192, 2731),
        (1, 512, 32768, 2048),
        (64, 128, 8192, 1024),
    ],
    ids=["decode", "mtp", "verify", "prefill", "prefill-64"],
)
def test_key_chunk_by_bytes(batch, tokens, count, want):
    """V4's 64 index heads: a decode at a 32k context (8192 keys) scores every key at once; more queries split
    the keys into equal chunks whose scores fit SCORE_BYTES; at least KEY_CHUNK keys a chunk."""
    chunk = csa.key_chunk(batch, tokens, V4_HEADS, count, csa.KEY_CHUNK)
    assert chunk == want
    assert (
        chunk == count or 4 * batch * tokens * V4_HEADS * chunk <= csa.SCORE_BYTES or chunk == csa.KEY_CHUNK
    )
