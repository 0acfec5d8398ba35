"""Serving benchmark in the manner of SGLang's ``bench_serving``: a ``jax-oc128 serve`` in this process (its
flags as the command takes them; its engine process apart, as the command's), requests streamed to it over
HTTP by a client in a process of its own (``--clients N``: N, each sending every N-th request; so that the
measurement is the server's) with Poisson arrivals at each of ``--rates`` (requests/s; ``inf``: all at once),
reporting per rate TTFT, time per output token (TPOT) and end-to-end latency at p50 and p99, request and
output-token throughput, the server's SSE events per request and decode dispatches.

Workloads (``--dataset``): ``random``, prompts of random token ids of ``--input-len`` tokens (lengths drawn
uniformly down to ``--range-ratio`` of it); ``shared-prefix``, each prompt a common ``--prefix-len``-token
prefix then a random suffix of that length. Every request asks ``--output-len`` greedy tokens and no stop
(``ignore_eos``), so each gives exactly that many. With ``--offline``, ``Engine.generate`` of the same prompts
is timed too, in the engine process on its engine before it serves (its output tokens/s: the serving
overhead's baseline; its ``prefills``, the prefill calls, against each rate's; ``offline_over_served`` per
rate; ``engine_over_offline``: the engine process's busy time, ``engine_busy_s``, over the offline run's: the
part of the overhead that is the engine's, the rest being the requests' way in and the tokens' way out;
``engine_cpu_s``, ``http_cpu_s``, ``client_cpu_s``: the CPU time of the engine process, the HTTP process, this
one, and the client's over the rate's run: one near ``duration_s`` is saturated, on a GPU host the bottleneck;
on the CPU backend the engine's includes the device's work). With ``--sweep-slots S ...``, one server per slot
count, and with ``--sweep-prefix-cache N ...`` one per snapshot count (0: prefix caching off), one after the
other; a row with the cache on then gives ``ttft_off_over_cached``: the TTFT p50 of the same slots and rate
with the cache off over its own (issue 41's shared-prefix target: at least 3x). With
``--sweep-backend online offline``, one server per C128 state (``--backend``), the offline rows'
``offline_c128_over_online`` the online row's output tokens/s (same slots, cache, rate) over their own (>= 1:
online is no slower).

Models (``--model``): ``shipped``, the checkpoint at PATH (default: the shipped text model);
``v4flash-slice``, DeepSeek-V4-Flash's first ``--layers`` layers with ``--experts`` routed experts, random
weights in DeepSeek's released format (FP8 attention, FP4 experts: ``bench_models.released_model``), built
in the engine process (never pickled; 6 layers of 256 experts: 27 GB), its runtime ``--max-len`` (default
4096) and a draft of up to 4. Its prompts and tokens are raw token ids: the server's tokenizer gives token
``i`` the word ``i`` (:func:`raw_tokenizer`), so that every token has text (the shipped tokenizer's 1024
ids would leave most of the slice's 129280 without any, and its events without text).

    python bench/bench_serving.py --slots 8 --pages 256 --rates 2 8 inf --num-prompts 64
    python bench/bench_serving.py --rates inf --num-prompts 64 --input-len 128 --output-len 64 --offline
    python bench/bench_serving.py --sweep-slots 8 32 --rates inf --num-prompts 128 --input-len 128 --offline
    python bench/bench_serving.py PATH --draft 2 --dataset shared-prefix --prefix-len 4096 --output json
    python bench/bench_serving.py --model v4flash-slice --slots 8 --rates inf --num-prompts 64 --offline
    python bench/bench_serving.py --sweep-backend online offline --draft 2 --rates inf --num-prompts 64
    python bench/bench_serving.py --model v4flash-slice --max-len 8192 --pages 320 --dataset shared-prefix \
        --prefix-len 4096 --input-len 128 --sweep-prefix-cache 0 8 --rates inf
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import multiprocessing
import pathlib
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import bench_models
import httpx
import numpy as np
import tokenizers
from bench_ops import Phases

from jax_oc128.checks import check_backend, int_argument
from jax_oc128.controller import BACKENDS
from jax_oc128.serve import cli
from jax_oc128.text import TextTokenizer

MODELS = ("shipped", "v4flash-slice")


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
    """Send ``prompts`` at Poisson arrivals of ``rate`` per second: each request's :func:`one`, and when the
    sending began and the last request ended (``time.perf_counter``: one clock for the processes of a
    machine) with the process's CPU time in between."""
    rng = np.random.default_rng(seed)
    limits = httpx.Limits(max_connections=len(prompts))
    async with httpx.AsyncClient(base_url=base, timeout=None, limits=limits) as http:
        start, cpu = time.perf_counter(), time.process_time()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(http, model, prompt, new)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.exponential(1 / rate))
        results = await asyncio.gather(*tasks)
        return dict(results=results, start=start, end=time.perf_counter(), cpu=time.process_time() - cpu)


