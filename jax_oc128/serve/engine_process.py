"""The engine process: the server's :class:`~jax_oc128.engine.requests.RequestScheduler` and its device loop
in a process of their own (spawned: JAX is never forked), apart from the HTTP process's event loop,
tokenizer and streams, so that the device loop never waits for their GIL (SGLang's layout).

The process builds its scheduler from an :class:`EngineSpec` (a module-level factory and its arguments,
pickled by name), reports its limits once (:class:`Ready`: the HTTP side checks requests with them, no round
trip) and runs the loop: the messages that came, one :meth:`~RequestScheduler.step`, one message back.
:class:`EngineProcess` is the HTTP side's end. The messages, pickled over two one-way pipes:

- HTTP -> engine: ``("add", id, prompt ids, SamplingParams)``, ``("abort", id)``, ``("stop",)``; ``id``
  the HTTP side's number for the request.
- engine -> HTTP: first ``("ready", Ready)`` or ``("failed", message, argument, usage, traceback)`` (the
  build failed: :class:`EngineFailed`); then per step ``("step", news, cached, stats)``: ``news`` id ->
  (its new token ids, None or how it ended: ``"stop"``, ``"length"``, ``"abort"``), ``cached`` id -> its
  prompt tokens taken from the prefix cache (at admission), ``stats`` (:func:`stats`); ``("error",
  traceback)`` if the loop fails (every request then ends ``"abort"``) or ``Ready`` could not be sent.

The engine process stops on ``("stop",)`` or when the HTTP process goes (its pipe closed), ignores SIGINT
(the HTTP process stops it), and gives the engine its state back (:meth:`RequestScheduler.close`)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from jax_oc128.engine.requests import RequestLimits, RequestScheduler, SamplingParams, StepOutput

log = logging.getLogger(__name__)

#: errors of a factory that mean a bad argument (its checks, a missing checkpoint): :class:`EngineFailed`
#: with ``usage`` True
USAGE_ERRORS = (OSError, ValueError, TypeError, NotImplementedError)
#: seconds the engine process is given to stop once asked, before it is terminated
STOP_TIMEOUT = 120
#: seconds without an arrival that end the admission wait early (as do requests enough for the free slots)
ADMISSION_GAP = 0.005


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """How the engine process builds its scheduler: ``factory(*args)``, a module-level function (pickled by
    its name, imported again in the engine process) returning ``(scheduler, extra)``: a
    :class:`RequestScheduler` and anything picklable for the HTTP side (:attr:`Ready.extra`; None)."""

    factory: Callable
    args: tuple = ()


@dataclasses.dataclass(frozen=True)
class Ready:
    """What the engine process reports once built: its requests' :class:`RequestLimits`, the engine's
    slots, its first :func:`stats` and the factory's ``extra``."""

    limits: RequestLimits
    slots: int
    stats: dict
    extra: Any


class EngineFailed(Exception):
    """The engine process did not start: its factory raised (``message``; ``argument``: the argument it
    named, or None; ``usage``: a bad argument rather than a bug, :data:`USAGE_ERRORS`), or it died
    (``traceback`` what it printed, if anything)."""

    def __init__(self, message: str, argument: str | None = None, usage: bool = False, trace: str = ""):
        super().__init__(message if not trace else f"{message}\n{trace}")
        self.message, self.argument, self.usage = message, argument, usage


class QueueFull(Exception):
    """The server holds as many requests as it takes (slots + max_queued)."""


class Handle:
    """One request as the HTTP side sees it: ``receive(tokens, finished)`` is called on the event loop once
    per step that read tokens for it or ended it: ``tokens`` a list of ints (maybe empty), ``finished`` None
    or, once and last, how it ended (``"stop"``, ``"length"``, ``"abort"``)."""

    def __init__(self, prompt: list[int], params: SamplingParams, receive: Callable):
        self.prompt, self.params, self.receive = prompt, params, receive
        self.id: int | None = None  # the HTTP side's, once submitted
        self.cached = 0  # its prompt tokens taken from the prefix cache, once admitted


def stats(scheduler: RequestScheduler, busy_seconds: float = 0.0) -> dict:
    """The scheduler's counts: ``free_pages`` (paged, else None), ``running`` (slots held), ``waiting``,
    ``dispatches``, ``totals`` (:attr:`RequestScheduler.totals`), ``busy_seconds``: the device loop's time
    in the iterations that ran a step, from its first message or its start to the step's message (the
    engine's share of a served run's time, to set against ``Engine.generate``'s), and ``cpu_seconds``: the
    engine process's CPU time so far (``time.process_time``: on the CPU backend the device's work too)."""
    pool = scheduler.page_pool
    return dict(
        free_pages=None if pool is None else pool.free_pages,
        running=len(scheduler.owner),
        waiting=scheduler.waiting,
        dispatches=scheduler.dispatches,
        totals=dict(scheduler.totals),
        busy_seconds=busy_seconds,
        cpu_seconds=time.process_time(),
    )


