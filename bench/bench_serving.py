"""Serving benchmark in the manner of SGLang's ``bench_serving``: a ``jax-oc128 serve`` in this process (its
flags as the command takes them; its engine process apart, as the command's), requests streamed to it over
HTTP by a client in a process of its own (so that the measurement is the server's) with Poisson arrivals at
each of ``--rates`` (requests/s; ``inf``: all at once), reporting per rate TTFT, time per output token (TPOT)
and end-to-end latency at p50 and p99, request and output-token throughput, the server's SSE events per
request and decode dispatches.

Workloads (``--dataset``): ``random``, prompts of random token ids of ``--input-len`` tokens (lengths drawn
uniformly down to ``--range-ratio`` of it); ``shared-prefix``, each prompt a common ``--prefix-len``-token
prefix then a random suffix of that length. Every request asks ``--output-len`` greedy tokens and no stop
(``ignore_eos``), so each gives exactly that many. With ``--offline``, ``Engine.generate`` of the same prompts
is timed too, in the engine process on its engine before it serves (its output tokens/s: the serving
overhead's baseline; ``offline_over_served`` per rate). With ``--sweep-slots S ...``, one server per slot
count, one after the other.

    python bench/bench_serving.py --slots 8 --pages 256 --rates 2 8 inf --num-prompts 64
    python bench/bench_serving.py --rates inf --num-prompts 64 --input-len 128 --output-len 64 --offline
    python bench/bench_serving.py --sweep-slots 8 32 --rates inf --num-prompts 128 --input-len 128 --offline
    python bench/bench_serving.py PATH --draft 2 --dataset shared-prefix --prefix-len 4096 --output json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import httpx
import numpy as np

from jax_oc128.serve import cli


def workload(args, vocab: int) -> list[list[int]]:
    """The prompts of ``args``' dataset, token ids in [0, ``vocab``)."""
    rng = random.Random(args.bench_seed)
    low = max(1, int(args.input_len * args.range_ratio))
    prefix = [rng.randrange(vocab) for _ in range(args.prefix_len)] if args.dataset == "shared-prefix" else []
    return [
        prefix + [rng.randrange(vocab) for _ in range(rng.randint(low, args.input_len))]
        for _ in range(args.num_prompts)
    ]


async def one(http: httpx.AsyncClient, model: str, prompt: list[int], new: int) -> dict:
    """Stream one completion; its TTFT, end-to-end latency and output tokens (from the usage)."""
    body = dict(model=model, prompt=prompt, max_tokens=new, temperature=0, stream=True, ignore_eos=True)
    body["stream_options"] = {"include_usage": True}
    start = time.perf_counter()
    first, tokens, events = None, 0, 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events += 1
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"] and first is None:
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter() - start
    first = end if first is None else first
    return dict(ttft=first, e2e=end, tokens=tokens, tpot=(end - first) / max(1, tokens - 1), events=events)


async def run_rate(base: str, model: str, prompts, new: int, rate: float, seed: int) -> dict:
    """Send ``prompts`` at Poisson arrivals of ``rate`` per second; the rate's metrics."""
    rng = np.random.default_rng(seed)
    limits = httpx.Limits(max_connections=len(prompts))
    async with httpx.AsyncClient(base_url=base, timeout=None, limits=limits) as http:
        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(http, model, prompt, new)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.exponential(1 / rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)

    def percentiles(key):
        values = [r[key] * 1000 for r in results]
        return {
            f"{key}_p50_ms": float(np.percentile(values, 50)),
            f"{key}_p99_ms": float(np.percentile(values, 99)),
        }

    return dict(
        rate=rate,
        requests=len(results),
        duration_s=duration,
        request_per_s=len(results) / duration,
        output_tokens=tokens,
        output_tokens_per_s=tokens / duration,
        events_per_request=sum(r["events"] for r in results) / len(results),
        **percentiles("ttft"),
        **percentiles("tpot"),
        **percentiles("e2e"),
    )


