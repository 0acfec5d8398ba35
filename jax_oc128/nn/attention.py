"""Flax NNX DeepSeek-V4 attention with the C128 compressed state threaded through explicitly.

:class:`DeepseekV4Attention` follows Hugging Face transformers' ``DeepseekV4Attention`` (5.24.0) for the
layer types ``sliding_attention``, ``compressed_sparse_attention`` (CSA, ratio 4 with the lightning indexer,
:mod:`~jax_oc128.nn.csa`) and ``heavily_compressed_attention`` (HCA, C128, :mod:`~jax_oc128.nn.hca`); a
compressed layer's compressor is its ``compressor`` submodule. Modules hold parameters only; caches go in
and come out as pytrees (donate them to the enclosing jit).

A CSA layer keeps its compressor's raw rows, entries and indexer keys in its own
:class:`AttentionCache`. The C128 compressor state is not the layer's: one layer-stacked state
(:class:`~jax_oc128.CompressState` or :class:`~jax_oc128.OfflineState`) holds every C128 layer of a
model, and each layer writes its own ``compress_layer`` of it. What one forward's layers read (mode,
positions, lengths, tree, page table) is its :class:`~jax_oc128.nn.forward.ForwardBatch`; the controller's
once-per-forward transition runs before the layers (:func:`~jax_oc128.nn.forward.prepare_forward`), so a
standalone layer is driven like this::

    forward_batch = ForwardBatch.create(positions, lengths=lengths, mode=mode)
    compressed = prepare_forward(compressed, forward_batch)  # compressed = attn.init_compressed(batch) first
    y, cache, compressed = attn(x, cache, compressed, forward_batch)
    compressed = commit_verify(compressed, seq_lens, accept_lens)  # after a verify: eager, or leave pending

Shapes: ``x`` ``[batch, T, hidden]`` float32 (the layer input after its input norm); positions and lengths as
:class:`~jax_oc128.nn.forward.ForwardBatch` has them. Batch row b is slot b of the compressed state.
Activations are float32; the weights are float32 or bfloat16, their matmuls accumulating
in float32 (:mod:`~jax_oc128.nn.functional`); the caches are stored as the config's ``cache_dtypes`` say
(float32, bfloat16 or FP8 entries, :mod:`~jax_oc128.nn.kv_cache`) and read back in float32.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_oc128.controller import ONLINE, Backend, State
from jax_oc128.nn import attend, csa, kv_cache
from jax_oc128.nn import weights as nn_weights
from jax_oc128.nn.csa import CSACompressor, IndexerConfig, IndexerQueries
from jax_oc128.nn.forward import ForwardBatch
from jax_oc128.nn.functional import normal_param, ones_param, rms_norm, zeros_param
from jax_oc128.nn.hca import EntriesSeen, HCACompressor
from jax_oc128.nn.kv_cache import CacheDtypes
from jax_oc128.nn.linear import linear
from jax_oc128.nn.rope import RopeConfig
from jax_oc128.rules import BLOCK, drop_index
from jax_oc128.tree import Tree, check_tree


class LayerType(enum.StrEnum):
    """An attention layer's type; a member equals the string configs hold (transformers' names)."""

    SLIDING = "sliding_attention"
    HCA = "heavily_compressed_attention"  # C128
    CSA = "compressed_sparse_attention"  # ratio 4, with the lightning indexer


SLIDING, HCA, CSA = LayerType.SLIDING, LayerType.HCA, LayerType.CSA
#: queries per block of a chain's window attention (:func:`_window_keys`)
QUERY_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Static configuration of one attention layer: a model's is :meth:`ModelConfig.attention
    <jax_oc128.nn.ModelConfig.attention>` (of transformers' ``DeepseekV4Config`` by
    :meth:`ModelConfig.from_hf <jax_oc128.nn.ModelConfig.from_hf>`)."""

    layer_type: LayerType
    hidden_size: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    indexer: IndexerConfig | None = None  # CSA layers
    dtype: str = "float32"  # the projections' weights'
    # the caches' storage (RuntimeConfig.cache_dtypes)
    cache_dtypes: CacheDtypes = dataclasses.field(default_factory=CacheDtypes)

    @property
    def compress_rate(self) -> int:
        """Tokens per compressed entry: 128 (HCA), 4 (CSA), 0 for a sliding layer."""
        return {SLIDING: 0, CSA: csa.RATE, HCA: BLOCK}[self.layer_type]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionCache:
    """One layer's cache for a batch, a pytree (the compressor state is the model's, see the module doc).

    The window and the raw rows are arrays of the config's ``cache_dtypes.rows`` (float32 or bfloat16); the
    entries are stored in its ``cache_dtypes.entries``, the indexer keys in its ``cache_dtypes.index_keys``
    (an array, or an :class:`~jax_oc128.nn.kv_cache.FP8Entries` or
    :class:`~jax_oc128.nn.kv_cache.FP4Keys` of that shape; :mod:`~jax_oc128.nn.kv_cache`).

    Attributes:
      window: ``[batch, R, D]``: a ring of the last rotated K=V rows, row ``p % R`` holding position p.
        ``R = sliding_window + max_draft``, so that a verify's rejected drafts never overwrite a row that the
        window still needs.
      window_positions: ``[batch, R]`` int32: the position held by each ring row, -1 for none.
      entries: ``[batch, max_entries, D]``: normed, rotated compressed entries by block index (HCA and CSA;
        zero-sized for sliding layers); paged: a pool ``[pages, per_page, D]`` shared by the slots, a slot's
        entries in the pages of its row of the model's page table (:mod:`~jax_oc128.nn.kv_cache`).
      index_keys: ``[batch, max_entries, index_head_dim]`` (paged: ``[pages, per_page, index_head_dim]``):
        the CSA indexer's keys by window index (zero-sized for other layers).
      rows: ``[batch, ring, row_width]``: the CSA compressor's raw rows by position
        (:mod:`~jax_oc128.nn.csa`; zero-sized for other layers).
      tree_entries: ``[batch, max_draft, D]``: an HCA or CSA layer's entries of the last tree verify by node
        (the entry of the block or window the node closes; normed, rotated), until :meth:`keep_path` stores
        the accepted path's (zero-sized for sliding layers).
      tree_index_keys: ``[batch, max_draft, index_head_dim]``: the same for a CSA layer's indexer keys
        (zero-sized for other layers).
    """

    window: jax.Array
    window_positions: jax.Array
    entries: jax.Array
    index_keys: jax.Array
    rows: jax.Array
    tree_entries: jax.Array
    tree_index_keys: jax.Array

    @classmethod
    def create(
        cls,
        config: AttentionConfig,
        max_draft: int,
        batch: int,
        max_len: int | None = None,
        pages: int | None = None,
        page_size: int | None = None,
    ) -> AttentionCache:
        """An empty cache of a layer of ``config`` (verifies of up to ``max_draft`` tokens) for ``batch`` rows
        and sequences up to ``max_len`` tokens (default: the config's ``max_position_embeddings``), stored as
        its ``cache_dtypes`` say; nothing but the config is read (``jax.eval_shape`` of it is free). With
        ``pages``, the entries and indexer keys of a compressed layer are a pool of ``pages`` pages of
        ``page_size`` tokens (a multiple of the layer's compress rate), ``[pages, page_size // rate, ...]``,
        addressed through the model's page table (:mod:`~jax_oc128.nn.kv_cache`)."""
        c, dtypes = config, config.cache_dtypes
        max_len = c.max_position_embeddings if max_len is None else max_len
        rows = c.sliding_window + max_draft
        is_csa = c.layer_type == CSA
        lead, max_entries = batch, max_len // c.compress_rate if c.compress_rate else 0
        if pages is not None and c.compress_rate:
            lead, max_entries = pages, page_size // c.compress_rate
        index_dim = c.indexer.head_dim if is_csa else 0
        tree_entries = max_draft if c.layer_type != SLIDING else 0
        return cls(
            window=jnp.zeros((batch, rows, c.head_dim), dtypes.rows),
            window_positions=jnp.full((batch, rows), -1, jnp.int32),
            entries=kv_cache.zeros((lead, max_entries, c.head_dim), dtypes.entries, c.rope.dim),
            index_keys=kv_cache.zeros((lead, max_entries if is_csa else 0, index_dim), dtypes.index_keys),
            rows=jnp.zeros(
                (batch, csa.ring_rows(max_draft), csa.row_width(c.head_dim, index_dim))
                if is_csa
                else (batch, 0, 0),
                dtypes.rows,
            ),
            tree_entries=kv_cache.zeros((batch, tree_entries, c.head_dim), dtypes.entries, c.rope.dim),
            tree_index_keys=kv_cache.zeros((batch, max_draft if is_csa else 0, index_dim), dtypes.index_keys),
        )

    def keep_path(self, tree: Tree, first_positions, nodes, written=None, page_table=None) -> AttentionCache:
        """After a tree verify or draft (``__call__(..., tree=tree)``) at ``first_positions`` ``[batch]``
        int32 (the root's position), keep the path from the root to ``nodes`` ``[batch]`` int32 (the
        accepted node; -1 leaves the row untouched): its window rows move to where a chain of the path puts
        them (row ``p % R`` for position p) and every other row the tree wrote is emptied, so the rejected
        branches leave no trace. ``written``: the static nodes the tree wrote (default: all); a path node
        not among them leaves its position empty. A chain (:attr:`Tree.is_chain`) was written as the chain
        is, by position: the cache is returned as it is (the positions past the path are rewritten before
        any query reads them). ``page_table``: the model's (None: the dense layout)."""
        if check_tree(tree).is_chain:
            return self
        window, batch = self.window.shape[1], nodes.shape[0]
        written = np.isin(np.arange(tree.size), range(tree.size) if written is None else written)
        kept = nodes >= 0
        path = jnp.asarray(tree.paths)[jnp.maximum(nodes, 0)]  # [batch, depth + 1], -1 past the node
        base = first_positions[:, None]
        ring = jnp.where(kept[:, None], (base + jnp.arange(tree.size)) % window, window)
        depth = jnp.arange(path.shape[1])[None]
        on_path = kept[:, None] & (path >= 0)
        source = (base + jnp.maximum(path, 0)) % window
        target = jnp.where(on_path, (base + depth) % window, window)
        moved = jnp.where(jnp.asarray(written)[jnp.maximum(path, 0)], base + depth, -1)
        rows = jnp.arange(batch)[:, None]
        kv = self.window[rows, source]
        positions = self.window_positions.at[rows, ring].set(-1, mode="drop")
        kept_cache = dataclasses.replace(
            self,
            window=self.window.at[rows, target].set(kv, mode="drop"),
            window_positions=positions.at[rows, target].set(moved, mode="drop"),
        )
        if not self.tree_entries.shape[1]:  # a sliding layer
            return kept_cache
        # the entries of the blocks (HCA) or windows (CSA) the path closes, by their index; a CSA layer's
        # raw rows, by position
        rate = csa.RATE if self.rows.shape[1] else BLOCK
        at = base + depth  # the path's positions
        count = kv_cache.slot_entries(self.entries, page_table)
        index = jnp.where(on_path & ((at + 1) % rate == 0), at // rate, count)
        node = jnp.maximum(path, 0)
        node_entries = kv_cache.take(self.tree_entries, (rows, node))
        entries = kv_cache.put(
            self.entries, kv_cache.locate(self.entries, page_table, rows, index), node_entries
        )
        kept_cache = dataclasses.replace(kept_cache, entries=entries)
        if self.rows.shape[1]:
            node_keys = kv_cache.take(self.tree_index_keys, (rows, node))
            at_keys = kv_cache.locate(self.index_keys, page_table, rows, index)
            keys = kv_cache.put(self.index_keys, at_keys, node_keys)
            ring_rows = self.rows.shape[1]
            raw = self.rows[rows, (base + node) % ring_rows]
            target = jnp.where(on_path, at % ring_rows, ring_rows)
            raw = self.rows.at[rows, target].set(raw, mode="drop")
            kept_cache = dataclasses.replace(kept_cache, index_keys=keys, rows=raw)
        return kept_cache

    def clear(self, rows) -> AttentionCache:
        """Empty ``rows`` ([n] int32, -1 ignored) for new sequences. Their entries and indexer keys (dense
        rows or pages) are not cleared: no query reads what a row has not written
        (:mod:`~jax_oc128.nn.kv_cache`), and clearing them would cost ``max_len``'s entries per request."""
        index = drop_index(rows, self.window.shape[0])
        return AttentionCache(
            self.window.at[index].set(0, mode="drop"),
            self.window_positions.at[index].set(-1, mode="drop"),
            self.entries,
            self.index_keys,
            self.rows.at[index].set(0, mode="drop"),
            kv_cache.clear(self.tree_entries, index),
            kv_cache.clear(self.tree_index_keys, index),
        )


def _window_visibility(forward_batch: ForwardBatch, window_positions, sliding_window: int):
    """``[batch, T, R + T]`` bool: what the T tokens of ``forward_batch`` see of the window ring's R rows
    (``window_positions`` ``[batch, R]``) and of themselves, within the sliding window. Of the ring, the
    rows before the root (rows at or past it hold rejected drafts of an earlier verify, positions this call
    rewrites), and for a tree the rows of the tokens' ancestors that earlier calls of the tree wrote (node m
    at row ``(base + m) % R``); of the new tokens, their ancestors (a chain's: the tokens before them, by
    position)."""
    fb = forward_batch
    positions, tree, nodes, base = fb.positions, fb.tree, fb.nodes, fb.base
    ring_size, (batch, tokens) = window_positions.shape[1], positions.shape
    if tree is None:  # a chain's earlier calls wrote positions before base; its ancestry: the position order
        ring, new = False, True
    else:
        sees = np.asarray(tree.mask)[list(nodes)]  # [T, N]: ancestors or self
        new = sees[:, list(nodes)]
        earlier = sees.copy()
        earlier[:, list(nodes)] = False
        rows = (base + jnp.arange(tree.size)) % ring_size  # [batch, N]: node m's ring row
        at = rows[:, None, :, None] == jnp.arange(ring_size)  # [batch, 1, N, R]
        ring = jnp.any(at & jnp.asarray(earlier)[None, :, :, None], axis=2)
    seen = jnp.concatenate(
        [
            jnp.broadcast_to((window_positions < base)[:, None, :] | ring, (batch, tokens, ring_size)),
            jnp.broadcast_to(new, (batch, tokens, tokens)),
        ],
        axis=2,
    )
    key_positions = jnp.concatenate([window_positions, positions], axis=1)
    return seen & _in_window(positions[:, :, None], key_positions[:, None, :], sliding_window)


def _in_window(t, k, sliding_window: int):
    """Whether a query at position ``t`` sees a key at ``k`` (broadcastable int32; -1: no key): ``t -
    sliding_window < k <= t``."""
    return (k >= 0) & (k <= t) & (k > t - sliding_window)


def _window_keys(forward_batch: ForwardBatch, ring, window_positions, kv, sliding_window: int):
    """The window attention's keys by query block: ``(keys [batch, n, K, D], visible [batch, n, B, K] bool)``,
    query ``i * B + j`` (of ``n * B >= T``, the last block padded) seeing ``keys[:, i]`` where ``visible[:, i,
    j]``. The keys are the ring's R rows (``ring`` ``[batch, R, D]`` float32, ``window_positions`` ``[batch,
    R]``) and the T new ones (``kv`` ``[batch, T, D]``). A tree or a chain of at most :data:`QUERY_BLOCK`
    tokens is one block of every key (:func:`_window_visibility`); a longer chain is banded, block i of
    ``B = QUERY_BLOCK`` queries over the ring and the ``sliding_window - 1 + B`` new keys that end with its
    own, so that the logits are ``[T, R + sliding_window - 1 + B]``, bounded by the block, not ``[T, R +
    T]``."""
    fb, (batch, ring_size, dim), tokens = forward_batch, ring.shape, kv.shape[1]
    if fb.tree is not None or tokens <= QUERY_BLOCK:
        keys = jnp.concatenate([ring, kv], axis=1)[:, None]
        return _seen_keys(keys, _window_visibility(fb, window_positions, sliding_window)[:, None])
    block, span = QUERY_BLOCK, sliding_window - 1
    blocks = -(-tokens // block)
    pad = blocks * block - tokens
    # [ring | span missing keys | new | pad missing keys]: block i reads the ring and the span + B keys from
    # the new key i * B - span
    index = np.concatenate(
        [
            np.broadcast_to(np.arange(ring_size), (blocks, ring_size)),
            ring_size + block * np.arange(blocks)[:, None] + np.arange(span + block),
        ],
        axis=1,
    )
    missing = jnp.full((batch, span), -1, jnp.int32)
    key_positions = jnp.concatenate([window_positions, missing, fb.positions, missing[:, :pad]], axis=1)
    empty = jnp.zeros((batch, span + pad, dim), kv.dtype)
    keys = jnp.concatenate([ring, empty[:, :span], kv, empty[:, span:]], axis=1)[:, index]
    k = key_positions[:, index]  # [batch, n, K]
    # of the ring, the rows before the root (the rest hold rejected drafts); every new key
    seen = jnp.where(jnp.asarray(index < ring_size), k < fb.base[:, :, None], True)
    t = jnp.pad(fb.positions, ((0, 0), (0, pad)), constant_values=-1).reshape(batch, blocks, block, 1)
    return _seen_keys(keys, seen[:, :, None, :] & _in_window(t, k[:, :, None, :], sliding_window))


def _seen_keys(keys, visible):
    """``(keys, visible)`` with the keys no query of their block sees zeroed: the ring's empty rows and
    rejected drafts never reach the output, whatever they hold."""
    return jnp.where(jnp.any(visible, axis=2)[..., None], keys, 0.0), visible


def _valid(forward_batch: ForwardBatch):
    """``[batch, T]`` bool: the valid tokens, the first ``lengths`` of each row. Padding sees no entry
    (its entries could be ones no valid token wrote: a page's earlier contents)."""
    positions, lengths = forward_batch.positions, forward_batch.lengths
    return jnp.arange(positions.shape[1])[None] < lengths[:, None]


def _entries_limit(forward_batch: ForwardBatch, rate: int, closed):
    """What the T tokens of ``forward_batch`` see of an HCA or CSA layer's entries (blocks or windows of
    ``rate`` tokens): ``(limit [batch, T] int32, nodes)``, a token seeing the stored entries by index below
    its limit: for a chain those complete at or before the token (its call stored those it closed), for a
    tree verify those complete before the root; ``nodes`` None for a chain, for a tree ``[batch, N, N]``
    bool: of the nodes' own entries (``closed`` ``[batch, N]`` the index each node closed, -1 for none)
    those its ancestors or itself closed. Padding (past each row's length) sees none."""
    positions, tree, base = forward_batch.positions, forward_batch.tree, forward_batch.base
    valid = _valid(forward_batch)
    if tree is None:
        return jnp.where(valid, (positions + 1) // rate, 0), None
    nodes = jnp.asarray(tree.mask)[None] & (closed[:, None, :] >= 0) & valid[..., None]
    return jnp.where(valid, base // rate, 0), nodes


def _entries_visibility(forward_batch: ForwardBatch, stored: int, rate: int, closed):
    """:func:`_entries_limit` as a mask: ``[batch, T, stored]`` bool for a chain, ``[batch, N, stored + N]``
    for a tree verify (the stored entries, then the nodes')."""
    limit, nodes = _entries_limit(forward_batch, rate, closed)
    visible = jnp.arange(stored) < limit[..., None]
    return visible if nodes is None else jnp.concatenate([visible, nodes], axis=2)


class DeepseekV4Attention(nnx.Module):
    """DeepSeek-V4 attention (sliding, CSA or HCA) with explicit caches.

    Args:
      config: the layer's :class:`AttentionConfig`.
      max_draft: the most tokens a verify call may feed (banks of the online state).
      compress_layer: an HCA layer's index in the model's layer-stacked compressor state (the number of
        HCA layers before it); unused for sliding layers.
      attention_impl: the attention math, ``"jnp"``, ``"kernel"`` or ``"auto"``
        (:mod:`~jax_oc128.nn.attend`).
      rngs: parameter initialisation.
    """

    def __init__(
        self,
        config: AttentionConfig,
        *,
        max_draft: int = 4,
        compress_layer: int = 0,
        attention_impl: str = "jnp",
        rngs: nnx.Rngs,
    ):
        attend.check_impl(attention_impl)
        self.config, self.max_draft, self.attention_impl = config, max_draft, attention_impl
        c = config
        self.q_a_proj = normal_param(rngs, c.q_lora_rank, c.hidden_size, dtype=c.dtype)
        self.q_a_norm = ones_param(c.q_lora_rank)
        self.q_b_proj = normal_param(rngs, c.num_heads * c.head_dim, c.q_lora_rank, dtype=c.dtype)
        self.kv_proj = normal_param(rngs, c.head_dim, c.hidden_size, dtype=c.dtype)
        self.kv_norm = ones_param(c.head_dim)
        self.o_a_proj = normal_param(
            rngs, c.o_groups * c.o_lora_rank, c.num_heads * c.head_dim // c.o_groups, dtype=c.dtype
        )
        self.o_b_proj = normal_param(rngs, c.hidden_size, c.o_groups * c.o_lora_rank, dtype=c.dtype)
        self.sinks = zeros_param(c.num_heads)
        if c.layer_type == HCA:
            self.compressor = HCACompressor(
                c.hidden_size,
                c.head_dim,
                c.rms_norm_eps,
                c.rope,
                layer=compress_layer,
                max_draft=max_draft,
                dtype=c.dtype,
                rngs=rngs,
            )
        if c.layer_type == CSA:
            self.compressor = CSACompressor(
                c.hidden_size,
                c.head_dim,
                c.q_lora_rank,
                c.rms_norm_eps,
                c.indexer,
                c.rope,
                dtype=c.dtype,
                rngs=rngs,
            )

    @classmethod
    def from_hf(cls, config: AttentionConfig, layer_idx: int, weights: dict, **kwargs) -> DeepseekV4Attention:
        """A layer with transformers weights, by :func:`jax_oc128.pretrained.load_part` (each tensor checked).

        Args:
          config: the layer's config, ``ModelConfig.from_hf(hf_config).attention(layer_type, runtime)``.
          layer_idx: the layer's index in the model (the weights' names).
          weights: that layer's state-dict entries (numpy arrays), named as in transformers, with or without
            the ``model.layers.{i}.self_attn.`` prefix (or DeepSeek's full names, ``layers.{i}.attn.``).
          kwargs: ``max_draft``, ``compress_layer``, ``rngs`` of the constructor.
        """
        from jax_oc128.pretrained import load_part  # (the loading pipeline imports the model)

        module = cls(config, rngs=kwargs.pop("rngs", nnx.Rngs(0)), **kwargs)
        prefix = f"model.layers.{layer_idx}."
        paths = nn_weights.hf_paths(module, nn_weights.LAYER, within=("attn",))
        paths = {prefix + name: path for name, path in paths.items()}
        load_part(module, paths, weights, prefix + "self_attn.", layer_idx + 1)
        return module

    def init_cache(self, batch: int, max_len: int | None = None) -> AttentionCache:
        """An empty cache for ``batch`` rows and sequences up to ``max_len`` tokens (default: the config's
        ``max_position_embeddings``): :meth:`AttentionCache.create` of this layer's config."""
        return AttentionCache.create(self.config, self.max_draft, batch, max_len)

    def init_compressed(self, batch: int, backend: Backend = ONLINE) -> State | None:
        """A fresh C128 state of ``backend`` for this layer alone (``compress_layer + 1`` layers, ``batch``
        slots), for standalone use (in a model the model makes one for all its HCA layers); None but for an
        HCA layer."""
        if self.config.layer_type != HCA:
            return None
        return self.compressor.init_state(batch, backend)

    def __call__(self, x, cache: AttentionCache, compressed: State | None, forward_batch: ForwardBatch):
        """Attention over the window, the new tokens (causal) and the visible compressed entries.

        Args:
          x: ``[batch, T, hidden]`` float32.
          cache: this layer's :class:`AttentionCache`.
          compressed: the prepared (:func:`~jax_oc128.nn.forward.prepare_forward`) layer-stacked compressor
            state; HCA layers only, other layers pass it through.
          forward_batch: the forward's :class:`~jax_oc128.nn.forward.ForwardBatch`. Its mode
            ``TARGET_VERIFY``: the compressor writes its banks, and the caller then keeps ``accept`` of them
            (:func:`~jax_oc128.nn.forward.commit_verify`) or leaves them pending (the row's next forward
            commits them from its positions). Its tree (a verify; a draft level: sliding layers only):
            token i is node ``nodes[i]`` at ``base + tree.depths[nodes[i]]`` (``base`` the root's position)
            and attends to the window before the root, to its ancestors among the tokens (``tree.mask``), to
            the ring rows of its ancestors that earlier calls of this tree wrote, and (HCA, CSA) to the
            entries complete before the root and those its ancestors or itself closed; node n's window row
            goes to ring row ``(base + n) % R`` until :meth:`AttentionCache.keep_path` keeps the accepted
            path. Without a tree the tokens are a chain (consecutive positions, causal). Its page table: the
            pages of the pool (``cache.entries``, ``cache.index_keys``) holding each row's entries.

        Returns:
          ``(y [batch, T, hidden], cache, compressed)``.
        """
        c, fb, positions = self.config, forward_batch, forward_batch.positions
        tokens = x.shape[1]
        if c.layer_type != SLIDING and not fb.every_node:
            raise ValueError(
                f"nodes: an {c.layer_type} layer verifies every node of the tree at once, got {fb.nodes}"
            )
        if c.layer_type == HCA and compressed is None:
            raise ValueError("compressed: an HCA layer needs the C128 state (init_compressed), got None")
        q_res = rms_norm(linear(x, self.q_a_proj[...]), self.q_a_norm[...], c.rms_norm_eps)
        kv = c.rope.apply(
            rms_norm(linear(x, self.kv_proj[...]), self.kv_norm[...], c.rms_norm_eps), positions
        )
        kv = kv_cache.round_trip(kv, cache.window)  # as the window stores it

        keys, visible = _window_keys(
            fb, kv_cache.decode(cache.window), cache.window_positions, kv, c.sliding_window
        )
        # what the queries attend to besides the window: an HCA layer's entries, by who sees them
        # (EntriesSeen); a CSA layer's picks, made in the loop by the indexer (IndexerQueries)
        entries, seen = None, None  # seen: by query, sliced by attend.by_query_blocks
        if c.layer_type == HCA:
            with jax.named_scope("compressor"):
                cache, compressed, entries, seen = self._compress(x, cache, compressed, fb)
        if c.layer_type == CSA:
            with jax.named_scope("compressor"):
                cache, entries, index_keys, limit, nodes = self._compress_sparse(x, cache, fb)
            seen = IndexerQueries(head_weights=self.compressor.index_weights(x), limit=limit, nodes=nodes)

        def queries(keys, visible, q_res, positions, seen):
            """The outputs ``[batch, L, hidden]`` of L of the queries (:func:`attend.by_query_blocks`)."""
            extra, extra_visible, picks = None, None, None  # a sliding layer's
            if c.layer_type == HCA:
                extra, extra_visible = entries, seen.visible
            if c.layer_type == CSA:
                with jax.named_scope("indexer"):
                    extra = entries
                    impl = self.attention_impl
                    picks = self.compressor.select(q_res, positions, seen, index_keys, impl=impl)
            q = linear(q_res, self.q_b_proj[...], name=("attn", "q_b_proj"))
            q = q.reshape(*q_res.shape[:2], c.num_heads, c.head_dim)
            q = c.rope.apply(rms_norm(q, 1.0, c.rms_norm_eps), positions)  # per head, unweighted
            out = attend.attend(
                q,
                keys,
                visible,
                extra,
                extra_visible,
                self.sinks[...],
                c.head_dim**-0.5,
                impl=self.attention_impl,
                entries_prefix=fb.tree is None,
                picks=picks,
            )
            grouped = c.rope.apply(out, positions, inverse=True).reshape(*q.shape[:2], c.o_groups, -1)
            # [batch, L, groups, o_lora_rank]
            o_a = linear(grouped, self.o_a_proj[...], groups=c.o_groups, name=("attn", "o_a_proj"))
            return linear(o_a.reshape(*q.shape[:2], -1), self.o_b_proj[...], name=("attn", "o_b_proj"))

        y = attend.by_query_blocks(queries, keys, visible, (q_res, positions, seen), tokens)
        return y, self._update_window(cache, kv, fb), compressed

    def _update_window(self, cache, kv, forward_batch: ForwardBatch):
        """Write the last ``R`` valid new rows into the window ring (row ``ring % R``, ``ring`` the
        position, or a tree node's row)."""
        fb, window = forward_batch, cache.window.shape[1]
        positions, lengths = fb.positions, fb.lengths
        ring = positions if fb.tree is None else fb.base + jnp.asarray(fb.nodes)[None]
        t = jnp.arange(positions.shape[1])[None]
        write = (t < lengths[:, None]) & (t >= lengths[:, None] - window)
        index = jnp.where(write, ring % window, window)
        rows = jnp.arange(positions.shape[0])[:, None]
        return dataclasses.replace(
            cache,
            window=kv_cache.store(cache.window, (rows, index), kv),
            window_positions=cache.window_positions.at[rows, index].set(positions, mode="drop"),
        )

    def _compress(self, x, cache, compressed, forward_batch: ForwardBatch):
        """An HCA layer's compressor (:class:`~jax_oc128.nn.hca.HCACompressor`) on its layer of the
        prepared state; the entries it closed stored (a tree verify's by node in ``tree_entries``, until
        :meth:`AttentionCache.keep_path`). Returns ``(cache, compressed, entries [batch, E, D], seen)``: the
        entries the tokens may attend to (zero where no token sees them: a page's earlier contents never
        reach the output) and which of them each sees (:class:`~jax_oc128.nn.hca.EntriesSeen` of
        :func:`_entries_visibility`)."""
        fb, page_table = forward_batch, forward_batch.page_table
        compressed, closed, blocks = self.compressor(x, compressed, fb)
        stored = kv_cache.slot_entries(cache.entries, page_table)
        read = fb.read_entries(stored, BLOCK)
        if fb.tree is None:  # the chain's kernels give the entries by block index
            index = jnp.where(blocks >= 0, blocks, stored)
            at = kv_cache.locate(cache.entries, page_table, jnp.arange(x.shape[0])[:, None], index)
            cache = dataclasses.replace(cache, entries=kv_cache.store(cache.entries, at, closed))
            entries = kv_cache.decode(kv_cache.slot_view(cache.entries, page_table, read))
        else:  # a tree verify's by node
            closed = kv_cache.encode(closed, cache.tree_entries)
            cache = dataclasses.replace(cache, tree_entries=kv_cache.put_nodes(cache.tree_entries, closed))
            view = kv_cache.slot_view(cache.entries, page_table, read)
            entries = jnp.concatenate([kv_cache.decode(view), kv_cache.decode(closed)], axis=1)
        visible = _entries_visibility(fb, read, BLOCK, blocks)
        entries = jnp.where(jnp.any(visible, axis=1)[..., None], entries, 0.0)
        return cache, compressed, entries, EntriesSeen(visible=visible)

    def _compress_sparse(self, x, cache, forward_batch: ForwardBatch):
        """A CSA layer's compressor (:mod:`~jax_oc128.nn.csa`): fold the new tokens into the cache (a tree
        verify's windows by node in ``tree_entries``, ``tree_index_keys``). Returns ``(cache, entries, keys
        [batch, E, index_head_dim], limit, nodes)``: the E entries (a
        :class:`~jax_oc128.nn.kv_cache.SlotEntries`, the picks read where they are stored) and indexer keys
        (stored values, in order) the tokens may pick from, a tree's nodes' last, and which of them each
        sees (:func:`_entries_limit`), for :meth:`CSACompressor.select
        <jax_oc128.nn.csa.CSACompressor.select>`."""
        fb, page_table, compressor = forward_batch, forward_batch.page_table, self.compressor
        read = fb.read_entries(kv_cache.slot_entries(cache.entries, page_table), csa.RATE)
        if fb.tree is None:
            rows, entries, keys = compressor.compress(x, cache.rows, cache.entries, cache.index_keys, fb)
            cache = dataclasses.replace(cache, rows=rows, entries=entries, index_keys=keys)
            node_entries, node_keys, windows = None, None, None
        else:
            rows, node_entries, node_keys, windows = compressor.compress_tree(x, cache.rows, fb)
            node_entries = kv_cache.encode(node_entries, cache.tree_entries)
            node_keys = kv_cache.encode(node_keys, cache.tree_index_keys)
            cache = dataclasses.replace(
                cache,
                rows=rows,
                tree_entries=kv_cache.put_nodes(cache.tree_entries, node_entries),
                tree_index_keys=kv_cache.put_nodes(cache.tree_index_keys, node_keys),
            )
        entries = kv_cache.SlotEntries(cache.entries, page_table, node_entries, read)
        keys = kv_cache.SlotEntries(cache.index_keys, page_table, node_keys, read).view()
        return (cache, entries, keys, *_entries_limit(fb, csa.RATE, windows))
