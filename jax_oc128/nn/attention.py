"""Flax NNX DeepSeek-V4 attention with the C128 compressed state threaded through explicitly.

:class:`DeepseekV4Attention` follows Hugging Face transformers' ``DeepseekV4Attention`` (5.24.0) for the
layer types ``sliding_attention``, ``compressed_sparse_attention`` (CSA, ratio 4 with the lightning indexer,
:mod:`~jax_oc128.nn.csa`) and ``heavily_compressed_attention`` (HCA, C128). Modules hold parameters only;
caches go in and come out as pytrees (donate them to the enclosing jit).

A CSA layer keeps its compressor's raw rows, entries and indexer keys in its own
:class:`AttentionCache`. The C128 compressor state is not the layer's: one layer-stacked state
(:class:`~jax_oc128.CompressState` or :class:`~jax_oc128.OfflineState`) holds every C128 layer of a
model, and each layer writes its own ``compress_layer`` of it. The controller's once-per-forward transition
runs before the layers (:func:`prepare_forward`), so a standalone layer is driven like this::

    compressed = prepare_forward(attn.backend, compressed, mode, positions, lengths)
    y, cache, compressed = attn(x, positions, cache, compressed, lengths=lengths, mode=mode)
    compressed = attn.commit(compressed, seq_lens, accept_lens)  # after a verify: eager, or leave it pending

Shapes: ``x`` ``[batch, T, hidden]`` float32 (the layer input after its input norm), ``positions``
``[batch, T]`` int32, consecutive per row, ``lengths`` ``[batch]`` int32. Batch row b is slot b of the
compressed state. Activations and caches are float32; the weights are float32 or bfloat16, their matmuls
accumulating in float32 (:mod:`~jax_oc128.nn.functional`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_oc128.controller import ONLINE, Backend, ForwardMode
from jax_oc128.nn import csa
from jax_oc128.nn.csa import CSACompressor, IndexerConfig
from jax_oc128.nn.functional import FULL, assign_weights, linear, normal_param, ones_param, rms_norm
from jax_oc128.nn.rope import RopeConfig
from jax_oc128.rules import BLOCK, drop_index
from jax_oc128.tree import Tree, check_tree

SLIDING, HCA, CSA = "sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention"


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Static configuration of one attention layer (the fields of transformers' ``DeepseekV4Config``)."""

    layer_type: str
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

    @classmethod
    def from_hf(cls, config: dict, layer_idx: int) -> AttentionConfig:
        """From ``DeepseekV4Config.to_dict()``."""
        layer_type = config["layer_types"][layer_idx]
        if layer_type not in (SLIDING, CSA, HCA):
            raise ValueError(f"layer_types[{layer_idx}]: unknown layer type {layer_type!r}")
        for kind, rate in ((HCA, BLOCK), (CSA, csa.RATE)):
            if config.get("compress_rates", {}).get(kind, rate) != rate:
                raise NotImplementedError(f"compress_rates[{kind!r}] must be {rate}")
        rope_kind = "main" if layer_type == SLIDING else "compress"
        indexer = None
        if layer_type == CSA:
            indexer = IndexerConfig(config["index_n_heads"], config["index_head_dim"], config["index_topk"])
        return cls(
            layer_type=layer_type,
            hidden_size=config["hidden_size"],
            num_heads=config["num_attention_heads"],
            head_dim=config["head_dim"],
            q_lora_rank=config["q_lora_rank"],
            o_groups=config["o_groups"],
            o_lora_rank=config["o_lora_rank"],
            sliding_window=config["sliding_window"],
            rms_norm_eps=config["rms_norm_eps"],
            rope=RopeConfig.from_hf(config["rope_parameters"][rope_kind], config["head_dim"]),
            max_position_embeddings=config["max_position_embeddings"],
            indexer=indexer,
        )

    @property
    def compress_rate(self) -> int:
        """Tokens per compressed entry: 128 (HCA), 4 (CSA), 0 for a sliding layer."""
        return {SLIDING: 0, CSA: csa.RATE, HCA: BLOCK}[self.layer_type]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionCache:
    """One layer's cache for a batch, a pytree (the compressor state is the model's, see the module doc).

    Attributes:
      window: ``[batch, R, D]`` float32: a ring of the last rotated K=V rows, row ``p % R`` holding
        position p. ``R = sliding_window + max_draft``, so that a verify's rejected drafts never overwrite
        a row that the window still needs.
      window_positions: ``[batch, R]`` int32: the position held by each ring row, -1 for none.
      entries: ``[batch, max_entries, D]`` float32: normed, rotated compressed entries by block index (HCA
        and CSA; zero-sized for sliding layers).
      index_keys: ``[batch, max_entries, index_head_dim]`` float32: the CSA indexer's keys by window index
        (zero-sized for other layers).
      rows: ``[batch, ring, row_width]`` float32: the CSA compressor's raw rows by position
        (:mod:`~jax_oc128.nn.csa`; zero-sized for other layers).
      tree_entries: ``[batch, max_draft, D]`` float32: an HCA or CSA layer's entries of the last tree verify
        by node (the entry of the block or window the node closes; normed, rotated), until :meth:`keep_path`
        stores the accepted path's (zero-sized for sliding layers).
      tree_index_keys: ``[batch, max_draft, index_head_dim]`` float32: the same for a CSA layer's indexer keys
        (zero-sized for other layers).
    """

    window: jax.Array
    window_positions: jax.Array
    entries: jax.Array
    index_keys: jax.Array
    rows: jax.Array
    tree_entries: jax.Array
    tree_index_keys: jax.Array

    def keep_path(self, tree: Tree, first_positions, nodes, written=None) -> AttentionCache:
        """After a tree verify or draft (``__call__(..., tree=tree)``) at ``first_positions`` ``[batch]``
        int32 (the root's position), keep the path from the root to ``nodes`` ``[batch]`` int32 (the
        accepted node; -1 leaves the row untouched): its window rows move to where a chain of the path puts
        them (row ``p % R`` for position p) and every other row the tree wrote is emptied, so the rejected
        branches leave no trace. ``written``: the static nodes the tree wrote (default: all); a path node
        not among them leaves its position empty. A chain (:attr:`Tree.is_chain`) was written as the chain
        is, by position: the cache is returned as it is (the positions past the path are rewritten before
        any query reads them)."""
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
        index = jnp.where(on_path & ((at + 1) % rate == 0), at // rate, self.entries.shape[1])
        node = jnp.maximum(path, 0)
        entries = self.entries.at[rows, index].set(self.tree_entries[rows, node], mode="drop")
        kept_cache = dataclasses.replace(kept_cache, entries=entries)
        if self.rows.shape[1]:
            keys = self.index_keys.at[rows, index].set(self.tree_index_keys[rows, node], mode="drop")
            ring_rows = self.rows.shape[1]
            raw = self.rows[rows, (base + node) % ring_rows]
            target = jnp.where(on_path, at % ring_rows, ring_rows)
            raw = self.rows.at[rows, target].set(raw, mode="drop")
            kept_cache = dataclasses.replace(kept_cache, index_keys=keys, rows=raw)
        return kept_cache

    def clear(self, rows) -> AttentionCache:
        """Empty ``rows`` ([n] int32, -1 ignored) for new sequences."""
        index = drop_index(rows, self.window.shape[0])
        return AttentionCache(
            self.window.at[index].set(0, mode="drop"),
            self.window_positions.at[index].set(-1, mode="drop"),
            self.entries.at[index].set(0, mode="drop"),
            self.index_keys.at[index].set(0, mode="drop"),
            self.rows.at[index].set(0, mode="drop"),
            self.tree_entries.at[index].set(0, mode="drop"),
            self.tree_index_keys.at[index].set(0, mode="drop"),
        )


def _check_tree_call(tree, nodes, tokens: int, mode: ForwardMode, layer_type: str) -> tuple[int, ...]:
    """A tree call's ``tree`` and ``nodes`` (default: every node) checked against its ``tokens``, ``mode``
    and layer type; returns the nodes."""
    if not isinstance(tree, Tree):
        raise TypeError(f"tree: a jax_oc128.tree.Tree or None, got {type(tree).__name__}")
    if mode not in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND):
        raise ValueError(f"tree: only for a verify or a draft (TARGET_VERIFY, DRAFT_EXTEND), got mode {mode}")
    nodes = tuple(range(tree.size)) if nodes is None else tuple(nodes)
    if len(nodes) != tokens:
        raise ValueError(f"tree: {len(nodes)} nodes for {tokens} tokens")
    depths = {int(tree.depths[n]) for n in nodes if 0 <= n < tree.size}
    if len(set(nodes)) != len(nodes) or (len(depths) != 1 and nodes != tuple(range(tree.size))):
        raise ValueError(f"nodes: all of the tree's nodes or distinct nodes of one depth, got {nodes}")
    if layer_type != SLIDING and nodes != tuple(range(tree.size)):
        raise ValueError(f"nodes: an {layer_type} layer verifies every node of the tree at once, got {nodes}")
    return nodes


