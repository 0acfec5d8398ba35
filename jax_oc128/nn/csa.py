"""The compressor and lightning indexer of DeepSeek-V4's compressed sparse attention (CSA, ratio 4), as
transformers' ``DeepseekV4CSACompressor`` and ``DeepseekV4Indexer`` (5.24.0) define them.

Every token projects a value ``kv`` and a gate of width ``2 * dim`` for the attention's entries (dim =
``head_dim``) and for the indexer's keys (dim = ``index_head_dim``): half A (the first ``dim`` channels)
feeds the next window's entry, half B the token's own window's. Entry w pools 8 slots per channel, the A
halves of tokens ``4w - 4 .. 4w - 1`` and the B halves of tokens ``4w .. 4w + 3``, by the softmax of gate +
``ape[j]``; then its RMSNorm and RoPE at position ``4w``. It exists once token ``4w + 3`` has been seen and
is visible to the queries at ``t >= 4w + 3``. The indexer scores each query against the visible keys,
``Σ_h (x·W_wᵀ)_h nI^-½ ReLU(q_h · K_w) dI^-½``, and the attention sees the top ``index_topk`` entries.

State: the raw projected rows (``[kv | gate]``, no ape) of the last ``2 * RATE + max_draft`` positions per
row, in a ring addressed by position (``p % ring``), and the entries and indexer keys by window index. As in
:class:`~jax_oc128.OfflineState`, a verify's rejected drafts need no rollback: their rows and entries are
rewritten by the positions that replace them before any query may read them. Activations and pooling are
float32; the projections' weights are float32 or bfloat16 (:mod:`~jax_oc128.nn.functional`); the state is
stored as the attention's caches are (:mod:`~jax_oc128.nn.kv_cache`), every raw row rounded to it before it
is pooled, so that a window pools the same values from the ring as from a call's own tokens.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jax_oc128 import indexer_op
from jax_oc128.nn import attend, kv_cache
from jax_oc128.nn.forward import ForwardBatch
from jax_oc128.nn.functional import FULL, normal_param, ones_param, rms_norm, zeros_param
from jax_oc128.nn.linear import linear
from jax_oc128.reference import pool

#: tokens per CSA window (transformers' ``compress_rates["compressed_sparse_attention"]``)
RATE = 4
#: raw rows an entry reads before the window it closes: the previous window's A halves and its own
LOOKBACK = 2 * RATE
#: the fewest indexer keys scored at once per query (:meth:`CSACompressor.select`; at least ``index_topk``)
KEY_CHUNK = 1024
#: bytes of the indexer's per-head scores of a chunk of keys, ``[batch, L, index_heads, chunk]`` float32, that
#: :func:`key_chunk` sizes the chunk to (more keys where fewer queries: a decode's every key in one chunk)
SCORE_BYTES = 256 * 2**20
#: the same where the scores come from the indexer op (``attention_impl`` "kernel"): fewer top-k merges
KERNEL_KEY_CHUNK = 8192


def key_chunk(batch: int, tokens: int, heads: int, count: int, least: int) -> int:
    """The indexer keys scored at once (static) by ``tokens`` queries of ``batch`` rows with ``heads`` index
    heads over ``count`` keys: the fewest equal chunks whose per-head scores (``[batch, tokens, heads,
    chunk]`` float32) fit :data:`SCORE_BYTES`, each at least ``least`` keys (and at most ``count``)."""
    fits = max(least, SCORE_BYTES // (4 * batch * tokens * heads))
    chunks = -(-count // fits)
    return min(count, max(least, -(-count // chunks)))


def bf16_keys(keys):
    """The stored indexer keys ``[batch, E, dim]`` as bfloat16 where every value they hold is a bfloat16
    (static, by format), else None: bfloat16 arrays; :class:`~jax_oc128.nn.kv_cache.FP4Keys` (e2m1, 2
    significant bits, times ``2^e`` with ``e >= -125``: zero or normal); :class:`~jax_oc128.nn.kv_cache.
    FP8Entries` (e4m3, 4 significant bits, times a power of two, and bfloat16 RoPE channels; only a key whose
    scale is the floor ``2^-125``, ``max |key| < 2^-117``, may hold e4m3 subnormals ``j 2^-134`` below
    bfloat16's subnormals, float32 subnormals that round here). float32 arrays: None."""
    if isinstance(keys, kv_cache.FP4Keys | kv_cache.FP8Entries):
        return kv_cache.decode(keys).astype(jnp.bfloat16)
    return keys if keys.dtype == jnp.bfloat16 else None


def split_bf16(q):
    """``q`` ``[..., d]`` float32 as three bfloat16 parts side by side, ``[hi | mid | lo]`` ``[..., 3 d]``:
    ``hi`` is ``q``'s leading 8 significant bits (its encoding's low 16 bits cleared), ``mid`` the same of
    the remainder, ``lo`` what is left, so ``hi + mid + lo == q`` exactly for ``|q| >= 2^-110`` (24
    significant bits in three parts of 8; each remainder is exact in float32) and zero. Below, ``lo`` falls
    under bfloat16's subnormals: ``q`` loses bits under ``2^-133``. The parts are cut by bits, not by a
    float32 -> bfloat16 -> float32 round trip, which XLA's GPU compiler may drop as excess precision (every
    remainder then zero)."""

    def lead(x):
        bits = jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000)
        return jax.lax.bitcast_convert_type(bits, jnp.float32)

    hi = lead(q)
    mid = lead(q - hi)
    lo = q - hi - mid
    return jnp.concatenate([hi, mid, lo], axis=-1).astype(jnp.bfloat16)


