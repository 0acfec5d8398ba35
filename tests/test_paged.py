"""Paged caches (Engine(..., pages=P), jax_oc128.engine.pages): the host's page pool; a paged run gives the
dense run's greedy tokens (plain, chain, tree) with requests waiting for pages, no page a slot does not hold
written (every page poisoned with NaN); a request that can never fit refused before anything runs."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from harness import first_difference, poisoned_entries
from models import DECODE_CONFIG, DECODE_RUNTIME, make_model, prompts

from jax_oc128.controller import ONLINE
from jax_oc128.engine import Engine
from jax_oc128.engine.pages import PagePool
from jax_oc128.nn import CSA, HCA, SLIDING, kv_cache

# the engine tests' model with a CSA layer too: every kind of paged cache (HCA entries, CSA entries and
# indexer keys)
CONFIG = dataclasses.replace(DECODE_CONFIG, layer_types=(SLIDING, HCA, CSA), mlp_layer_types=None)


@pytest.fixture(scope="module")
def dense_engine():
    """The dense engine of :data:`CONFIG`'s model (float32 caches), 3 slots, K = 8."""
    return Engine(make_model(ONLINE, config=CONFIG), slots=3, steps_per_dispatch=8)


def test_page_pool_reserves_assigns_and_frees():
    """A request reserves its most tokens' pages, takes them lowest first as it grows (never past its
    reservation), gives them back when it ends; each device's slots draw from that device's pages."""
    pool = PagePool(pages=8, page_size=128, slots=4, max_pages=4, shards=2)  # slots 0, 1 | 2, 3
    assert pool.per_shard == 4 and [pool.shard(s) for s in range(4)] == [0, 0, 1, 1]
    pool.reserve(0, 300)  # 3 pages
    assert not pool.can_reserve(1, 200) and pool.can_reserve(1, 128) and pool.can_reserve(2, 512)
    assert pool.grow(0, 1) and not pool.grow(0, 100) and pool.table[0].tolist() == [0, -1, -1, -1]
    assert pool.grow(0, 10_000) and pool.table[0].tolist() == [0, 1, 2, -1]  # its reservation
    pool.reserve(2, 200)
    pool.grow(2, 200)
    assert pool.table[2].tolist() == [0, 1, -1, -1]  # device 1's own pages
    pool.reserve(1, 100)
    pool.grow(1, 100)
    assert pool.table[1].tolist() == [3, -1, -1, -1]
    assert pool.release(0) and pool.table[0].tolist() == [-1] * 4 and not pool.holds(0)
    pool.reserve(0, 128)
    pool.grow(0, 1)
    assert pool.table[0].tolist() == [0, -1, -1, -1]  # the lowest free page
    assert pool.handed_out == {(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)}
    with pytest.raises(RuntimeError, match="slot 0: reserved already"):
        pool.reserve(0, 1)


def test_paged_tokens_are_the_dense_tokens(dense_engine):
    """Greedy plain, chain (N = 4) and tree tokens of a paged engine (7 pages of 128 tokens for 3 slots,
    requests of 106 to 304 tokens) equal the dense engine's plain greedy tokens (speculative greedy is plain
    greedy on the dense layout: test_decode, test_tree_decode); with 300 new tokens (requests of 306 to 501
    tokens, 3 or 4 pages each) requests wait for pages, and the tokens are still the dense ones. Every page
    starts NaN: the pages a slot is given hold earlier contents that no query may read, and the pages no
    slot was given are untouched bit for bit after the runs (a write through a missing page, -1, would land
    in the last one)."""
    dense = dense_engine
    engine = Engine(dense.model, slots=3, steps_per_dispatch=8, pages=7, page_size=128)
    engine._idle_state = poisoned_entries(engine.init_state())  # generate's state: its first call runs on it
    expected = dense.generate(prompts(), 100).tokens
    handed_out = set()
    for options in (dict(), dict(num_tokens=4), dict(tree=(-1, 0, 0, 1))):
        assert engine.generate(prompts(), 100, **options).tokens == expected, options
        handed_out |= engine.page_pool.handed_out
        pool = engine.page_pool  # every page back once generate returns (before: the last reservations)
        assert not any(map(pool.holds, range(3))) and np.all(pool.table == -1)
        assert pool.can_reserve(0, 7 * 128)
    never = [page for page in range(7) if (0, page) not in handed_out]
    assert never and never[-1] == 6, handed_out
    for layer in engine._idle_state.cache.layers[1:]:
        for pool in jax.tree.leaves((layer.entries, layer.index_keys)):
            assert np.all(np.isnan(np.asarray(pool[np.asarray(never)], np.float32))), "a page was written"
    assert engine.generate(prompts(), 300).tokens == dense.generate(prompts(), 300).tokens
    assert engine.page_pool.waits > 0


