"""Cost against the context bound (``ForwardBatch.context``): one prefill chunk and one decode forward of 2
prompts on ``ModelConfig.tiny()`` with sliding, CSA and HCA layers, dense caches, at several ``max_len``, each
with ``context`` a bucket (``nn.context_bucket``) and unbounded (None): forward ms (median of ``--reps``, the
cache donated) and the compiled program's temporary and argument bytes (``compiled.memory_analysis()``).
With ``--engine``: the engine end to end instead (issue 40's case), ``Engine(model, 2,
prefill_chunk=--chunk)`` generating ``--new`` tokens after 2 prompts of ``--prompt`` tokens, with its context
buckets (``context_floor=--floor``) and without (None): seconds per ``generate`` call (median of ``--reps``,
after one call that compiles). Markdown table on stdout.

Usage: python bench/bench_context.py [--max-lens 1024 16384 131072] [--prompt 200] [--chunk 128] [--reps 5]
  [--engine [--new 64]]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from jax_oc128.controller import ForwardMode
from jax_oc128.engine import Engine
from jax_oc128.nn import (
    CSA,
    HCA,
    SLIDING,
    DeepseekV4Model,
    ModelConfig,
    RuntimeConfig,
    SpeculativeModel,
    context_bucket,
)

BATCH = 2


def forwards(prompt: int, chunk: int):
    """The measured forwards, ``(name, mode, first position, tokens)``: the prompt's last prefill chunk of
    ``chunk`` tokens and the decode after it."""
    last = (prompt - 1) // chunk * chunk
    return [
        ("prefill chunk", ForwardMode.EXTEND, last, prompt - last),
        ("decode", ForwardMode.DECODE, prompt, 1),
    ]


def measure(model, mode, first: int, tokens: int, context, reps: int):
    """``(ms, temp bytes, argument bytes)`` of one forward of ``tokens`` tokens from position ``first`` per
    row, bounded by ``context``."""
    graphdef, params = nnx.split(model)

    def forward(cache, ids, positions):
        logits, _, cache = nnx.merge(graphdef, params)(ids, positions, cache, mode=mode, context=context)
        return logits, cache

    ids = jnp.zeros((BATCH, tokens), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(first, first + tokens, dtype=jnp.int32), (BATCH, tokens))
    cache = model.init_cache(BATCH)
    compiled = jax.jit(forward, donate_argnums=0).lower(cache, ids, positions).compile()
    memory = compiled.memory_analysis()
    logits, cache = compiled(cache, ids, positions)  # warm
    jax.block_until_ready(logits)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        logits, cache = compiled(cache, ids, positions)
        jax.block_until_ready(logits)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times), memory.temp_size_in_bytes, memory.argument_size_in_bytes


def engine_seconds(config, runtime, prompt: int, new: int, chunk: int, floor, reps: int) -> float:
    """The median seconds of ``generate`` (2 prompts of ``prompt`` tokens, ``new`` new tokens) of an engine of
    2 slots with the prefill in chunks of ``chunk``, its context buckets from ``floor`` (None: unbounded),
    after one call that compiles; ``runtime`` its max_len."""
    model = SpeculativeModel(config, runtime, rngs=nnx.Rngs(0))
    engine = Engine(model, 2, prefill_chunk=chunk, context_floor=floor)
    prompts = [[(7 * i + row) % config.vocab_size for i in range(prompt)] for row in range(BATCH)]
    engine.generate(prompts, new)
    return statistics.median(engine.generate(prompts, new).seconds for _ in range(reps))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-lens", type=int, nargs="+", default=[1024, 16384, 131072])
    parser.add_argument("--prompt", type=int, default=200, help="prompt tokens per row")
    parser.add_argument("--chunk", type=int, default=128, help="prefill chunk")
    parser.add_argument("--floor", type=int, default=512, help="the context bucket's floor")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--engine", action="store_true", help="the engine end to end (generate)")
    parser.add_argument("--new", type=int, default=64, help="new tokens per prompt (--engine)")
    args = parser.parse_args(argv)
    config = ModelConfig.tiny(layer_types=(SLIDING, CSA, HCA))
    runtimes = {n: RuntimeConfig(max_len=n) for n in args.max_lens}
    if args.engine:
        print("| max_len | context_floor | generate s |")
        print("|---|---|---|")
        for max_len, runtime in runtimes.items():
            for floor in (args.floor, None):
                seconds = engine_seconds(config, runtime, args.prompt, args.new, args.chunk, floor, args.reps)
                print(f"| {max_len} | {floor} | {seconds:.3f} |", flush=True)
        return
    print("| max_len | forward | context | ms | temp MiB | argument MiB |")
    print("|---|---|---|---|---|---|")
    for max_len, runtime in runtimes.items():
        model = DeepseekV4Model(config, runtime, rngs=nnx.Rngs(0))
        context = context_bucket(args.prompt + 1, max_len, floor=args.floor)
        for name, mode, first, tokens in forwards(args.prompt, args.chunk):
            for bound in (context, None):
                ms, temp, arguments = measure(model, mode, first, tokens, bound, args.reps)
                cells = [max_len, name, bound, f"{ms:.2f}", f"{temp / 2**20:.2f}", f"{arguments / 2**20:.2f}"]
                print("| " + " | ".join(map(str, cells)) + " |", flush=True)


if __name__ == "__main__":
    main()
