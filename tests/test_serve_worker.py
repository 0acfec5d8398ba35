"""The server's device thread (:class:`~jax_oc128.serve.worker.Worker`) over a scheduler stand-in (no model):
one message to the HTTP side per step with every request's tokens and ends, and it never waits for that side
(the posted messages are not run until the work is done)."""

from __future__ import annotations

import itertools
import time

from jax_oc128.engine.requests import SamplingParams, StepOutput
from jax_oc128.serve.worker import Handle, Worker

STEPS = 2  # each request's steps


class Scripted:
    """The scheduler's members the worker uses: each step gives every running request its id three times;
    a request ends (``"length"``) at its :data:`STEPS`-th step."""

    def __init__(self):
        self.running: dict[int, int] = {}  # request -> steps run
        self.ids = itertools.count()
        self.steps, self.closed = 0, False

    @property
    def busy(self) -> bool:
        return bool(self.running)

    def add_request(self, prompt, params) -> int:
        request = next(self.ids)
        self.running[request] = 0
        return request

    def abort(self, request) -> None:
        raise AssertionError("nothing is aborted here")

    def step(self) -> StepOutput:
        self.steps += 1
        out = StepOutput()
        for request in list(self.running):
            self.running[request] += 1
            out.tokens[request] = [request] * 3
            if self.running[request] == STEPS:
                out.finished[request] = "length"
                del self.running[request]
        return out

    def close(self) -> None:
        self.closed = True


def test_one_message_per_step_and_no_wait_for_the_http_side():
    scheduler, posted = Scripted(), []
    worker = Worker(scheduler, capacity=3)
    received = {i: [] for i in range(3)}
    for i in range(3):  # queued before the loop starts: the first step runs all three
        worker.submit(
            Handle([1], SamplingParams(6), lambda tokens, end, i=i: received[i].append((tokens, end)))
        )
    worker.start(posted.append)  # the HTTP side runs nothing meanwhile
    deadline = time.monotonic() + 30
    while worker.outstanding:
        assert time.monotonic() < deadline, "the device thread waited for the HTTP side"
        time.sleep(0.01)
    worker.stop()
    assert scheduler.closed and scheduler.steps == STEPS and len(posted) == STEPS
    assert worker.finished == {"stop": 0, "length": 3, "abort": 0}
    for message in posted:
        message()
    assert received == {i: [([i] * 3, None), ([i] * 3, "length")] for i in range(3)}
