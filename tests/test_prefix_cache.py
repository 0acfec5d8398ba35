"""Prefix caching (RequestScheduler(..., prefix_cache=N), jax_oc128.engine.prefix_cache) on the online C128
state: requests sharing a long system prompt (three pages of 128 tokens) give the tokens they give without
the cache (greedy plain, chain N = 2 and a draft tree), every page NaN-poisoned at the start, the cached
pages never rewritten, and with cached pages evicted under a small pool; every page back (free or cached,
nothing pinned) when all end; the hit tokens reported per request and in total; the page pool's sharing,
adoption and eviction; bad settings refused."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from harness import poisoned_entries
from models import DECODE_CONFIG, make_model

from jax_oc128.checks import ArgumentError
from jax_oc128.controller import ONLINE
from jax_oc128.engine import Engine, memory
from jax_oc128.engine.pages import PagePool
from jax_oc128.engine.requests import RequestScheduler, SamplingParams
from jax_oc128.nn import CSA, HCA, SLIDING

# every kind of layer state: sliding window ring, HCA (online C128) entries, CSA entries, keys and raw rows
CONFIG = dataclasses.replace(DECODE_CONFIG, layer_types=(SLIDING, HCA, CSA), mlp_layer_types=None)
PAGE = 128
NEW = 12
_rng = np.random.default_rng(7)
SYSTEM = [int(t) for t in _rng.integers(0, CONFIG.vocab_size, 3 * PAGE + 20)]  # 3 pages and some
# the system prompt and suffixes: the first two admitted together (both miss), the others hit
PROMPTS = [SYSTEM + [int(t) for t in _rng.integers(0, CONFIG.vocab_size, n)] for n in (30, 150, 5, 200, 60)]


@pytest.fixture(scope="module")
def engine():
    """:data:`CONFIG`'s model, 2 slots, K = 8, 16 pages of 128 tokens (float32 caches)."""
    return Engine(make_model(ONLINE, config=CONFIG), slots=2, steps_per_dispatch=8, pages=16, page_size=PAGE)


def run(engine, prefix_cache=0, **speculation):
    """:data:`PROMPTS` through a new scheduler (``NEW`` greedy tokens each): the first two, then once they
    ended the others. Returns ``(tokens per prompt, cached tokens per prompt, the scheduler, the pages
    changed meanwhile)``: the pages the cache held after the first two whose contents the others changed
    (the scheduler closed)."""
    scheduler = RequestScheduler(engine, prefix_cache=prefix_cache, **speculation)
    outputs, cached, ids, changed = {}, {}, [], []
    for phase in (PROMPTS[:2], PROMPTS[2:]):
        if ids and prefix_cache:
            nodes = list(scheduler.prefix_cache.nodes)
            before = [pool_pages(scheduler.state, node.page) for node in nodes]
        ids += [scheduler.add_request(prompt, SamplingParams(NEW)) for prompt in phase]
        while scheduler.busy:
            out = scheduler.step()
            for request, tokens in out.tokens.items():
                outputs.setdefault(request, []).extend(tokens)
            cached.update(out.cached)
    if prefix_cache:
        for node, pages in zip(nodes, before, strict=True):
            after = pool_pages(scheduler.state, node.page)
            if node in scheduler.prefix_cache.nodes and not all(
                np.array_equal(a, b, equal_nan=True) for a, b in zip(pages, after, strict=True)
            ):
                changed.append(node.page)
    scheduler.close()
    return [outputs[i] for i in ids], [cached.get(i, 0) for i in ids], scheduler, changed


def pool_pages(state, page):
    """Page ``page`` of every pool of ``state`` (entries and indexer keys, every compressed layer)."""
    leaves = jax.tree.leaves([(layer.entries, layer.index_keys) for layer in state.cache.layers])
    return [np.asarray(leaf[page]) for leaf in leaves if leaf.size]


@pytest.fixture(scope="module")
def expected(engine):
    """The tokens without the cache: plain and chain N = 2."""
    return {n: run(engine, **({} if n is None else dict(num_tokens=n)))[0] for n in (None, 2)}


def assert_all_back(scheduler):
    """No page leaked, no pin left: every page free or cached, nothing pinned, no slot holding any."""
    pool, cache = scheduler.page_pool, scheduler.prefix_cache
    assert cache.pinned == 0 and all(node.refs == 0 for node in cache.nodes)
    assert pool.free_pages + cache.pages == pool.per_shard
    assert not any(map(pool.holds, range(2))) and np.all(pool.table == -1)
    assert pool.can_reserve(0, pool.per_shard * PAGE)  # the cache's pages count as available