def client(base: str, model: str, prompts, new: int, rate: float, seed: int) -> dict:
    """In the client's process: :func:`run_rate`."""
    return asyncio.run(run_rate(base, model, prompts, new, rate, seed))


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_arguments(parser)
    parser.add_argument("--dataset", choices=["random", "shared-prefix"], default="random")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: the common prefix")
    parser.add_argument("--range-ratio", type=float, default=1.0, help="input lengths from this fraction up")
    parser.add_argument("--rates", type=float, nargs="+", default=[4.0, 16.0, math.inf])
    parser.add_argument("--bench-seed", type=int, default=0)
    parser.add_argument("--offline", action="store_true", help="time Engine.generate of the same prompts")
    parser.add_argument(
        "--sweep-slots", type=int, nargs="+", default=None, metavar="S", help="one run per --slots value"
    )
    parser.add_argument("--output", choices=["table", "json"], default="table")
    args = parser.parse_args(argv)
    args.port = 0
    rows = []
    for slots in args.sweep_slots or [args.slots]:
        args.slots = slots
        rows += [dict(slots=slots) | row for row in run(parser, args)]
    if args.output == "json":
        print(json.dumps(rows, indent=1))
    else:
        keys = [
            "slots",
            "rate",
            "requests",
            "duration_s",
            "output_tokens_per_s",
            "offline_over_served",
            "ttft_p50_ms",
            "ttft_p99_ms",
            "tpot_p50_ms",
            "tpot_p99_ms",
            "e2e_p50_ms",
            "e2e_p99_ms",
            "events_per_request",
            "dispatches",
            "prefill_tokens",
            "cached_tokens",
        ]
        print(" ".join(f"{k:>14s}" for k in keys))
        for row in rows:
            cells = [row.get(k, "") for k in keys]
            print(" ".join(f"{c:>14.2f}" if isinstance(c, float) else f"{c!s:>14s}" for c in cells))
    return rows


class Phases:
    """Prints the time each phase took on stderr as it ends (so that a run cut short shows where its time
    went), in whichever process runs it."""

    def __init__(self, slots: int):
        self.slots, self.clock = slots, time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        print(f"slots {self.slots}: {name} {now - self.clock:.1f} s", file=sys.stderr, flush=True)
        self.clock = now


def engine(args):
    """In the engine process: the server's scheduler and, with ``--offline``, ``Engine.generate`` of the
    workload timed on its engine before it serves (the offline row; else None)."""
    phase = Phases(args.slots)
    scheduler = cli.scheduler(args)
    if not args.offline:
        return scheduler, None
    phase("loading the engine")
    engine, prompts = scheduler.engine, workload(args, scheduler.limits.vocab_size)
    options = dict(tree=scheduler.tree, stop_tokens=())  # no EOS stop, as the requests' ignore_eos
    engine.generate(prompts, args.output_len, **options)  # compiles every shape and bucket it meets
    phase("offline warm-up (compiling)")
    result = engine.generate(prompts, args.output_len, **options)
    phase("offline")
    tokens = sum(map(len, result.tokens))
    return scheduler, dict(
        rate="offline",
        requests=len(prompts),
        duration_s=result.seconds,
        output_tokens=tokens,
        output_tokens_per_s=tokens / result.seconds,
        dispatches=result.dispatches,
    )


def run(parser: argparse.ArgumentParser, args) -> list[dict]:
    """The rows of one server of ``args`` (its engine process built by :func:`engine`): the offline run's
    (with ``--offline``) and each rate's; each phase's time on stderr."""
    phase = Phases(args.slots)
    server = cli.build(parser, args, engine)
    prompts = workload(args, server.engine.limits.vocab_size)
    phase("loading (the offline run's phases included)")
    offline = server.engine.extra
    rows = [] if offline is None else [offline]
    spawn = multiprocessing.get_context("spawn")  # (no fork of a process running JAX's threads)
    with cli.running(server) as base, ProcessPoolExecutor(1, mp_context=spawn) as pool:
        for warm in prompts[:2]:  # compiles (the second: a prefix cache's hit)
            pool.submit(client, base, server.model_name, [warm], args.output_len, math.inf, 0).result()
        phase("served warm-up")
        for rate in args.rates:
            before = server.engine.stats
            job = (base, server.model_name, prompts, args.output_len, rate, args.bench_seed)
            row = pool.submit(client, *job).result()
            after = server.engine.stats
            row["dispatches"] = after["dispatches"] - before["dispatches"]
            for key in ("prefill_tokens", "cached_tokens"):  # the prompt tokens fed, and taken from the cache
                row[key] = after["totals"].get(key, 0) - before["totals"].get(key, 0)
            if offline is not None:
                row["offline_over_served"] = offline["output_tokens_per_s"] / row["output_tokens_per_s"]
            rows.append(row)
            phase(f"rate {rate}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
