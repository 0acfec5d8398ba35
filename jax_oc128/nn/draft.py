"""Draft heads (Flax NNX): what a speculative step drafts with, and the model that pairs one with its target.

A draft head follows the :class:`DraftHead` protocol: it is built from the target's config and the target
(whose embedding and LM head it shares), keeps a cache of its own, and predicts the token after each of its
input tokens from that token and the hidden state before it. It is applied recursively: its own output hidden
state feeds the next draft. :data:`DRAFT_HEADS` holds the heads by name, and :attr:`ModelConfig.draft_head
<jax_oc128.nn.ModelConfig.draft_head>` names a config's:

* :class:`MTPHead` (``"mtp_head"``): the draft head in the DeepSeek manner for a model with one residual
  stream (the shipped model's): the next token's embedding and the last hidden state, each normed, projected
  together, one sliding-window block, then the target's final norm and LM head.
* :class:`DeepseekV4MTP` (``"deepseek_v4_mtp"``): DeepSeek-V4's own MTP layer (its checkpoints'
  ``mtp.0.*``), the draft head of a model with hyper-connections.

:class:`SpeculativeModel` is the target and its draft head (or none: ``ModelConfig.mtp`` False, plain decoding
only), one module and one checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from jax_oc128.controller import ONLINE, Backend, ForwardMode
from jax_oc128.nn.attention import SLIDING, AttentionCache
from jax_oc128.nn.config import DEEPSEEK_V4_MTP, MTP_HEAD, ModelConfig
from jax_oc128.nn.forward import ForwardBatch
from jax_oc128.nn.functional import normal_param, ones_param, rms_norm
from jax_oc128.nn.hyper_connections import HyperHead
from jax_oc128.nn.linear import linear
from jax_oc128.nn.model import Block, DeepseekV4Model, flatten_streams, output_logits
from jax_oc128.nn.moe import MOE
from jax_oc128.tree import Tree


class DraftHead(Protocol):
    """What the engine asks of a draft head (``model.mtp``).

    ``__init__(config, target, *, rngs)``: the head of ``target`` (a :class:`~jax_oc128.nn.DeepseekV4Model` of
    ``config``), its own parameters drawn from ``rngs``; the target's parameters it uses (embedding, LM head)
    are the same :class:`flax.nnx.Param` objects, so a checkpoint holds them once.
    """

    def __init__(self, config: ModelConfig, target: DeepseekV4Model, *, rngs: nnx.Rngs) -> None: ...

    def init_cache(self, batch: int) -> AttentionCache:
        """An empty cache of the head's own for ``batch`` rows (slots)."""
        ...

    def __call__(
        self,
        tokens: jax.Array,
        hidden: jax.Array,
        positions: jax.Array,
        cache: AttentionCache,
        *,
        lengths: jax.Array | None = None,
        tree: Tree | None = None,
        nodes: tuple[int, ...] | None = None,
    ) -> tuple[jax.Array, jax.Array, AttentionCache]:
        """Drafts from ``tokens`` ``[batch, T]`` int32 at ``positions`` ``[batch, T]`` int32 (consecutive per
        row) with ``hidden`` ``[batch, T, config.draft_hidden_size]`` float32, the target's (or this head's
        own) hidden states of the positions before them; ``lengths`` ``[batch]`` int32 valid tokens per row
        (None: all; rows of length 0 untouched). ``tree``, ``nodes`` (static): a level of a tree draft, as
        :class:`~jax_oc128.nn.DeepseekV4Attention` takes them. Returns ``(logits [batch, T, vocab] float32,
        hidden [batch, T, config.draft_hidden_size] float32, cache)``: the logits of the token after each
        input token, the head's own hidden states (the next draft's ``hidden``), the updated cache."""
        ...


