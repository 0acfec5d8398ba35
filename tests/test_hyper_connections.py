"""The hyper-connections (mHC) at V4-Flash's width against a float64 numpy transcription of transformers'
``DeepseekV4HyperConnection``, ``DeepseekV4HyperHead`` and the decoder layer's expansion (5.24.0), on fresh
random streams and parameters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from oracle import rel_err

from jax_oc128.nn.hyper_connections import HyperConnection, HyperHead

N, HIDDEN, SINKHORN_ITERS, HC_EPS, NORM_EPS = 4, 4096, 20, 1e-6, 1e-6
#: float32 against float64: a few ulps per op, the mixes summed over n * hidden = 16384 terms
TOL = 1e-5


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def mixes(streams, fn):
    """The unweighted RMS norm of the flattened streams times ``fnᵀ``, float64."""
    flat = streams.reshape(*streams.shape[:-2], -1)
    flat = flat / np.sqrt(np.mean(flat * flat, axis=-1, keepdims=True) + NORM_EPS)
    return flat @ fn.T


def hyper_connection(streams, fn, base, scale):
    """``(post, comb, collapsed)`` of transformers' ``DeepseekV4HyperConnection.forward``, float64."""
    mix = mixes(streams, fn)
    pre = sigmoid(mix[..., :N] * scale[0] + base[:N]) + HC_EPS
    post = 2 * sigmoid(mix[..., N : 2 * N] * scale[1] + base[N : 2 * N])
    logits = (mix[..., 2 * N :] * scale[2] + base[2 * N :]).reshape(*mix.shape[:-1], N, N)
    comb = np.exp(logits - logits.max(axis=-1, keepdims=True))
    comb = comb / comb.sum(axis=-1, keepdims=True) + HC_EPS
    comb = comb / (comb.sum(axis=-2, keepdims=True) + HC_EPS)
    for _ in range(SINKHORN_ITERS - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + HC_EPS)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + HC_EPS)
    return post, comb, (pre[..., None] * streams).sum(axis=-2)


def expand(post, comb, output, streams):
    """The decoder layer's new streams ``post ⊗ output + combᵀ streams``, float64."""
    return post[..., None] * output[..., None, :] + np.swapaxes(comb, -1, -2) @ streams


def hyper_head(streams, fn, base, scale):
    pre = sigmoid(mixes(streams, fn) * scale + base) + HC_EPS
    return (pre[..., None] * streams).sum(axis=-2)


def randomize(module, key):
    """``module``'s parameters drawn afresh (base and scale away from their zeros and ones), float32."""
    keys = iter(jax.random.split(key, 3))
    for name, std in (("fn", HIDDEN**-0.5), ("base", 1.0), ("scale", 0.5)):
        param = getattr(module, name)
        shift = 1.0 if name == "scale" else 0.0
        param[...] = shift + std * jax.random.normal(next(keys), param.shape, jnp.float32)
    return [np.asarray(getattr(module, name)[...], np.float64) for name in ("fn", "base", "scale")]


@pytest.mark.parametrize("tokens", [1, 8])
def test_hyper_connection_matches_float64(tokens):
    """A decode-shaped (8 rows of 1 token) and a chunk-shaped call at V4-Flash's width (n = 4, hidden 4096):
    post, the doubly-stochastic comb, the collapsed input, the expanded streams and the head's collapse
    equal the float64 transcription, < 1e-5 relative."""
    key = jax.random.key(tokens)
    hc = HyperConnection(N, HIDDEN, SINKHORN_ITERS, HC_EPS, NORM_EPS, rngs=nnx.Rngs(0))
    head = HyperHead(N, HIDDEN, HC_EPS, NORM_EPS, rngs=nnx.Rngs(1))
    hc_params, head_params = randomize(hc, jax.random.key(2)), randomize(head, jax.random.key(3))
    keys = jax.random.split(key)
    streams = jax.random.normal(keys[0], (8, tokens, N, HIDDEN), jnp.float32)
    output = jax.random.normal(keys[1], (8, tokens, HIDDEN), jnp.float32)

    @jax.jit
    def forward(streams, output):
        post, comb, collapsed = hc(streams)
        return post, comb, collapsed, HyperConnection.expand(post, comb, output, streams), head(streams)

    got = forward(streams, output)
    streams64, output64 = np.asarray(streams, np.float64), np.asarray(output, np.float64)
    post, comb, collapsed = hyper_connection(streams64, *hc_params)
    want = post, comb, collapsed, expand(post, comb, output64, streams64), hyper_head(streams64, *head_params)
    for name, g, w in zip(["post", "comb", "collapsed", "expanded", "head"], got, want, strict=True):
        assert g.dtype == jnp.float32 and g.shape == w.shape, name
        assert rel_err(g, w) < TOL, (name, rel_err(g, w))