def _tree_visibility(tree: Tree, nodes, base, ring_size: int):
    """What the tokens of ``nodes`` (node i at ``base + depths[i]``, ``base`` ``[batch, 1]`` the root's
    position) see of this tree: ``(ring [batch, T, R], new [T, T])`` bool, the ring rows of their ancestors
    written by earlier calls (node m at row ``(base + m) % R``) and their ancestors among the new tokens."""
    sees = np.asarray(tree.mask)[list(nodes)]  # [T, N]: ancestors or self
    new = sees[:, list(nodes)]
    earlier = sees.copy()
    earlier[:, list(nodes)] = False
    rows = (base + jnp.arange(tree.size)) % ring_size  # [batch, N]: node m's ring row
    at = rows[:, None, :, None] == jnp.arange(ring_size)  # [batch, 1, N, R]
    ring = jnp.any(at & jnp.asarray(earlier)[None, :, :, None], axis=2)
    return ring, jnp.asarray(new)


def _tree_entries_visibility(tree: Tree, base, committed: int, rate: int, closed):
    """What the nodes of a tree verify see of an HCA or CSA layer's entries (blocks or windows of ``rate``
    tokens): ``[batch, N, committed + N]`` bool, of the ``committed`` entries by index those complete before
    the root (``base`` ``[batch, 1]`` its position), then of the nodes' own entries (``closed`` ``[batch, N]``
    the index each node closed, -1 for none) those its ancestors or itself closed."""
    before_root = jnp.arange(committed)[None, None, :] < base[:, :, None] // rate  # [batch, 1, committed]
    batch, nodes = closed.shape
    return jnp.concatenate(
        [
            jnp.broadcast_to(before_root, (batch, nodes, committed)),
            jnp.asarray(tree.mask)[None] & (closed[:, None, :] >= 0),
        ],
        axis=2,
    )


