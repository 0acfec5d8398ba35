"""Top-k and top-p (jax_oc128.sampling) exact under speculation: the truncated set against a float64 oracle;
speculative steps of toy context models (chain and trees) whose first two tokens follow the target's
truncated distribution whatever the draft's; the engine's plain, chain and tree steps on a small model
whose first tokens follow it too; rows of different parameters in one batch (greedy rows greedy); a
truncation to one token is the greedy decoding.

Chi-square at p > 1e-3 as test_tree.py's and test_decode.py's sampled tests (tests/sampled.py); a token
outside the truncated support fails whatever the statistic."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models import DECODE_CONFIG, DECODE_RUNTIME, make_model, prompts
from sampled import (
    VOCAB,
    assert_first_two_follow,
    chi_square_holds,
    context_tables,
    draft_and_accept,
    resampled,
    sampling_rows,
    truncated64,
)

from jax_oc128.controller import ONLINE
from jax_oc128.engine import Engine
from jax_oc128.sampling import Sampling, log_probs, pick
from jax_oc128.tree import Tree, accept, accept_greedy, accept_sampled

#: (top_p, top_k) cases: the nucleus alone, top-k alone, both (top-k first)
CASES = [(0.6, None), (None, 3), (0.8, 4)]
TEMPERATURE = 0.8


@pytest.mark.parametrize(("top_p", "top_k"), [*CASES, (1.0, 0), (0.3, 100)])
def test_truncation_matches_the_oracle(top_p, top_k):
    """log_probs keeps exactly the oracle's tokens (random logits of 64 tokens, with ties at the top-k
    boundary in some rows: all kept) and gives its renormalised probabilities (float32 rounding)."""
    logits = np.random.default_rng(0).normal(size=(40, 64)).astype(np.float32)
    logits[:10, :4] = logits[:10].max(axis=1, keepdims=True)  # four tokens tied at the top
    got = jax.nn.softmax(log_probs(jnp.asarray(logits), sampling_rows(40, TEMPERATURE, top_p, top_k)))
    want = truncated64(logits, TEMPERATURE, top_p or 1.0, top_k or 0, margin=1e-5)
    assert np.array_equal(np.asarray(got) > 0, want > 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    if top_k == 3:  # the ties at the boundary are kept, past k
        assert ((want[:10] > 0).sum(axis=1) >= 4).all()


def test_rows_have_their_own_parameters():
    """One batch: rows greedy, sampled, truncated by top-p, by top-k; each row's distribution is its own
    and the greedy rows pick the argmax (one compilation for any parameters)."""
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(4, 32)).astype(np.float32))
    rows = Sampling(
        jnp.asarray([0.0, 1.0, 0.7, 1.3], jnp.float32),
        jnp.asarray([0.5, 1.0, 0.5, 1.0], jnp.float32),
        jnp.asarray([2, 0, 0, 5], jnp.int32),
    )
    kept = np.asarray(jnp.isfinite(log_probs(logits, rows)))
    assert kept[1].all() and kept[3].sum() == 5
    assert np.array_equal(kept[2], truncated64(logits[2], 0.7, 0.5, margin=1e-4) > 0)
    picked = jax.jit(pick)(logits, jax.random.key(0), rows)
    assert int(picked[0]) == int(jnp.argmax(logits[0])) and kept[np.arange(4), picked].all()


WIDE = Tree.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 2]])
ROWS = 30000


@pytest.mark.parametrize(
    ("t", "top_p", "top_k"),
    [(WIDE, *CASES[0]), (WIDE, *CASES[2]), (Tree.default(8), *CASES[1]), (Tree.chain(3), *CASES[2])],
    ids=["wide-top_p", "wide-both", "default8-top_k", "chain3-both"],
)
def test_truncated_speculation_follows_the_truncated_target(t, top_p, top_k):
    """30000 speculative steps of toy context models, a draft close to the target (its logits + normal(0,
    0.5); both truncated the same way, so their supports differ at times): the first new token follows the
    target's truncated distribution at the root and the first two its truncated joint law
    (assert_first_two_follow); drafts are accepted beyond the first level."""
    rng = np.random.default_rng(t.size + (top_k or 0))
    target = context_tables(rng, t.depth)
    draft = [table + 0.5 * rng.normal(size=table.shape).astype(np.float32) for table in target]
    rows = sampling_rows(ROWS, TEMPERATURE, top_p, top_k)
    got = draft_and_accept(t, target, draft, jax.random.key(t.size), rows)
    p = [truncated64(table, TEMPERATURE, top_p or 1.0, top_k or 0, margin=1e-3) for table in target[:2]]
    assert (p[0] == 0).any()  # the truncation removes tokens
    assert_first_two_follow(got, p, rng)
    assert (np.asarray(got.length) >= 3).mean() > 0.02


def test_accept_takes_each_rows_rule():
    """accept: the greedy rows get accept_greedy's path and bonus, the others accept_sampled's (same key)."""
    t, rows = Tree.default(6), 64
    rng = np.random.default_rng(2)
    target_logits = jnp.asarray(rng.normal(size=(rows, t.size, VOCAB)).astype(np.float32))
    draft_logits = jnp.asarray(rng.normal(size=(rows, t.size, VOCAB)).astype(np.float32))
    tokens = jnp.asarray(rng.integers(0, VOCAB, (rows, t.size)), jnp.int32)
    params = sampling_rows(rows, 1.0, 0.9)
    params = dataclasses.replace(params, temperature=params.temperature.at[::2].set(0.0))
    key = jax.random.key(5)
    got = accept(t, target_logits, draft_logits, tokens, key, params)
    greedy = accept_greedy(t, target_logits, tokens)
    sampled = accept_sampled(t, target_logits, draft_logits, tokens, key, params)
    for name in ("node", "emitted", "bonus"):
        assert np.array_equal(getattr(got, name)[::2], getattr(greedy, name)[::2]), name
        assert np.array_equal(getattr(got, name)[1::2], getattr(sampled, name)[1::2]), name
    assert not np.array_equal(greedy.bonus[1::2], sampled.bonus[1::2])  # the rules differ here


SLOTS = 512
ENGINE_VOCAB = 12
#: CASES for the engine's model: its nucleus of 0.6 ends at 0.6002 (float32 and float64 could differ)
ENGINE_CASES = [(0.65, None), (None, 3), (0.8, 4)]


@pytest.fixture(scope="module")
def small():
    """A small random model of 12 tokens (online C128) and an engine of 512 slots, prefilled greedily with
    one prompt in every slot; the target's next-token logits after the prompt and its first token."""
    config = dataclasses.replace(DECODE_CONFIG, vocab_size=ENGINE_VOCAB)
    model = make_model(
        ONLINE, seed=3, config=config, runtime=dataclasses.replace(DECODE_RUNTIME, max_draft=4)
    )
    engine = Engine(model, slots=SLOTS, steps_per_dispatch=1)  # generate's dispatches are decode(steps=1)
    prompt = prompts(vocab=ENGINE_VOCAB, lengths=(140,))[0]
    prefilled, _ = engine.prefill(engine.init_state(), dict.fromkeys(range(SLOTS), prompt), 10, num_tokens=4)
    first = int(prefilled.token[0])
    sequence = jnp.asarray([[*prompt, first]], jnp.int32)
    logits, _, _ = model.target(sequence, jnp.arange(sequence.shape[1])[None], model.target.init_cache(1))
    return engine, prefilled, np.asarray(logits[0, -1])


