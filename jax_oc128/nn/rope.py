"""Rotary position embedding as DeepSeek-V4 applies it: interleaved pairs on the trailing channels, default
or YaRN frequencies (transformers' ``rope_parameters``)."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np


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
