"""The device thread: :class:`Worker` owns a :class:`~jax_oc128.engine.requests.RequestScheduler` and is the
only thread that touches it. The HTTP side hands it requests and aborts through a queue and never waits for
it; after each step the worker posts what every request got from it (its tokens of the step's dispatches,
and how it ended) to the HTTP side in one message, and never waits for that side either."""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
from collections.abc import Callable

from jax_oc128.engine.requests import RequestScheduler, SamplingParams

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The server holds as many requests as it takes (slots + max_queued)."""


class Handle:
    """One request as the HTTP side sees it: ``receive(tokens, finished)`` is called on the HTTP side (by the
    worker's ``post``) once per step that read tokens for it or ended it: ``tokens`` a list of ints (maybe
    empty), ``finished`` None or, once and last, the reason it ended (``"stop"``, ``"length"``,
    ``"abort"``)."""

    def __init__(self, prompt, params: SamplingParams, receive: Callable):
        self.prompt, self.params, self.receive = prompt, params, receive
        self.id: int | None = None  # the scheduler's, once added
        self.cached = 0  # its prompt tokens taken from the prefix cache, once admitted


def _deliver(news: dict) -> None:
    """On the HTTP side: each request's news of one step."""
    for handle, (tokens, finished) in news.items():
        handle.receive(tokens, finished)


class Worker:
    """The device loop over ``scheduler`` in a daemon thread, holding at most ``capacity`` requests
    (running or waiting) at a time; more are refused (:class:`QueueFull`). ``post(function)`` (given to
    :meth:`start`) has ``function()`` called on the HTTP side without waiting for it (the event loop's
    ``call_soon_threadsafe``).

    Attributes:
      outstanding: requests submitted and not yet ended.
      finished: counts of the ended requests by reason.
    """

    def __init__(self, scheduler: RequestScheduler, capacity: int):
        self.scheduler, self.capacity = scheduler, capacity
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._stopping = False
        self.outstanding = 0
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="jax-oc128-device", daemon=True)
        self._post: Callable = lambda function: None

    def start(self, post: Callable) -> None:
        self._post = post
        self._thread.start()

    def stop(self) -> None:
        """End the device loop (requests still running are dropped) and give the engine its state back."""
        self._stopping = True
        self._wake.set()
        self._thread.join()

    def submit(self, handle: Handle) -> None:
        """Queue ``handle``'s request (checked already); :class:`QueueFull` when the server is full."""
        with self._lock:
            if self.outstanding >= self.capacity:
                raise QueueFull(f"the server holds {self.capacity} requests (slots + max_queued)")
            self.outstanding += 1
        self._inbox.put(("add", handle))
        self._wake.set()

    def abort(self, handle: Handle) -> None:
        """Abort ``handle``'s request (a client gone, a stop string met); nothing if it ended."""
        self._inbox.put(("abort", handle))
        self._wake.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        handles: dict[int, Handle] = {}
        try:
            while not self._stopping:
                self._wake.clear()
                news: dict[Handle, tuple[list[int], str | None]] = {}
                self._take_inbox(handles, news)
                if self.scheduler.busy:
                    out = self.scheduler.step()
                    for request, cached in out.cached.items():
                        handles[request].cached = cached
                    for request, tokens in out.tokens.items():
                        news[handles[request]] = (tokens, None)
                    for request, reason in out.finished.items():
                        handle = handles.pop(request)
                        news[handle] = (news.get(handle, ([], None))[0], self._ended(reason))
                self._send(news)
                if not self.scheduler.busy:
                    self._wake.wait(0.5)
        except BaseException as error:  # the server answers 503 from now on (/health says why)
            log.exception("the device loop failed")
            self.error = error
            self._send({handle: ([], "abort") for handle in handles.values()})
        finally:
            self.scheduler.close()

    def _send(self, news: dict) -> None:
        """Post ``news`` (handle -> its tokens and end) to the HTTP side, one message for all requests."""
        if news:
            with contextlib.suppress(RuntimeError):  # the event loop closed (the server stopping)
                self._post(functools.partial(_deliver, news))

    def _take_inbox(self, handles: dict[int, Handle], news: dict) -> None:
        while True:
            try:
                what, handle = self._inbox.get_nowait()
            except queue.Empty:
                return
            if what == "abort":
                if handle.id is not None:
                    self.scheduler.abort(handle.id)
                continue
            try:  # checked on the HTTP side already
                handle.id = self.scheduler.add_request(handle.prompt, handle.params)
            except (TypeError, ValueError):
                log.exception("a request passed the HTTP side's checks but not the scheduler's")
                news[handle] = ([], self._ended("abort"))
                continue
            handles[handle.id] = handle

    def _ended(self, reason: str) -> str:
        """Count a request ended for ``reason``; returns it."""
        with self._lock:
            self.outstanding -= 1
            self.finished[reason] += 1
        return reason