def test_paged_fp8_fp4_caches(dense_engine, capsys):
    """DeepSeek's cache format (kv_cache_dtype "fp8_fp4": FP8 entries, FP4 indexer keys, in pages): greedy
    chain (N = 4) and tree tokens of a paged engine equal the dense engine's plain greedy tokens under the
    same caches (a verify reads the keys and entries as the decodes would); against float32 caches' tokens
    the tokens before the first difference are printed and asserted at the measured level."""
    model = make_model(
        ONLINE, config=CONFIG, runtime=dataclasses.replace(DECODE_RUNTIME, kv_cache_dtype="fp8_fp4")
    )
    expected = Engine(model, slots=3, steps_per_dispatch=8).generate(prompts(), 100).tokens
    engine = Engine(model, slots=3, steps_per_dispatch=8, pages=7, page_size=128)
    for options in (dict(num_tokens=4), dict(tree=(-1, 0, 0, 1))):
        assert engine.generate(prompts(), 100, **options).tokens == expected, options
    float32 = dense_engine.generate(prompts(), 100).tokens
    agree = [first_difference(x, y) for x, y in zip(expected, float32, strict=True)]
    with capsys.disabled():
        print(
            f"\nfp8_fp4 caches: tokens equal to float32 caches' before the first difference (of 100): {agree}"
        )
    # measured: a random tiny model with near-tied logits; its five requests part from float32 caches' at
    # tokens 85, 72, 19, 15 and 30 (e4m3 entries round to 2^-4 relative, e2m1 keys to 2^-2)
    assert agree == [85, 72, 19, 15, 30]


def test_paged_engine_errors():
    """A request that can never fit the pool is refused before anything runs, naming it; bad paging
    arguments and page tables name the argument."""
    model = make_model(ONLINE, config=CONFIG)
    engine = Engine(model, slots=2, pages=2, page_size=128)
    with pytest.raises(ValueError, match=r"prompts\[1\]: needs 3 pages of 128 tokens .* more than the 2"):
        engine.generate([[1] * 10, [1] * 200], 100)
    with pytest.raises(ValueError, match="page_size: must be a multiple of 128 dividing max_len"):
        Engine(model, slots=2, pages=4, page_size=192)
    with pytest.raises(ValueError, match=r"pages: must be in \[1, "):
        Engine(model, slots=2, pages=0)
    state = engine.init_state()
    with pytest.raises(ValueError, match="page_table: a page is held twice"):
        engine.set_page_table(state, np.array([[0] + [-1] * 7, [0] + [-1] * 7]))
    with pytest.raises(ValueError, match=r"page_table: entries must be -1 or pages in \[0, 2\)"):
        engine.set_page_table(state, np.full((2, 8), 2))
    with pytest.raises(ValueError, match="page_table: this engine's caches are dense"):
        dense = Engine(model, slots=2)
        dense.set_page_table(dense.init_state(), np.zeros((2, 8), int))


def test_paged_cache_shapes():
    """A paged cache's compressed layers hold pools of pages (``[pages, page_size // rate, ...]``, HCA rate
    128, CSA 4) and one page table ``[slots, max_len // page_size]``, every entry -1; sliding layers and the
    windows stay per slot."""
    model = make_model(ONLINE, config=CONFIG)
    cache = jax.eval_shape(lambda: model.target.init_cache(3, 5, 256))
    assert cache.page_table.shape == (3, DECODE_RUNTIME.max_len // 256)
    sliding, hca, csa = cache.layers
    assert sliding.entries.shape[:2] == (3, 0) and hca.window.shape[0] == csa.window.shape[0] == 3
    assert hca.entries.shape == (5, 2, CONFIG.head_dim)
    assert csa.entries.shape == (5, 64, CONFIG.head_dim) and csa.index_keys.shape == (
        5,
        64,
        CONFIG.index_head_dim,
    )
    assert kv_cache.slot_entries(csa.entries, cache.page_table) == DECODE_RUNTIME.max_len // 4
