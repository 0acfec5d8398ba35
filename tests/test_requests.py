"""The request-level scheduler (jax_oc128.engine.requests) on the shipped model: requests added between
steps join the running batch with their own budgets and stop tokens and give generate's greedy tokens; an
abort frees the slot and the pages at once; a seeded sampled request runs alone with generate's tokens; bad
requests are refused naming the argument."""

from __future__ import annotations

import pytest
from harness import count_compiles

from jax_oc128 import checkpoint
from jax_oc128.checks import ArgumentError, ArgumentTypeError
from jax_oc128.engine import Engine
from jax_oc128.engine.requests import RequestScheduler, SamplingParams

PROMPTS = [b"Return the number of items", b"Open the file and", b"Create a new thread", b"Raise an error"]
PAGES = 6


@pytest.fixture(scope="module")
def engine():
    """The shipped model, 2 slots, K = 4, paged (6 pages of 256 tokens)."""
    model, _ = checkpoint.load()
    return Engine(model, 2, steps_per_dispatch=4, pages=PAGES, page_size=256)


@pytest.fixture(scope="module")
def expected(engine):
    """generate's greedy 24 tokens of each prompt."""
    return engine.generate(PROMPTS, 24).tokens


def drain(scheduler, outputs, reasons, steps=None):
    """Step until idle (or ``steps`` steps), collecting tokens and end reasons by request id."""
    for _ in range(steps or 1000):
        if not scheduler.busy:
            return
        out = scheduler.step()
        for request, tokens in out.tokens.items():
            outputs.setdefault(request, []).extend(tokens)
        reasons.update(out.finished)
    assert steps, "the scheduler did not become idle"


def test_requests_join_the_running_batch(engine, expected):
    """Requests added after steps ran, each with its own max_new_tokens and stop tokens (one shared by no
    other request: cut on the host), give generate's tokens up to their budget or stop token; the pages are
    all free afterwards."""
    scheduler = RequestScheduler(engine)
    outputs, reasons = {}, {}
    stop = expected[1][5]
    try:
        first = scheduler.add_request(PROMPTS[0], SamplingParams(24))
        drain(scheduler, outputs, reasons, steps=1)
        second = scheduler.add_request(PROMPTS[1], SamplingParams(20, stop_tokens=(stop,)))
        third = scheduler.add_request(PROMPTS[2], SamplingParams(7))
        drain(scheduler, outputs, reasons, steps=1)
        fourth = scheduler.add_request(PROMPTS[3], SamplingParams(13))
        drain(scheduler, outputs, reasons)
        assert scheduler.page_pool.free_pages == PAGES and not scheduler.owner
    finally:
        scheduler.close()
    cut = expected[1].index(stop) + 1
    assert outputs[second] == expected[1][:cut] and reasons[second] == "stop"
    assert outputs[third] == expected[2][:7] and reasons[third] == "length"
    assert outputs[fourth] == expected[3][:13] and reasons[fourth] == "length"
    assert outputs[first] == expected[0] and reasons[first] == "length"


def test_waiting_requests_compile_nothing_after_generate(engine, expected):
    """Requests waiting for a slot while others run: the tokens are generate's, and nothing compiles after
    generate's compilations (the same shapes and context buckets)."""
    scheduler = RequestScheduler(engine)
    outputs, reasons = {}, {}
    try:
        with count_compiles() as compiles:
            ids = [scheduler.add_request(prompt, SamplingParams(24)) for prompt in PROMPTS]
            while scheduler.busy:
                drain(scheduler, outputs, reasons, steps=1)
    finally:
        scheduler.close()
    assert not compiles, compiles
    assert [outputs[i] for i in ids] == expected


def test_abort_frees_the_slot_and_pages(engine, expected):
    """An aborted running request ends at once ("abort"), its slot and pages taken by a waiting request that
    gives generate's tokens; an aborted waiting request never runs."""
    scheduler = RequestScheduler(engine)
    outputs, reasons = {}, {}
    try:
        running = [scheduler.add_request(p, SamplingParams(24)) for p in PROMPTS[:2]]
        waiting = scheduler.add_request(PROMPTS[2], SamplingParams(24))
        never = scheduler.add_request(PROMPTS[3], SamplingParams(24))
        drain(scheduler, outputs, reasons, steps=1)
        scheduler.abort(running[0])
        scheduler.abort(never)
        assert scheduler.page_pool.free_pages == PAGES - 1  # the other running request's page
        drain(scheduler, outputs, reasons)
        assert scheduler.page_pool.free_pages == PAGES
    finally:
        scheduler.close()
    assert reasons[running[0]] == reasons[never] == "abort" and never not in outputs
    assert outputs[running[0]] == expected[0][: len(outputs[running[0]])]
    assert outputs[running[1]] == expected[1] and outputs[waiting] == expected[2]