#: in a client's process: the barrier of the clients of a rate (:func:`client`)
_clients = None


def _client_process(barrier) -> None:
    global _clients
    _clients = barrier


def client(base: str, model: str, prompts, new: int, rate: float, seed: int, together=False) -> dict:
    """In a client's process: :func:`run_rate`; ``together``: once every client has reached the barrier (all
    the processes started)."""
    if together:
        _clients.wait()
    return asyncio.run(run_rate(base, model, prompts, new, rate, seed))


def metrics(rate: float, parts: list[dict]) -> dict:
    """The rate's metrics from its clients' :func:`run_rate` ``parts``: over all their requests, from the
    first one's sending to the last one's end; ``client_cpu_s`` the clients' CPU time together."""
    results = [result for part in parts for result in part["results"]]
    duration = max(part["end"] for part in parts) - min(part["start"] for part in parts)
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
        client_cpu_s=sum(part["cpu"] for part in parts),
        **percentiles("ttft"),
        **percentiles("tpot"),
        **percentiles("e2e"),
    )


def raw_tokenizer(vocab: int) -> TextTokenizer:
    """A tokenizer of ``vocab`` ids, id ``i`` the word ``i`` (words joined by spaces; no BOS, no EOS, no chat
    template): the served text of raw token ids."""
    model = tokenizers.models.WordLevel({str(i): i for i in range(vocab)}, unk_token="0")
    return TextTokenizer(tokenizers.Tokenizer(model), None, (), False, None, pathlib.Path(__file__).parent)


def main(argv=None, slice_=None) -> list[dict]:
    """The rows of ``argv``'s runs, printed. ``slice_``: a ``ModelConfig`` for ``--model v4flash-slice`` in
    place of ``--layers`` / ``--experts``' (a test's small shapes)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_arguments(parser)
    parser.add_argument("--model", choices=MODELS, default="shipped", help="see the module doc")
    parser.add_argument("--layers", type=int, default=6, help="v4flash-slice: its layers")
    parser.add_argument("--experts", type=int, default=256, help="v4flash-slice: its routed experts")
    parser.add_argument("--dataset", choices=["random", "shared-prefix"], default="random")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: the common prefix")
    parser.add_argument("--range-ratio", type=float, default=1.0, help="input lengths from this fraction up")
    parser.add_argument("--rates", type=float, nargs="+", default=[4.0, 16.0, math.inf])
    parser.add_argument("--bench-seed", type=int, default=0)
    parser.add_argument(
        "--clients",
        type=int_argument(1),
        default=1,
        help="client processes, each sending every N-th prompt at rate / N (Poisson still; default 1)",
    )
    parser.add_argument("--offline", action="store_true", help="time Engine.generate of the same prompts")
    parser.add_argument(
        "--sweep-slots", type=int, nargs="+", default=None, metavar="S", help="one run per --slots value"
    )
    parser.add_argument(
        "--sweep-prefix-cache",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="one run per --prefix-cache",
    )
    parser.add_argument(
        "--sweep-backend",
        choices=list(BACKENDS),
        nargs="+",
        default=None,
        metavar="B",
        help="one run per --backend (online, offline)",
    )
    parser.add_argument("--output", choices=["table", "json"], default="table")
    args = parser.parse_args(argv)
    args.port = 0
    if args.model == "v4flash-slice" and args.path is not None:
        parser.error("argument --model: v4flash-slice is built with random weights, not read from PATH")
    if args.model == "v4flash-slice":
        slice_ = slice_ or bench_models.slice_config(args.layers, args.experts)
        args.served_model_name = args.served_model_name or args.model
    else:
        slice_ = None
    backends = args.sweep_backend or [args.backend]
    for backend in backends:  # every server's flags checked before the first one runs
        check_backend(parser, backend, args.tree is not None)
    rows = []
    for backend, slots, cache in itertools.product(
        backends, args.sweep_slots or [args.slots], args.sweep_prefix_cache or [args.prefix_cache]
    ):
        args.backend, args.slots, args.prefix_cache = backend, slots, cache
        swept = dict(backend=backend, slots=slots, prefix_cache=cache)
        rows += [swept | row for row in run(parser, args, slice_)]
    compare(rows, "prefix_cache", 0, "ttft_p50_ms", "ttft_off_over_cached")
    compare(rows, "backend", "online", "output_tokens_per_s", "offline_c128_over_online")
    if args.output == "json":
        print(json.dumps(rows, indent=1))
    else:
        keys = [
            "backend",
            "slots",
            "prefix_cache",
            "rate",
            "requests",
            "duration_s",
            "output_tokens_per_s",
            "offline_c128_over_online",
            "offline_over_served",
            "engine_busy_s",
            "engine_over_offline",
            "engine_cpu_s",
            "http_cpu_s",
            "client_cpu_s",
            "ttft_p50_ms",
            "ttft_p99_ms",
            "ttft_off_over_cached",
            "tpot_p50_ms",
            "tpot_p99_ms",
            "e2e_p50_ms",
            "e2e_p99_ms",
            "events_per_request",
            "dispatches",
            "prefill_tokens",
            "cached_tokens",
            "prefills",
        ]
        print(" ".join(f"{k:>14s}" for k in keys))
        for row in rows:
            cells = [row.get(k, "") for k in keys]
            print(" ".join(f"{c:>14.2f}" if isinstance(c, float) else f"{c!s:>14s}" for c in cells))
    return rows


#: what tells a row from the others of a sweep: the swept flags and the rate
ROW_KEYS = ("backend", "slots", "prefix_cache", "rate")


def compare(rows: list[dict], key: str, base, metric: str, name: str) -> None:
    """Give each row whose ``key`` is not ``base`` (and that has ``metric``) ``name``: the ``metric`` of the
    row alike in every other of :data:`ROW_KEYS` with ``key`` at ``base`` over its own (when there is one).
    ``prefix_cache`` at 0: ``ttft_off_over_cached``; ``backend`` at online: ``offline_c128_over_online``."""
    others = [k for k in ROW_KEYS if k != key]
    bases = {tuple(row.get(k) for k in others): row for row in rows if row.get(key) == base}
    for row in rows:
        alike = bases.get(tuple(row.get(k) for k in others))
        if row.get(key) != base and alike is not None and metric in row and metric in alike:
            row[name] = alike[metric] / row[metric]


def slice_model(args, config):
    """The V4-Flash slice of ``config`` (a ``ModelConfig``) in the released format, random, on the C128
    state ``args.backend``, its runtime's ``max_len`` ``args.max_len`` (None: 4096)."""
    model = bench_models.released_model(config, args.backend)
    return bench_models.with_runtime(model, args.backend, max_len=args.max_len)


