"""What the sampled-distribution tests share: a chi-square check of counts against exact probabilities, the
float64 sampled distributions (softmax, and truncated by top-k / top-p, computed independently of
jax_oc128.sampling), and toy context models (logits a table of the drafts before)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from harness import copy_tree
from scipy import stats

from jax_oc128.engine.arguments import check_top_k, check_top_p
from jax_oc128.engine.arguments import sampling_rows as rows_of
from jax_oc128.engine.requests import SamplingParams
from jax_oc128.tree import accept_sampled, draft_tree

#: the toy models' vocabulary
VOCAB = 6


def chi_square_holds(counts, probabilities):
    """Whether ``counts`` (any shape) fit ``probabilities`` (same shape) at p > 1e-3; cells of probability 0
    must be empty (asserted: a token outside the distribution's support is a failure whatever the
    statistic)."""
    counts, probabilities = np.ravel(counts), np.ravel(probabilities)
    possible = probabilities > 0
    assert counts[~possible].sum() == 0, (counts, probabilities)
    expected = probabilities[possible] * counts.sum()
    chi2 = float(np.sum((counts[possible] - expected) ** 2 / expected))
    return chi2 < stats.chi2.isf(1e-3, int(possible.sum()) - 1), (chi2, counts, expected)


def softmax64(logits, temperature):
    """softmax(logits / temperature) over the last axis in float64 (numpy)."""
    x = np.asarray(logits, np.float64) / temperature
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def truncated64(logits, temperature, top_p=1.0, top_k=0, margin=0.0):
    """softmax(logits / temperature) over the last axis (float64) restricted to the tokens whose logit is
    at least the k-th largest (``top_k`` 0: all), renormalised, then to the tokens x whose more probable
    tokens weigh less than ``top_p`` (the nucleus, ties kept), renormalised. With ``margin`` > 0, asserts
    that no token's mass of more probable tokens is within ``margin`` of ``top_p`` (the set is then the same
    in float32)."""
    logits = np.asarray(logits, np.float64)
    p = softmax64(logits, temperature)
    if top_k:
        kth = -np.sort(-logits, axis=-1)[..., min(top_k, logits.shape[-1]) - 1 : top_k]
        p = np.where(logits >= kth, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    if top_p < 1:
        heavier = np.sum(np.where(p[..., None, :] > p[..., :, None], p[..., None, :], 0.0), axis=-1)
        assert not np.any(np.abs(heavier - top_p) < margin), (heavier, top_p)
        p = np.where(heavier < top_p, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    return p


def context_tables(rng, depth, support=None, vocab=VOCAB):
    """A toy model: logits ``tables[d]`` ``[V] * (d + 1)`` after the d drafts of a path, normal(0, 1) on
    the tokens of ``support`` (default all), -inf elsewhere."""
    tables = [rng.normal(size=(vocab,) * (d + 1)).astype(np.float32) for d in range(depth + 1)]
    if support is not None:
        outside = ~np.isin(np.arange(vocab), support)
        for table in tables:
            table[..., outside] = -np.inf
    return [jnp.asarray(table) for table in tables]


def at_nodes(tables, t, tokens, nodes):
    """The toy model's logits ``[bs, len(nodes), V]`` at ``nodes`` of ``tokens`` ``[bs, N]`` (of the tree
    ``t``): its table of the node's depth at the drafts on the node's path."""
    bs, vocab = tokens.shape[0], tables[0].shape[-1]
    rows = []
    for k in nodes:
        context = tokens[:, t.paths[k, 1 : t.depths[k] + 1]]  # [bs, depth]
        rows.append(jnp.broadcast_to(tables[t.depths[k]][tuple(context.T)], (bs, vocab)))
    return jnp.stack(rows, axis=1)


def sampling_rows(rows, temperature, top_p=None, top_k=None):
    """Every one of ``rows`` rows sampling at ``temperature`` with ``top_p`` / ``top_k`` (None: off), as the
    engine sends them to the device (a :class:`~jax_oc128.sampling.Sampling` of ``[rows]`` arrays)."""
    params = SamplingParams(1, temperature, top_p=check_top_p(top_p), top_k=check_top_k(top_k))
    return jax.tree.map(jnp.asarray, rows_of(rows, dict.fromkeys(range(rows), params)))


@functools.partial(jax.jit, static_argnums=0)
def draft_and_accept(t, target_tables, draft_tables, key, sampling):
    """One speculative step of the toy models (:func:`context_tables`) for ``sampling``'s rows: draft the
    tree ``t``, accept (:func:`~jax_oc128.tree.accept_sampled`)."""
    draft_key, accept_key = jax.random.split(key)

    def draft_fn(carry, tokens, level):
        return at_nodes(draft_tables, t, tokens, t.expanded[level]), carry

    root = jnp.zeros(sampling.temperature.shape[0], jnp.int32)
    tokens, draft_logits, _ = draft_tree(t, root, draft_fn, None, draft_key, sampling)
    target_logits = at_nodes(target_tables, t, tokens, range(t.size))
    return accept_sampled(t, target_logits, draft_logits, tokens, accept_key, sampling)


def assert_first_two_follow(got, p, rng):
    """A speculative step's (``got``, an :class:`~jax_oc128.tree.Acceptance`) first new token is
    distributed as ``p[0]`` ``[V]`` and its first two as the joint law ``p[0](x) p[1][x](y)`` (``p[1]``
    ``[V, V]``; a step that emitted one token takes its second from ``p[1]`` after it, drawn here with
    ``rng``, as the next step's first token would be): chi-square, p > 1e-3."""
    emitted, length = np.asarray(got.emitted), np.asarray(got.length)
    vocab = p[0].shape[-1]
    ok, detail = chi_square_holds(np.bincount(emitted[:, 0], minlength=vocab), p[0])
    assert ok, detail
    first = emitted[:, 0]
    second = np.where(length >= 2, emitted[:, 1], 0)
    one = length == 1
    cumulative = np.cumsum(p[1][first[one]], axis=-1)  # the target after the first token, by inversion
    second[one] = (rng.random((one.sum(), 1)) > cumulative).sum(axis=-1)
    counts = np.zeros((vocab, vocab))
    np.add.at(counts, (first, second), 1)
    ok, detail = chi_square_holds(counts, p[0][:, None] * p[1])
    assert ok, detail


def resampled(state, seed, temperature, top_p=None, top_k=None):
    """A copy of the prefilled decode state ``state`` (its buffers kept for more copies), its PRNG key
    ``jax.random.key(seed)`` and every slot sampling at ``temperature`` with ``top_p`` / ``top_k``: decode
    steps from the same context, their first token drawn anew."""
    rows = sampling_rows(state.token.shape[0], temperature, top_p, top_k)
    return dataclasses.replace(copy_tree(state), key=jax.random.key(seed), sampling=rows)
