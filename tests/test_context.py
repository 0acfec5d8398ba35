"""The context bound (ForwardBatch.context, nn.context_bucket): a forward bounded to ``context`` positions
reads no cache position at or past it (dense, paged), and gives the unbounded forward's logits bit for bit;
the engine bounds every forward by the bucket of what its rows may reach (Engine(..., context_floor=)),
giving the unbounded engine's tokens, its compiled steps' temporaries following the bucket."""

from __future__ import annotations

import dataclasses
import functools

import bench_context
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from harness import poisoned_entries
from models import MODEL_CONFIG, MODEL_RUNTIME

from jax_oc128.controller import ForwardMode
from jax_oc128.engine import Engine, arguments
from jax_oc128.nn import (
    CSA,
    HCA,
    SLIDING,
    DeepseekV4Model,
    ForwardBatch,
    SpeculativeModel,
    context_bucket,
    csa,
    kv_cache,
)
from jax_oc128.rules import BLOCK
from jax_oc128.tree import Tree

CONFIG = dataclasses.replace(
    MODEL_CONFIG,
    layer_types=(SLIDING, HCA, CSA),
    index_n_heads=2,
    index_head_dim=32,
    index_topk=4,
)
RUNTIME = dataclasses.replace(MODEL_RUNTIME, max_len=1024)
CONTEXT, PAGE = 256, 128
# the pages of each slot (the page table's row): a slot owns a page past the context (4, 5); 6, 7 are no one's
TABLE = [[0, 2, 4, -1, -1, -1, -1, -1], [1, 3, 5, -1, -1, -1, -1, -1]]
POOL = 8


def poison(cache, paged: bool):
    """``cache`` with every entry and indexer key at or past :data:`CONTEXT` NaN (paged: every page the
    slots hold past it, and the pages no slot holds) in their float leaves."""

    def nan(leaf):
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf
        if paged:
            return leaf.at[jnp.asarray([4, 5, 6, 7])].set(jnp.nan)
        rate = CONTEXT * leaf.shape[1] // RUNTIME.max_len  # entries of CONTEXT positions
        return leaf.at[:, rate:].set(jnp.nan)

    layers = tuple(
        dataclasses.replace(
            layer, entries=jax.tree.map(nan, layer.entries), index_keys=jax.tree.map(nan, layer.index_keys)
        )
        for layer in cache.layers
    )
    return dataclasses.replace(cache, layers=layers)


def forwards(model):
    """The forwards of :func:`test_bounded_forward_is_the_unbounded_one`, jitted: ``forward(cache, tokens,
    positions, lengths, mode, tree, context)``."""
    graphdef, params = nnx.split(model)

    @functools.partial(jax.jit, static_argnames=("mode", "tree", "context"))
    def forward(cache, tokens, positions, lengths, mode, tree=None, context=None):
        return nnx.merge(graphdef, params)(
            tokens, positions, cache, lengths=lengths, mode=mode, tree=tree, context=context
        )

    return forward


def steps():
    """``(tokens, first positions, lengths, mode, tree)`` of two rows: a prefill in two chunks, a decode, a
    chain verify (then commit 2 and 4 tokens), a tree verify (then keep nodes 2 and 3); the rows reach
    positions 208 and 160 of the 256 of :data:`CONTEXT`."""
    rng = np.random.default_rng(0)

    def tokens(t):
        return jnp.asarray(rng.integers(0, CONFIG.vocab_size, (2, t)), jnp.int32)

    return [
        (tokens(130), (0, 0), (130, 100), ForwardMode.EXTEND, None),
        (tokens(70), (130, 100), (70, 50), ForwardMode.EXTEND, None),
        (tokens(1), (200, 150), (1, 1), ForwardMode.DECODE, None),
        (tokens(4), (201, 151), (4, 4), ForwardMode.TARGET_VERIFY, None),
        (tokens(4), (203, 155), (4, 4), ForwardMode.TARGET_VERIFY, Tree((-1, 0, 1, 0))),
    ]


