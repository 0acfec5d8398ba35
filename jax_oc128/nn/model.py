"""A small DeepSeek-V4-style decoder and its MTP draft head (Flax NNX), with one compressed state per model.

:class:`DeepseekV4Model`: embedding, blocks of RMSNorm -> attention -> residual and RMSNorm -> SwiGLU ->
residual mixing sliding and C128 (HCA) layers, final norm, LM head. Its cache (:class:`ModelCache`) holds a
window/entry cache per layer and one layer-stacked compressor state for all its C128 layers: the
controller's transition runs once per forward, each C128 layer writes its own layer of the state, and an
eager commit is one launch for all layers.

:class:`MTPHead`: the draft head in the DeepSeek manner (the next token's embedding and the last hidden
state, each normed, projected together, one sliding-window block, then the target's final norm and LM head,
which it shares; applied recursively, its own output hidden state feeding the next draft).

Shapes: ``tokens`` ``[batch, T]`` int32, ``positions`` ``[batch, T]`` int32 (consecutive per row),
``lengths`` ``[batch]`` int32 (valid tokens per row, default all; rows of length 0 are untouched).
Everything is computed in float32.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jax_oc128.controller import ONLINE, Backend, ForwardMode
from jax_oc128.nn.attention import (
    HCA,
    SLIDING,
    AttentionCache,
    AttentionConfig,
    DeepseekV4Attention,
    prepare_forward,
)
from jax_oc128.nn.functional import linear, normal_param, ones_param, rms_norm
from jax_oc128.nn.rope import RopeConfig
from jax_oc128.rules import MAX_DRAFT


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    hidden_size: int = 128
    layer_types: tuple[str, ...] = (SLIDING, HCA, SLIDING, HCA)
    num_heads: int = 4
    head_dim: int = 64
    rope_dim: int = 16
    q_lora_rank: int = 64
    o_groups: int = 2
    o_lora_rank: int = 64
    sliding_window: int = 32
    mlp_hidden: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    max_len: int = 4096
    max_draft: int = 8  # most tokens per verify (banks of the online C128 state)

    def __post_init__(self):
        """Every field checked (a config read from a file is checked before any parameter is built): ints
        in [1, 2**31) (positions and token ids are int32), finite floats > 0, a non-empty tuple of
        supported layer types, and the shapes' constraints."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "int":
                if not isinstance(value, int) or isinstance(value, bool):
                    raise TypeError(f"{field.name}: must be an int, got {value!r}")
                if not 1 <= value < 2**31:
                    raise ValueError(f"{field.name}: must be in [1, 2**31), got {value}")
            elif field.type == "float":
                if not isinstance(value, int | float) or isinstance(value, bool):
                    raise TypeError(f"{field.name}: must be a number, got {value!r}")
                if not 0 < value < math.inf:
                    raise ValueError(f"{field.name}: must be finite and > 0, got {value}")
        if not isinstance(self.layer_types, tuple) or not self.layer_types:
            raise TypeError(f"layer_types: must be a non-empty tuple, got {self.layer_types!r}")
        for i, layer_type in enumerate(self.layer_types):
            if layer_type not in (SLIDING, HCA):
                raise ValueError(f"layer_types[{i}]: must be {SLIDING!r} or {HCA!r}, got {layer_type!r}")
        if self.rope_dim % 2 or self.rope_dim > self.head_dim:
            raise ValueError(f"rope_dim: must be even and <= head_dim ({self.head_dim}), got {self.rope_dim}")
        if self.num_heads * self.head_dim % self.o_groups:
            raise ValueError(
                f"o_groups: must divide num_heads * head_dim ({self.num_heads * self.head_dim}), "
                f"got {self.o_groups}"
            )
        if self.max_draft > MAX_DRAFT:
            raise ValueError(f"max_draft: at most {MAX_DRAFT}, got {self.max_draft}")
        if self.compressed_layers and self.head_dim % 32:
            raise ValueError(f"head_dim: must be a multiple of 32 with C128 layers, got {self.head_dim}")

    @property
    def compressed_layers(self) -> int:
        """The number of C128 (HCA) layers: the layers of the model's compressor state."""
        return self.layer_types.count(HCA)

    def attention(self, layer_type: str) -> AttentionConfig:
        theta = self.rope_theta if layer_type == SLIDING else self.compress_rope_theta
        return AttentionConfig(
            layer_type=layer_type,
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            q_lora_rank=self.q_lora_rank,
            o_groups=self.o_groups,
            o_lora_rank=self.o_lora_rank,
            sliding_window=self.sliding_window,
            rms_norm_eps=self.rms_norm_eps,
            rope=RopeConfig(self.rope_dim, theta),
            max_position_embeddings=self.max_len,
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelCache:
    """The target model's cache for a batch (slot = batch row), a pytree.

    Attributes:
      layers: one :class:`~jax_oc128.nn.AttentionCache` per layer (window ring; entries of C128 layers).
      compressed: the C128 compressor state of all C128 layers, layer-stacked
        (:class:`~jax_oc128.CompressState` or :class:`~jax_oc128.OfflineState` with ``compressed_layers``
        layers), or None for a model without C128 layers.
    """

    layers: tuple[AttentionCache, ...]
    compressed: object

    def clear(self, rows) -> ModelCache:
        """Empty ``rows`` ([n] int32, -1 ignored) for new sequences, in every layer and the compressor."""
        return ModelCache(
            tuple(layer.clear(rows) for layer in self.layers),
            None if self.compressed is None else self.compressed.alloc(rows),
        )


class Block(nnx.Module):
    """RMSNorm -> attention -> residual, RMSNorm -> SwiGLU MLP -> residual."""

    def __init__(
        self, config: ModelConfig, layer_type: str, backend: Backend, compress_layer: int, *, rngs: nnx.Rngs
    ):
        self.eps = config.rms_norm_eps
        self.attn_norm = ones_param(config.hidden_size)
        self.attn = DeepseekV4Attention(
            config.attention(layer_type),
            backend=backend,
            max_draft=config.max_draft,
            compress_layer=compress_layer,
            rngs=rngs,
        )
        self.mlp_norm = ones_param(config.hidden_size)
        self.gate = normal_param(rngs, config.mlp_hidden, config.hidden_size)
        self.up = normal_param(rngs, config.mlp_hidden, config.hidden_size)
        self.down = normal_param(rngs, config.hidden_size, config.mlp_hidden)

    def __call__(self, h, positions, cache, compressed, lengths, mode):
        """``h`` ``[batch, T, hidden]`` -> ``(h, cache, compressed)``."""
        y, cache, compressed = self.attn(
            rms_norm(h, self.attn_norm[...], self.eps),
            positions,
            cache,
            compressed,
            lengths=lengths,
            mode=mode,
        )
        h = h + y
        x = rms_norm(h, self.mlp_norm[...], self.eps)
        mlp = linear(jax.nn.silu(linear(x, self.gate[...])) * linear(x, self.up[...]), self.down[...])
        return h + mlp, cache, compressed


def output_logits(hidden, norm, lm_head, eps):
    """The final RMSNorm and the LM head: ``[..., hidden]`` -> ``[..., vocab]``."""
    return linear(rms_norm(hidden, norm, eps), lm_head)


class DeepseekV4Model(nnx.Module):
    """The target model; ``backend`` selects the C128 compressor state (online banks or offline rows)."""

    def __init__(self, config: ModelConfig, *, backend: Backend = ONLINE, rngs: nnx.Rngs):
        self.config, self.backend = config, backend
        self.embed = normal_param(rngs, config.vocab_size, config.hidden_size, scale=0.5)
        compress_layers = [config.layer_types[:i].count(HCA) for i in range(len(config.layer_types))]
        self.blocks = nnx.List(
            [
                Block(config, kind, backend, index, rngs=rngs)
                for kind, index in zip(config.layer_types, compress_layers, strict=True)
            ]
        )
        self.norm = ones_param(config.hidden_size)
        self.lm_head = normal_param(rngs, config.vocab_size, config.hidden_size)

    def init_cache(self, batch: int) -> ModelCache:
        """An empty cache for ``batch`` rows (slots)."""
        c = self.config
        compressed = None
        if c.compressed_layers:
            compressed = self.backend.create(c.compressed_layers, batch, c.head_dim, c.max_draft)
        return ModelCache(tuple(block.attn.init_cache(batch, c.max_len) for block in self.blocks), compressed)

    def logits(self, hidden):
        """``[..., hidden]`` -> ``[..., vocab]`` (final norm and LM head)."""
        return output_logits(hidden, self.norm[...], self.lm_head[...], self.config.rms_norm_eps)

    def __call__(self, tokens, positions, cache: ModelCache, *, lengths=None, mode=ForwardMode.EXTEND):
        """A forward of ``mode`` (static :class:`~jax_oc128.controller.ForwardMode`: EXTEND or DECODE fold
        the tokens into the caches; TARGET_VERIFY writes a verify's banks, kept by :meth:`commit` or
        committed lazily by the rows' next forward). Returns ``(logits [batch, T, vocab], hidden
        [batch, T, hidden], cache)``; ``hidden`` is the last block's output (before the final norm), what
        the MTP head takes."""
        lengths = jnp.full(tokens.shape[:1], tokens.shape[1], jnp.int32) if lengths is None else lengths
        compressed = prepare_forward(self.backend, cache.compressed, mode, positions, lengths)
        h = self.embed[...][tokens]
        layers = []
        for block, layer in zip(self.blocks, cache.layers, strict=True):
            h, layer, compressed = block(h, positions, layer, compressed, lengths, mode)
            layers.append(layer)
        return self.logits(h), h, ModelCache(tuple(layers), compressed)

    def commit(self, cache: ModelCache, seq_lens, accept_lens) -> ModelCache:
        """Keep ``accept_lens`` ``[batch]`` tokens of the verify forward at ``seq_lens`` ``[batch]`` (the
        eager commit): one launch for all C128 layers."""
        if cache.compressed is None:
            return cache
        slots = jnp.arange(seq_lens.shape[0], dtype=jnp.int32)
        compressed = self.backend.controller.commit(cache.compressed, slots, seq_lens, accept_lens)
        return dataclasses.replace(cache, compressed=compressed)


class MTPHead(nnx.Module):
    """The draft head: predicts token ``p + 1`` from token ``p`` and the hidden state at ``p - 1``.

    Args:
      config: the target's config.
      embed, norm, lm_head: the target's embedding ``[vocab, hidden]``, final norm ``[hidden]`` and LM head
        ``[vocab, hidden]`` parameters, shared (the same :class:`flax.nnx.Param` objects).
    """

    def __init__(self, config: ModelConfig, embed: nnx.Param, norm: nnx.Param, lm_head: nnx.Param, *, rngs):
        self.eps = config.rms_norm_eps
        self.embed, self.norm, self.lm_head = embed, norm, lm_head
        self.embed_norm = ones_param(config.hidden_size)
        self.hidden_norm = ones_param(config.hidden_size)
        self.proj = normal_param(rngs, config.hidden_size, 2 * config.hidden_size)
        self.block = Block(config, SLIDING, ONLINE, 0, rngs=rngs)

    def init_cache(self, batch: int) -> AttentionCache:
        return self.block.attn.init_cache(batch)

    def __call__(self, tokens, hidden, positions, cache: AttentionCache, *, lengths=None):
        """``tokens`` at ``positions`` with the hidden states ``[batch, T, hidden]`` of the positions before
        them. Returns ``(logits, hidden, cache)``: the logits of the next tokens and the head's own hidden
        states."""
        e = rms_norm(self.embed[...][tokens], self.embed_norm[...], self.eps)
        h = linear(
            jnp.concatenate([e, rms_norm(hidden, self.hidden_norm[...], self.eps)], axis=-1), self.proj[...]
        )
        h, cache, _ = self.block(h, positions, cache, None, lengths, ForwardMode.DRAFT_EXTEND)
        return output_logits(h, self.norm[...], self.lm_head[...], self.eps), h, cache


class SpeculativeModel(nnx.Module):
    """The target and its MTP head, as one module (one checkpoint)."""

    def __init__(self, config: ModelConfig, *, backend: Backend = ONLINE, rngs: nnx.Rngs):
        self.config = config
        self.target = DeepseekV4Model(config, backend=backend, rngs=rngs)
        self.mtp = MTPHead(config, self.target.embed, self.target.norm, self.target.lm_head, rngs=rngs)