def engine(args, slice_=None):
    """In the engine process: the server's scheduler (its model ``args.path``'s checkpoint, or with
    ``slice_``, a ``ModelConfig``, :func:`slice_model`'s) and, with ``--offline``, ``Engine.generate`` of the
    workload timed on its engine before it serves (the offline row; else None)."""
    phase = Phases(f"{args.backend}, slots {args.slots}")
    scheduler = cli.scheduler(args, None if slice_ is None else slice_model(args, slice_))
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
        prefills=result.prefills,
    )


def run(parser: argparse.ArgumentParser, args, slice_=None) -> list[dict]:
    """The rows of one server of ``args`` (its engine process built by :func:`engine`, of ``slice_`` if
    given): the offline run's (with ``--offline``) and each rate's; each phase's time on stderr, with the row
    it gave."""
    phase = Phases(f"{args.backend}, slots {args.slots}")
    if slice_ is None:
        server = cli.build(parser, args, engine)
    else:
        server = cli.build(parser, args, engine, slice_, tokenizer=raw_tokenizer(slice_.vocab_size))
    prompts = workload(args, server.engine.limits.vocab_size)
    offline = server.engine.extra
    phase(f"loading (the offline run's phases included): {json.dumps(offline)}")
    rows = [] if offline is None else [offline]
    spawn = multiprocessing.get_context("spawn")  # (no fork of a process running JAX's threads)
    n, model = args.clients, server.model_name
    pool = ProcessPoolExecutor(n, spawn, _client_process, (spawn.Barrier(n),))
    with cli.running(server) as base, pool:
        for warm in prompts[:2]:  # compiles (the second: a prefix cache's hit)
            pool.submit(client, base, model, [warm], args.output_len, math.inf, 0).result()
        phase("served warm-up")
        for rate in args.rates:
            before, cpu = server.engine.stats, time.process_time()
            jobs = [
                pool.submit(client, base, model, prompts[i::n], args.output_len, rate / n, seed, True)
                for i, seed in enumerate(range(args.bench_seed, args.bench_seed + n))
            ]
            row = metrics(rate, [job.result() for job in jobs])
            after, row["http_cpu_s"] = server.engine.stats, time.process_time() - cpu
            row["dispatches"] = after["dispatches"] - before["dispatches"]
            row["engine_busy_s"] = after["busy_seconds"] - before["busy_seconds"]
            row["engine_cpu_s"] = after["cpu_seconds"] - before["cpu_seconds"]
            for key in ("prefill_tokens", "cached_tokens", "prefills"):  # prompt tokens fed, cached; calls
                row[key] = after["totals"].get(key, 0) - before["totals"].get(key, 0)
            if offline is not None:
                row["offline_over_served"] = offline["output_tokens_per_s"] / row["output_tokens_per_s"]
                row["engine_over_offline"] = row["engine_busy_s"] / offline["duration_s"]
            rows.append(row)
            phase(f"rate {rate}: {json.dumps(row)}")  # (a run cut short keeps its rows)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
