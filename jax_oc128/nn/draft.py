"""Draft heads (Flax NNX): what a speculative step drafts with, and the model that pairs one with its target.

A draft head is a :class:`~jax_oc128.protocols.Drafter` built from the target's config and the target
(whose embedding and LM head it shares) (:class:`DraftHead`): it keeps a cache of its own and predicts the
token after each of its input tokens from that token and the hidden state before it. It is applied
recursively: its own output hidden state feeds the next draft. The heads are registered by name
(:func:`~jax_oc128.registry.register_drafter`):

* :class:`MTPHead` (``"mtp_head"``): the draft head in the DeepSeek manner for a model with one residual
  stream (the byte-level model's): the next token's embedding and the last hidden state, each normed,
  projected together, one sliding-window block, then the target's final norm and LM head.
* :class:`DeepseekV4MTP` (``"deepseek_v4_mtp"``): DeepSeek-V4's own MTP layer (its checkpoints'
  ``mtp.0.*``), the draft head of a model with hyper-connections.

:class:`SpeculativeModel` is the target and its draft head (or none: ``ModelConfig.mtp`` False, plain decoding
only), one module and one checkpoint: the :class:`~jax_oc128.protocols.Model` the engine drives, registered
as the architecture ``"DeepseekV4ForCausalLM"`` (:mod:`jax_oc128.registry`).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax.numpy as jnp
from flax import nnx

from jax_oc128.controller import ONLINE, Backend, ForwardMode
from jax_oc128.nn.attention import HCA, SLIDING, AttentionCache
from jax_oc128.nn.config import ModelConfig, RuntimeConfig
from jax_oc128.nn.forward import ForwardBatch
from jax_oc128.nn.functional import normal_param, ones_param, rms_norm
from jax_oc128.nn.hyper_connections import HyperHead
from jax_oc128.nn.linear import linear
from jax_oc128.nn.model import Block, DeepseekV4Model, ModelCache, flatten_streams, output_logits
from jax_oc128.nn.moe import MOE
from jax_oc128.protocols import Drafter
from jax_oc128.registry import drafter_class, register_drafter, register_model
from jax_oc128.tree import Tree

#: the draft heads' registered names
MTP_HEAD, DEEPSEEK_V4_MTP = "mtp_head", "deepseek_v4_mtp"


class DraftHead(Drafter, Protocol):
    """A :class:`~jax_oc128.protocols.Drafter` of a DeepSeek-V4 target, as :class:`SpeculativeModel` builds
    it: ``__init__(config, target, *, rngs)``, the head of ``target`` (a
    :class:`~jax_oc128.nn.DeepseekV4Model` of ``config``, whose ``runtime`` it runs as), its own parameters
    drawn from ``rngs``; the
    target's parameters it uses (embedding, LM head) are the same :class:`flax.nnx.Param` objects, so a
    checkpoint holds them once. Its hidden state is ``config.draft_hidden_size`` wide."""

    def __init__(self, config: ModelConfig, target: DeepseekV4Model, *, rngs: nnx.Rngs) -> None: ...


class BlockHead(nnx.Module):
    """The cache of a draft head whose one decoder block is ``self.block``: the block's attention cache
    (:class:`~jax_oc128.nn.AttentionCache`)."""

    def init_cache(self, slots: int) -> AttentionCache:
        return self.block.attn.init_cache(slots)

    def clear(self, cache: AttentionCache, slots) -> AttentionCache:
        return cache.clear(slots)

    def keep_path(self, cache: AttentionCache, tree: Tree, first_positions, nodes, written) -> AttentionCache:
        return cache.keep_path(tree, first_positions, nodes, written=written)


@register_drafter(MTP_HEAD)
class MTPHead(BlockHead):
    """The draft head of a model with one residual stream: predicts token ``p + 1`` from token ``p`` and the
    hidden state at ``p - 1`` (:class:`DraftHead`). It shares the target's embedding, final norm and LM head.
    """

    def __init__(self, config: ModelConfig, target: DeepseekV4Model, *, rngs: nnx.Rngs):
        self.eps = config.rms_norm_eps
        self.embed, self.norm, self.lm_head = target.embed, target.norm, target.lm_head
        self.embed_norm = ones_param(config.hidden_size)
        self.hidden_norm = ones_param(config.hidden_size)
        self.proj = normal_param(rngs, config.hidden_size, 2 * config.hidden_size, dtype=config.dtype)
        # one sliding layer with a dense MLP and one residual stream, whatever the target's layout
        self.block = Block(
            dataclasses.replace(config, layer_types=(SLIDING,), mlp_layer_types=None, hc_mult=None),
            target.runtime,
            0,
            rngs=rngs,
        )

    def __call__(
        self, tokens, hidden, positions, cache: AttentionCache, *, lengths=None, tree=None, nodes=None
    ):
        """:meth:`~jax_oc128.protocols.Drafter.__call__`; ``hidden`` ``[batch, T, hidden_size]``."""
        e = rms_norm(self.embed[...][tokens].astype(jnp.float32), self.embed_norm[...], self.eps)
        h = linear(
            jnp.concatenate([e, rms_norm(hidden, self.hidden_norm[...], self.eps)], axis=-1), self.proj[...]
        )
        forward_batch = ForwardBatch.create(
            positions, lengths=lengths, mode=ForwardMode.DRAFT_EXTEND, tree=tree, nodes=nodes
        )
        h, cache, _ = self.block(h, tokens, cache, None, forward_batch)
        return output_logits(h, self.norm[...], self.lm_head[...], self.eps), h, cache


@register_drafter(DEEPSEEK_V4_MTP)
class DeepseekV4MTP(BlockHead):
    """DeepSeek-V4's MTP layer (DeepSeek's ``MTPBlock``, its checkpoints' ``mtp.0.*`` tensors) as the draft
    head of a model with hyper-connections (:class:`DraftHead`): predicts token ``p + 1`` from token ``p``
    and the target's residual streams at ``p - 1``. The token's embedding (normed by ``enorm``) and each
    stream (normed by ``hnorm``) are projected (``e_proj``, ``h_proj``) and added, the embedding's projection
    to every stream; one decoder block with hyper-connections follows (sliding-window attention and a top-k
    routed MoE: DeepSeek-V4's MTP layer type), then the layer's own stream collapse (``hc_head``) and norm,
    and the target's LM head. It shares the target's embedding and LM head.
    """

    def __init__(self, config: ModelConfig, target: DeepseekV4Model, *, rngs: nnx.Rngs):
        self.config = config
        size = config.hidden_size
        self.embed, self.lm_head = target.embed, target.lm_head
        self.embed_norm = ones_param(size)
        self.hidden_norm = ones_param(size)
        self.embed_proj = normal_param(rngs, size, size, dtype=config.dtype)
        self.hidden_proj = normal_param(rngs, size, size, dtype=config.dtype)
        layer = dataclasses.replace(config, layer_types=(SLIDING,), mlp_layer_types=(MOE,))
        self.block = Block(layer, target.runtime, 0, rngs=rngs)
        self.hc_head = HyperHead(config.hc_mult, size, config.hc_eps, config.rms_norm_eps, rngs=rngs)
        self.norm = ones_param(size)

    def __call__(
        self, tokens, hidden, positions, cache: AttentionCache, *, lengths=None, tree=None, nodes=None
    ):
        """:meth:`~jax_oc128.protocols.Drafter.__call__`; ``hidden`` ``[batch, T, hc_mult * hidden_size]``,
        the residual streams flattened (in and out)."""
        c = self.config
        e = rms_norm(self.embed[...][tokens].astype(jnp.float32), self.embed_norm[...], c.rms_norm_eps)
        streams = hidden.reshape(*hidden.shape[:-1], c.hc_mult, c.hidden_size)
        h = linear(rms_norm(streams, self.hidden_norm[...], c.rms_norm_eps), self.hidden_proj[...])
        h = h + linear(e, self.embed_proj[...])[..., None, :]
        forward_batch = ForwardBatch.create(
            positions, lengths=lengths, mode=ForwardMode.DRAFT_EXTEND, tree=tree, nodes=nodes
        )
        h, cache, _ = self.block(h, tokens, cache, None, forward_batch)
        logits = output_logits(self.hc_head(h), self.norm[...], self.lm_head[...], c.rms_norm_eps)
        return logits, flatten_streams(h), cache


def default_draft_head(config: ModelConfig) -> str | None:
    """The registered name of the draft head a :class:`SpeculativeModel` of ``config`` has unless told: None
    with ``config.mtp`` False; DeepSeek-V4's MTP layer for a model with hyper-connections (its checkpoints'),
    else the MTP head of one residual stream (the byte-level model's)."""
    if not config.mtp:
        return None
    return DEEPSEEK_V4_MTP if config.hyper_connections else MTP_HEAD


@register_model("DeepseekV4ForCausalLM")
class SpeculativeModel(nnx.Module):
    """The target and its draft head, as one module (one checkpoint), the
    :class:`~jax_oc128.protocols.Model` the engine drives: ``target`` the
    :class:`~jax_oc128.nn.DeepseekV4Model` of ``config`` running as ``runtime`` says (a
    :class:`~jax_oc128.nn.RuntimeConfig`, None: its defaults; a given ``target`` brings its own), ``mtp``
    the draft head registered as ``drafter`` (default
    :func:`default_draft_head`), or None (``config.mtp`` False: plain decoding only). Its caches are the
    target's :class:`~jax_oc128.nn.ModelCache` and the head's :class:`~jax_oc128.nn.AttentionCache`. A tree
    verify needs the online C128 state in a model with C128 layers (:attr:`verifies_trees`)."""

    def __init__(
        self,
        config: ModelConfig,
        runtime: RuntimeConfig | None = None,
        *,
        drafter: str | None = None,
        target: DeepseekV4Model | None = None,
        backend: Backend = ONLINE,
        rngs: nnx.Rngs,
    ):
        if drafter is not None and not config.mtp:
            raise ValueError(f"drafter: None for a config without a draft head (mtp False), got {drafter!r}")
        self.config = config
        if target is None:
            target = DeepseekV4Model(config, runtime, backend=backend, rngs=rngs)
        elif runtime is not None:
            raise ValueError("runtime: None with a given target (the target's is the model's)")
        self.target = target
        head = default_draft_head(config) if drafter is None else drafter
        self.mtp = None if head is None else drafter_class(head)(config, self.target, rngs=rngs)

    @classmethod
    def config_from_hf(cls, config: dict, **options) -> ModelConfig:
        """The config of a transformers ``DeepseekV4ForCausalLM``'s ``config.json``:
        :meth:`ModelConfig.from_hf` (``options`` its keyword arguments)."""
        return ModelConfig.from_hf(config, **options)

    @classmethod
    def from_hf(cls, config: dict, weights: dict, *, rngs: nnx.Rngs, **kwargs) -> SpeculativeModel:
        """The target of :meth:`DeepseekV4Model.from_hf` (``kwargs``: its keyword arguments) with a new,
        untrained draft head (a :class:`DeepseekV4MTP`) drawn from ``rngs``: transformers has no MTP layers
        (:func:`jax_oc128.load_pretrained` loads a checkpoint's)."""
        target = DeepseekV4Model.from_hf(config, weights, **kwargs)
        return cls(
            dataclasses.replace(target.config, mtp=True), backend=target.backend, rngs=rngs, target=target
        )

    # the protocol's static facts: the config's and the runtime's
    vocab_size = property(lambda self: self.config.vocab_size)
    runtime = property(lambda self: self.target.runtime)
    max_len = property(lambda self: self.runtime.max_len)
    max_draft = property(lambda self: self.runtime.max_draft)
    draft_hidden_size = property(lambda self: self.config.draft_hidden_size)

    @property
    def verifies_trees(self) -> bool:
        """Whether a verify takes any tree: chains only on the offline C128 state (its raw rows keep one
        path)."""
        return HCA not in self.config.layer_types or self.target.backend is ONLINE

    @property
    def drafter(self) -> DraftHead | None:
        return self.mtp

    def init_cache(self, slots: int, pages: int | None = None, page_size: int = 0) -> ModelCache:
        """The target's :meth:`~jax_oc128.nn.DeepseekV4Model.init_cache`."""
        return self.target.init_cache(slots, pages, page_size)

    def clear(self, cache: ModelCache, slots) -> ModelCache:
        return cache.clear(slots)

    def with_page_table(self, cache: ModelCache, page_table) -> ModelCache:
        return dataclasses.replace(cache, page_table=page_table)

    def prefix_state(self, cache: ModelCache, slots):
        """:meth:`ModelCache.prefix_state <jax_oc128.nn.ModelCache.prefix_state>` of ``slots``."""
        return cache.prefix_state(slots)

    def with_prefix_state(self, cache: ModelCache, slots, state) -> ModelCache:
        """:meth:`ModelCache.with_prefix_state <jax_oc128.nn.ModelCache.with_prefix_state>`."""
        return cache.with_prefix_state(slots, state)

    def __call__(self, tokens, positions, cache: ModelCache, **options):
        """The target's forward (:meth:`~jax_oc128.nn.DeepseekV4Model.__call__`, ``options`` its keyword
        arguments: ``lengths``, ``mode``, ``tree``, ``context``, ``logits_at``)."""
        return self.target(tokens, positions, cache, **options)

    def keep_path(self, cache: ModelCache, tree: Tree, first_positions, nodes) -> ModelCache:
        """The target's :meth:`~jax_oc128.nn.DeepseekV4Model.keep_path`."""
        return self.target.keep_path(cache, tree, first_positions, nodes)