@pytest.mark.parametrize(
    "how", [{}, {"num_tokens": 3}, {"tree": Tree.default(4)}], ids=["plain", "chain3", "tree4"]
)
def test_engine_steps_follow_the_truncated_target(small, how):
    """Plain, chain and tree steps of the engine (8 dispatches of one step, 4096 samples per case, each case
    only new sampling rows: no compilation): the first token of a step follows the target's distribution
    truncated by top-p, top-k, both (chi-square, p > 1e-3; none outside the truncated support)."""
    engine, prefilled, logits = small
    for top_p, top_k in ENGINE_CASES:
        counts = np.zeros(ENGINE_VOCAB)
        for seed in range(8):
            state = resampled(prefilled, seed + 1, TEMPERATURE, top_p, top_k)
            _, output = engine.decode(state, steps=1, **how)
            counts += np.bincount(np.asarray(output.tokens[0, :, 0]), minlength=ENGINE_VOCAB)
        expected = truncated64(logits, TEMPERATURE, top_p or 1.0, top_k or 0, margin=1e-3)
        assert (expected == 0).any()  # the truncation removes tokens
        ok, detail = chi_square_holds(counts, expected)
        assert ok, (top_p, top_k, detail)


def test_truncation_to_one_token_is_greedy(small):
    """top_k=1 (or a tiny top_p) keeps the most probable token alone: at any temperature, with speculation,
    generate gives the greedy tokens (the draft's one token accepted exactly when it is the target's)."""
    engine, _, _ = small
    prompt = prompts(vocab=ENGINE_VOCAB, lengths=(130, 200))  # the fixture's prefill width
    greedy = engine.generate(prompt, 12, num_tokens=3).tokens
    assert engine.generate(prompt, 12, num_tokens=3, temperature=1.5, top_k=1, seed=4).tokens == greedy
    assert engine.generate(prompt, 12, tree=Tree.default(4), temperature=2.0, top_p=1e-6).tokens == greedy
