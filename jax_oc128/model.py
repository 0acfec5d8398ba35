"""A small DeepSeek-V4-style decoder and its MTP draft head (Flax NNX), caches threaded explicitly.

The decoder: token embedding, a stack of blocks (RMSNorm -> attention -> residual, RMSNorm -> SwiGLU ->
residual) whose attention layers mix sliding-window and C128 (HCA) :class:`~jax_oc128.nn.DeepseekV4Attention`,
a final RMSNorm and an LM head. The MTP head, in the DeepSeek manner: the next token's embedding and the last
hidden state, each normed, projected together, one sliding-window block, the final norm and the shared LM
head; applied recursively (its own output hidden state feeds the next draft).

Shapes: ``tokens``/``positions`` ``[batch, T]`` int32, ``lengths`` ``[batch]`` int32 (valid tokens per row,
0 for a row left alone), logits ``[batch, T, vocab]`` and hidden states ``[batch, T, hidden]`` float32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jax_oc128.nn import HCA, SLIDING, AttentionConfig, DeepseekV4Attention, RopeConfig, linear, rms_norm


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


def _linear(rngs, out_features, in_features):
    return nnx.Param(
        jax.random.normal(rngs.params(), (out_features, in_features), jnp.float32) * in_features**-0.5
    )


class Block(nnx.Module):
    """RMSNorm -> attention -> residual, RMSNorm -> SwiGLU MLP -> residual."""

    def __init__(self, config: ModelConfig, layer_type: str, backend: str, *, rngs: nnx.Rngs):
        self.eps = config.rms_norm_eps
        self.attn_norm = nnx.Param(jnp.ones((config.hidden_size,), jnp.float32))
        self.attn = DeepseekV4Attention(
            config.attention(layer_type), backend=backend, max_draft=config.max_draft, rngs=rngs
        )
        self.mlp_norm = nnx.Param(jnp.ones((config.hidden_size,), jnp.float32))
        self.gate = _linear(rngs, config.mlp_hidden, config.hidden_size)
        self.up = _linear(rngs, config.mlp_hidden, config.hidden_size)
        self.down = _linear(rngs, config.hidden_size, config.mlp_hidden)

    def __call__(self, h, positions, cache, lengths, verify):
        y, cache = self.attn(
            rms_norm(h, self.attn_norm[...], self.eps), positions, cache, lengths=lengths, verify=verify
        )
        h = h + y
        x = rms_norm(h, self.mlp_norm[...], self.eps)
        return h + linear(
            jax.nn.silu(linear(x, self.gate[...])) * linear(x, self.up[...]), self.down[...]
        ), cache


class DeepseekV4Model(nnx.Module):
    """The target model. ``backend`` ("online" or "offline") selects the C128 compressor state."""

    def __init__(self, config: ModelConfig, *, backend: str = "online", rngs: nnx.Rngs):
        self.config = config
        self.embed = nnx.Param(
            jax.random.normal(rngs.params(), (config.vocab_size, config.hidden_size)) * 0.5
        )
        self.blocks = nnx.List([Block(config, kind, backend, rngs=rngs) for kind in config.layer_types])
        self.norm = nnx.Param(jnp.ones((config.hidden_size,), jnp.float32))
        self.lm_head = _linear(rngs, config.vocab_size, config.hidden_size)

    def init_cache(self, batch: int) -> list:
        """Empty per-layer caches for ``batch`` rows (slots)."""
        return [block.attn.init_cache(batch, self.config.max_len) for block in self.blocks]

    def logits(self, hidden):
        return linear(rms_norm(hidden, self.norm[...], self.config.rms_norm_eps), self.lm_head[...])

    def __call__(self, tokens, positions, caches, *, lengths=None, verify: bool = False):
        """Returns ``(logits, hidden, caches)``; ``hidden`` is the last block's output (before the final
        norm), what the MTP head takes."""
        h = self.embed[...][tokens]
        new_caches = []
        for block, cache in zip(self.blocks, caches, strict=True):
            h, cache = block(h, positions, cache, lengths, verify)
            new_caches.append(cache)
        return self.logits(h), h, new_caches


class MTPHead(nnx.Module):
    """The draft head: predicts token ``p + 1`` from token ``p`` and the hidden state at ``p - 1``."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.eps = config.rms_norm_eps
        self.embed_norm = nnx.Param(jnp.ones((config.hidden_size,), jnp.float32))
        self.hidden_norm = nnx.Param(jnp.ones((config.hidden_size,), jnp.float32))
        self.proj = _linear(rngs, config.hidden_size, 2 * config.hidden_size)
        self.block = Block(config, SLIDING, "online", rngs=rngs)

    def init_cache(self, batch: int):
        return self.block.attn.init_cache(batch)

    def __call__(self, target: DeepseekV4Model, tokens, hidden, positions, cache, *, lengths=None):
        """``tokens`` at ``positions`` with the hidden states of the positions before them. Returns
        ``(logits, hidden, cache)``: the logits of the next tokens and the head's own hidden states."""
        e = rms_norm(target.embed[...][tokens], self.embed_norm[...], self.eps)
        h = linear(
            jnp.concatenate([e, rms_norm(hidden, self.hidden_norm[...], self.eps)], axis=-1), self.proj[...]
        )
        h, cache = self.block(h, positions, cache, lengths, False)
        return target.logits(h), h, cache


class SpeculativeModel(nnx.Module):
    """The target and its MTP head, as one module (one checkpoint)."""

    def __init__(self, config: ModelConfig, *, backend: str = "online", rngs: nnx.Rngs):
        self.config = config
        self.target = DeepseekV4Model(config, backend=backend, rngs=rngs)
        self.mtp = MTPHead(config, rngs=rngs)
