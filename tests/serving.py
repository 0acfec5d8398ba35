"""A live ``jax-oc128 serve`` for the tests: :func:`build` makes the server of the command's flags,
:func:`live` runs it under uvicorn in a thread on a free port of 127.0.0.1 and stops it."""

from __future__ import annotations

import argparse
import contextlib
import socket
import threading
import time

import httpx
import uvicorn

from jax_oc128.serve import cli
from jax_oc128.serve.app import create_app

#: seconds a test waits for the server to start or stop
START_TIMEOUT = 120


def build(*flags: str):
    """The :class:`~jax_oc128.serve.app.Server` of ``jax-oc128 serve FLAGS``."""
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.build(parser, parser.parse_args(list(flags)))


@contextlib.contextmanager
def live(server):
    """Serve ``server`` on a free port of 127.0.0.1 while the block runs; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(create_app(server), log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(START_TIMEOUT)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


def wait_idle(base: str, timeout: float = 60) -> dict:
    """``/health`` once the server holds no request (its body)."""
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(f"{base}/health", timeout=10).json()
        if health["outstanding"] == 0:
            return health
        assert time.monotonic() < deadline, f"requests still held: {health}"
        time.sleep(0.05)