class EngineProcess:
    """The HTTP side of an engine process built from ``spec``, holding at most its slots + ``max_queued``
    requests (running or waiting) at a time; more are refused (:class:`QueueFull`). Starting waits for the
    process to be built (:class:`EngineFailed` if it is not). Requests are sent by a thread of their own (a
    send never blocks the event loop); the news is read on the event loop given to :meth:`attach`.
    ``admission_wait``: the admission wait, seconds (0: none): when a request reaches the engine process
    while no request runs, it takes further arrivals for up to this long before its first step, so that a
    burst starts as one batch in one prefill; a pause of :data:`ADMISSION_GAP` or requests enough for the
    free slots end it early (``serve --admission-wait``).

    Attributes:
      limits, slots, extra: the process's :class:`Ready`.
      capacity: the requests it holds at most (slots + ``max_queued``).
      stats: its latest :func:`stats`.
      outstanding: requests submitted and not yet ended.
      finished: counts of the ended requests by reason.
      error: None, or why the engine process is gone (a traceback or a sentence).
    """

    def __init__(self, spec: EngineSpec, max_queued: int, admission_wait: float = 0.0):
        context = multiprocessing.get_context("spawn")
        inbox, self._inbox = context.Pipe(duplex=False)
        self._outbox, outbox = context.Pipe(duplex=False)
        self.process = context.Process(
            target=_main, args=(spec, inbox, outbox, admission_wait), name="jax-oc128-engine", daemon=True
        )
        self.process.start()
        inbox.close()  # the process's ends: closed here, so that its exit reads as the pipe's end
        outbox.close()
        try:
            kind, *message = self._outbox.recv()
        except EOFError:
            self.process.join()
            raise EngineFailed(
                f"the engine process exited ({self.process.exitcode}) before it was built"
            ) from None
        if kind == "failed":  # its factory raised
            self.process.join()
            raise EngineFailed(*message)
        if kind == "error":  # built, but it could not report (e.g. an extra that cannot be pickled)
            self.process.join()
            raise EngineFailed("the engine process failed", trace=message[0])
        ready: Ready = message[0]
        self.limits, self.slots, self.stats, self.extra = ready.limits, ready.slots, ready.stats, ready.extra
        self.capacity = self.slots + max_queued
        self.outstanding = 0
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        self.error: str | None = None
        self._handles: dict[int, Handle] = {}
        self._ids = itertools.count()
        self._sends: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_all, name="jax-oc128-sender", daemon=True)
        self._sender.start()
        self._loop = None

    @property
    def alive(self) -> bool:
        return self.error is None and self.process.is_alive()

    def attach(self, loop) -> None:
        """Read the engine process's news on the event loop ``loop`` (its thread calls everything below)."""
        self._loop = loop
        loop.add_reader(self._outbox.fileno(), self._drain)

    def close(self) -> None:
        """Stop the engine process (requests still running are dropped) and wait for it."""
        if self._loop is not None:
            self._loop.remove_reader(self._outbox.fileno())
            self._loop = None
        self._sends.put(("stop",))
        self._sends.put(None)
        self._sender.join()
        self.process.join(STOP_TIMEOUT)
        if self.process.is_alive():
            log.error("the engine process did not stop in %s s: terminated", STOP_TIMEOUT)
            self.process.terminate()
            self.process.join()
        self._outbox.close()

    def submit(self, handle: Handle) -> None:
        """Send ``handle``'s request (checked already); :class:`QueueFull` when the server is full,
        :class:`EngineFailed` when the engine process is gone."""
        if not self.alive:  # why (a traceback): the server's log, not the client's answer
            raise EngineFailed("the engine process is gone (the server's log says why)")
        if self.outstanding >= self.capacity:
            raise QueueFull(f"the server holds {self.capacity} requests (slots + max_queued)")
        self.outstanding += 1
        handle.id = next(self._ids)
        self._handles[handle.id] = handle
        self._sends.put(("add", handle.id, handle.prompt, handle.params))

    def abort(self, handle: Handle) -> None:
        """Abort ``handle``'s request (a client gone, a stop string met); nothing if it ended."""
        if handle.id in self._handles:
            self._sends.put(("abort", handle.id))

    def _send_all(self) -> None:
        """The sender thread: the queued messages to the engine process, until None."""
        while (message := self._sends.get()) is not None:
            try:
                self._inbox.send(message)
            except OSError:  # the engine process is gone (its news says so)
                pass
        self._inbox.close()

    def _drain(self) -> None:
        """On the event loop: every message the engine process has sent."""
        try:
            while self._outbox.poll():
                kind, *message = self._outbox.recv()
                if kind != "step":  # "error": the loop failed
                    self._gone(message[0])
                    return
                self._deliver(*message)
        except (EOFError, OSError):
            self._gone(f"the engine process exited ({self.process.exitcode})")

    def _deliver(self, news: dict, cached: dict, stats: dict) -> None:
        """Each request's news of one step."""
        self.stats = stats
        for request, count in cached.items():
            self._handles[request].cached = count
        for request, (tokens, finished) in news.items():
            handle = self._handles[request]
            if finished is not None:
                self._ended(request, finished)
            handle.receive(tokens, finished)

    def _gone(self, error: str) -> None:
        """The engine process failed or exited: every request ends ``"abort"``; nothing is read any more."""
        log.error("the engine process is gone: %s", error)
        self.error = error
        if self._loop is not None:
            self._loop.remove_reader(self._outbox.fileno())
            self._loop = None
        for request, handle in list(self._handles.items()):
            self._ended(request, "abort")
            handle.receive([], "abort")

    def _ended(self, request: int, reason: str) -> None:
        del self._handles[request]
        self.outstanding -= 1
        self.finished[reason] += 1


