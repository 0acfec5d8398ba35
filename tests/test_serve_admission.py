"""The server's admission alignment (``RequestScheduler(..., align=True)``, docs/serving.md): requests
admitted apart, and so ending a dispatch apart, are brought back together, in fewer prefill calls, with
generate's greedy tokens."""

from __future__ import annotations

import pytest

from jax_oc128 import checkpoint
from jax_oc128.engine import Engine
from jax_oc128.engine.requests import RequestScheduler, SamplingParams

PROMPTS = [b"Return the number of items", b"Open the file and", b"Create a new thread", b"Raise an error"] * 2
NEW = 9  # a prefill's token and two dispatches of K = 4


@pytest.fixture(scope="module")
def engine():
    """The shipped model, 4 slots, K = 4, dense."""
    model, _ = checkpoint.load()
    return Engine(model, 4, steps_per_dispatch=4)


def serve(engine, align: bool) -> tuple[list, RequestScheduler]:
    """Two requests, a step, then six more, stepped until all end: their tokens in order of arrival, and
    the scheduler (closed)."""
    scheduler = RequestScheduler(engine, align=align)
    outputs = {}
    ids = [scheduler.add_request(p, SamplingParams(NEW, stop_tokens=())) for p in PROMPTS[:2]]
    for step in range(100):
        if step == 1:
            ids += [scheduler.add_request(p, SamplingParams(NEW, stop_tokens=())) for p in PROMPTS[2:]]
        elif not scheduler.busy:
            break
        for request, tokens in scheduler.step().tokens.items():
            outputs.setdefault(request, []).extend(tokens)
    scheduler.close()
    return [outputs[i] for i in ids], scheduler


def test_aligned_admissions_take_fewer_prefills_and_give_the_same_tokens(engine):
    """Unaligned, the six later requests are admitted two, then two at each end of the first two's and
    their successors' (four prefills in all, the pairs a dispatch apart); aligned, the third and fourth wait
    one dispatch for the first two's slots (that dispatch runs two slots idle: one more in all), then four
    and the last two are admitted together (three prefills). Both give generate's greedy tokens."""
    expected = engine.generate(PROMPTS, NEW, stop_tokens=()).tokens
    apart, unaligned = serve(engine, align=False)
    together, aligned = serve(engine, align=True)
    assert apart == together == expected
    assert (unaligned.totals["prefills"], aligned.totals["prefills"]) == (4, 3)
    assert aligned.dispatches == unaligned.dispatches + 1
