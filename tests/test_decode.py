"""Speculative decoding end to end: greedy equals plain greedy, sampling follows the target, slots reuse
cleanly, K steps per dispatch change nothing, stop tokens end a request exactly, and the decode loop
compiles once per (slots, N, K)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import count_compiles
from models import DECODE_CONFIG, make_model, prompts
from sampled import resampled

from jax_oc128 import checkpoint
from jax_oc128.controller import OFFLINE, ONLINE
from jax_oc128.engine import Engine
from jax_oc128.nn import ModelConfig


@pytest.fixture(scope="module")
def greedy():
    """``greedy(backend, n)``: ``generate(prompts(), 100, num_tokens=n)`` on one 3-slot engine per backend
    (3 slots for 5 requests: slots are reused), each computed once for the module's tests."""
    engines = {}

    @functools.cache
    def run(backend, n):
        if backend not in engines:
            engines[backend] = Engine(make_model(backend), slots=3)
        return engines[backend].generate(prompts(), 100, num_tokens=n)

    return run


@pytest.mark.parametrize("n", [2, 4, 8], ids=lambda n: f"N={n}")
@pytest.mark.parametrize("backend", [ONLINE, OFFLINE], ids=["online", "offline"])
def test_greedy_speculation_equals_plain_greedy(greedy, backend, n):
    """Token for token the plain greedy output."""
    plain, spec = greedy(backend, None), greedy(backend, n)
    assert spec.tokens == plain.tokens
    assert spec.steps < plain.steps or n == 2  # drafts of a random head are rarely accepted, but some are


def test_backends_agree(greedy):
    for n in (None, 4):
        assert greedy(ONLINE, n).tokens == greedy(OFFLINE, n).tokens, f"N = {n}"


def test_reused_slot_carries_nothing_from_its_previous_owner():
    """One slot: request B alone in a fresh engine gives what the same engine then gives for B after A in one
    generate call (A in the slot B left, B in the slot A left) and in the next call (which reuses the last
    call's state)."""
    a, b = prompts(lengths=(250, 140))
    model = make_model(ONLINE)
    for n in (None, 4):
        engine = Engine(model, slots=1)
        alone = engine.generate([b], 70, num_tokens=n)
        together = engine.generate([a, b], 70, num_tokens=n)
        next_call = engine.generate([b], 70, num_tokens=n)
        assert together.tokens[1] == alone.tokens[0]
        assert next_call.tokens[0] == alone.tokens[0]


def test_decode_loop_compiles_once_per_slots_n_and_k():
    """Other prompts, budgets, seeds and stop tokens reuse the executable; another N or K compiles anew."""
    engine = Engine(make_model(ONLINE), slots=3, steps_per_dispatch=4)
    with count_compiles() as compiles:
        for seed, stop in ((0, ()), (1, (5,)), (2, (7, 9, 11))):
            engine.generate(
                prompts(lengths=(30, 70, 90, 20)), 20 + seed, num_tokens=4, seed=seed, stop_tokens=stop
            )
        assert compiles["decode"] == 1
        engine.generate(prompts(lengths=(30,)), 20, num_tokens=2)
        assert compiles["decode"] == 2
        engine.generate(prompts(lengths=(30,)), 20, num_tokens=2)
        engine.decode(engine.init_state(), num_tokens=2, steps=1)
        assert compiles["decode"] == 3


@pytest.fixture(scope="module")
def dispatching():
    """3-slot engines of one model taking K = 1, 3 and 16 steps per dispatch."""
    model = make_model(ONLINE)
    return [Engine(model, slots=3, steps_per_dispatch=k) for k in (1, 3, 16)]


@pytest.mark.parametrize("num_tokens", [None, 4], ids=["plain", "N=4"])
def test_steps_per_dispatch_change_nothing(dispatching, num_tokens):
    """K = 1 (the host reads every step), 3 and 16 steps per dispatch: the same tokens in the same number of
    steps; more steps per dispatch, fewer dispatches. 3 slots for 5 requests: the loop leaves early when a
    row ends while requests wait."""
    results = [engine.generate(prompts(), 60, num_tokens=num_tokens) for engine in dispatching]
    assert all(r.tokens == results[0].tokens and r.steps == results[0].steps for r in results)
    assert results[0].dispatches > results[1].dispatches > results[2].dispatches
    assert all(len(tokens) == 60 for tokens in results[0].tokens)


def test_result_counts_the_prefill_calls(dispatching, monkeypatch):
    """``Result.prefills`` is the number of prefill calls generate made: 3 slots for 5 requests, one step
    per dispatch, so the requests that wait for a slot are admitted by later prefills."""
    engine, calls = dispatching[0], []
    prefill_rows = engine._prefill_rows

    def counted(*args, **kwargs):
        calls.append(len(args[1]))  # the rows (slot: prompt) this call prefills
        return prefill_rows(*args, **kwargs)

    monkeypatch.setattr(engine, "_prefill_rows", counted)
    result = engine.generate(prompts(), 60)
    assert result.prefills == len(calls) > 1 and sum(calls) == 5, calls


