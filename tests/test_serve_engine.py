"""The server's engine process (:class:`~jax_oc128.serve.engine_process.EngineProcess`) over a scheduler
stand-in (no model), built from a module-level factory: its limits and the factory's extra reported at
start, one message to the HTTP side per step with every request's tokens and ends, an abort reported and
counted, the process stopping when the HTTP side's pipe closes (the HTTP side then ending its requests
and refusing new ones), and the admission wait (a burst to an idle engine process starts as one step)."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import types

import pytest

from jax_oc128.engine.requests import RequestLimits, SamplingParams, StepOutput
from jax_oc128.serve import engine_process
from jax_oc128.serve.engine_process import EngineFailed, EngineProcess, EngineSpec, Handle

SLOTS = 3
STEP_SECONDS = 0.02  # a step's time (an abort lands long before a request of 60 steps ends)
LIMITS = RequestLimits(max_len=64, vocab_size=100, eos_token_ids=(1,), tree=None)


class Scripted:
    """The scheduler's members the engine process uses: each step (of :data:`STEP_SECONDS`) admits every
    waiting request and gives every running one its id three times; a request ends (``"length"``) at its
    ``max_new_tokens``-th step, or is aborted."""

    def __init__(self):
        self.limits, self.engine, self.page_pool = LIMITS, types.SimpleNamespace(slots=SLOTS), None
        self.running: dict[int, int] = {}  # request -> steps left
        self.queued: dict[int, int] = {}  # waiting: request -> its steps
        self.ids = itertools.count()
        self.dispatches, self.totals = 0, {}
        self._aborted: list[int] = []

    @property
    def owner(self) -> dict[int, int]:
        return dict(enumerate(self.running))

    @property
    def waiting(self) -> int:
        return len(self.queued)

    @property
    def busy(self) -> bool:
        return bool(self.running or self.queued or self._aborted)

    def add_request(self, prompt, params) -> int:
        LIMITS.check(prompt, params)
        request = next(self.ids)
        self.queued[request] = params.max_new_tokens
        return request

    def abort(self, request) -> None:
        self.running.pop(request, None)
        self.queued.pop(request, None)
        self._aborted.append(request)

    def step(self) -> StepOutput:
        time.sleep(STEP_SECONDS)
        self.dispatches += 1
        self.running |= self.queued
        self.queued = {}
        out = StepOutput(finished=dict.fromkeys(self._aborted, "abort"))
        self._aborted = []
        for request in list(self.running):
            self.running[request] -= 1
            out.tokens[request] = [request] * 3
            if not self.running[request]:
                out.finished[request] = "length"
                del self.running[request]
        return out

    def close(self) -> None:
        pass


def scripted(extra, gap=None):
    """The engine process's factory: a :class:`Scripted` and ``extra``; ``gap``: the admission wait's
    :data:`~jax_oc128.serve.engine_process.ADMISSION_GAP` in the engine process (None: as it is)."""
    if gap is not None:
        engine_process.ADMISSION_GAP = gap
    return Scripted(), extra


def failing(how: str):
    """A factory that fails: raises a bug's error, or returns an extra that cannot be pickled."""
    if how == "raise":
        raise RuntimeError("a bug")
    return Scripted(), threading.Lock()


@pytest.mark.parametrize("how", ["raise", "unpicklable"])
def test_a_failed_build_is_engine_failed(how):
    """A factory's error that is no bad argument, or an extra the process cannot report: EngineFailed with
    the process's traceback, not a usage error."""
    with pytest.raises(EngineFailed, match="RuntimeError: a bug" if how == "raise" else "pickle") as raised:
        EngineProcess(EngineSpec(failing, (how,)), max_queued=0)
    assert not raised.value.usage and raised.value.argument is None


@pytest.fixture(scope="module")
def engine():
    engine = EngineProcess(EngineSpec(scripted, ("extra",)), max_queued=1)
    yield engine
    engine.close()