@pytest.mark.parametrize(
    ("paged", "kv_cache_dtype"),
    [(False, "auto"), (True, "auto"), (True, "fp8_fp4")],
    ids=["dense", "paged", "fp8"],
)
def test_bounded_forward_is_the_unbounded_one(paged, kv_cache_dtype):
    """Prefill (two chunks), decode, chain verify and tree verify of sliding, HCA and CSA layers with
    ``context=256``, every cache position past it NaN (paged: the pages past it and the pages no slot
    holds), give the logits of the same forwards without a bound on clean caches bit for bit, finite; the
    bounded program's temporaries are smaller."""
    runtime = dataclasses.replace(RUNTIME, kv_cache_dtype=kv_cache_dtype)
    model = DeepseekV4Model(CONFIG, runtime, rngs=nnx.Rngs(2))
    forward = forwards(model)
    if paged:
        clean = model.init_cache(2, pages=POOL, page_size=PAGE)
        clean = dataclasses.replace(clean, page_table=jnp.asarray(TABLE, jnp.int32))
    else:
        clean = model.init_cache(2)
    bounded = poison(clean, paged)
    for tokens, first, lengths, mode, tree in steps():
        t = tokens.shape[1]
        positions = jnp.asarray(first, jnp.int32)[:, None] + (
            jnp.arange(t) if tree is None else jnp.asarray(tree.depths)
        )
        args = (tokens, positions, jnp.asarray(lengths, jnp.int32), mode, tree)
        want, _, clean = forward(clean, *args)
        got, _, bounded = forward(bounded, *args, context=CONTEXT)
        for row, n in enumerate(lengths):
            assert np.isfinite(np.asarray(got[row, :n])).all(), (mode, row)
            np.testing.assert_array_equal(got[row, :n], want[row, :n], err_msg=f"{mode} row {row}")
        if mode is ForwardMode.TARGET_VERIFY and tree is None:
            seq_lens, accept = jnp.asarray(first, jnp.int32), jnp.asarray([2, 4], jnp.int32)
            clean, bounded = (model.commit(c, seq_lens, accept) for c in (clean, bounded))
        if tree is not None:
            nodes = jnp.asarray([2, 3], jnp.int32)
            first = jnp.asarray(first, jnp.int32)
            clean, bounded = (model.keep_path(c, tree, first, nodes) for c in (clean, bounded))


def temp_bytes(max_len: int, pages, context) -> int:
    """Temporary bytes of the compiled prefill chunk (8 tokens, 2 rows) of :data:`CONFIG` at ``max_len``
    (paged: ``pages`` pages), bounded by ``context``."""
    model = DeepseekV4Model(CONFIG, dataclasses.replace(RUNTIME, max_len=max_len), rngs=nnx.Rngs(2))
    cache = model.init_cache(2, pages=pages, page_size=PAGE)
    tokens = jnp.zeros((2, 8), jnp.int32)
    args = (cache, tokens, tokens + jnp.arange(8), jnp.full(2, 8, jnp.int32), ForwardMode.EXTEND)
    return forwards(model).lower(*args, context=context).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("pages", [None, POOL], ids=["dense", "paged"])
def test_bounded_reads_follow_the_context(pages):
    """A prefill chunk's compiled program bounded to 256 positions needs the same temporary bytes at max_len
    65536 as at 1024 (its shapes follow the context), and fewer than half of the unbounded one's at 65536
    (the indexer's keys of every entry, dense and paged; 6.8x and 34x measured). At 16384 the unbounded
    program's every-entry buffers are still near the bounded one's other temporaries (1.8x dense)."""
    bounded = temp_bytes(65536, pages, CONTEXT)
    assert bounded == temp_bytes(1024, pages, CONTEXT)
    assert bounded < temp_bytes(65536, pages, None) // 2


def test_context_bucket():
    """Powers of two from the floor, capped at max_len; a context past max_len refused, naming it."""
    assert [context_bucket(n, 4096) for n in (1, 256, 257, 1000, 2049, 4096)] == [
        256,
        256,
        512,
        1024,
        4096,
        4096,
    ]
    assert context_bucket(300, 1000) == 512 and context_bucket(900, 1000) == 1000
    assert context_bucket(1, 1 << 20, floor=384) == 384 and context_bucket(800, 1 << 20, floor=384) == 1536
    with pytest.raises(ValueError, match="exceed max_len 1024"):
        context_bucket(1025, 1024)
    with pytest.raises(ValueError, match="floor: a positive multiple of 128"):
        context_bucket(10, 1024, floor=100)