class MTPHead(nnx.Module):
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
            0,
            rngs=rngs,
        )

    def init_cache(self, batch: int) -> AttentionCache:
        return self.block.attn.init_cache(batch)

    def __call__(
        self, tokens, hidden, positions, cache: AttentionCache, *, lengths=None, tree=None, nodes=None
    ):
        """:meth:`DraftHead.__call__`; ``hidden`` ``[batch, T, hidden_size]``."""
        e = rms_norm(self.embed[...][tokens].astype(jnp.float32), self.embed_norm[...], self.eps)
        h = linear(
            jnp.concatenate([e, rms_norm(hidden, self.hidden_norm[...], self.eps)], axis=-1), self.proj[...]
        )
        forward_batch = ForwardBatch.create(
            positions, lengths=lengths, mode=ForwardMode.DRAFT_EXTEND, tree=tree, nodes=nodes
        )
        h, cache, _ = self.block(h, tokens, cache, None, forward_batch)
        return output_logits(h, self.norm[...], self.lm_head[...], self.eps), h, cache


class DeepseekV4MTP(nnx.Module):
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
        self.block = Block(layer, 0, rngs=rngs)
        self.hc_head = HyperHead(config.hc_mult, size, config.hc_eps, config.rms_norm_eps, rngs=rngs)
        self.norm = ones_param(size)

    def init_cache(self, batch: int) -> AttentionCache:
        return self.block.attn.init_cache(batch)

    def weight_paths(self) -> dict[str, tuple]:
        """Tensor name (within the layer's prefix, ``mtp.0.``: DeepSeek's names for the layer's own tensors,
        transformers' for its block's) -> attribute path of this head."""
        paths = {name: (attr,) for name, attr in MTP_WEIGHT_NAMES.items()}
        paths |= {f"hc_head_{name}": ("hc_head", name) for name in ("fn", "base", "scale")}
        return paths | {name: ("block", *path) for name, path in self.block.hf_weight_paths().items()}

    def __call__(
        self, tokens, hidden, positions, cache: AttentionCache, *, lengths=None, tree=None, nodes=None
    ):
        """:meth:`DraftHead.__call__`; ``hidden`` ``[batch, T, hc_mult * hidden_size]``, the residual
        streams flattened (in and out)."""
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


#: DeepSeek's name of an MTP layer's own tensor (within ``mtp.{i}.``) -> attribute of :class:`DeepseekV4MTP`
MTP_WEIGHT_NAMES = {
    "enorm.weight": "embed_norm",
    "hnorm.weight": "hidden_norm",
    "e_proj.weight": "embed_proj",
    "h_proj.weight": "hidden_proj",
    "norm.weight": "norm",
}

#: the draft heads by name (:attr:`ModelConfig.draft_head <jax_oc128.nn.ModelConfig.draft_head>`)
DRAFT_HEADS: dict[str, type[DraftHead]] = {MTP_HEAD: MTPHead, DEEPSEEK_V4_MTP: DeepseekV4MTP}


class SpeculativeModel(nnx.Module):
    """The target and its draft head, as one module (one checkpoint): ``mtp`` is the head
    ``DRAFT_HEADS[config.draft_head]``, or None (``config.mtp`` False: plain decoding only)."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        backend: Backend = ONLINE,
        rngs: nnx.Rngs,
        target: DeepseekV4Model | None = None,
    ):
        self.config = config
        self.target = DeepseekV4Model(config, backend=backend, rngs=rngs) if target is None else target
        head = config.draft_head
        self.mtp = None if head is None else DRAFT_HEADS[head](config, self.target, rngs=rngs)

    @classmethod
    def from_hf(cls, config: dict, weights: dict, *, rngs: nnx.Rngs, **kwargs) -> SpeculativeModel:
        """The target of :meth:`DeepseekV4Model.from_hf` (``kwargs``: its keyword arguments) with a new,
        untrained draft head (a :class:`DeepseekV4MTP`) drawn from ``rngs``: transformers has no MTP layers
        (:func:`jax_oc128.load_pretrained` loads a checkpoint's)."""
        target = DeepseekV4Model.from_hf(config, weights, **kwargs)
        return cls(target.config, backend=target.backend, rngs=rngs, target=target)