@pytest.fixture(scope="module")
def shipped_engine():
    """The shipped model's engine of 2 slots, 5 steps per dispatch."""
    return Engine(checkpoint.load()[0], slots=2, steps_per_dispatch=5)


@pytest.mark.parametrize("num_tokens", [None, 2, 4], ids=["plain", "N=2", "N=4"])
def test_stop_tokens_end_a_request_at_the_stop_token(shipped_engine, num_tokens):
    """The shipped (trained) model, whose drafts are often accepted: each request's output is its output
    without stop tokens cut just after the first stop token, also where the stop token is inside an
    accepted run of drafts; a request whose first token is a stop token returns just that token."""
    texts = (b"Return the number of items in the container. ", b"Raise ValueError if ", b"Open file and ")
    requests = [list(text) for text in texts]
    engine = shipped_engine
    free = engine.generate(requests, 60, num_tokens=num_tokens)
    for stop in ([ord(" ")], [ord("."), ord("\n")], [free.tokens[1][0]]):
        stopped = engine.generate(requests, 60, num_tokens=num_tokens, stop_tokens=stop)
        for full, cut in zip(free.tokens, stopped.tokens, strict=True):
            ends = [i for i, token in enumerate(full) if token in stop]
            assert cut == (full[: ends[0] + 1] if ends else full), (stop, full, cut)


def test_stop_token_inside_an_accepted_run_of_drafts():
    """A speculative step keeps up to N tokens at once: a stop token among them (here the second of three
    kept tokens) ends the request there, and the tokens after it in the same step are dropped."""
    model, _ = checkpoint.load()
    prompt = list(b"Return the number of items in the container. ")
    engine = Engine(model, slots=1, steps_per_dispatch=1)
    state, first = engine.prefill(engine.init_state(), {0: prompt}, 100)
    tokens = [int(first.tokens[0, 0, 0])]
    for _ in range(40):  # step by step until a step keeps 3 tokens whose second was not generated before
        state, output = engine.decode(state, num_tokens=4, steps=1)
        run = [int(t) for t in output.tokens[0, 0, : int(output.counts[0, 0])]]
        if len(run) >= 3 and run[1] not in tokens + run[:1]:
            stop, at = run[1], len(tokens) + 1
            break
        tokens += run
    else:
        pytest.fail("no step kept 3 tokens whose second is new")
    free = engine.generate([prompt], 100, num_tokens=4).tokens[0]
    stopped = engine.generate([prompt], 100, num_tokens=4, stop_tokens=[stop]).tokens[0]
    assert free[: at + 1] == [*tokens, *run[:2]] and free[at + 1] == run[2]
    assert stopped == free[: at + 1]


@pytest.fixture(scope="module")
def sampling():
    """The sampling tests' 512-slot engine (a vocabulary of 12, a random draft head), its state with one
    prompt prefilled in every slot, and after the prompt and its greedy first token, the next token's
    distributions ``[12]`` float32 of the target and of the draft head."""
    config = ModelConfig(**{**DECODE_CONFIG.__dict__, "vocab_size": 12})
    model = make_model(ONLINE, seed=3, config=config)
    engine = Engine(model, slots=512)
    prompt = prompts(vocab=12, lengths=(140,))[0]
    prefilled, _ = engine.prefill(engine.init_state(), dict.fromkeys(range(512), prompt), 10)
    sequence = jnp.asarray([[*prompt, int(prefilled.token[0])]], jnp.int32)
    logits, _, _ = model.target(sequence, jnp.arange(sequence.shape[1])[None], model.target.init_cache(1))
    position = jnp.full((1, 1), sequence.shape[1] - 1, jnp.int32)
    hidden = jnp.zeros((1, 1, config.hidden_size))
    draft_logits, _, _ = model.mtp(sequence[:, -1:], hidden, position, model.mtp.init_cache(1))
    return engine, prefilled, *(np.asarray(jax.nn.softmax(x[0, -1])) for x in (logits, draft_logits))


@pytest.mark.parametrize("n", [2, 4])
def test_speculative_sampling_follows_the_target(sampling, n):
    """Temperature 1: the first token of a speculative step is distributed as the target's softmax (chi-square
    over 4096 samples, p > 1e-3), though the draft head (random) proposes from another distribution."""
    engine, prefilled, target, draft = sampling
    counts = np.zeros(12)
    for seed in range(8):
        _, output = engine.decode(resampled(prefilled, seed + 1, 1.0), num_tokens=n, steps=1)
        counts += np.bincount(np.asarray(output.tokens[0, :, 0]), minlength=12)
    expected = target * counts.sum()
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    # survival function of chi-square with 11 degrees of freedom at 31.3 is 1e-3
    assert chi2 < 31.3, (chi2, counts, expected)
    assert np.abs(draft - target).max() > 0.05