def test_a_seeded_sampled_request_runs_alone(engine, expected):
    """A sampled request with a seed, queued behind greedy ones, gives generate's tokens at that seed; the
    greedy ones keep theirs."""
    offline = engine.generate([PROMPTS[3]], 16, temperature=0.7, seed=3).tokens[0]
    scheduler = RequestScheduler(engine)
    outputs, reasons = {}, {}
    try:
        greedy = scheduler.add_request(PROMPTS[0], SamplingParams(24))
        sampled = scheduler.add_request(PROMPTS[3], SamplingParams(16, temperature=0.7, seed=3))
        other = scheduler.add_request(PROMPTS[1], SamplingParams(24))
        drain(scheduler, outputs, reasons)
    finally:
        scheduler.close()
    assert outputs[sampled] == offline
    assert outputs[greedy] == expected[0] and outputs[other] == expected[1]


def test_requests_of_any_sampling_share_the_batch(engine, expected):
    """A greedy request and sampled ones (temperature 1.3 with top_k=1, 0.9 with a tiny top_p: each keeps
    the most probable token alone) run in the same batch, admitted together, with no compilation beyond
    the greedy ones': all give generate's greedy tokens; and a request of sampled parameters, unseeded, runs
    beside them."""
    scheduler = RequestScheduler(engine)
    outputs, reasons = {}, {}
    params = [SamplingParams(24), SamplingParams(24, temperature=1.3, top_k=1)]
    params += [
        SamplingParams(24, temperature=0.9, top_p=1e-6),
        SamplingParams(24, temperature=0.8, top_p=0.9),
    ]
    try:
        with count_compiles() as compiles:
            ids = [scheduler.add_request(PROMPTS[i], p) for i, p in enumerate(params)]
            drain(scheduler, outputs, reasons, steps=1)
            assert set(scheduler.owner.values()) == set(ids[:2])  # the greedy and a sampled one together
            drain(scheduler, outputs, reasons)
    finally:
        scheduler.close()
    assert not compiles, compiles
    assert [outputs[ids[i]] for i in range(3)] == expected[:3]
    assert len(outputs[ids[3]]) == 24 and reasons[ids[3]] == "length"


@pytest.mark.parametrize(
    ("prompt", "params", "error", "match"),
    [
        (b"x", SamplingParams(0), ArgumentError, r"max_new_tokens: must be in \[1, "),
        (b"x", SamplingParams(4, temperature=-1.0), ArgumentError, "temperature: must be finite and >= 0"),
        (b"x", SamplingParams(4, top_p=0.0), ArgumentError, r"top_p: must be in \(0, 1\]"),
        (b"x", SamplingParams(4, top_k=-3), ArgumentError, "top_k: must be >= 0"),
        (
            b"x",
            SamplingParams(4, stop_tokens=(256,)),
            ArgumentError,
            r"stop_tokens: ids must be in \[0, 256\)",
        ),
        (b"x", SamplingParams(4, seed=-1), ArgumentError, r"seed: must be in \[0, "),
        ([300], SamplingParams(4), ArgumentError, r"prompt: token ids must be in \[0, 256\)"),
        (b"", SamplingParams(4), ArgumentError, "prompt: length 0 must be in"),
        (b"x" * 1600, SamplingParams(4), ArgumentError, "prompt: needs 7 pages of 256 tokens"),
        (b"x", (4,), ArgumentTypeError, "params: must be a SamplingParams"),
    ],
)
def test_bad_requests_are_refused_naming_the_argument(engine, prompt, params, error, match):
    """Nothing is queued for a refused request; the error (a ValueError or TypeError) names the argument
    (``argument``: what the message starts with)."""
    scheduler = RequestScheduler(engine)
    try:
        with pytest.raises(error, match=match) as raised:
            scheduler.add_request(prompt, params)
        assert raised.value.argument == match.split(":")[0]
        assert not scheduler.busy
    finally:
        scheduler.close()