def test_context_errors():
    """A context that is not a positive int, or past the model's max_len, is refused naming it."""
    positions = jnp.zeros((1, 1), jnp.int32)
    for bad, error in ((0, ValueError), (-256, ValueError), (256.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="context: None or a positive int"):
            ForwardBatch.create(positions, context=bad)
    model = DeepseekV4Model(CONFIG, RUNTIME, rngs=nnx.Rngs(2))
    with pytest.raises(ValueError, match="context: 2048 exceeds the model's max_len 1024"):
        model(positions, positions, model.init_cache(1), context=2048)


def test_read_entries_and_slot_view():
    """``read_entries``: context // rate entries, at most those stored; ``slot_view`` of a count reads the
    first count entries, dense or through the page table's first columns (zeros for -1)."""
    fb = ForwardBatch.create(jnp.zeros((1, 1), jnp.int32), context=300)
    assert fb.read_entries(256, 4) == 75 and fb.read_entries(8, BLOCK) == 2 and fb.read_entries(50, 4) == 50
    assert ForwardBatch.create(jnp.zeros((1, 1), jnp.int32)).read_entries(256, 4) == 256
    pool = jnp.arange(4 * 3, dtype=jnp.float32).reshape(4, 3, 1)  # 4 pages of 3 entries
    table = jnp.asarray([[2, -1, 0, 1], [3, 1, -1, -1]], jnp.int32)
    view = kv_cache.slot_view(pool, table, 5)[..., 0]
    np.testing.assert_array_equal(view, [[6, 7, 8, 0, 0], [9, 10, 11, 3, 4]])
    np.testing.assert_array_equal(kv_cache.slot_view(pool, None, 2), pool[:, :2])
    np.testing.assert_array_equal(kv_cache.slot_view(pool, table)[:, :5, 0], view)


def test_slot_entries_are_read_where_stored():
    """``SlotEntries.take``: a slot's stored entry i through the page table (or the dense rows), then a tree's
    nodes, the same values as its ``view`` (``slot_view`` of ``count``, then the nodes) at those indices."""
    pool = jnp.arange(4 * 3, dtype=jnp.float32).reshape(4, 3, 1)  # 4 pages of 3 entries
    table = jnp.asarray([[2, 0, -1, -1], [3, 1, -1, -1]], jnp.int32)
    nodes = jnp.asarray([[[100], [101]], [[200], [201]]], jnp.float32)
    index = jnp.asarray([[0, 4, 5, 6, 2], [3, 6, 5, 1, 4]], jnp.int32)
    expected = [[6, 1, 100, 101, 8], [3, 201, 200, 10, 4]]
    dense = kv_cache.slot_view(pool, table, 5)
    for stored, page_table in ((pool, table), (dense, None)):
        entries = kv_cache.SlotEntries(stored, page_table, nodes, 5)
        assert entries.rows == 7
        np.testing.assert_array_equal(entries.take(index)[..., 0], expected)
        np.testing.assert_array_equal(entries.view()[jnp.arange(2)[:, None], index][..., 0], expected)


def test_bench_context_runs(capsys):
    """bench/bench_context.py at tiny sizes: a table row per max_len, forward and bound, the bounded prefill
    chunk's temporaries below the unbounded one's at the larger max_len (65536: at 2048 the unbounded
    chunk's every-entry buffers fit under its other temporaries)."""
    bench_context.main(
        ["--max-lens", "512", "65536", "--prompt", "20", "--chunk", "8", "--floor", "256", "--reps", "1"]
    )
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (f"| {n}", forward, bound)
        for n in ("512", "65536")
        for forward in ("prefill chunk", "decode")
        for bound in ("256", "None")
    ]
    temp = {(r[0], r[1], r[2]): float(r[4]) for r in rows}
    assert temp["| 65536", "prefill chunk", "256"] < temp["| 65536", "prefill chunk", "None"]