def key_products(q, keys):
    """``q · k`` per head, ``[batch, L, heads, E]`` float32, of the queries ``q`` ``[batch, L, heads, dim]``
    float32 and the stored keys ``keys`` ``[batch, E, dim]``. Keys of bfloat16 values (:func:`bf16_keys`):
    one bfloat16 contraction of ``3 dim`` channels on the tensor cores, :func:`split_bf16`'s parts against
    the keys thrice, every product ``part * k`` exact in float32 (8 by 8 significant bits) and summed in
    float32, as float32 products are; only the order of the sum differs. float32 keys: a float32 product."""
    k = bf16_keys(keys)
    if k is None:
        return jnp.einsum("bthi,bei->bthe", q, kv_cache.decode(keys), precision=FULL)
    k3 = jnp.concatenate([k, k, k], axis=-1)
    return jnp.einsum("bthc,bec->bthe", split_bf16(q), k3, preferred_element_type=jnp.float32)


def ring_rows(max_draft: int) -> int:
    """Rows of the raw ring: a call reads positions down to ``seq_len - (LOOKBACK - 1)`` that the previous
    call (at most ``max_draft`` tokens past ``seq_len - 1``) must not have overwritten."""
    return LOOKBACK + max_draft


def row_width(head_dim: int, index_head_dim: int) -> int:
    """Channels of a raw ring row: ``[kv | gate]``, each ``[A | B]`` of ``head_dim + index_head_dim``."""
    return 4 * (head_dim + index_head_dim)


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
    """The lightning indexer's static configuration."""

    num_heads: int  # index_n_heads
    head_dim: int  # index_head_dim
    topk: int  # index_topk


class IndexerQueries(NamedTuple):
    """A CSA layer's T queries' inputs of the indexer (:meth:`CSACompressor.select`), carried through its
    attention's loop over query blocks (:func:`~jax_oc128.nn.attend.by_query_blocks`, which slices it by
    query).

    Attributes:
      head_weights: ``[batch, T, index_heads]`` float32 (:meth:`CSACompressor.index_weights`).
      limit: ``[batch, T]`` int32: a query sees the stored entries below it (0: none).
      nodes: None, or (a tree verify) ``[batch, T, N]`` bool: which of the last N entries (the nodes') each
        query sees.
    """

    head_weights: jax.Array
    limit: jax.Array
    nodes: jax.Array | None


