"""The float32 building blocks the modules share: linear layers in transformers' weight layout, RMSNorm and
parameter initialisation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

FULL = jax.lax.Precision.HIGHEST  # float32 matmuls stay float32 (on GPUs the default would allow TF32)


def linear(x, weight):
    """``x @ weight.T`` for a ``[out, in]`` weight (transformers' layout), in full float32."""
    return jnp.matmul(x, weight.T, precision=FULL)


def rms_norm(x, weight, eps):
    """RMSNorm over the last axis, in float32 (as transformers' DeepseekV4RMSNorm)."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def normal_param(rngs: nnx.Rngs, *shape, scale=None) -> nnx.Param:
    """A float32 parameter ~ N(0, scale^2), by default ``scale = 1 / sqrt(shape[-1])`` (fan-in)."""
    scale = shape[-1] ** -0.5 if scale is None else scale
    return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32) * scale)


def ones_param(size: int) -> nnx.Param:
    """A float32 ``[size]`` parameter of ones (a norm's weight)."""
    return nnx.Param(jnp.ones((size,), jnp.float32))


def swiglu(x, gate, up, down, limit=None):
    """The SwiGLU MLP ``down(silu(gate(x)) * up(x))`` with ``[out, in]`` weights; with a ``limit`` the gate
    is clamped from above and the up projection to ``[-limit, limit]`` (transformers' ``swiglu_limit``)."""
    g, u = linear(x, gate), linear(x, up)
    if limit is not None:
        g, u = jnp.minimum(g, limit), jnp.clip(u, -limit, limit)
    return linear(jax.nn.silu(g) * u, down)