# the engine's runs: 3 requests over 2 slots (one waits), crossing the buckets of 128 and 256 positions in
# the chunked prefill (the longest prompt's chunks end at 64 .. 256) and in the decode (requests of 70 to 190
# tokens, K x N positions ahead)
ENGINE_PROMPTS, ENGINE_NEW = (150, 30, 100), 40


@pytest.fixture(scope="module")
def speculative_model():
    """A :class:`SpeculativeModel` of :data:`CONFIG` (sliding, HCA, CSA) drafting up to 8 nodes."""
    return SpeculativeModel(CONFIG, dataclasses.replace(RUNTIME, max_draft=8), rngs=nnx.Rngs(3))


def engine_prompts():
    rng = np.random.default_rng(4)
    return [list(rng.integers(0, CONFIG.vocab_size, n)) for n in ENGINE_PROMPTS]


def engine(model, **options) -> Engine:
    """An engine of 2 slots, K = 4, the prefill in chunks of 64 (``options``: more of Engine's)."""
    return Engine(model, 2, steps_per_dispatch=4, prefill_chunk=64, **options)


@pytest.fixture(scope="module")
def unbounded_tokens(speculative_model):
    """The plain greedy tokens of the engine without a bound (``context_floor=None``)."""
    return engine(speculative_model, context_floor=None).generate(engine_prompts(), ENGINE_NEW).tokens


@pytest.mark.parametrize(
    ("pages", "speculation", "buckets"),
    [
        (None, [{}, dict(tree=(-1, 0, 0, 1, 1, 2, 3, 4))], {128, 256}),
        (6, [dict(num_tokens=2), dict(num_tokens=4)], {256}),
    ],
    ids=["dense-plain-tree8", "paged-chain2-chain4"],
)
def test_engine_tokens_are_the_unbounded_ones(
    speculative_model, unbounded_tokens, pages, speculation, buckets
):
    """Greedy plain and tree (8 nodes) tokens of a dense engine, chain (N = 2, 4) tokens of a paged one (every
    page NaN at first, as in test_paged), bounding every forward by buckets from 128, are the plain greedy
    tokens of the engine without a bound; the decode dispatches met the ``buckets`` expected (the chains' rows
    pass 128 positions while the longest request runs, and an ended slot keeps its most), never max_len's."""
    bounded = engine(speculative_model, context_floor=128, pages=pages, page_size=128)
    if pages is not None:
        bounded._idle_state = poisoned_entries(bounded.init_state())  # generate's state
    seen = []
    unspied = bounded.bound
    bounded.bound = lambda longest: seen.append(unspied(longest)) or seen[-1]
    for options in speculation:
        assert bounded.generate(engine_prompts(), ENGINE_NEW, **options).tokens == unbounded_tokens, options
    assert set(seen) == buckets, seen


def test_engine_decode_cost_follows_the_bucket(monkeypatch):
    """The engine's compiled decode dispatch (plain, K = 1) at max_len 65536 bounded to the bucket of 256
    positions: fewer temporary bytes and a third of the FLOPs of the same unbounded (the indexer's scores
    over every CSA entry; at 16384 they fit under the step's other temporaries), the same argument bytes
    (the decode state). The indexer scores its keys in one chunk: XLA's cost analysis counts a loop's body
    once, not once per chunk."""
    monkeypatch.setattr(csa, "KEY_CHUNK", 1 << 30)
    model = SpeculativeModel(CONFIG, dataclasses.replace(RUNTIME, max_len=65536), rngs=nnx.Rngs(3))
    bounded = Engine(model, 2, steps_per_dispatch=1)
    state, stops = bounded.init_state(), arguments.stop_array(())

    def compiled(context):
        return bounded._decode.lower(
            bounded.params, state, stops, np.bool_(False), 1, None, context
        ).compile()

    small, full = compiled(256), compiled(None)
    memory = small.memory_analysis(), full.memory_analysis()
    assert memory[0].temp_size_in_bytes < memory[1].temp_size_in_bytes, memory
    assert memory[0].argument_size_in_bytes == memory[1].argument_size_in_bytes
    costs = [c.cost_analysis() for c in (small, full)]
    flops = [(cost[0] if isinstance(cost, list) else cost)["flops"] for cost in costs]
    assert flops[0] < flops[1] / 3, flops