class CSACompressor(nnx.Module):
    """The CSA compressor and indexer parameters of one attention layer (named in
    :data:`jax_oc128.nn.weights.LAYER`).

    Args:
      hidden_size, head_dim, q_lora_rank, rms_norm_eps: the attention layer's.
      indexer: the :class:`IndexerConfig`.
      rope: the layer's (compress) :class:`~jax_oc128.nn.RopeConfig`, for entries, keys and indexer queries.
      dtype: the projections' weights' (a name in :data:`~jax_oc128.nn.functional.DTYPES`).
    """

    def __init__(
        self,
        hidden_size,
        head_dim,
        q_lora_rank,
        rms_norm_eps,
        indexer: IndexerConfig,
        rope,
        *,
        dtype: str = "float32",
        rngs,
    ):
        self.head_dim, self.eps, self.indexer, self.rope = head_dim, rms_norm_eps, indexer, rope
        index_dim = indexer.head_dim
        self.kv_proj = normal_param(rngs, 2 * head_dim, hidden_size, dtype=dtype)
        self.gate_proj = normal_param(rngs, 2 * head_dim, hidden_size, dtype=dtype)
        self.ape = zeros_param(RATE, 2 * head_dim)
        self.kv_norm = ones_param(head_dim)
        self.indexer_kv_proj = normal_param(rngs, 2 * index_dim, hidden_size, dtype=dtype)
        self.indexer_gate_proj = normal_param(rngs, 2 * index_dim, hidden_size, dtype=dtype)
        self.indexer_ape = zeros_param(RATE, 2 * index_dim)
        self.indexer_kv_norm = ones_param(index_dim)
        self.indexer_q_b_proj = normal_param(rngs, indexer.num_heads * index_dim, q_lora_rank, dtype=dtype)
        self.indexer_weights_proj = normal_param(rngs, indexer.num_heads, hidden_size, dtype=dtype)

    @property
    def row_width(self) -> int:
        """Channels of a raw ring row (:func:`row_width`)."""
        return row_width(self.head_dim, self.indexer.head_dim)

    def _by_half(self, main, index):
        """``[A | B]`` along the last axis, each half the attention's then the indexer's channels."""
        d, di = self.head_dim, self.indexer.head_dim
        return jnp.concatenate([main[..., :d], index[..., :di], main[..., d:], index[..., di:]], axis=-1)

    def _rows(self, x, ring):
        """The raw rows ``[batch, T, row_width]`` float32 of ``x`` ``[batch, T, hidden]``, rounded to the
        format of the ``ring`` they go to."""
        kv = self._by_half(linear(x, self.kv_proj[...]), linear(x, self.indexer_kv_proj[...]))
        gate = self._by_half(linear(x, self.gate_proj[...]), linear(x, self.indexer_gate_proj[...]))
        return kv_cache.round_trip(jnp.concatenate([kv, gate], axis=-1), ring)

    def compress(self, x, rows, entries, keys, forward_batch: ForwardBatch):
        """Fold the new tokens (a chain: consecutive positions) into the state: pool every window they
        close, then write their raw rows.

        Args:
          x: ``[batch, T, hidden]``.
          rows: ``[batch, ring, row_width]``; entries: ``[batch, E, head_dim]``; keys: ``[batch, E,
            index_head_dim]``, by window index; each stored in its cache format
            (:mod:`~jax_oc128.nn.kv_cache`). Paged (the record's ``page_table``): the entries and keys are
            pools of pages, written through the page table.
          forward_batch: the forward's :class:`~jax_oc128.nn.forward.ForwardBatch`.

        Returns:
          ``(rows, entries, keys)`` updated.
        """
        batch, tokens, _ = x.shape
        ring, positions, lengths = rows.shape[1], forward_batch.positions, forward_batch.lengths
        page_table = forward_batch.page_table
        new = self._rows(x, rows)
        seq_lens = positions[:, 0]
        windows = seq_lens[:, None] // RATE + jnp.arange((tokens + RATE - 1) // RATE + 1)  # [batch, W]
        closed = (windows + 1) * RATE <= (seq_lens + lengths)[:, None]
        # the 8 slots of each window: previous window's tokens (A halves), then its own (B halves)
        slot_pos = windows[..., None] * RATE + jnp.arange(-RATE, RATE)  # [batch, W, 8]
        is_new = slot_pos >= seq_lens[:, None, None]
        from_new = jnp.take_along_axis(
            new, jnp.clip(slot_pos - seq_lens[:, None, None], 0, tokens - 1).reshape(batch, -1, 1), axis=1
        ).reshape(*slot_pos.shape, -1)
        main, index = self._pool(rows, from_new, is_new, slot_pos)
        index_at = jnp.where(closed, windows, kv_cache.slot_entries(entries, page_table))
        slots = jnp.arange(batch)[:, None]
        entries = kv_cache.store(entries, kv_cache.locate(entries, page_table, slots, index_at), main)
        keys = kv_cache.store(keys, kv_cache.locate(keys, page_table, slots, index_at), index)

        t = jnp.arange(tokens)[None]
        write = (t < lengths[:, None]) & (t >= lengths[:, None] - ring)
        rows = kv_cache.store(
            rows, (jnp.arange(batch)[:, None], jnp.where(write, positions % ring, ring)), new
        )
        return rows, entries, keys

    def compress_tree(self, x, rows, forward_batch: ForwardBatch):
        """A tree verify's windows (the record's tree, the T tokens every node: node k at ``base +
        depths[k]``, ``base`` the root's position): each node that closes a window pools it from the nodes
        of its own path and the ring's earlier rows. Nothing is written by window index (branches close the
        same window differently); node k's raw row goes to ring row ``(base + k) % ring`` until the
        attention's ``keep_path``.

        Returns ``(rows, entries [batch, T, head_dim], keys [batch, T, index_head_dim], windows [batch, T])``:
        per node the entry and indexer key (float32) of the window it closes, and that window's index (-1 if
        none)."""
        batch, tokens, _ = x.shape
        ring, tree, lengths = rows.shape[1], forward_batch.tree, forward_batch.lengths
        base = forward_batch.base[:, 0]
        new = self._rows(x, rows)
        positions = base[:, None] + jnp.asarray(tree.depths)  # [batch, T]
        windows = positions // RATE
        slot_pos = windows[..., None] * RATE + jnp.arange(-RATE, RATE)  # [batch, T, 8]
        depth = slot_pos - base[:, None, None]  # a slot's depth on the node's path; < 0: before the root
        paths = jnp.asarray(tree.paths)  # [T, depth + 1]
        node = paths[jnp.arange(tokens)[None, :, None], jnp.clip(depth, 0, paths.shape[1] - 1)]
        from_new = new[jnp.arange(batch)[:, None, None], jnp.maximum(node, 0)]  # [batch, T, 8, width]
        main, index = self._pool(rows, from_new, depth >= 0, slot_pos)
        closes = (positions + 1) % RATE == 0
        t = jnp.arange(tokens)[None]
        at = jnp.where(t < lengths[:, None], (base[:, None] + t) % ring, ring)
        rows = kv_cache.store(rows, (jnp.arange(batch)[:, None], at), new)
        return rows, main, index, jnp.where(closes, windows, -1)

    def _pool(self, rows, from_new, is_new, slot_pos):
        """The normed, rotated entries and indexer keys of windows whose 8 slots are at ``slot_pos`` ``[batch,
        W, 8]`` (window ``slot_pos[..., RATE] // RATE``): the rows ``from_new`` ``[batch, W, 8, row_width]``
        where ``is_new``, else the ring's (``rows``)."""
        batch, ring, width = *rows.shape[:2], self.row_width
        from_ring = kv_cache.decode(
            jnp.take_along_axis(rows, (slot_pos % ring).reshape(batch, -1, 1), axis=1)
        )
        slot_rows = jnp.where(is_new[..., None], from_new, from_ring.reshape(*slot_pos.shape, width))
        half = width // 4
        is_b = jnp.arange(LOOKBACK) >= RATE  # [8]
        kv = jnp.where(is_b[:, None], slot_rows[..., half : 2 * half], slot_rows[..., :half])
        gate = jnp.where(is_b[:, None], slot_rows[..., 3 * half :], slot_rows[..., 2 * half : 3 * half])
        ape = self._by_half(self.ape[...], self.indexer_ape[...])  # [4, 2 * half]
        ape = jnp.where(is_b[:, None], jnp.tile(ape[:, half:], (2, 1)), jnp.tile(ape[:, :half], (2, 1)))
        gate = jnp.where((slot_pos >= 0)[..., None], gate + ape, -jnp.inf)
        _, _, pooled = pool(gate, kv, axis=2)  # [batch, W, half]
        start = slot_pos[..., RATE]  # the window's first position
        main = self.rope.apply(rms_norm(pooled[..., : self.head_dim], self.kv_norm[...], self.eps), start)
        index = self.rope.apply(
            rms_norm(pooled[..., self.head_dim :], self.indexer_kv_norm[...], self.eps), start
        )
        return main, index

    def index_weights(self, x):
        """The indexer's weights of its heads per query, ``[batch, T, index_heads]`` float32, of ``x``
        ``[batch, T, hidden]`` (:class:`IndexerQueries`' ``head_weights``)."""
        return linear(x, self.indexer_weights_proj[...]) * self.indexer.num_heads**-0.5

    def select(self, q_res, positions, queries: IndexerQueries, keys, *, impl: str = "jnp"):
        """The indexer's picks for L queries: ``[batch, L, k]`` int32 indices of the entries, the top ``k =
        min(index_topk, E)`` of those each query sees by its score (ties: the lower index first, as
        ``lax.top_k``), -1 past the visible ones where fewer than k are visible. The scores are made a
        chunk of keys at a time (:func:`key_chunk`: a decode's every key at once, a long chain's query group
        about :data:`KEY_CHUNK`), each chunk's merged into a running top k, so that no ``[L, index_heads,
        E]`` tensor past :data:`SCORE_BYTES` exists. The products come from :func:`key_products`; the
        score ``Σ_h w_h ReLU(q_h · k) dI^-½`` is a float32 multiply and sum over the heads.

        Args:
          q_res: ``[batch, L, q_lora_rank]`` float32: the queries' normed LoRA residual.
          positions: ``[batch, L]`` int32.
          queries: the L queries' :class:`IndexerQueries`.
          keys: ``[batch, E, index_head_dim]``: the stored indexer keys (``E - N`` stored entries', then the
            nodes'), read in float32.
          impl: the layer's ``attention_impl`` (:func:`~jax_oc128.nn.attend.resolve`): where it resolves to
            ``"kernel"``, the scores come from the indexer op (:func:`jax_oc128.indexer_op.indexer_scores`,
            :data:`KERNEL_KEY_CHUNK` keys at a time) on the queries and keys rounded to bfloat16.
        """
        c, limit, nodes = self.indexer, queries.limit, queries.nodes
        batch, tokens = q_res.shape[:2]
        q = linear(q_res, self.indexer_q_b_proj[...]).reshape(batch, tokens, c.num_heads, c.head_dim)
        q = self.rope.apply(q, positions)
        count = kv_cache.rows(keys)
        k = min(c.topk, count)
        stored = count - (0 if nodes is None else nodes.shape[2])
        kernel = attend.resolve(impl) == "kernel"
        if kernel:
            chunk = min(count, max(KERNEL_KEY_CHUNK, k))
        else:
            chunk = key_chunk(batch, tokens, c.num_heads, count, max(KEY_CHUNK, k))
        q_op = q.astype(jnp.bfloat16) if kernel else None

        def scores(i):
            """Chunk i's scores ``[batch, L, chunk]`` (-inf where unseen) and its entries' indices. The last
            chunk ends at the last key: those of its keys an earlier chunk scored are unseen here."""
            start = jnp.minimum(i * chunk, count - chunk)
            index = start + jnp.arange(chunk)
            part = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, chunk, axis=1), keys)
            if kernel:  # the op's limit: the chain's, or every key (a tree's nodes are masked below)
                below = jnp.minimum(limit, stored) - start if nodes is None else chunk
                score = indexer_op.indexer_scores(
                    q_op,
                    kv_cache.decode(part).astype(jnp.bfloat16),
                    queries.head_weights,
                    jnp.broadcast_to(below, limit.shape).astype(jnp.int32),
                    scale=c.head_dim**-0.5,
                )
            else:
                relu = jax.nn.relu(key_products(q, part)) * c.head_dim**-0.5
                score = jnp.sum(queries.head_weights[..., None] * relu, axis=2)
            seen = index < jnp.minimum(limit, stored)[..., None]
            if nodes is not None:
                node = index - stored
                seen |= (node >= 0) & nodes[..., jnp.clip(node, 0, nodes.shape[2] - 1)]
            return jnp.where(seen & (index >= i * chunk), score, -jnp.inf), index

        def merge(running, i):
            """The running top k merged with chunk i's scores. The running picks' indices are lower than the
            chunk's new keys', so the concatenation keeps ``lax.top_k``'s order among equal scores; its
            unseen ones (-inf) come first, so an unseen key is picked once."""
            top, picks = running
            score, index = scores(i)
            top, at = jax.lax.top_k(jnp.concatenate([top, score], axis=-1), k)
            candidates = jnp.concatenate([picks, jnp.broadcast_to(index, score.shape)], axis=-1)
            return (top, jnp.take_along_axis(candidates, at, axis=-1)), None

        first = tuple(jax.lax.top_k(scores(0)[0], k))
        (top, picks), _ = jax.lax.scan(merge, first, jnp.arange(1, -(-count // chunk)))
        return jnp.where(top > -jnp.inf, picks, -1)
