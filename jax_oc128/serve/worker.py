"""The device thread: :class:`Worker` owns a :class:`~jax_oc128.engine.requests.RequestScheduler` and is the
only thread that touches it. The HTTP side hands it requests and aborts through a queue and never waits for
it; the worker calls each request's ``sink`` with its tokens as dispatches are read."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from jax_oc128.engine.requests import RequestScheduler, SamplingParams

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The server holds as many requests as it takes (slots + max_queued)."""


class Handle:
    """One request as the HTTP side sees it: ``sink(tokens, finished)`` is called from the device thread
    with each batch of new tokens (a list of ints) and, last, with the reason it ended (``"stop"``,
    ``"length"``, ``"abort"``; else None)."""

    def __init__(self, prompt, params: SamplingParams, sink: Callable):
        self.prompt, self.params, self.sink = prompt, params, sink
        self.id: int | None = None  # the scheduler's, once added
        self.cached = 0  # its prompt tokens taken from the prefix cache, once admitted
        self.aborted = False


class Worker:
    """The device loop over ``scheduler`` in a daemon thread, holding at most ``capacity`` requests
    (running or waiting) at a time; more are refused (:class:`QueueFull`).

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

    def start(self) -> None:
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
                self._take_inbox(handles)
                if not self.scheduler.busy:
                    self._wake.wait(0.5)
                    continue
                out = self.scheduler.step()
                for request, cached in out.cached.items():
                    handles[request].cached = cached
                for request, tokens in out.tokens.items():
                    handles[request].sink(tokens, None)
                for request, reason in out.finished.items():
                    self._ended(handles.pop(request), reason)
        except BaseException as error:  # the server answers 503 from now on (/health says why)
            log.exception("the device loop failed")
            self.error = error
            for handle in handles.values():
                handle.sink([], "abort")
        finally:
            self.scheduler.close()

    def _take_inbox(self, handles: dict[int, Handle]) -> None:
        while True:
            try:
                what, handle = self._inbox.get_nowait()
            except queue.Empty:
                return
            if what == "abort":
                handle.aborted = True
                if handle.id is not None:
                    self.scheduler.abort(handle.id)
                continue
            try:  # checked on the HTTP side already
                handle.id = self.scheduler.add_request(handle.prompt, handle.params)
            except (TypeError, ValueError):
                log.exception("a request passed the HTTP side's checks but not the scheduler's")
                self._ended(handle, "abort")
                continue
            handles[handle.id] = handle

    def _ended(self, handle: Handle, reason: str) -> None:
        with self._lock:
            self.outstanding -= 1
            self.finished[reason] += 1
        handle.sink([], reason)