def serve(engine: EngineProcess, requests: dict, until=None) -> tuple[dict, int]:
    """Submit ``requests`` (name -> max_new_tokens) on an event loop and gather what each receives until all
    end; ``until(name, received)`` may abort one (it is called after each news). Also the step messages
    the HTTP side read."""
    received = {name: [] for name in requests}
    messages = 0

    async def run():
        nonlocal messages
        loop = asyncio.get_running_loop()
        ended = asyncio.Event()
        deliver = engine._deliver

        def counted(*message):
            nonlocal messages
            messages += 1
            deliver(*message)

        engine._deliver = counted
        handles = {}
        for name, new in requests.items():

            def receive(tokens, finished, name=name):
                received[name].append((tokens, finished))
                if until is not None:
                    until(name, received[name], handles[name])
                if engine.outstanding == 0:
                    ended.set()

            handles[name] = Handle([5, 6], SamplingParams(new), receive)
            engine.submit(handles[name])
        engine.attach(loop)
        try:
            await asyncio.wait_for(ended.wait(), 60)
        finally:
            engine._deliver = deliver
            loop.remove_reader(engine._outbox.fileno())
            engine._loop = None

    asyncio.run(run())
    return received, messages


def test_reports_its_limits_and_one_message_per_step(engine):
    """The limits and extra arrive at start; each request gets its tokens of every step and its end, in one
    message per step for all requests (the stats' dispatches); the stats' busy time is within the run's.
    (Counts as differences: the module's other tests may have run first on this engine process.)"""
    assert engine.limits == LIMITS and engine.slots == SLOTS and engine.extra == "extra"
    assert engine.capacity == SLOTS + 1
    before, finished, start = engine.stats, dict(engine.finished), time.perf_counter()
    received, messages = serve(engine, {"a": 2, "b": 2, "c": 1})
    assert 0 < engine.stats["busy_seconds"] - before["busy_seconds"] < time.perf_counter() - start
    steps = {name: [t for t, _ in got] for name, got in received.items()}
    assert [end for _, end in received["a"]] == [None, "length"]
    assert [end for _, end in received["c"]] == ["length"]
    assert all(len(set(map(tuple, tokens))) == 1 and len(tokens[0]) == 3 for tokens in steps.values())
    assert messages == engine.stats["dispatches"] - before["dispatches"] >= 2
    assert engine.outstanding == 0 and engine.finished == finished | {"length": finished["length"] + 3}
    assert engine.stats["running"] == 0


def test_an_abort_ends_its_request(engine):
    """A request aborted after its first tokens ends ``"abort"``, counted; the other runs to its end."""
    before = dict(engine.finished)

    def until(name, received, handle):
        if name == "long" and len(received) == 1:
            engine.abort(handle)

    received, _ = serve(engine, {"long": 60, "short": 3}, until)
    assert received["long"][-1] == ([], "abort") and len(received["long"]) >= 2
    assert [end for _, end in received["short"]] == [None, None, "length"]
    assert engine.finished == before | {"abort": before["abort"] + 1, "length": before["length"] + 1}
    assert engine.outstanding == 0 and engine.stats["running"] == 0


def test_stops_when_the_http_side_goes():
    """With its pipe closed (the HTTP process gone, no stop message), the engine process ends by itself; the
    HTTP side sees it go: its running request ends ``"abort"``, a new one is refused. (An engine process of
    its own: the module's may serve other tests after this one.)"""
    engine = EngineProcess(EngineSpec(scripted, (None,)), max_queued=0)
    try:

        def until(name, received, handle):
            if len(received) == 1:
                engine._sends.put(None)  # the sender closes the pipe without a stop

        received, _ = serve(engine, {"long": 60}, until)
        assert received["long"][-1] == ([], "abort")
        engine.process.join(60)
        assert engine.process.exitcode == 0 and not engine.alive and "exited" in engine.error
        with pytest.raises(EngineFailed, match="the engine process is gone"):
            engine.submit(Handle([5], SamplingParams(1), print))
    finally:
        engine.close()


def test_an_idle_engine_process_takes_a_burst_as_one_step():
    """With an admission wait (and no gap short enough to end it): a lone request to an idle engine process
    waits for the wait's bound before its first step; as many requests as slots, sent together, end the
    wait at once and run in one step (one message: each its tokens and its end)."""
    wait = 3.0
    engine = EngineProcess(EngineSpec(scripted, (None, 60.0)), max_queued=0, admission_wait=wait)
    try:
        start = time.perf_counter()
        received, messages = serve(engine, {"alone": 1})
        assert time.perf_counter() - start >= wait and messages == 1, messages
        start = time.perf_counter()
        received, messages = serve(engine, dict.fromkeys("abc"[:SLOTS], 1))
        assert messages == 1 and time.perf_counter() - start < wait, messages  # ended by the free slots
        assert list(received.values()) == [[([request] * 3, "length")] for request in (1, 2, 3)], received
    finally:
        engine.close()
