"""A live ``jax-oc128 serve`` for the tests: :func:`build` makes the server of the command's flags, its
engine process optionally built by :func:`engine` (held steps, offline references); ``live``
(:func:`jax_oc128.serve.cli.running`) serves it on a free port of 127.0.0.1 while a block runs."""

from __future__ import annotations

import argparse
import time

import httpx

from jax_oc128.serve import cli
from jax_oc128.serve.cli import running as live

__all__ = ["build", "engine", "live", "wait_idle"]


def build(*flags: str, gate=None, jobs=()):
    """The :class:`~jax_oc128.serve.app.Server` of ``jax-oc128 serve FLAGS``; with ``gate`` or ``jobs``,
    its engine process built by :func:`engine` (the jobs' tokens in ``server.engine.extra``)."""
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(list(flags))
    if gate is None and not jobs:
        return cli.build(parser, args)
    return cli.build(parser, args, engine, gate, list(jobs))


def engine(args, gate, jobs):
    """In the engine process: the command's scheduler, each step of it held until ``gate`` (a spawn
    context's Event, or None) is set; and, computed before it serves, each job's ``Engine.generate``
    tokens as the server's requests would give them: a job is a dict of ``prompts`` (texts, encoded as
    the server encodes them: with the chat template if ``chat``) and generate's arguments, by default the
    server's speculation and its stop tokens (the EOS ids)."""
    from jax_oc128.text import SHIPPED_MODEL, load_tokenizer

    scheduler = cli.scheduler(args)
    tokenizer = load_tokenizer(SHIPPED_MODEL if args.path is None else args.path)
    results = []
    for job in jobs:
        job = dict(job)
        chat = job.pop("chat", False)
        prompts = [tokenizer.encode(text, chat=chat) for text in job.pop("prompts")]
        options = dict(tree=scheduler.tree, stop_tokens=tokenizer.eos_token_ids) | job
        results.append(scheduler.engine.generate(prompts, **options).tokens)
    if gate is not None:
        step = scheduler.step
        scheduler.step = lambda: (gate.wait(), step())[1]
    return scheduler, results


def wait_idle(base: str, timeout: float = 60) -> dict:
    """``/health`` once the server holds no request (its body)."""
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(f"{base}/health", timeout=10).json()
        if health["outstanding"] == 0:
            return health
        assert time.monotonic() < deadline, f"requests still held: {health}"
        time.sleep(0.05)
