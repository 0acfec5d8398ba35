"""The context bound (ForwardBatch.context, nn.context_bucket): a forward bounded to ``context`` positions
reads no cache position at or past it (dense, paged), and gives the unbounded forward's logits bit for bit."""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from models import MODEL_CONFIG, MODEL_RUNTIME

from jax_oc128.controller import ForwardMode
from jax_oc128.nn import CSA, HCA, SLIDING, DeepseekV4Model, ForwardBatch, context_bucket, kv_cache
from jax_oc128.rules import BLOCK
from jax_oc128.tree import Tree

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))
import bench_context

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
    16384 as at 1024 (its shapes follow the context), and fewer than a quarter of the unbounded one's at
    16384 (the indexer's scores over every entry), dense and paged."""
    bounded = temp_bytes(16384, pages, CONTEXT)
    assert bounded == temp_bytes(1024, pages, CONTEXT)
    assert bounded < temp_bytes(16384, pages, None) // 4


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


def test_bench_context_runs(capsys):
    """bench/bench_context.py at tiny sizes: a table row per max_len, forward and bound, the bounded prefill
    chunk's temporaries below the unbounded one's at the larger max_len."""
    bench_context.main(
        ["--max-lens", "512", "2048", "--prompt", "20", "--chunk", "8", "--floor", "256", "--reps", "1"]
    )
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (f"| {n}", forward, bound)
        for n in ("512", "2048")
        for forward in ("prefill chunk", "decode")
        for bound in ("256", "None")
    ]
    temp = {(r[0], r[1], r[2]): float(r[4]) for r in rows}
    assert temp["| 2048", "prefill chunk", "256"] < temp["| 2048", "prefill chunk", "None"]