def batch_slots(lengths):
    """``[batch]`` int32: the compressor slot of each batch row, its index; -1 (padding) for rows of
    length 0, which leave every state untouched."""
    return jnp.where(lengths > 0, jnp.arange(lengths.shape[0], dtype=jnp.int32), -1)


def prepare_forward(backend: Backend, compressed, mode: ForwardMode, positions, lengths):
    """The controller's once-per-forward transition of the C128 state before a forward of ``mode`` over
    ``positions`` ``[batch, T]`` with ``lengths`` ``[batch]``: commits what is pending for the rows (one
    launch for all layers), or for a verify hands it to each layer's verify kernel. ``compressed`` None
    (no C128 layer) stays None."""
    if compressed is None:
        return None
    return backend.controller.prepare_forward(compressed, mode, batch_slots(lengths), positions[:, 0])


# transformers state-dict name (within the layer's self_attn) -> attribute, for sliding and HCA layers
HF_WEIGHT_NAMES = {
    "q_a_proj.weight": "q_a_proj",
    "q_a_norm.weight": "q_a_norm",
    "q_b_proj.weight": "q_b_proj",
    "kv_proj.weight": "kv_proj",
    "kv_norm.weight": "kv_norm",
    "o_a_proj.weight": "o_a_proj",
    "o_b_proj.weight": "o_b_proj",
    "sinks": "sinks",
    "compressor.kv_proj.weight": "compressor_kv_proj",
    "compressor.gate_proj.weight": "compressor_gate_proj",
    "compressor.position_bias": "compressor_ape",
    "compressor.kv_norm.weight": "compressor_kv_norm",
}


