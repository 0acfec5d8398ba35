"""Quantized test weights made by DeepSeek's rules and the float64 check of a linear layer on them (shared by
the MoE, linear and mesh tests)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_oc128.nn import quant
from jax_oc128.nn.quant import FP4, FP8, QuantizedArray


def quantized(w, fmt, scales, dtype):
    """Float ``w`` ``[experts, out, in]`` quantized expert by expert by DeepSeek's rules (FP8 ``[128, 128]``
    blocks, FP4 ``[1, 32]`` groups) into the :class:`QuantizedArray` the loader makes: per-row scales as
    uint8 e8m0 exponents (``scales`` ``"e8m0"``) or their float32 values (``"float32"``), dequantized to
    ``dtype``."""
    quantize = quant.quantize_fp8 if fmt == FP8 else quant.quantize_fp4
    pieces = [quantize(np.asarray(expert, np.float32)) for expert in w]
    codes = np.stack([c.view(np.uint8) if fmt == FP4 else c for c, _ in pieces])
    exponents = np.stack([e.view(np.uint8) for _, e in pieces])
    exponents = quant.row_scales(exponents, w.shape[1]) if fmt == FP8 else exponents
    values = np.exp2(exponents.astype(np.float64) - quant.E8M0_BIAS).astype(np.float32)
    return QuantizedArray(
        jnp.asarray(codes), jnp.asarray(exponents if scales == "e8m0" else values), fmt, dtype
    )


def abstract_quantized(fmt, shape, dtype):
    """The abstract :class:`QuantizedArray` (e8m0 scales) of a ``[experts, out, in]`` weight in ``fmt``."""
    *lead, width = shape
    stored = (*lead, width // 2) if fmt == FP4 else shape
    codes = jax.ShapeDtypeStruct(stored, jnp.uint8 if fmt == FP4 else jnp.float8_e4m3fn)
    scales = jax.ShapeDtypeStruct((*lead, -(-width // quant.GROUP[fmt])), jnp.uint8)
    return QuantizedArray(codes, scales, fmt, dtype)


def float64_linear(x, weight, groups, magnitudes=False):
    """``x`` (rounded to the weight's dtype) by the dequantized ``weight`` in float64 numpy; with
    ``magnitudes``, also the same of ``|x|`` by ``|weight|`` (the sums of the products' magnitudes)."""
    w = np.asarray(quant.dequantize(weight).astype(jnp.float32), np.float64)
    x = np.asarray(jnp.asarray(x).astype(weight.dtype).astype(jnp.float32), np.float64)
    if groups is None:
        product = lambda a, b: a @ b.T  # noqa: E731
    else:
        w = w.reshape(groups, -1, w.shape[-1])
        product = lambda a, b: np.einsum("...gi,goi->...go", a, b)  # noqa: E731
    return (product(x, w), product(np.abs(x), np.abs(w))) if magnitudes else product(x, w)


def assert_float32_sum(got, want, magnitudes, width):
    """``got`` (float32) is ``want`` to the error bound of float32 sums of ``width`` exact products (x is
    rounded to the weight's dtype first and the weights' values are exact in it): ``width * 2^-24`` times the
    sum of the products' magnitudes (recursive summation's bound, whatever the order: the kernel adds its
    K blocks in sequence, XLA in its own order)."""
    np.testing.assert_array_less(
        np.abs(np.asarray(got, np.float64) - want), width * 2**-24 * magnitudes + 1e-30
    )
