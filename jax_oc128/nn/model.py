"""The DeepSeek-V4 decoder (Flax NNX), with one compressed state per model; its config is
:mod:`~jax_oc128.nn.config`.

:class:`DeepseekV4Model` is transformers' ``DeepseekV4ForCausalLM`` (5.24.0) when its :class:`ModelConfig`
says so (:meth:`ModelConfig.from_hf`, :meth:`DeepseekV4Model.from_hf`): embedding, blocks of attention
(sliding, CSA or HCA layers) and a mixture of experts (hash-routed or top-k routed), each sublayer inside
hyper-connections over ``hc_mult`` residual streams (:mod:`~jax_oc128.nn.hyper_connections`), the
streams' final collapse, norm and LM head. Without ``hc_mult`` and ``mlp_layer_types`` (the shipped
model, :meth:`ModelConfig.tiny`) it is a small look-alike: one residual stream, RMSNorm -> attention ->
residual and RMSNorm -> SwiGLU -> residual. Its cache (:class:`ModelCache`) holds a
window/entry cache per layer and one layer-stacked compressor state for all its C128 layers: the
controller's transition runs once per forward, each C128 layer writes its own layer of the state, and an
eager commit is one launch for all layers.

The draft heads and :class:`~jax_oc128.nn.SpeculativeModel` (the
target with its draft head) are in :mod:`~jax_oc128.nn.draft`.

Shapes: ``tokens`` ``[batch, T]`` int32, ``positions`` ``[batch, T]`` int32 (consecutive per row),
``lengths`` ``[batch]`` int32 (valid tokens per row, default all; rows of length 0 are untouched).
Activations and logits are float32; the matrices are stored in ``ModelConfig.dtype`` (float32 or bfloat16,
accumulated in float32: :mod:`~jax_oc128.nn.functional`), the caches as ``RuntimeConfig.kv_cache_dtype`` says
(by default in the model's dtype; :mod:`~jax_oc128.nn.kv_cache`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jax_oc128.controller import ONLINE, Backend, ForwardMode, State, backend_of
from jax_oc128.nn.attention import HCA, AttentionCache, DeepseekV4Attention
from jax_oc128.nn.config import ModelConfig, RuntimeConfig
from jax_oc128.nn.forward import ForwardBatch, commit_verify, prepare_forward
from jax_oc128.nn.functional import normal_param, ones_param, rms_norm
from jax_oc128.nn.hyper_connections import HyperConnection, HyperHead
from jax_oc128.nn.linear import linear, swiglu
from jax_oc128.nn.moe import MoE
from jax_oc128.rules import per_row
from jax_oc128.tree import check_tree


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelCache:
    """The target model's cache for a batch (slot = batch row), a pytree.

    Attributes:
      layers: one :class:`~jax_oc128.nn.AttentionCache` per layer (window ring; entries of C128 layers).
      compressed: the C128 compressor state of all C128 layers, layer-stacked
        (:class:`~jax_oc128.CompressState` or :class:`~jax_oc128.OfflineState` with ``compressed_layers``
        layers), or None for a model without C128 layers.
      page_table: None (the dense layout: every slot holds ``max_len`` tokens of entries), or ``[batch,
        max_pages]`` int32: paged, the pages of every compressed layer's pool holding slot b's tokens
        ``[k * page_size, (k + 1) * page_size)`` at ``page_table[b, k]`` (-1: none), one table for all
        layers (:mod:`~jax_oc128.nn.kv_cache`); set by the host between forwards.
    """

    layers: tuple[AttentionCache, ...]
    compressed: State | None
    page_table: jax.Array | None = None

    @classmethod
    def create(
        cls,
        config: ModelConfig,
        runtime: RuntimeConfig,
        backend: Backend,
        batch: int,
        pages: int | None = None,
        page_size: int = 0,
    ) -> ModelCache:
        """An empty cache of a model of ``config`` running as ``runtime`` says with the C128 ``backend`` for
        ``batch`` rows (slots): each layer's :meth:`~jax_oc128.nn.AttentionCache.create` up to the runtime's
        ``max_len`` tokens, and the C128 state (float32); nothing but the configs is read. With ``pages``:
        paged, a pool of ``pages`` pages of
        ``page_size`` tokens (a multiple of 128 dividing ``max_len``) per compressed layer and a page table
        of ``max_len // page_size`` pages per slot, none assigned."""
        compressed = None
        if config.compressed_layers:
            compressed = backend.create(config.compressed_layers, batch, config.head_dim, runtime.max_draft)
        layers = tuple(
            AttentionCache.create(
                config.attention(t, runtime), runtime.max_draft, batch, runtime.max_len, pages, page_size
            )
            for t in config.layer_types
        )
        if pages is None:
            return cls(layers, compressed)
        return cls(layers, compressed, jnp.full((batch, runtime.max_len // page_size), -1, jnp.int32))

    def clear(self, rows) -> ModelCache:
        """Empty ``rows`` ([n] int32, -1 ignored) for new sequences, in every layer and the compressor (not
        their entries, :meth:`~jax_oc128.nn.attention.AttentionCache.clear`, nor a paged cache's page
        table: the host's)."""
        return ModelCache(
            tuple(layer.clear(rows) for layer in self.layers),
            None if self.compressed is None else self.compressed.alloc(rows),
            self.page_table,
        )

    def prefix_state(self, rows):
        """What ``rows`` ([n] int32) hold beyond their pages after a prefix of P tokens, P a multiple of the
        page size (so of 128 and of the CSA window): per layer the window ring, its positions and the CSA
        raw rows, ``[n, ...]`` each. The C128 state holds nothing then (every block closed) and is not
        kept; the entries are in the pages (docs/serving.md, prefix caching)."""
        return tuple(
            (layer.window[rows], layer.window_positions[rows], layer.rows[rows]) for layer in self.layers
        )

    def with_prefix_state(self, rows, state) -> ModelCache:
        """``rows`` ([n] int32) cleared (:meth:`clear`) and given ``state``, a :meth:`prefix_state`."""
        cache = self.clear(rows)
        layers = tuple(
            dataclasses.replace(
                layer,
                window=layer.window.at[rows].set(window),
                window_positions=layer.window_positions.at[rows].set(positions),
                rows=layer.rows.at[rows].set(raw),
            )
            for layer, (window, positions, raw) in zip(cache.layers, state, strict=True)
        )
        return dataclasses.replace(cache, layers=layers)


class Block(nnx.Module):
    """One decoder layer of ``config``: RMSNorm -> attention, RMSNorm -> MLP (dense SwiGLU or MoE), each
    added to the residual, or with ``hc_mult`` inside its hyper-connection over the residual streams.

    Args:
      config: the model's config; runtime: how it runs (:class:`~jax_oc128.nn.RuntimeConfig`); layer: the
        layer's index in it (an HCA layer writes layer ``config.layer_types[:layer].count(HCA)`` of the
        model's C128 state).
    """

    def __init__(self, config: ModelConfig, runtime: RuntimeConfig, layer: int, *, rngs: nnx.Rngs):
        self.eps = config.rms_norm_eps
        self.attn_norm = ones_param(config.hidden_size)
        self.attn = DeepseekV4Attention(
            config.attention(config.layer_types[layer], runtime),
            max_draft=runtime.max_draft,
            compress_layer=config.layer_types[:layer].count(HCA),
            attention_impl=runtime.attention_impl,
            rngs=rngs,
        )
        self.mlp_norm = ones_param(config.hidden_size)
        moe_config = config.moe(layer, runtime)
        if moe_config is None:
            self.gate = normal_param(rngs, config.mlp_hidden, config.hidden_size, dtype=config.dtype)
            self.up = normal_param(rngs, config.mlp_hidden, config.hidden_size, dtype=config.dtype)
            self.down = normal_param(rngs, config.hidden_size, config.mlp_hidden, dtype=config.dtype)
        else:
            self.moe = MoE(moe_config, rngs=rngs)
        if config.hyper_connections:
            hc = (config.hc_mult, config.hidden_size, config.hc_sinkhorn_iters, config.hc_eps, self.eps)
            self.attn_hc = HyperConnection(*hc, rngs=rngs)
            self.ffn_hc = HyperConnection(*hc, rngs=rngs)

    def __call__(
        self, h, tokens, cache: AttentionCache, compressed: State | None, forward_batch: ForwardBatch
    ):
        """``h`` the residual ``[batch, T, hidden]`` (or the streams ``[batch, T, hc_mult, hidden]``) of
        ``tokens`` ``[batch, T]`` in the forward of ``forward_batch``
        (:class:`~jax_oc128.nn.forward.ForwardBatch`) -> ``(h, cache, compressed)``: the layer's cache and
        the model's C128 state (None without C128 layers) in and out
        (:class:`~jax_oc128.nn.DeepseekV4Attention`)."""

        def attention(x):
            nonlocal cache, compressed
            with jax.named_scope("attention"):
                x = rms_norm(x, self.attn_norm[...], self.eps)
                y, cache, compressed = self.attn(x, cache, compressed, forward_batch)
            return y

        h = self._residual(getattr(self, "attn_hc", None), h, attention)
        h = self._residual(getattr(self, "ffn_hc", None), h, lambda x: self._mlp(x, tokens))
        return h, cache, compressed

    @staticmethod
    def _residual(hc, h, sublayer):
        """``h + sublayer(h)``, or with a hyper-connection ``hc`` its collapse, sublayer and expansion."""
        if hc is None:
            return h + sublayer(h)
        with jax.named_scope("hyper_connection"):
            post, comb, collapsed = hc(h)
        output = sublayer(collapsed)
        with jax.named_scope("hyper_connection"):
            return hc.expand(post, comb, output, h)

    def _mlp(self, h, tokens):
        with jax.named_scope("mlp"):
            x = rms_norm(h, self.mlp_norm[...], self.eps)
            if hasattr(self, "moe"):
                return self.moe(x, tokens)
            return swiglu(x, self.gate[...], self.up[...], self.down[...])


def flatten_streams(streams):
    """The residual streams ``[batch, T, hc_mult, hidden]`` as one hidden state ``[batch, T, hc_mult *
    hidden]`` (what the target hands the draft head)."""
    return streams.reshape(*streams.shape[:-2], -1)


def output_logits(hidden, norm, lm_head, eps):
    """The final RMSNorm and the LM head: ``[..., hidden]`` -> ``[..., vocab]``."""
    with jax.named_scope("lm_head"):
        return linear(rms_norm(hidden, norm, eps), lm_head)


class DeepseekV4Model(nnx.Module):
    """The target model of ``config`` running as ``runtime`` says (:class:`~jax_oc128.nn.RuntimeConfig`;
    None: its defaults); ``backend`` selects the C128 compressor state (online banks or offline rows) that
    its caches hold (:meth:`init_cache`); the layers drive it through its own controller
    (:func:`~jax_oc128.controller.backend_of`)."""

    def __init__(
        self,
        config: ModelConfig,
        runtime: RuntimeConfig | None = None,
        *,
        backend: Backend = ONLINE,
        rngs: nnx.Rngs,
    ):
        if not isinstance(backend, Backend):
            raise TypeError(f"backend: a jax_oc128.controller.Backend (ONLINE or OFFLINE), got {backend!r}")
        runtime = config.check_runtime(RuntimeConfig() if runtime is None else runtime)
        self.config, self.runtime, self.backend = config, runtime, backend
        self.embed = normal_param(rngs, config.vocab_size, config.hidden_size, scale=0.5, dtype=config.dtype)
        self.blocks = nnx.List(
            [Block(config, runtime, layer, rngs=rngs) for layer in range(len(config.layer_types))]
        )
        if config.hyper_connections:
            self.hc_head = HyperHead(
                config.hc_mult, config.hidden_size, config.hc_eps, config.rms_norm_eps, rngs=rngs
            )
        self.norm = ones_param(config.hidden_size)
        self.lm_head = normal_param(rngs, config.vocab_size, config.hidden_size, dtype=config.dtype)

    @classmethod
    def from_hf(cls, config: dict, weights: dict, *, backend: Backend = ONLINE, **kwargs) -> DeepseekV4Model:
        """The model of a transformers ``DeepseekV4ForCausalLM``: its ``config`` (``to_dict()``) and its
        ``weights``, the full state dict (name -> numpy array), loaded by the pipeline of
        :func:`jax_oc128.load_pretrained` (:func:`jax_oc128.pretrained.load_weights`: every tensor checked
        before any is placed, one ValueError naming each at fault); ``kwargs``: those of
        :func:`~jax_oc128.pretrained.load_weights` (``max_len``, ``max_draft``, ``dtype``, ...)."""
        from jax_oc128.pretrained import load_weights  # (the loading pipeline imports the model)

        return load_weights(config, weights, backend=backend, **kwargs).target

    def init_cache(self, batch: int, pages: int | None = None, page_size: int = 0) -> ModelCache:
        """An empty cache for ``batch`` rows (slots), paged with ``pages`` pages of ``page_size`` tokens:
        :meth:`ModelCache.create`."""
        return ModelCache.create(self.config, self.runtime, self.backend, batch, pages, page_size)

    def logits(self, hidden):
        """``[..., hidden]`` -> ``[..., vocab]`` (final norm and LM head)."""
        return output_logits(hidden, self.norm[...], self.lm_head[...], self.config.rms_norm_eps)

    def __call__(
        self,
        tokens,
        positions,
        cache: ModelCache,
        *,
        lengths=None,
        mode=ForwardMode.EXTEND,
        tree=None,
        context: int | None = None,
        logits_at=None,
    ):
        """A forward of ``mode`` (static :class:`~jax_oc128.controller.ForwardMode`: EXTEND or DECODE fold
        the tokens into the caches; TARGET_VERIFY writes a verify's banks, kept by :meth:`commit` or
        committed lazily by the rows' next forward; with ``tree``, a static :class:`~jax_oc128.tree.Tree`,
        the tokens are its nodes at ``positions`` = the root's + depth, then :meth:`keep_path`; a chain
        runs as ``tree=None``; ``context``, static: the forward's context bound, at most ``max_len``,
        :attr:`ForwardBatch.context <jax_oc128.nn.forward.ForwardBatch.context>`; ``logits_at``: None, or
        ``[batch]`` int32 indices into T: the LM head runs at those positions only, ``logits`` then
        ``[batch, 1, vocab]``, as a prefill that samples after its last token needs). Returns
        ``(logits [batch, T, vocab], hidden [batch, T, draft_hidden_size], cache)``; ``hidden`` is what the
        draft head takes, the last block's output (with hyper-connections its residual streams, flattened,
        before their final collapse)."""
        forward_batch = ForwardBatch.create(
            positions, lengths=lengths, mode=mode, tree=tree, page_table=cache.page_table, context=context
        )
        if context is not None and context > self.runtime.max_len:
            raise ValueError(f"context: {context} exceeds the model's max_len {self.runtime.max_len}")
        compressed = prepare_forward(cache.compressed, forward_batch)
        h = self.embed[...][tokens].astype(jnp.float32)
        if self.config.hyper_connections:
            h = jnp.broadcast_to(h[..., None, :], (*h.shape[:-1], self.config.hc_mult, h.shape[-1]))
        layers = []
        for block, layer in zip(self.blocks, cache.layers, strict=True):
            h, layer, compressed = block(h, tokens, layer, compressed, forward_batch)
            layers.append(layer)
        cache = ModelCache(tuple(layers), compressed, cache.page_table)
        out = h if logits_at is None else per_row(h, logits_at)[:, None]
        if self.config.hyper_connections:
            return self.logits(self.hc_head(out)), flatten_streams(h), cache
        return self.logits(out), h, cache

    def keep_path(self, cache: ModelCache, tree, first_positions, nodes) -> ModelCache:
        """After a verify of ``tree`` at ``first_positions`` ``[batch]`` (the root's positions), keep each
        row's path to ``nodes`` ``[batch]`` (-1: the row is left as it is) in every layer's cache
        (:meth:`~jax_oc128.nn.AttentionCache.keep_path`) and commit it in the C128 state: the node's bank,
        ``depths[node] + 1`` tokens (one launch for all layers). A chain (:attr:`Tree.is_chain`) keeps its
        path as the chain does: its caches are returned as they are, the verify pending for the rows' next
        forward to commit."""
        if check_tree(tree).is_chain:
            return cache
        layers = tuple(
            layer.keep_path(tree, first_positions, nodes, page_table=cache.page_table)
            for layer in cache.layers
        )
        cache = dataclasses.replace(cache, layers=layers)
        if cache.compressed is None:
            return cache
        slots = jnp.where(nodes >= 0, jnp.arange(nodes.shape[0], dtype=jnp.int32), -1)
        accept = jnp.asarray(tree.depths)[jnp.maximum(nodes, 0)] + 1
        compressed = backend_of(cache.compressed).controller.commit(
            cache.compressed, slots, first_positions, accept, accept_banks=nodes + 1
        )
        return dataclasses.replace(cache, compressed=compressed)

    def commit(self, cache: ModelCache, seq_lens, accept_lens) -> ModelCache:
        """Keep ``accept_lens`` ``[batch]`` tokens of the verify forward at ``seq_lens`` ``[batch]`` (the
        eager commit): one launch for all C128 layers."""
        if cache.compressed is None:
            return cache
        return dataclasses.replace(cache, compressed=commit_verify(cache.compressed, seq_lens, accept_lens))