@pytest.mark.parametrize(
    ("speculation", "uncached"),
    [({}, None), (dict(num_tokens=2), 2), (dict(tree=(-1, 0, 0, 1)), None)],
    ids=["plain", "chain2", "tree"],
)
def test_cached_prefixes_give_the_uncached_tokens(engine, expected, speculation, uncached):
    """With the cache (pages NaN at the start: a read of a page a slot was not given shows), the tokens
    are the uncached ones (plain, chain N = 2; a draft tree: greedy speculation gives plain greedy tokens,
    test_tree_decode); the later requests take the system prompt's three pages from it, the totals count
    what was fed and taken, and no cached page changed while the later requests ran on it."""
    engine._idle_state = poisoned_entries(engine.init_state())
    tokens, cached, scheduler, changed = run(engine, prefix_cache=4, **speculation)
    assert tokens == expected[uncached]
    assert cached == [0, 0, 3 * PAGE, 3 * PAGE, 3 * PAGE]
    assert scheduler.totals["cached_tokens"] == 9 * PAGE
    assert scheduler.totals["prefill_tokens"] == sum(map(len, PROMPTS)) - 9 * PAGE
    assert scheduler.prefix_cache.evictions == 0 and not changed
    assert_all_back(scheduler)


def test_eviction_under_a_small_pool(engine, expected):
    """With 6 pages (requests of 4 or 5 pages: the first two run one after the other), unpinned cached pages
    are evicted when a slot grows past the free pages; the tokens are still the uncached ones, the requests
    after the first take the system prompt's pages, and every page is back at the end."""
    small = Engine(engine.model, slots=2, steps_per_dispatch=8, pages=6, page_size=PAGE)
    small._idle_state = poisoned_entries(small.init_state())
    tokens, cached, scheduler, _ = run(small, prefix_cache=4)
    assert tokens == expected[None]
    assert scheduler.prefix_cache.evictions > 0
    assert cached == [0] + [3 * PAGE] * 4
    assert_all_back(scheduler)


@pytest.mark.parametrize(
    ("options", "value", "error", "match"),
    [
        (dict(), 2, ValueError, "prefix_cache: needs paged caches"),
        (dict(pages=16, page_size=PAGE), -1, ValueError, "prefix_cache: must be >= 0"),
        (dict(pages=16, page_size=PAGE), 1.5, TypeError, "prefix_cache: must be an int"),
    ],
)
def test_bad_settings_are_refused_by_name(engine, options, value, error, match):
    """prefix_cache on a dense engine, or not an int >= 0: refused naming it."""
    other = Engine(engine.model, slots=2, **options)
    with pytest.raises(error, match=match):
        RequestScheduler(other, prefix_cache=value)


class FakeCache:
    """A prefix cache holding ``pages``, ``pinned`` of them pinned; evicts the last."""

    def __init__(self):
        self.pages, self.pinned = [], 0

    def evict(self):
        return self.pages.pop()


def test_a_prefix_feed_too_large_for_the_device_is_refused_naming_the_request(engine, monkeypatch):
    """A prefix feed's program larger than the device's free memory (:mod:`jax_oc128.engine.memory`; the CPU
    reports none: patched) is refused before its dispatch, naming ``max_len`` and the request reaching
    furthest (the second, fed to its 4th page: the first holds 3 pages and some)."""
    scheduler = RequestScheduler(engine, prefix_cache=4)
    try:
        for prompt in PROMPTS[:2]:
            scheduler.add_request(prompt, SamplingParams(NEW))
        monkeypatch.setattr(memory, "free_bytes", lambda device: 1000)
        context = r"\(a context of 512 positions, context bucket 512\)"
        with pytest.raises(
            ArgumentError, match=rf"^max_len: the prefix feed of request 1 \(slot 1\) {context}"
        ):
            scheduler.step()
    finally:
        scheduler.close()


def test_page_pool_shares_adopts_and_evicts():
    """A slot's adopted page passes to the cache (out of its reservation, not freed at its release); a slot
    sharing it reserves only its own pages, the pinned ones counted against the pool; a slot that grows past
    the free pages takes an evicted page of the cache."""
    pool = PagePool(pages=4, page_size=PAGE, slots=2, max_pages=4)
    cache = pool.cache = FakeCache()
    pool.reserve(0, 3 * PAGE)
    pool.grow(0, 3 * PAGE)
    assert pool.table[0].tolist() == [0, 1, 2, -1]
    assert pool.adopt(0, 0) == 0
    cache.pages, cache.pinned = [0], 1
    with pytest.raises(RuntimeError, match="page 0 is not its own"):
        pool.adopt(0, 0)
    assert not pool.can_reserve(1, 2 * PAGE)  # 2 reserved + 1 pinned + 2 > 4
    pool.release(0)
    assert pool.free_pages == 3 and pool.table[0].tolist() == [-1] * 4
    assert pool.can_reserve(1, 4 * PAGE, shared=1) and not pool.can_reserve(1, 4 * PAGE)
    pool.reserve(1, 4 * PAGE, [0])
    assert pool.grow(1, 4 * PAGE) and pool.table[1].tolist() == [0, 1, 2, 3]
    pool.release(1)  # the shared page stays the cache's
    assert pool.free_pages == 3
    cache.pinned = 0  # unpinned: available, evicted when a slot needs it
    pool.reserve(0, 4 * PAGE)
    pool.grow(0, 4 * PAGE)
    assert sorted(pool.table[0].tolist()) == [0, 1, 2, 3] and cache.pages == [] and pool.free_pages == 0
