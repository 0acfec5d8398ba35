"""The building blocks the modules share: the linear layers' rule in transformers' weight layout, RMSNorm,
the SwiGLU gate, parameter initialisation, the parameters' dtype and the variable at an attribute path.

Precision: activations are float32. The matrices (linear layers, experts, the embedding and the LM head, made
by :func:`normal_param`) are stored in the model's dtype, float32 or bfloat16; every other parameter stays
float32, as transformers keeps DeepSeek-V4's norms, hyper-connections, sinks, position biases and router
biases in float32. A linear layer takes its input in the weight's dtype and accumulates in float32
(:func:`linear_jnp`, the rule of :func:`jax_oc128.nn.linear.linear`), so a bfloat16 model runs its
matmuls on bfloat16 operands and everything else (norms, softmaxes, RoPE, the residual streams, routing, the
compressors' pooling) in float32. A weight may also be quantized (a
:class:`~jax_oc128.nn.quant.QuantizedArray`, a released checkpoint's FP8 or FP4 weight): it is dequantized
to the model's dtype (:func:`~jax_oc128.nn.quant.matrix`), and the matmul is the float one: whole, or in
registers by a kernel (:func:`jax_oc128.nn.linear.linear`)."""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

from jax_oc128.nn.quant import matrix
from jax_oc128.ops import FULL

#: the dtypes a model's weights may have, by name (``ModelConfig.dtype``)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_Built = TypeVar("_Built")


def linear_jnp(x, weight, *, groups: int | None = None, name: tuple[str, ...] | None = None):
    """``x @ weight.T`` for an ``[out, in]`` weight (transformers' layout; a quantized one dequantized whole
    to its dtype, :func:`~jax_oc128.nn.quant.matrix`): ``x`` ``[..., in]`` is taken in the weight's dtype and
    the products are accumulated and returned in float32 (full float32 for a float32 weight), ``[...,
    out]``. ``groups`` G: ``x`` ``[..., G, in]``, group g by the weight's rows ``[g * out / G, (g + 1) * out
    / G)`` -> ``[..., G, out / G]``. The rule of every linear layer and the twin of
    :func:`~jax_oc128.nn.linear.linear`'s kernel, whose arguments it takes (``name`` unused: XLA
    partitions this matmul by its operands' shardings)."""
    weight = matrix(weight)
    x = x.astype(weight.dtype)
    if groups is None:
        return jnp.matmul(x, weight.T, precision=FULL, preferred_element_type=jnp.float32)
    weight = weight.reshape(groups, -1, weight.shape[-1])
    return jnp.einsum("...gi,goi->...go", x, weight, precision=FULL, preferred_element_type=jnp.float32)


def rms_norm(x, weight, eps):
    """RMSNorm over the last axis, in float32 (as transformers' DeepseekV4RMSNorm)."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


#: Whether the parameter helpers make shapes only (:func:`build_abstract`).
_ABSTRACT = contextvars.ContextVar("jax_oc128.nn.functional abstract parameters", default=False)


def build_abstract(build: Callable[[nnx.Rngs], _Built]) -> _Built:
    """``build(rngs)`` (a module's construction) with every parameter a :class:`jax.ShapeDtypeStruct`: the
    module's structure, shapes and dtypes as :func:`flax.nnx.eval_shape` gives them, with nothing computed
    or traced (tracing the construction costs a few ms per parameter: 61 layers, seconds). The modules
    make their parameters by :func:`param` (or its helpers below), which then compute nothing; ``rngs``
    refuses to draw a key."""
    token = _ABSTRACT.set(True)
    try:
        return build(_NoDraws())
    finally:
        _ABSTRACT.reset(token)


class _NoDraws:
    """The ``rngs`` of :func:`build_abstract`: a parameter made with shapes only draws no key."""

    @staticmethod
    def params():
        raise RuntimeError("build_abstract: a parameter drew a key instead of being made by functional.param")


def param(shape: tuple[int, ...], dtype, init: Callable[[], jax.Array], kind=nnx.Param) -> nnx.Variable:
    """A ``kind`` variable (a parameter by default) of ``shape`` and ``dtype``, valued ``init()``; within
    :func:`build_abstract`, a :class:`jax.ShapeDtypeStruct` and ``init`` is not called."""
    if _ABSTRACT.get():
        return kind(jax.ShapeDtypeStruct(shape, dtype))
    return kind(init())


def normal_param(rngs: nnx.Rngs, *shape, scale=None, dtype: str = "float32") -> nnx.Param:
    """A parameter ~ N(0, scale^2), by default ``scale = 1 / sqrt(shape[-1])`` (fan-in), drawn in float32
    and stored as ``dtype`` (a name in :data:`DTYPES`)."""
    scale = shape[-1] ** -0.5 if scale is None else scale
    return param(
        shape,
        DTYPES[dtype],
        lambda: (jax.random.normal(rngs.params(), shape, jnp.float32) * scale).astype(DTYPES[dtype]),
    )


def zeros_param(*shape) -> nnx.Param:
    """A float32 parameter of zeros."""
    return param(shape, jnp.float32, lambda: jnp.zeros(shape, jnp.float32))


def ones_param(*shape) -> nnx.Param:
    """A float32 parameter of ones (e.g. a norm's weight)."""
    return param(shape, jnp.float32, lambda: jnp.ones(shape, jnp.float32))


def swiglu_gate(g, u, limit=None):
    """``silu(g) * u`` of the gate and up projections; with a ``limit`` the gate is clamped from above and
    the up projection to ``[-limit, limit]`` first (transformers' ``swiglu_limit``)."""
    if limit is not None:
        g, u = jnp.minimum(g, limit), jnp.clip(u, -limit, limit)
    return jax.nn.silu(g) * u


def variable_at(module: nnx.Module, path: tuple) -> nnx.Variable:
    """The variable at ``path`` in ``module``: a tuple of attribute names and list indices."""
    for step in path:
        module = module[step] if isinstance(step, int) else getattr(module, step)
    return module
