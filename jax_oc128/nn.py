"""Flax NNX DeepSeek-V4 attention with the C128 compressed state threaded through explicitly.

:class:`DeepseekV4Attention` follows Hugging Face transformers' ``DeepseekV4Attention`` (5.24.0) for the
layer types ``sliding_attention`` and ``heavily_compressed_attention`` (HCA, C128). Compressed sparse
attention (CSA, C4 with the lightning indexer) is not supported yet. Modules hold parameters only; the
cache is a pytree that goes in and comes out (donate it to the enclosing jit)::

    y, cache = attn(x, positions)                  # prefill from position 0 (cache=None: a fresh cache)
    y, cache = attn(x, positions, cache)           # chunked prefill / decode continue the sequence
    y, cache = attn(x, positions, cache, verify=True)   # N draft tokens; then attn.commit(...) or nothing

The same module holds :class:`DeepseekV4Model`, a small DeepSeek-V4-style decoder (embedding, blocks of
RMSNorm -> attention -> residual and RMSNorm -> SwiGLU -> residual mixing sliding and C128 layers, final norm,
LM head), and :class:`MTPHead`, its draft head in the DeepSeek manner (the next token's embedding and the last
hidden state, each normed, projected together, one sliding-window block, the final norm and the shared LM
head; applied recursively, its own output hidden state feeding the next draft).

Shapes: ``x`` ``[batch, T, hidden]`` float32 (the layer input after its input norm), ``positions``
``[batch, T]`` int32, consecutive per row. Everything is computed in float32.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_oc128.controller import Controller, ForwardMode, OfflineController
from jax_oc128.state import BLOCK, CompressState, OfflineState, _scatter_index

SLIDING, HCA, CSA = "sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention"


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Interleaved RoPE on the trailing ``dim`` channels: base ``theta``, YaRN when ``factor`` is set."""

    dim: int
    theta: float
    factor: float | None = None  # YaRN
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True

    @classmethod
    def from_hf(cls, params: dict, head_dim: int) -> RopeConfig:
        rope_type = params.get("rope_type", "default")
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        if rope_type == "default":
            return cls(dim, float(params["rope_theta"]))
        if rope_type != "yarn":
            raise NotImplementedError(f"rope_type {rope_type!r}: only 'default' and 'yarn' are supported")
        factor = float(params["factor"])
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        return cls(
            dim,
            float(params["rope_theta"]),
            factor,
            int(params["original_max_position_embeddings"]),
            float(params.get("beta_fast") or 32.0),
            float(params.get("beta_slow") or 1.0),
            float(attention_factor),
            bool(params.get("truncate", True)),
        )

    def inv_freq(self) -> np.ndarray:
        """``[dim // 2]`` float32, as transformers computes it (default or YaRN)."""
        exponents = np.arange(0, self.dim, 2, dtype=np.float32) / self.dim
        pos_freqs = np.float32(self.theta) ** exponents
        if self.factor is None:
            return (1.0 / pos_freqs).astype(np.float32)

        def correction_dim(rotations):
            return (
                self.dim
                * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(self.theta))
            )

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, self.dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(self.dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        inv = (1.0 / (self.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
        return inv.astype(np.float32)

    def apply(self, x, positions, inverse=False):
        """Rotate the trailing ``dim`` channels of ``x`` ``[..., T, (heads,) D]`` at ``positions``
        ``[..., T]`` (``inverse``: by minus the angle)."""
        freqs = positions[..., None].astype(jnp.float32) * jnp.asarray(self.inv_freq())
        cos, sin = jnp.cos(freqs) * self.attention_factor, jnp.sin(freqs) * self.attention_factor
        if inverse:
            sin = -sin
        if x.ndim == positions.ndim + 2:  # a heads axis
            cos, sin = cos[..., None, :], sin[..., None, :]
        nope, rope = x[..., : -self.dim], x[..., -self.dim :]
        even, odd = rope[..., 0::2], rope[..., 1::2]
        rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1).reshape(rope.shape)
        return jnp.concatenate([nope, rotated], axis=-1)


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

    @classmethod
    def from_hf(cls, config: dict, layer_idx: int) -> AttentionConfig:
        """From ``DeepseekV4Config.to_dict()``."""
        layer_type = config["layer_types"][layer_idx]
        if layer_type == CSA:
            raise NotImplementedError(
                "compressed_sparse_attention (C4 with the lightning indexer) is not supported yet; "
                "jax_oc128 implements sliding_attention and heavily_compressed_attention layers"
            )
        if layer_type not in (SLIDING, HCA):
            raise ValueError(f"layer_types[{layer_idx}]: unknown layer type {layer_type!r}")
        if config.get("compress_rates", {}).get(HCA, BLOCK) != BLOCK:
            raise NotImplementedError(f"compress_rates[{HCA!r}] must be {BLOCK}")
        rope_kind = "main" if layer_type == SLIDING else "compress"
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
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionCache:
    """Per-layer cache for a batch, a pytree.

    Attributes:
      window: ``[batch, R, D]`` float32: a ring of the last rotated K=V rows, row ``p % R`` holding
        position p. ``R = sliding_window + max_draft``, so that a verify's rejected drafts never overwrite
        a row that the window still needs.
      window_positions: ``[batch, R]`` int32: the position held by each ring row, -1 for none.
      entries: ``[batch, max_entries, D]`` float32: normed, rotated compressed entries by block index (HCA;
        zero-sized for sliding layers).
      compress: the compressor state (:class:`CompressState` or :class:`OfflineState`, slot = batch row), or
        None for sliding layers.
    """

    window: jax.Array
    window_positions: jax.Array
    entries: jax.Array
    compress: CompressState | OfflineState | None

    def clear(self, rows) -> AttentionCache:
        """Empty ``rows`` ([n] int32, -1 ignored) for new sequences: window, entries and compressor state."""
        index = _scatter_index(rows, self.window.shape[0])
        return AttentionCache(
            self.window.at[index].set(0, mode="drop"),
            self.window_positions.at[index].set(-1, mode="drop"),
            self.entries.at[index].set(0, mode="drop"),
            None if self.compress is None else self.compress.alloc(rows),
        )


# transformers state-dict name (within the layer's self_attn) -> attribute
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


FULL = jax.lax.Precision.HIGHEST  # float32 matmuls stay float32 (on GPUs the default would allow TF32)


def linear(x, weight):
    """``x @ weight.T`` for a ``[out, in]`` weight (transformers' layout), in full float32."""
    return jnp.matmul(x, weight.T, precision=FULL)


def rms_norm(x, weight, eps):
    """RMSNorm over the last axis, in float32 (as transformers' DeepseekV4RMSNorm)."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


class DeepseekV4Attention(nnx.Module):
    """DeepSeek-V4 attention (sliding or HCA) with an explicit cache.

    Args:
      config: the layer's :class:`AttentionConfig`.
      backend: ``"online"`` (the C128 online state, :class:`CompressState`) or ``"offline"`` (raw rows).
      max_draft: the most tokens a verify call may feed (banks of the online state).
      rngs: parameter initialisation.
    """

    def __init__(
        self, config: AttentionConfig, *, backend: str = "online", max_draft: int = 4, rngs: nnx.Rngs
    ):
        if backend not in ("online", "offline"):
            raise ValueError(f"backend: 'online' or 'offline', got {backend!r}")
        self.config, self.backend, self.max_draft = config, backend, max_draft
        c = config

        def param(*shape, scale=None):
            scale = shape[-1] ** -0.5 if scale is None else scale
            return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32) * scale)

        self.q_a_proj = param(c.q_lora_rank, c.hidden_size)
        self.q_a_norm = nnx.Param(jnp.ones((c.q_lora_rank,), jnp.float32))
        self.q_b_proj = param(c.num_heads * c.head_dim, c.q_lora_rank)
        self.kv_proj = param(c.head_dim, c.hidden_size)
        self.kv_norm = nnx.Param(jnp.ones((c.head_dim,), jnp.float32))
        self.o_a_proj = param(c.o_groups * c.o_lora_rank, c.num_heads * c.head_dim // c.o_groups)
        self.o_b_proj = param(c.hidden_size, c.o_groups * c.o_lora_rank)
        self.sinks = nnx.Param(jnp.zeros((c.num_heads,), jnp.float32))
        if c.layer_type == HCA:
            self.compressor_kv_proj = param(c.head_dim, c.hidden_size)
            self.compressor_gate_proj = param(c.head_dim, c.hidden_size)
            self.compressor_ape = nnx.Param(jnp.zeros((BLOCK, c.head_dim), jnp.float32))
            self.compressor_kv_norm = nnx.Param(jnp.ones((c.head_dim,), jnp.float32))

    @classmethod
    def from_hf(cls, config: dict, layer_idx: int, weights: dict, **kwargs) -> DeepseekV4Attention:
        """A layer with transformers weights.

        Args:
          config: ``DeepseekV4Config.to_dict()``.
          layer_idx: the layer.
          weights: that layer's state-dict entries (numpy arrays), named as in transformers, with or without
            the ``model.layers.{i}.self_attn.`` prefix.
          kwargs: ``backend``, ``max_draft``, ``rngs`` of the constructor.
        """
        module = cls(
            AttentionConfig.from_hf(config, layer_idx), rngs=kwargs.pop("rngs", nnx.Rngs(0)), **kwargs
        )
        given = {name.split("self_attn.")[-1]: value for name, value in weights.items()}
        for name, attr in HF_WEIGHT_NAMES.items():
            if not hasattr(module, attr):
                continue
            if name not in given:
                raise KeyError(f"weights: missing {name!r} for layer {layer_idx}")
            current = getattr(module, attr)
            value = jnp.asarray(given[name], jnp.float32)
            if value.shape != current.shape:
                raise ValueError(f"weights[{name!r}]: expected shape {current.shape}, got {value.shape}")
            current[...] = value
        return module

    @property
    def controller(self):
        return Controller() if self.backend == "online" else OfflineController()

    def init_cache(self, batch: int, max_len: int | None = None) -> AttentionCache:
        """An empty cache for ``batch`` rows and sequences up to ``max_len`` tokens (default: the config's
        ``max_position_embeddings``)."""
        c = self.config
        max_len = c.max_position_embeddings if max_len is None else max_len
        hca = c.layer_type == HCA
        compress = None
        if hca:
            state_type = CompressState if self.backend == "online" else OfflineState
            compress = state_type.create(1, batch, c.head_dim, self.max_draft)
        return AttentionCache(
            window=jnp.zeros((batch, c.sliding_window + self.max_draft, c.head_dim), jnp.float32),
            window_positions=jnp.full((batch, c.sliding_window + self.max_draft), -1, jnp.int32),
            entries=jnp.zeros((batch, max_len // BLOCK if hca else 0, c.head_dim), jnp.float32),
            compress=compress,
        )

    def __call__(
        self, x, positions, cache: AttentionCache | None = None, *, lengths=None, verify: bool = False
    ):
        """Attention over the window, the new tokens (causal) and the visible compressed entries.

        ``lengths`` ``[batch]`` int32 (default: all T) is the number of valid tokens of each row; the rest is
        padding, and a row of length 0 leaves its cache untouched (outputs of padding are meaningless).
        Returns ``(y [batch, T, hidden], cache)``. With ``verify=True`` the T tokens are a chain verify
        (1 <= T <= max_draft, rows of length T or 0): the compressor writes its banks, and the caller then
        keeps ``accept`` of them with :meth:`commit` or leaves them pending (the row's next call commits
        them from its positions).
        """
        c = self.config
        batch, tokens, _ = x.shape
        cache = self.init_cache(batch) if cache is None else cache
        lengths = jnp.full((batch,), tokens, jnp.int32) if lengths is None else lengths
        q_res = rms_norm(linear(x, self.q_a_proj[...]), self.q_a_norm[...], c.rms_norm_eps)
        q = linear(q_res, self.q_b_proj[...]).reshape(batch, tokens, c.num_heads, c.head_dim)
        q = c.rope.apply(rms_norm(q, 1.0, c.rms_norm_eps), positions)  # per head, unweighted
        kv = c.rope.apply(
            rms_norm(linear(x, self.kv_proj[...]), self.kv_norm[...], c.rms_norm_eps), positions
        )

        keys = jnp.concatenate([cache.window, kv], axis=1)
        key_positions = jnp.concatenate([cache.window_positions, positions], axis=1)
        t, k = positions[:, :, None], key_positions[:, None, :]
        # window rows at or past this call's first position hold rejected drafts of an earlier verify: this
        # call rewrites those positions, so only the window rows before it count
        fresh = jnp.concatenate(
            [cache.window_positions < positions[:, :1], jnp.ones_like(positions, bool)], axis=1
        )
        visible = fresh[:, None, :] & (k >= 0) & (k <= t) & (k > t - c.sliding_window)
        if c.layer_type == HCA:
            cache = self._compress(x, positions, lengths, cache, verify)
            keys = jnp.concatenate([keys, cache.entries], axis=1)
            entry = jnp.arange(cache.entries.shape[1])[None, None, :]
            visible = jnp.concatenate([visible, entry < (t + 1) // BLOCK], axis=2)

        logits = jnp.einsum("bthd,bkd->bhtk", q, keys, precision=FULL) * c.head_dim**-0.5
        logits = jnp.where(visible[:, None], logits, -jnp.inf)
        sink = self.sinks[...][None, :, None]
        top = jnp.maximum(jnp.max(logits, axis=-1), sink)
        weights = jnp.exp(logits - top[..., None])
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + jnp.exp(sink - top)[..., None])
        out = c.rope.apply(
            jnp.einsum("bhtk,bkd->bthd", weights, keys, precision=FULL), positions, inverse=True
        )

        grouped = out.reshape(batch, tokens, c.o_groups, -1)
        o_a = self.o_a_proj[...].reshape(c.o_groups, c.o_lora_rank, -1)
        y = linear(
            jnp.einsum("btgi,goi->btgo", grouped, o_a, precision=FULL).reshape(batch, tokens, -1),
            self.o_b_proj[...],
        )
        return y, self._update_window(cache, kv, positions, lengths)

    def _update_window(self, cache, kv, positions, lengths):
        """Write the last ``R`` valid new rows into the window ring (row ``p % R``)."""
        window = cache.window.shape[1]
        t = jnp.arange(positions.shape[1])[None]
        write = (t < lengths[:, None]) & (t >= lengths[:, None] - window)
        index = jnp.where(write, positions % window, window)
        rows = jnp.arange(positions.shape[0])[:, None]
        return dataclasses.replace(
            cache,
            window=cache.window.at[rows, index].set(kv, mode="drop"),
            window_positions=cache.window_positions.at[rows, index].set(positions, mode="drop"),
        )

    def _compress(self, x, positions, lengths, cache, verify):
        """Run the compressor (compress, or verify's bank writes) and store the entries it closed."""
        c = self.config
        batch, tokens, _ = x.shape
        kv_score = jnp.concatenate(
            [linear(x, self.compressor_kv_proj[...]), linear(x, self.compressor_gate_proj[...])], -1
        )
        kv_score, ape = kv_score[None], self.compressor_ape[...][None]
        seq_lens = positions[:, 0]
        slots = jnp.where(lengths > 0, jnp.arange(batch, dtype=jnp.int32), -1)
        controller, state = self.controller, cache.compress
        if verify:
            state = controller.prepare_forward(state, ForwardMode.TARGET_VERIFY, slots, seq_lens)
            state, entries, blocks = controller.write_prefix(state, kv_score, seq_lens, slots, ape)
        else:
            mode = ForwardMode.DECODE if tokens == 1 else ForwardMode.EXTEND
            state = controller.prepare_forward(state, mode, slots, seq_lens)
            state, entries, blocks = controller.compress(state, kv_score, seq_lens, lengths, slots, ape)
        normed = rms_norm(entries[0], self.compressor_kv_norm[...], c.rms_norm_eps)
        normed = c.rope.apply(normed, jnp.maximum(blocks, 0) * BLOCK)
        index = jnp.where(blocks >= 0, blocks, cache.entries.shape[1])
        stored = cache.entries.at[jnp.arange(batch)[:, None], index].set(normed, mode="drop")
        return dataclasses.replace(cache, entries=stored, compress=state)

    def commit(self, cache: AttentionCache, seq_lens, accept_lens) -> AttentionCache:
        """Keep ``accept_lens`` ``[batch]`` tokens of the verify call at ``seq_lens`` (the eager commit)."""
        if cache.compress is None:
            return cache
        slots = jnp.arange(seq_lens.shape[0], dtype=jnp.int32)
        return dataclasses.replace(
            cache, compress=self.controller.commit(cache.compress, slots, seq_lens, accept_lens)
        )


# ---------------------------------------------------------------------------------------------
# A small DeepSeek-V4-style decoder and its MTP draft head


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
