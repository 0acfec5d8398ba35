"""Float64 offline computations the ops are checked against, and the random data they run on."""

from __future__ import annotations

import numpy as np

BLOCK = 128

# Scales of realistic data: kv ~ N(0, 1) (the projection's output), gate scores ~ N(0, 2) plus a
# learned ape ~ N(0, 0.5), so the per-channel softmax over a block is far from uniform.
KV_SCALE, SCORE_SCALE, APE_SCALE = 1.0, 2.0, 0.5


def random_ape(rng, layers, dim):
    return (APE_SCALE * rng.standard_normal((layers, BLOCK, dim))).astype(np.float32)


def random_tokens(rng, shape_prefix, dim, score_offset=0.0):
    """``[*shape_prefix, 2*dim]`` float32 rows ``[kv | score]``."""
    kv = KV_SCALE * rng.standard_normal((*shape_prefix, dim))
    score = SCORE_SCALE * rng.standard_normal((*shape_prefix, dim)) + score_offset
    return np.concatenate([kv, score], axis=-1).astype(np.float32)


class Stream:
    """The true token stream of one request: ``rows[layer, position] = [kv | score]``.

    An accepted token at position p always carries ``rows[:, p]``; rejected drafts carry junk.
    """

    def __init__(self, rng, layers, length, dim, score_offset=0.0):
        self.rows = random_tokens(rng, (layers, length), dim, score_offset)
        self.dim = dim

    def sigma(self, ape, start, stop):
        """float64 scores with ape, ``[layers, stop - start, dim]``."""
        pos = np.arange(start, stop) % BLOCK
        return self.rows[:, start:stop, self.dim :].astype(np.float64) + ape[:, pos].astype(np.float64)

    def kv(self, start, stop):
        return self.rows[:, start:stop, : self.dim].astype(np.float64)

    def entry(self, ape, block):
        """Offline pooling of a closed block: per-channel softmax of the scores, ``[layers, dim]``."""
        lo, hi = block * BLOCK, (block + 1) * BLOCK
        sigma = self.sigma(ape, lo, hi)
        w = np.exp(sigma - sigma.max(axis=1, keepdims=True))
        return (w * self.kv(lo, hi)).sum(axis=1) / w.sum(axis=1)

    def open_state(self, ape, length):
        """``(m, s, a)`` of the open block after ``length`` tokens (``length % 128 != 0``), each
        ``[layers, dim]``."""
        lo = length // BLOCK * BLOCK
        sigma = self.sigma(ape, lo, length)
        m = sigma.max(axis=1)
        w = np.exp(sigma - m[:, None])
        return m, w.sum(axis=1), (w * self.kv(lo, length)).sum(axis=1) / w.sum(axis=1)


def window_attention(q, kv, first, sinks, scale, window=BLOCK):
    """float64 sliding-window attention of one row's chain of T queries from position ``first``: query t (at
    ``p = first + t``) over the keys (= values) of positions ``p - window < k <= p``, with the head's sink in
    the denominator.

    Args:
      q: ``[T, heads, D]``.
      kv: ``[first + T, D]``: the key of every position up to the last query's.
      first: the first query's position.
      sinks: ``[heads]``.
      scale: the logits' scale.
      window: the keys each query sees, itself included.

    Returns:
      ``[T, heads, D]`` float64.
    """
    q, kv, sinks = (np.asarray(a, np.float64) for a in (q, kv, sinks))
    out = np.empty(q.shape)
    for t in range(q.shape[0]):
        p = first + t
        keys = kv[max(0, p - window + 1) : p + 1]  # [n, D]
        logits = q[t] @ keys.T * scale  # [heads, n]
        top = np.maximum(logits.max(axis=1), sinks)
        weights = np.exp(logits - top[:, None])
        out[t] = weights @ keys / (weights.sum(axis=1) + np.exp(sinks - top))[:, None]
    return out


def rel_err(x, ref):
    """Normwise relative error ``max|x - ref| / max|ref|``."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))


def state_err(rows, m, s, a):
    """Relative errors of stored rows ``[..., 3, D]`` against a float64 open state.

    The stored sum is compared after rescaling it to the true max (only ``s * exp(m)`` is meaningful),
    so a stored max that was rounded (bf16) is not counted twice.
    """
    rows = np.asarray(rows, np.float64)
    m_q, s_q, a_q = rows[..., 0, :], rows[..., 1, :], rows[..., 2, :]
    return rel_err(m_q, m), rel_err(s_q * np.exp(m_q - m), s), rel_err(a_q, a)
