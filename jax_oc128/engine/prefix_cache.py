"""Prefix caching for paged engines on one device: prompts' page-aligned prefixes kept by their tokens,
shared by later requests (docs/serving.md, "Prefix caching").

A cached prefix is a chain of pages (a node per page, keyed by its tokens under its parent: the hash chain
of vLLM and SGLang, exact since a node keeps its page's tokens) and, at some nodes, a *snapshot*: the
per-slot state after the prefix ending with that node's page (the model's
:meth:`~jax_oc128.protocols.PrefixState.prefix_state`, the drafter's cache rows and the target's hidden state
at its last position), stored on the device in a pool of ``capacity`` snapshots. A request whose prompt
starts with a chain ending at a snapshot shares those pages, gets the snapshot restored into its slot and
prefills only the rest.

A request stores snapshots at its prompt's last page boundary before its last token and at the boundary
where its prompt leaves the cached chain (so that the next request sharing that much finds one): its
prefill is fed in segments ending there (:func:`~jax_oc128.engine.steps.feed`), each stored as it ends, and
its pages up to there pass to the cache (:meth:`~jax_oc128.engine.pages.PagePool.adopt`). Only pages behind
the boundary are shared: a page is written by the positions it holds, all fed before it passes.

Nodes a running request uses are pinned (counted against the page pool); the others, and every snapshot,
are evicted least recently used first when pages or snapshots run short (a node only once it has no
children)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_oc128.checks import ArgumentError, ArgumentTypeError, check_int
from jax_oc128.engine import steps
from jax_oc128.protocols import PrefixState


@dataclasses.dataclass(eq=False)
class Node:
    """A cached page: ``page`` of the pool holding the tokens ``key`` after its ``parent``'s."""

    parent: Node | None
    key: bytes
    page: int
    children: dict = dataclasses.field(default_factory=dict)
    refs: int = 0  # running requests that use it
    snapshot: int | None = None  # its snapshot's index in the device pool
    used: int = 0  # when last used (the LRU order)


@dataclasses.dataclass
class Plan:
    """Where a prompt meets the cache: ``path`` the cached nodes its first pages match, ``hit`` how many of
    them it shares (the deepest with a snapshot), ``points`` the page counts after which it stores a
    snapshot (its prefill's segments end there)."""

    path: list[Node]
    hit: int
    points: list[int]


def take(model, state, slot):
    """Slot ``slot``'s snapshot: the model's prefix state, the drafter's cache rows, the hidden state."""
    rows = jnp.reshape(slot, (1,))
    draft = jax.tree.map(lambda leaf: leaf[rows], state.draft_cache)
    return model.prefix_state(state.cache, rows), draft, state.hidden[rows]


def store(model, snapshots, state, slot, index):
    """``snapshots`` (each leaf ``[capacity, ...]``) with entry ``index`` set to slot ``slot``'s."""
    row = take(model, state, slot)
    return jax.tree.map(lambda pool, x: pool.at[index].set(x[0]), snapshots, row)


def restore(model, state, slot, snapshots, index):
    """``state`` with slot ``slot`` cleared and given snapshot ``index`` of ``snapshots``."""
    rows = jnp.reshape(slot, (1,))
    cached, draft, hidden = jax.tree.map(lambda pool: pool[index][None], snapshots)
    draft_cache = jax.tree.map(lambda leaf, x: leaf.at[rows].set(x), state.draft_cache, draft)
    return dataclasses.replace(
        state,
        cache=model.with_prefix_state(state.cache, rows, cached),
        draft_cache=draft_cache,
        hidden=state.hidden.at[rows].set(hidden),
    )


def _on_model(fn, graphdef, params, *args, **static):
    return fn(nnx.merge(graphdef, params), *args, **static)


def _feed(model, state, tokens, starts, lengths, *, chunk, floor, start_bound):
    feeding = dict(chunk=chunk, floor=floor, start_bound=start_bound)
    return steps.feed(model, state, tokens, starts, lengths, **feeding)[0]