class DeepseekV4Attention(nnx.Module):
    """DeepSeek-V4 attention (sliding, CSA or HCA) with explicit caches.

    Args:
      config: the layer's :class:`AttentionConfig`.
      backend: the C128 compressor backend (:data:`~jax_oc128.controller.ONLINE` or ``OFFLINE``).
      max_draft: the most tokens a verify call may feed (banks of the online state).
      compress_layer: an HCA layer's index in the model's layer-stacked compressor state (the number of
        HCA layers before it); unused for sliding layers.
      rngs: parameter initialisation.
    """

    def __init__(
        self,
        config: AttentionConfig,
        *,
        backend: Backend = ONLINE,
        max_draft: int = 4,
        compress_layer: int = 0,
        rngs: nnx.Rngs,
    ):
        if not isinstance(backend, Backend):
            raise TypeError(f"backend: a jax_oc128.controller.Backend (ONLINE or OFFLINE), got {backend!r}")
        self.config, self.backend, self.max_draft = config, backend, max_draft
        self.compress_layer = compress_layer if config.layer_type == HCA else None
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
        self.sinks = nnx.Param(jnp.zeros((c.num_heads,), jnp.float32))
        if c.layer_type == HCA:
            self.compressor_kv_proj = normal_param(rngs, c.head_dim, c.hidden_size, dtype=c.dtype)
            self.compressor_gate_proj = normal_param(rngs, c.head_dim, c.hidden_size, dtype=c.dtype)
            self.compressor_ape = nnx.Param(jnp.zeros((BLOCK, c.head_dim), jnp.float32))
            self.compressor_kv_norm = ones_param(c.head_dim)
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

    def hf_weight_paths(self) -> dict[str, tuple[str, ...]]:
        """transformers state-dict name (within the layer's ``self_attn``) -> attribute path of this layer."""
        paths = {name: (attr,) for name, attr in HF_WEIGHT_NAMES.items() if hasattr(self, attr)}
        if self.config.layer_type == CSA:
            paths |= {name: ("compressor", attr) for name, attr in csa.HF_WEIGHT_NAMES.items()}
        return paths

    @classmethod
    def from_hf(cls, config: dict, layer_idx: int, weights: dict, **kwargs) -> DeepseekV4Attention:
        """A layer with transformers weights.

        Args:
          config: ``DeepseekV4Config.to_dict()``.
          layer_idx: the layer.
          weights: that layer's state-dict entries (numpy arrays), named as in transformers, with or without
            the ``model.layers.{i}.self_attn.`` prefix.
          kwargs: ``backend``, ``max_draft``, ``compress_layer``, ``rngs`` of the constructor.
        """
        module = cls(
            AttentionConfig.from_hf(config, layer_idx), rngs=kwargs.pop("rngs", nnx.Rngs(0)), **kwargs
        )
        given = {name.split("self_attn.")[-1]: value for name, value in weights.items()}
        assign_weights(module, module.hf_weight_paths(), given, f"model.layers.{layer_idx}.self_attn.")
        return module

    def init_cache(self, batch: int, max_len: int | None = None) -> AttentionCache:
        """An empty cache for ``batch`` rows and sequences up to ``max_len`` tokens (default: the config's
        ``max_position_embeddings``)."""
        c = self.config
        max_len = c.max_position_embeddings if max_len is None else max_len
        rows = c.sliding_window + self.max_draft
        is_csa = c.layer_type == CSA
        max_entries = max_len // c.compress_rate if c.compress_rate else 0
        index_dim = c.indexer.head_dim if is_csa else 0
        return AttentionCache(
            window=jnp.zeros((batch, rows, c.head_dim), jnp.float32),
            window_positions=jnp.full((batch, rows), -1, jnp.int32),
            entries=jnp.zeros((batch, max_entries, c.head_dim), jnp.float32),
            tree_entries=jnp.zeros(
                (batch, self.max_draft if c.layer_type != SLIDING else 0, c.head_dim), jnp.float32
            ),
            tree_index_keys=jnp.zeros((batch, self.max_draft if is_csa else 0, index_dim), jnp.float32),
            index_keys=jnp.zeros((batch, max_entries if is_csa else 0, index_dim), jnp.float32),
            rows=jnp.zeros(
                (batch, csa.ring_rows(self.max_draft), self.compressor.row_width)
                if is_csa
                else (batch, 0, 0),
                jnp.float32,
            ),
        )

    def init_compressed(self, batch: int):
        """A fresh compressor state for this layer alone (``compress_layer + 1`` layers, ``batch`` slots), for
        standalone use (in a model the model makes one for all its HCA layers); None for a sliding layer."""
        if self.compress_layer is None:
            return None
        return self.backend.create(self.compress_layer + 1, batch, self.config.head_dim, self.max_draft)

    def __call__(
        self,
        x,
        positions,
        cache: AttentionCache,
        compressed=None,
        *,
        lengths=None,
        mode=ForwardMode.EXTEND,
        tree: Tree | None = None,
        nodes: tuple[int, ...] | None = None,
    ):
        """Attention over the window, the new tokens (causal) and the visible compressed entries.

        Args:
          x: ``[batch, T, hidden]`` float32; positions: ``[batch, T]`` int32.
          cache: this layer's :class:`AttentionCache`.
          compressed: the prepared (:func:`prepare_forward`) layer-stacked compressor state; HCA layers
            only, sliding layers pass it through.
          lengths: ``[batch]`` int32 (default: all T), the valid tokens of each row; the rest is padding, and
            a row of length 0 leaves its caches untouched (outputs of padding are meaningless).
          mode: static :class:`~jax_oc128.controller.ForwardMode`. ``TARGET_VERIFY``: the T tokens are a
            chain verify (1 <= T <= max_draft, rows of length T or 0): the compressor writes its banks, and
            the caller then keeps ``accept`` of them with :meth:`commit` or leaves them pending (the row's
            next forward commits them from its positions).
          tree: a static :class:`~jax_oc128.tree.Tree` for a tree verify (``mode`` TARGET_VERIFY) or a
            level of a tree draft (DRAFT_EXTEND, sliding layers). Token i is node ``nodes[i]`` at ``base +
            tree.depths[nodes[i]]`` (``base`` the root's position) and attends to the window before the
            root, to its ancestors among the tokens (``tree.mask``), to the ring rows of its ancestors that
            earlier calls of this tree wrote, and (HCA, CSA) to the entries complete before the root and
            those its ancestors or itself closed; node n's window row goes to ring row
            ``(base + n) % R`` until :meth:`AttentionCache.keep_path` keeps the accepted path. None, or a
            chain (:attr:`Tree.is_chain`, run as None): the tokens are a chain (consecutive positions,
            causal).
          nodes: static, the tree's nodes the T tokens are: every node (the default, a verify) or distinct
            nodes of one depth (a draft level).

        Returns:
          ``(y [batch, T, hidden], cache, compressed)``.
        """
        c = self.config
        batch, tokens, _ = x.shape
        lengths = jnp.full((batch,), tokens, jnp.int32) if lengths is None else lengths
        if tree is not None:
            nodes = _check_tree_call(tree, nodes, tokens, mode, c.layer_type)
            if tree.is_chain:  # the chain's kernels and masks: its nodes are consecutive positions
                tree = None
        q_res = rms_norm(linear(x, self.q_a_proj[...]), self.q_a_norm[...], c.rms_norm_eps)
        q = linear(q_res, self.q_b_proj[...]).reshape(batch, tokens, c.num_heads, c.head_dim)
        q = c.rope.apply(rms_norm(q, 1.0, c.rms_norm_eps), positions)  # per head, unweighted
        kv = c.rope.apply(
            rms_norm(linear(x, self.kv_proj[...]), self.kv_norm[...], c.rms_norm_eps), positions
        )

        keys = jnp.concatenate([cache.window, kv], axis=1)
        key_positions = jnp.concatenate([cache.window_positions, positions], axis=1)
        t, k = positions[:, :, None], key_positions[:, None, :]
        # window rows at or past the root's position hold rejected drafts of an earlier verify: this call
        # rewrites those positions, so only the window rows before it count
        base = positions[:, :1] if tree is None else positions[:, :1] - int(tree.depths[nodes[0]])
        before = cache.window_positions < base
        if tree is None:
            seen = jnp.concatenate([before, jnp.ones_like(positions, bool)], axis=1)[:, None, :]
        else:  # the new tokens see their ancestors, not every earlier position
            ring, new = _tree_visibility(tree, nodes, base, cache.window.shape[1])
            seen = jnp.concatenate(
                [before[:, None, :] | ring, jnp.broadcast_to(new, (batch, tokens, tokens))], 2
            )
        visible = seen & (k >= 0) & (k <= t) & (k > t - c.sliding_window)
        if c.layer_type == HCA:
            cache, compressed, closed = self._compress(x, positions, lengths, cache, compressed, mode, tree)
            keys = jnp.concatenate([keys, cache.entries], axis=1)
            if tree is None:
                entry = jnp.arange(cache.entries.shape[1])[None, None, :]
                visible = jnp.concatenate([visible, entry < (t + 1) // BLOCK], axis=2)
            else:
                keys = jnp.concatenate([keys, cache.tree_entries[:, :tokens]], axis=1)
                seen_entries = _tree_entries_visibility(tree, base, cache.entries.shape[1], BLOCK, closed)
                visible = jnp.concatenate([visible, seen_entries], axis=2)
        scale = c.head_dim**-0.5
        logits = jnp.einsum("bthd,bkd->bhtk", q, keys, precision=FULL) * scale
        logits = jnp.where(visible[:, None], logits, -jnp.inf)
        if c.layer_type == CSA:  # the indexer's picks, per query
            cache, selected, picked = self._compress_sparse(x, q_res, positions, lengths, cache, tree, base)
            picked_logits = jnp.einsum("bthd,btkd->bhtk", q, selected, precision=FULL) * scale
            logits = jnp.concatenate([logits, jnp.where(picked[:, None], picked_logits, -jnp.inf)], axis=-1)
        sink = self.sinks[...][None, :, None]
        top = jnp.maximum(jnp.max(logits, axis=-1), sink)
        weights = jnp.exp(logits - top[..., None])
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + jnp.exp(sink - top)[..., None])
        out = jnp.einsum("bhtk,bkd->bthd", weights[..., : keys.shape[1]], keys, precision=FULL)
        if c.layer_type == CSA:
            out += jnp.einsum("bhtk,btkd->bthd", weights[..., keys.shape[1] :], selected, precision=FULL)
        out = c.rope.apply(out, positions, inverse=True)

        grouped = out.reshape(batch, tokens, c.o_groups, -1)
        o_a = self.o_a_proj[...].reshape(c.o_groups, c.o_lora_rank, -1)
        y = linear(
            jnp.einsum(
                "btgi,goi->btgo",
                grouped.astype(o_a.dtype),
                o_a,
                precision=FULL,
                preferred_element_type=jnp.float32,
            ).reshape(batch, tokens, -1),
            self.o_b_proj[...],
        )
        ring = positions if tree is None else base + jnp.asarray(nodes)[None]
        return y, self._update_window(cache, kv, positions, ring, lengths), compressed

    def _update_window(self, cache, kv, positions, ring, lengths):
        """Write the last ``R`` valid new rows into the window ring (row ``ring % R``: the position, or a
        tree node's row)."""
        window = cache.window.shape[1]
        t = jnp.arange(positions.shape[1])[None]
        write = (t < lengths[:, None]) & (t >= lengths[:, None] - window)
        index = jnp.where(write, ring % window, window)
        rows = jnp.arange(positions.shape[0])[:, None]
        return dataclasses.replace(
            cache,
            window=cache.window.at[rows, index].set(kv, mode="drop"),
            window_positions=cache.window_positions.at[rows, index].set(positions, mode="drop"),
        )

    def _compress(self, x, positions, lengths, cache, compressed, mode, tree=None):
        """Run this layer's compressor (compress, or a verify's bank writes) on its layer of the prepared
        state and store the entries it closed (a tree verify's by node in ``tree_entries``). Returns
        ``(cache, compressed, entry_blocks)``, ``entry_blocks`` ``[batch, 1]`` (a tree: ``[batch, N]``)
        the block each token closed, -1 for none."""
        c = self.config
        batch = x.shape[0]
        if compressed is None:
            compressed = self.init_compressed(batch)
        kv_score = jnp.concatenate(
            [linear(x, self.compressor_kv_proj[...]), linear(x, self.compressor_gate_proj[...])], -1
        )
        kv_score, ape = kv_score[None], self.compressor_ape[...][None]
        seq_lens, slots = positions[:, 0], batch_slots(lengths)
        controller, layer = self.backend.controller, self.compress_layer
        if mode is ForwardMode.TARGET_VERIFY:
            compressed, entries, blocks = controller.write_prefix(
                compressed, kv_score, seq_lens, slots, ape, layer=layer, tree=tree
            )
        else:
            compressed, entries, blocks = controller.compress(
                compressed, kv_score, seq_lens, lengths, slots, ape, layer=layer
            )
        normed = rms_norm(entries[0], self.compressor_kv_norm[...], c.rms_norm_eps)
        normed = c.rope.apply(normed, jnp.maximum(blocks, 0) * BLOCK)
        if tree is not None:
            tree_entries = cache.tree_entries.at[:, : tree.size].set(normed)
            return dataclasses.replace(cache, tree_entries=tree_entries), compressed, blocks
        index = jnp.where(blocks >= 0, blocks, cache.entries.shape[1])
        stored = cache.entries.at[jnp.arange(batch)[:, None], index].set(normed, mode="drop")
        return dataclasses.replace(cache, entries=stored), compressed, blocks

    def _compress_sparse(self, x, q_res, positions, lengths, cache, tree=None, base=None):
        """A CSA layer's compressor and indexer (:mod:`~jax_oc128.nn.csa`): fold the new tokens into the
        cache, then pick each query's entries. Returns ``(cache, selected [batch, T, k, D], picked
        [batch, T, k] bool)``. A tree verify (``base`` ``[batch, 1]`` the root's position) keeps its
        windows by node (``tree_entries``, ``tree_index_keys``): a node picks among the windows complete
        before the root and those its ancestors closed."""
        compressor = self.compressor
        if tree is None:
            rows, entries, keys = compressor.compress(
                x, positions, lengths, cache.rows, cache.entries, cache.index_keys
            )
            selected, picked = compressor.select(x, q_res, positions, entries, keys)
            return dataclasses.replace(cache, rows=rows, entries=entries, index_keys=keys), selected, picked
        rows, node_entries, node_keys, windows = compressor.compress_tree(
            x, tree, base[:, 0], lengths, cache.rows
        )
        tokens = x.shape[1]
        visible = _tree_entries_visibility(tree, base, cache.entries.shape[1], csa.RATE, windows)
        selected, picked = compressor.select(
            x,
            q_res,
            positions,
            jnp.concatenate([cache.entries, node_entries], axis=1),
            jnp.concatenate([cache.index_keys, node_keys], axis=1),
            visible,
        )
        cache = dataclasses.replace(
            cache,
            rows=rows,
            tree_entries=cache.tree_entries.at[:, :tokens].set(node_entries),
            tree_index_keys=cache.tree_index_keys.at[:, :tokens].set(node_keys),
        )
        return cache, selected, picked

    def commit(self, compressed, seq_lens, accept_lens):
        """Keep ``accept_lens`` ``[batch]`` tokens of the verify at ``seq_lens`` (the eager commit), in every
        layer of ``compressed`` at once."""
        slots = jnp.arange(seq_lens.shape[0], dtype=jnp.int32)
        return self.backend.controller.commit(compressed, slots, seq_lens, accept_lens)