def _main(spec: EngineSpec, inbox, outbox, admission_wait: float) -> None:
    """The engine process: build, report, run the loop; stop when told or when the HTTP side goes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        scheduler, extra = spec.factory(*spec.args)
    except Exception as error:
        usage = isinstance(error, USAGE_ERRORS)
        outbox.send(("failed", str(error), getattr(error, "argument", None), usage, traceback.format_exc()))
        return
    try:
        outbox.send(("ready", Ready(scheduler.limits, scheduler.engine.slots, stats(scheduler), extra)))
        _run(scheduler, inbox, outbox, admission_wait)
    except (EOFError, BrokenPipeError):  # the HTTP process is gone
        pass
    except BaseException:
        log.exception("the device loop failed")
        try:
            outbox.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        scheduler.close()


def _run(scheduler: RequestScheduler, inbox, outbox, admission_wait: float) -> None:
    """The device loop: take the messages that came (wait for one while no request runs; then, for at most
    ``admission_wait`` seconds, for more arrivals: :data:`ADMISSION_GAP`), run a step if requests run (or one
    was aborted: the step reports it), send the step's news."""
    requests: dict[int, int] = {}  # the scheduler's id -> the HTTP side's
    ids: dict[int, int] = {}  # the HTTP side's id -> the scheduler's
    busy = 0.0  # stats' busy_seconds
    while True:
        news: dict[int, tuple[list[int], str | None]] = {}
        aborted = False
        wait = None if not scheduler.busy else 0  # None: block until a message (or the pipe's end)
        start = deadline = time.perf_counter()
        while inbox.poll(wait):
            if wait is None:  # idle until now: gather the arrivals of a burst before the first step
                start = time.perf_counter()
                deadline = start + admission_wait
            kind, *message = inbox.recv()
            if kind == "stop":
                return
            if kind == "abort":
                if message[0] in ids:
                    scheduler.abort(ids[message[0]])
                    aborted = True
            else:
                request, prompt, params = message
                try:  # checked on the HTTP side already
                    ids[request] = scheduler.add_request(prompt, params)
                    requests[ids[request]] = request
                except (TypeError, ValueError):
                    log.exception("a request passed the HTTP side's checks but not the scheduler's")
                    news[request] = ([], "abort")
            left = deadline - time.perf_counter()
            free = scheduler.engine.slots - len(scheduler.owner)
            wait = min(ADMISSION_GAP, left) if left > 0 and scheduler.waiting < free else 0
        stepped = scheduler.busy or aborted
        out = scheduler.step() if stepped else StepOutput()
        cached = {requests[request]: count for request, count in out.cached.items()}
        for request, tokens in out.tokens.items():
            news[requests[request]] = (tokens, None)
        for request, reason in out.finished.items():
            request = requests.pop(request)
            del ids[request]
            news[request] = (news.get(request, ([], None))[0], reason)
        if stepped:
            busy += time.perf_counter() - start
        if stepped or news:
            outbox.send(("step", news, cached, stats(scheduler, busy)))
