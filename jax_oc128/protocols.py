"""What the engine asks of a model and of its drafter: :class:`Model` and :class:`Drafter`.

The engine (:mod:`jax_oc128.engine`) imports no model class: it drives any :class:`flax.nnx.Module` that
implements :class:`Model` (the engine splits it into its graph and parameters, places the parameters once and
merges them back inside its jitted steps). :class:`~jax_oc128.nn.SpeculativeModel` (DeepSeek-V4 and its MTP
head) is one; ``tests/test_protocol.py`` registers another. ``docs/extending.md`` walks through adding one.

A cache is any pytree of arrays the model makes (:meth:`Model.init_cache`) and transforms; the engine holds it
in its decode state, donates it to every step and never looks inside. On a mesh every cache array is split by
slot over the ``"data"`` axis along its first axis (:func:`jax_oc128.nn.sharding.slot_specs`, which knows the
C128 states' own slot axes).

Shapes: ``slots`` the engine's slots (a forward's batch row b is slot b), ``T`` tokens per row, ``V`` the
vocabulary, ``H`` :attr:`Model.draft_hidden_size`. ``tokens`` and ``positions`` are ``[slots, T]`` int32,
positions consecutive per row (the nodes of a tree at the root's position + their depth); ``lengths``
``[slots]`` int32 the valid tokens of each row (its first ones): a row of length 0 is left as it is, in
every cache. ``slots`` of :meth:`Model.clear` is ``[n]`` int32, -1 ignored. A tree is a static
:class:`~jax_oc128.tree.Tree`; ``first_positions`` ``[slots]`` int32 its root's positions, ``nodes``
``[slots]`` int32 the accepted node of each row (-1: the row is left as it is).
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, runtime_checkable

import jax

from jax_oc128.controller import ForwardMode
from jax_oc128.tree import Tree

#: a model's or a drafter's cache: a pytree of arrays whose first axis is the slots
Cache = Any


@runtime_checkable
class Drafter(Protocol):
    """A draft model (:attr:`Model.drafter`): it proposes the next token from a token and the hidden state
    before it, and runs on its own output hidden state for the tokens after (a tree drafts level by level).
    DeepSeek-V4's MTP heads (:mod:`jax_oc128.nn.draft`) are drafters. A drafter takes no context bound (the
    model's ``context``): what it reads must not grow with ``max_len`` (V4's heads read their sliding
    window)."""

    def init_cache(self, slots: int) -> Cache:
        """An empty cache of ``slots`` slots; nothing but static facts is read (the engine traces it
        abstractly for its layout)."""
        ...

    def clear(self, cache: Cache, slots: jax.Array) -> Cache:
        """``cache`` with ``slots`` emptied for new requests."""
        ...

    def __call__(
        self,
        tokens: jax.Array,
        hidden: jax.Array,
        positions: jax.Array,
        cache: Cache,
        *,
        lengths: jax.Array | None = None,
        tree: Tree | None = None,
        nodes: tuple[int, ...] | None = None,
    ) -> tuple[jax.Array, jax.Array, Cache]:
        """Drafts from ``tokens`` with ``hidden`` ``[slots, T, H]`` float32, the hidden states of the
        positions before them (the target's, or this drafter's own output at the token's parent), at
        ``positions``. Without ``tree``: consecutive tokens (the prefill), kept in the cache. With ``tree``
        and ``nodes`` (static, the nodes of one level of ``tree``, T of them): one level of a tree draft,
        each node seeing the committed tokens and its ancestors; :meth:`keep_path` follows. Returns
        ``(logits [slots, T, V] float32, hidden [slots, T, H] float32, cache)``: the logits of the token
        after each input token, the drafter's own hidden states, the updated cache."""
        ...

    def keep_path(
        self, cache: Cache, tree: Tree, first_positions: jax.Array, nodes: jax.Array, written: tuple[int, ...]
    ) -> Cache:
        """After the levels of a tree draft, keep each row's path from the root to ``nodes`` (the accepted
        node) and forget the rest; ``written`` (static) are the nodes the draft ran on (the path's others
        were never drafted from)."""
        ...


@runtime_checkable
class Model(Protocol):
    """A target model as the engine drives it: a causal LM with its caches, forwarding a batch of slots
    (prefill, decode, or the verify of a draft tree) and keeping a verify's accepted path, with an optional
    :class:`Drafter` for speculative decoding.

    Static facts (read on the host, before anything is traced):

    * ``vocab_size``: V, token ids are in [0, V).
    * ``max_len``: the most tokens a slot's caches hold (prompt + output + a verify's N).
    * ``max_draft``: the most nodes a verify takes (N <= max_draft).
    * ``draft_hidden_size``: H, the width of the hidden state a forward returns and the drafter takes.
    * ``verifies_trees``: whether a verify takes any :class:`~jax_oc128.tree.Tree` (False: chains only).
    * ``drafter``: the :class:`Drafter`, or None (plain decoding only).
    * ``eos_token_ids`` (optional, default ``()``): a tuple of at most 8 token ids that end a generation
      (a loaded checkpoint's EOS ids, :func:`jax_oc128.pretrained.eos_token_ids`): where
      :meth:`Engine.generate <jax_oc128.engine.Engine.generate>` and a ``SamplingParams`` stop unless given
      ``stop_tokens``.
    """

    vocab_size: int
    max_len: int
    max_draft: int
    draft_hidden_size: int
    verifies_trees: bool
    drafter: Drafter | None

    def init_cache(self, slots: int, pages: int | None = None, page_size: int = 0) -> Cache:
        """An empty cache of ``slots`` slots, each holding up to ``max_len`` tokens; nothing but static
        facts is read (the engine traces it abstractly for its layout). With ``pages``: paged, a pool of
        ``pages`` pages of ``page_size`` tokens (a multiple of 128 dividing ``max_len``) and a page table
        ``[slots, max_len // page_size]`` int32 of -1 (:meth:`with_page_table`). A model without paged caches
        raises ValueError naming ``pages``."""
        ...

    def clear(self, cache: Cache, slots: jax.Array) -> Cache:
        """``cache`` with ``slots`` emptied for new requests (a paged cache's page table is the host's)."""
        ...

    def with_page_table(self, cache: Cache, page_table: jax.Array) -> Cache:
        """A paged ``cache`` with the page table ``page_table`` ``[slots, max_len // page_size]`` int32:
        slot s's tokens ``[k * page_size, (k + 1) * page_size)`` in page ``page_table[s, k]`` (-1: none, a
        write there dropped); set by the engine between forwards."""
        ...

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: Cache,
        *,
        lengths: jax.Array | None = None,
        mode: ForwardMode = ForwardMode.EXTEND,
        tree: Tree | None = None,
        context: int | None = None,
        logits_at: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, Cache]:
        """A forward of ``mode`` (static): ``EXTEND`` (a prefill or a chunk of one, at any position) and
        ``DECODE`` (one token) keep the tokens in the cache; ``TARGET_VERIFY`` with ``tree`` verifies its
        nodes (``tokens[:, k]`` node k at the root's position + its depth, each seeing the cache and its
        ancestors), :meth:`keep_path` then keeping the accepted path. ``context`` (static): None, or the
        engine's promise that every row's position + its tokens is at most ``context`` (<= ``max_len``, a
        bucket of :func:`~jax_oc128.nn.context_bucket`): the forward may read only the first ``context``
        positions of each slot's caches, so that its cost follows the context, not ``max_len``.
        ``logits_at``: None, or ``[slots]`` int32 indices into T: the logits only there, ``[slots, 1, V]``
        (a prefill samples after each row's last token only). Returns ``(logits [slots, T, V] float32, hidden
        [slots, T, H] float32, cache)``: the next token's logits after each token and the hidden state the
        drafter takes at the next position."""
        ...

    def keep_path(self, cache: Cache, tree: Tree, first_positions: jax.Array, nodes: jax.Array) -> Cache:
        """After a verify of ``tree``, keep each row's path from the root to ``nodes`` (``depths[node] + 1``
        tokens at ``first_positions`` on): the next forward of the row, at ``first_positions + depths[node]
        + 1``, sees the cache as if the path's tokens alone had been fed."""
        ...


@runtime_checkable
class PrefixState(Protocol):
    """A :class:`Model` whose paged slots can be served from a cached prefix (the engine's prefix caching,
    :mod:`~jax_oc128.engine.prefix_cache`): the per-slot state a prefix ending on a page boundary leaves
    beyond its pages, stored and restored."""

    def prefix_state(self, cache: Cache, slots: jax.Array) -> Any:
        """The per-slot state of ``slots`` ([n] int32) after a prefix of a multiple of the page size: a
        pytree of ``[n, ...]`` arrays."""
        ...

    def with_prefix_state(self, cache: Cache, slots: jax.Array, state: Any) -> Cache:
        """``cache`` with ``slots`` cleared and given ``state`` (a :meth:`prefix_state`): as after the
        prefix, with its pages in the slots' rows of the page table."""
        ...


def members(protocol: type) -> tuple[str, ...]:
    """The attributes and methods ``protocol`` (:class:`Model`, :class:`Drafter`) declares, in order."""
    methods = [
        name
        for name, value in vars(protocol).items()
        if inspect.isfunction(value) and (name == "__call__" or not name.startswith("_"))
    ]
    return (*vars(protocol).get("__annotations__", {}), *methods)
