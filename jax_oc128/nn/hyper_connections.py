"""Manifold-constrained hyper-connections (mHC) as DeepSeek-V4 uses them (transformers'
``DeepseekV4HyperConnection`` and ``DeepseekV4HyperHead``, 5.24.0).

The residual is ``n = hc_mult`` parallel streams ``[batch, T, n, hidden]``. Around each sublayer (attention,
MLP) a :class:`HyperConnection` collapses the streams into the sublayer's input and mixes the sublayer's
output back in: ``streams' = post ⊗ f(Σ_i pre_i streams_i) + combᵀ streams``, where pre, post and the
doubly-stochastic comb (Sinkhorn-projected) are computed from the streams themselves. :class:`HyperHead`
collapses the streams once more before the final norm. Everything is float32 (parameters included, as in
transformers).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_oc128.nn.functional import FULL, normal_param, ones_param, rms_norm, zeros_param
from jax_oc128.nn.linear import linear


def _mixes(streams, fn, eps):
    """The unweighted RMS of the flattened streams ``[batch, T, n, hidden]`` times ``fnᵀ``: ``[batch, T, m]``
    for an ``fn`` of ``[m, n * hidden]``."""
    flat = streams.reshape(*streams.shape[:-2], -1)
    return linear(rms_norm(flat, 1.0, eps), fn)


def _collapse(pre, streams):
    """``Σ_i pre_i · streams_i``: ``[batch, T, n]``, ``[batch, T, n, hidden]`` -> ``[batch, T, hidden]``."""
    return jnp.einsum("btn,btnd->btd", pre, streams, precision=FULL)


class HyperConnection(nnx.Module):
    """The mHC around one sublayer.

    Args:
      hc_mult: n, the number of streams; hidden_size: their width.
      sinkhorn_iters: Sinkhorn-Knopp iterations that make comb doubly stochastic.
      hc_eps: the epsilon added to pre and comb and to the Sinkhorn denominators.
      norm_eps: the epsilon of the unweighted RMS norm of the streams.
    """

    def __init__(
        self, hc_mult: int, hidden_size: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float, *, rngs
    ):
        self.hc_mult, self.sinkhorn_iters, self.hc_eps, self.norm_eps = (
            hc_mult,
            sinkhorn_iters,
            hc_eps,
            norm_eps,
        )
        width = (2 + hc_mult) * hc_mult
        self.fn = normal_param(rngs, width, hc_mult * hidden_size)
        self.base = zeros_param(width)
        self.scale = ones_param(3)

    def __call__(self, streams):
        """``streams`` ``[batch, T, n, hidden]`` -> ``(post [batch, T, n], comb [batch, T, n, n],
        collapsed [batch, T, hidden])``: the sublayer's input and the weights :meth:`expand` takes."""
        n, eps = self.hc_mult, self.hc_eps
        mixes = _mixes(streams, self.fn[...], self.norm_eps)
        base, scale = self.base[...], self.scale[...]
        pre = jax.nn.sigmoid(mixes[..., :n] * scale[0] + base[:n]) + eps
        post = 2 * jax.nn.sigmoid(mixes[..., n : 2 * n] * scale[1] + base[n : 2 * n])
        comb_logits = mixes[..., 2 * n :] * scale[2] + base[2 * n :]
        comb = jax.nn.softmax(comb_logits.reshape(*comb_logits.shape[:-1], n, n), axis=-1) + eps
        comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)

        def sinkhorn(_, comb):
            comb = comb / (jnp.sum(comb, axis=-1, keepdims=True) + eps)
            return comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)

        # unrolled, so that XLA fuses the iterations: as a while loop on a GPU each iteration is several
        # kernels (84 a call against 10 at V4-Flash's shapes on the H200, bench/RESULTS.md section 11)
        comb = jax.lax.fori_loop(0, self.sinkhorn_iters - 1, sinkhorn, comb, unroll=True)
        return post, comb, _collapse(pre, streams)

    @staticmethod
    def expand(post, comb, output, streams):
        """The new streams ``post ⊗ output + combᵀ streams``: ``output`` ``[batch, T, hidden]`` is the
        sublayer's, ``post``/``comb``/``streams`` as in and out of :meth:`__call__`."""
        mixed = jnp.einsum("btjk,btjd->btkd", comb, streams, precision=FULL)
        return post[..., None] * output[..., None, :] + mixed


class HyperHead(nnx.Module):
    """The final collapse of the streams ``[batch, T, n, hidden]`` -> ``[batch, T, hidden]`` (before the
    final norm): ``Σ_i (sigmoid(mix_i · scale + base_i) + eps) · streams_i``."""

    def __init__(self, hc_mult: int, hidden_size: int, hc_eps: float, norm_eps: float, *, rngs):
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.fn = normal_param(rngs, hc_mult, hc_mult * hidden_size)
        self.base = zeros_param(hc_mult)
        self.scale = ones_param(1)

    def __call__(self, streams):
        mixes = _mixes(streams, self.fn[...], self.norm_eps)
        pre = jax.nn.sigmoid(mixes * self.scale[...] + self.base[...]) + self.hc_eps
        return _collapse(pre, streams)