#: an engine's jitted feed, store and restore (compiled once per engine, whatever its schedulers)
_JITTED = weakref.WeakKeyDictionary()


def _jitted(engine) -> tuple:
    if engine not in _JITTED:
        model = engine.model
        graphdef = nnx.split(model)[0]
        _JITTED[engine] = (
            jax.jit(
                functools.partial(_on_model, _feed, graphdef, floor=engine.context_floor),
                static_argnames=("chunk", "start_bound"),
                donate_argnames="state",
            ),
            jax.jit(functools.partial(store, model), donate_argnames="snapshots"),
            jax.jit(functools.partial(restore, model), donate_argnames="state"),
        )
    return _JITTED[engine]


def check_prefix_cache(value, engine) -> int:
    """``prefix_cache`` (the snapshots kept, 0: off) checked for ``engine``: an int >= 0; past 0, a paged
    engine on one device (no mesh) whose model is a
    :class:`~jax_oc128.protocols.PrefixState`."""
    value = check_int("prefix_cache", value, 0)
    if value:
        if engine.pages is None:
            raise ArgumentError("prefix_cache", "needs paged caches (Engine(..., pages=...))")
        if engine.mesh is not None:
            raise ArgumentError("prefix_cache", "an engine on one device only (no mesh)")
        if not isinstance(engine.model, PrefixState):
            raise ArgumentTypeError(
                "prefix_cache", "the model stores no prefix state (protocols.PrefixState)"
            )
    return value


