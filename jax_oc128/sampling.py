"""Per-row sampling parameters and the distribution they sample: softmax(logits / temperature) truncated to
the top-k tokens, then to the nucleus of top-p mass, renormalised. Greedy rows (temperature 0) take the
argmax. Pure functions of device arrays, jit-friendly: every parameter is a per-row array, so rows of any
parameters share one compilation.

**The truncation rule** (the same for the target and the draft head, which is what keeps speculative
sampling exact on the truncated distributions, :mod:`jax_oc128.tree`): with ``x`` the tempered logits of a
row, top-k keeps the tokens whose ``x`` is at least the k-th largest (ties at the k-th value all kept);
on the renormalised result, top-p keeps every token whose probability is at least that of the token
that brings the descending cumulative probability to ``top_p`` (again ties kept): the smallest set of the
most probable tokens of mass >= ``top_p``. Computed in float32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

#: The least positive temperature a row samples at: below it, sampling is as at 2**-100, which in float32
#: is already one-hot unless two logits are within ~1e-28; the bound keeps logit gaps up to ~2.7e8 finite
#: once scaled, so that a tree's later draws without replacement still see the next most probable tokens.
MIN_TEMPERATURE = 2.0**-100


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampling:
    """Each row's sampling parameters (device or host arrays of ``[rows]``).

    Attributes:
      temperature: float32, 0 (greedy) or > 0.
      top_p: float32 in (0, 1]; 1: off.
      top_k: int32 >= 0; 0: off (as is any k >= V).
    """

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array

    @property
    def greedy(self):
        """``[rows]`` bool: the rows that take the argmax."""
        return self.temperature == 0


def _rows(x, ndim: int):
    """A ``[rows]`` array shaped to broadcast against an array of ``ndim`` dimensions, rows first."""
    x = jnp.asarray(x)
    return x.reshape(x.shape + (1,) * (ndim - x.ndim))


def tempered(logits, temperature):
    """``logits`` ``[rows, ..., V]`` (any float dtype) / ``temperature`` (a number or ``[rows]``; values
    below :data:`MIN_TEMPERATURE` taken as it) less their maximum, in float32: the log-probabilities of
    softmax(logits / temperature) up to a constant, all <= 0 and 0 at the maximum (rows of -inf only
    stay -inf). The maximum is subtracted before scaling: scaling first makes the maximum's entry a rounding
    difference of huge numbers at a tiny temperature, whose exp overflows to inf and then NaN. This way
    nothing overflows at any temperature, and otherwise the values are softmax's own shift of logits /
    temperature."""
    logits = logits.astype(jnp.float32)
    top = jnp.max(logits, axis=-1, keepdims=True)
    scale = 1.0 / jnp.maximum(_rows(jnp.asarray(temperature, jnp.float32), logits.ndim), MIN_TEMPERATURE)
    return (logits - jnp.where(jnp.isfinite(top), top, 0.0)) * scale


def _truncate(x, top_p, top_k):
    """The tempered logits ``x`` ``[rows, ..., V]`` with the tokens outside each row's top-k, then outside
    its top-p nucleus, set to -inf (module docstring); ``top_p``, ``top_k`` shaped to broadcast."""
    vocab = x.shape[-1]
    ordered = -jnp.sort(-x, axis=-1)  # descending
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    kth = jnp.take_along_axis(ordered, jnp.broadcast_to(k - 1, (*x.shape[:-1], 1)), axis=-1)
    probabilities = softmax(jnp.where(ordered >= kth, ordered, -jnp.inf))
    before = jnp.cumsum(probabilities, axis=-1) - probabilities  # the mass of the more probable tokens
    count = jnp.sum(before < top_p, axis=-1, keepdims=True)  # >= 1: before[0] is 0 < top_p
    cutoff = jnp.take_along_axis(ordered, count - 1, axis=-1)
    threshold = jnp.where(top_p < 1, jnp.maximum(kth, cutoff), kth)
    return jnp.where(x >= threshold, x, -jnp.inf)


def log_probs(logits, sampling: Sampling):
    """The log-probabilities, up to a per-row constant, of each row's sampled distribution: ``logits``
    ``[rows, ..., V]`` tempered (:func:`tempered`) and truncated by top-k and top-p (module docstring; -inf
    outside), float32. The truncation's sort runs only when a row truncates. Greedy rows give their
    distribution at :data:`MIN_TEMPERATURE` (unused: they take the argmax)."""
    x = tempered(logits, sampling.temperature)
    top_p, top_k = (_rows(v, x.ndim) for v in (sampling.top_p, sampling.top_k))
    truncates = jnp.any((top_p < 1) | (top_k > 0))
    return jax.lax.cond(truncates, _truncate, lambda x, *_: x, x, top_p, top_k)


def softmax(logits):
    """softmax over the last axis, zeros where every logit is -inf (nothing left to draw)."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    e = jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0))
    total = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(total > 0, total, 1.0)


def pick(logits, key, sampling: Sampling):
    """One token per row: the argmax of ``logits`` ``[rows, V]`` for greedy rows, else a draw from the
    row's distribution (:func:`log_probs`; drawn only when a row samples). Returns ``[rows]`` int32."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def drawn():
        tokens = jax.random.categorical(key, log_probs(logits, sampling)).astype(jnp.int32)
        return jnp.where(sampling.greedy, greedy, tokens)

    return jax.lax.cond(jnp.all(sampling.greedy), lambda: greedy, drawn)
