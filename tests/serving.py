"""A live ``jax-oc128 serve`` for the tests: :func:`build` makes the server of the command's flags;
``live`` (:func:`jax_oc128.serve.cli.running`) serves it on a free port of 127.0.0.1 while a block runs."""

from __future__ import annotations

import argparse
import time

import httpx

from jax_oc128.serve import cli
from jax_oc128.serve.cli import running as live

__all__ = ["build", "live", "wait_idle"]


def build(*flags: str):
    """The :class:`~jax_oc128.serve.app.Server` of ``jax-oc128 serve FLAGS``."""
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.build(parser, parser.parse_args(list(flags)))


def wait_idle(base: str, timeout: float = 60) -> dict:
    """``/health`` once the server holds no request (its body)."""
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(f"{base}/health", timeout=10).json()
        if health["outstanding"] == 0:
            return health
        assert time.monotonic() < deadline, f"requests still held: {health}"
        time.sleep(0.05)