class PrefixCache:
    """The cached prefixes of an engine's requests: pages of ``pool`` (a
    :class:`~jax_oc128.engine.pages.PagePool`, which it evicts from) and up to ``capacity`` snapshots on the
    device.

    Attributes:
      pinned: pages that running requests use.
      pages: pages the cache holds.
      nodes: every cached node.
      evictions: pages evicted.
    """

    def __init__(self, engine, pool, capacity: int):
        self.engine, self.pool, self.capacity = engine, pool, capacity
        self.page_size = pool.page_size
        self.root = Node(None, b"", -1)
        self.nodes: set[Node] = set()
        self.pinned = self.pages = 0
        self._clock = itertools.count(1)
        self._free = list(range(capacity - 1, -1, -1))
        self._holders: dict[int, Node] = {}  # snapshot index -> its node
        pool.cache = self
        self._feed, self._store, self._restore = _jitted(engine)
        self.evictions = 0
        self._snapshots = None  # allocated at the first store

    def _keys(self, prompt, pages: int) -> list[bytes]:
        size = self.page_size
        return [np.asarray(prompt[k * size : (k + 1) * size], np.int32).tobytes() for k in range(pages)]

    def plan(self, prompt) -> Plan:
        """Where ``prompt`` (``[length]`` int32) meets the cache (nothing changed)."""
        last = (len(prompt) - 1) // self.page_size  # pages before its last token
        path, node = [], self.root
        for key in self._keys(prompt, last):
            node = node.children.get(key)
            if node is None:
                break
            path.append(node)
        hit = max((k + 1 for k, node in enumerate(path) if node.snapshot is not None), default=0)
        return Plan(path, hit, sorted({len(path), last} - set(range(hit + 1))))

    def hit_only(self, plan: Plan) -> Plan:
        """``plan`` storing no snapshot unless its match ends at its hit: the nodes between its hit and
        where its prompt leaves the cache are not pinned (the pool may have no room for them besides the
        request's own copies of their pages)."""
        if len(plan.path) == plan.hit:
            return plan
        return Plan(plan.path[: plan.hit], plan.hit, [])

    def pins(self, plan: Plan) -> int:
        """Pages that :meth:`pin` of ``plan`` would newly pin."""
        return sum(node.refs == 0 for node in self._pinned_path(plan))

    def _pinned_path(self, plan: Plan) -> list[Node]:
        # the shared pages, and the nodes up to the divergence point when a snapshot is stored there
        return plan.path if plan.points else plan.path[: plan.hit]

    def pin(self, plan: Plan) -> list[Node]:
        """Pin the nodes a request admitted with ``plan`` uses; returns them (for :meth:`unpin`)."""
        held = self._pinned_path(plan)
        tick = next(self._clock)
        for node in held:
            self.pinned += node.refs == 0
            node.refs += 1
            node.used = tick
        return list(held)

    def unpin(self, held: list[Node]) -> None:
        """A request that used ``held`` ended."""
        for node in held:
            node.refs -= 1
            self.pinned -= node.refs == 0

    def restore(self, state, slot: int, plan: Plan):
        """``state`` (donated) with ``slot`` given the snapshot at ``plan``'s hit."""
        return self._restore(
            state, np.int32(slot), self._snapshots, np.int32(plan.path[plan.hit - 1].snapshot)
        )

    def feed(self, state, rows: dict, starts: dict, names: dict):
        """``state`` (donated) with ``rows`` {slot: tokens} fed from ``starts`` {slot: position}, its program
        first found to fit the device's memory (an error naming the request of ``names`` {slot: name} that
        reaches furthest; :mod:`~jax_oc128.engine.memory`)."""
        engine = self.engine
        fed = engine._prompt_rows(rows, starts)
        args = (engine.params, state, fed.tokens, fed.starts, fed.lengths)
        static = dict(chunk=fed.chunk, start_bound=fed.start_bound)

        def lower():
            return self._feed.lower(*args, **static)

        engine._check_feed_fits("prefix feed", lower, rows, starts, names, fed)
        return self._feed(*args, **static)

    def insert(self, state, slot: int, prompt, pages: int, held: list[Node]) -> None:
        """After ``slot`` was fed ``prompt``'s first ``pages`` pages: its pages there that the cache lacks
        pass to it (pinned, added to ``held``), and the node of the last one gets ``slot``'s snapshot if it
        has none."""
        node, tick = self.root, next(self._clock)
        for k, key in enumerate(self._keys(prompt, pages)):
            child = node.children.get(key)
            if child is None:
                child = Node(node, key, self.pool.adopt(slot, k))
                node.children[key] = child
                self.nodes.add(child)
                self.pages += 1
            if child not in held:
                self.pinned += child.refs == 0
                child.refs += 1
                held.append(child)
            child.used = tick
            node = child
        if node.snapshot is None:
            node.snapshot = self._snapshot_index()
            self._holders[node.snapshot] = node
            if self._snapshots is None:
                layout = jax.eval_shape(functools.partial(take, self.engine.model), state, np.int32(0))
                self._snapshots = jax.tree.map(
                    lambda x: jnp.zeros((self.capacity, *x.shape[1:]), x.dtype), layout
                )
            self._snapshots = self._store(self._snapshots, state, np.int32(slot), np.int32(node.snapshot))

    def _snapshot_index(self) -> int:
        if not self._free:  # the least recently used snapshot goes
            index = min(self._holders, key=lambda i: self._holders[i].used)
            self._holders.pop(index).snapshot = None
            return index
        return self._free.pop()

    def evict(self) -> int:
        """The least recently used unpinned node without children removed (its snapshot freed); returns its
        page (:meth:`PagePool.grow <jax_oc128.engine.pages.PagePool.grow>` takes it)."""
        leaves = [node for node in self.nodes if not node.refs and not node.children]
        if not leaves:
            raise RuntimeError("prefix cache: no page to evict (a bug: the pool's accounting)")
        node = min(leaves, key=lambda n: n.used)
        del node.parent.children[node.key]
        self.nodes.remove(node)
        self.pages -= 1
        self.evictions += 1
        if node.snapshot is not None:
            del self._holders[node.snapshot]
            self._free.append(node.snapshot)
        return node.page

    @property
    def snapshots(self) -> int:
        """Snapshots held."""
        return len(self._holders)
