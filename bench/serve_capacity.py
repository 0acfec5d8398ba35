"""Serving capacity measured on one device: the engine with paged caches holding the concurrent requests of a
mix of lengths that a cache memory budget fits, where per-slot (dense) caches run out of memory.

Model: DeepSeek-V4-Flash's caches (``ModelConfig.deepseek_v4_flash``, its first ``--layers`` layers: 2
sliding, then CSA and HCA alternating; head_dim 512 with RoPE on 64, window 128, the CSA entries every 4
tokens and its indexer keys of 128, the HCA entries every 128 tokens, the C128 state), stored as
``--kv-cache-dtype`` says; the matrices bfloat16, random weights; a dense SwiGLU MLP of 2048, one residual
stream, no draft head (plain greedy decoding, ``max_draft`` 1), a vocabulary of 4096. The query side, which
shapes no cache, is cut (``--num-heads`` query heads, ``--index-heads`` indexer heads, ``--index-topk``
picks; ``--hidden-size``): the engine prefills the admitted prompts in one forward over ``[slots, longest
prompt]`` (no chunked prefill), whose attention logits ``[slots, heads, T, T + 128]``, indexer scores
``[slots, T, index heads, T / 4]`` and picked entries ``[slots, T, topk, 512]`` are float32. At V4-Flash's
64 heads and T = 8192 the logits alone are 17 GiB per slot and per copy, where a slot's caches are 6 MiB:
one H200 would prefill a few such prompts, and the prefill's working memory, not the caches, would set what
fits.

Counts, from the engine's decode state (``jax.eval_shape`` of :func:`jax_oc128.engine.state.init_state`,
the bytes that ``Engine.init_state`` allocates, checked against ``bench/capacity.py``'s per-slot formula):
a dense slot's bytes; a paged slot's fixed bytes (window, raw rows, C128 state, per-slot vectors, page
table row) and a page's bytes (:data:`capacity.PAGE_SIZE` tokens of every compressed layer's entries and
indexer keys). Request i needs ``LENGTH_MIX[i % 5] * max_len`` tokens (:data:`capacity.LENGTH_MIX`): a prompt
of that less ``--new-tokens`` + 1 random tokens, then ``--new-tokens`` greedy tokens. In ``--budget-gib``:
dense, ``R_d = budget // dense slot`` requests; paged, the most requests R whose fixed bytes and pages fit,
the pool ``P`` the pages the rest of the budget holds.

Measured:

1. serving: ``Engine(model, R, pages=P).generate`` of the R requests, once to compile, once timed (tokens/s
   of the new tokens and of the prompts over the call's seconds); every request must give its new tokens.
   On a GPU the allocator's peak bytes in use are reported (weights, caches and the prefill's working
   memory, which the budget does not cover: see above; compilation's scratch included).
2. the budget (GPU only: on the CPU no allocator limit exists): every free byte of the device but the budget
   (+ ``--margin-mib``) taken by a ballast of arrays (the last ones small, into the holes), then
   ``init_state`` of the dense engine at R_d slots (fits), of the paged engine (fits) and of the dense
   engine at R slots (RESOURCE_EXHAUSTED, caught: the expected outcome; last, so that nothing a failed call
   leaves behind decides another's outcome).

The allocator's pool is 95% of the device (``XLA_PYTHON_CLIENT_MEM_FRACTION``, unless set).

Usage: python bench/serve_capacity.py [--budget-gib 0.05] [--max-len 8192] [--layers 6]
[--kv-cache-dtype bfloat16] [--new-tokens 8] [--out serve_capacity.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import pathlib
import sys
import time

# the GPU allocator's pool: most of the device (JAX's default is 75%), set before jax initializes it
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from capacity import LENGTH_MIX, PAGE_SIZE, per_slot_bytes, slot_bytes

from jax_oc128.controller import ONLINE
from jax_oc128.engine import Engine
from jax_oc128.engine.state import init_state
from jax_oc128.nn import ModelConfig, RuntimeConfig, SpeculativeModel
from jax_oc128.nn import kv_cache as kv
from jax_oc128.state import nbytes

#: the ballast's smallest array (bytes): the allocator places a small array in the smallest free block that
#: holds it, so that the last arrays fill the holes left by the model's construction before the free tail
BALLAST_CHUNK = 4 << 20


def serve_config(
    layers: int,
    max_len: int,
    kv_cache_dtype: str,
    num_heads: int,
    index_heads: int,
    index_topk: int,
    hidden: int,
) -> tuple[ModelConfig, RuntimeConfig]:
    """DeepSeek-V4-Flash's first ``layers`` layers with its caches and a cut query side (module doc), and
    its runtime (``max_len``, ``kv_cache_dtype``, one token a verify)."""
    config = ModelConfig.deepseek_v4_flash(
        num_layers=layers,
        mtp=False,
        dtype="bfloat16",
        vocab_size=4096,
        hc_mult=None,
        num_heads=num_heads,
        index_n_heads=index_heads,
        index_topk=index_topk,
        hidden_size=hidden,
    )
    runtime = RuntimeConfig(max_len=max_len, max_draft=1, kv_cache_dtype=kv_cache_dtype)
    return dataclasses.replace(config, mlp_layer_types=None), runtime


def state_bytes(model: SpeculativeModel, slots: int, pages: int | None = None) -> int:
    """Bytes of the decode state that ``Engine(model, slots, pages=pages).init_state()`` allocates (pages of
    :data:`PAGE_SIZE` tokens; the PRNG key left out)."""
    layout = jax.eval_shape(lambda: init_state(model, slots, 0, 0, pages, PAGE_SIZE))
    return nbytes(dataclasses.replace(layout, key=None))


def request_tokens(count: int, max_len: int) -> list[int]:
    """The tokens each of ``count`` requests needs: :data:`LENGTH_MIX` of ``max_len`` in turn."""
    return [int(LENGTH_MIX[i % len(LENGTH_MIX)] * max_len) for i in range(count)]


def counts(model: SpeculativeModel, budget: int) -> dict:
    """The requests of the mix that ``budget`` bytes of decode state hold, dense and paged (module doc), and
    the bytes they come from. ValueError if the budget holds no dense slot."""
    dense_slot = state_bytes(model, 2) - state_bytes(model, 1)
    formula = sum(slot_bytes(model.config, model.runtime, ONLINE, per_slot_bytes(model)).values())
    if dense_slot != formula:
        raise RuntimeError(f"the engine's dense slot is {dense_slot} bytes, bench/capacity.py says {formula}")
    fixed = state_bytes(model, 2, 1) - state_bytes(model, 1, 1)
    page = state_bytes(model, 1, 2) - state_bytes(model, 1, 1)
    shared = state_bytes(model, 1, 1) - fixed - page  # bytes no slot or page owns (none today)
    dense = (budget - (state_bytes(model, 1) - dense_slot)) // dense_slot
    if dense < 1:
        raise ValueError(f"budget: {budget} bytes hold no dense slot of {dense_slot} bytes")
    max_len = model.max_len
    slots, needed = 0, 0
    while True:
        more = math.ceil(request_tokens(slots + 1, max_len)[-1] / PAGE_SIZE)
        if shared + (slots + 1) * fixed + (needed + more) * page > budget:
            break
        slots, needed = slots + 1, needed + more
    pages = (budget - shared - slots * fixed) // page
    return dict(
        dense_slot_bytes=dense_slot,
        paged_fixed_bytes=fixed,
        page_bytes=page,
        dense_slots=int(dense),
        paged_slots=slots,
        pages=int(pages),
        pages_needed=needed,
        paged_request_bytes=fixed + needed * page / slots,
        dense_state_bytes=state_bytes(model, dense),
        dense_at_paged_slots_bytes=state_bytes(model, slots),
        paged_state_bytes=state_bytes(model, slots, int(pages)),
    )


def make_prompts(vocab: int, needs: list[int], new_tokens: int) -> list[list[int]]:
    """Random prompts of ``needs[i] - new_tokens - 1`` tokens."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, n - new_tokens - 1).tolist() for n in needs]


def serve(model: SpeculativeModel, slots: int, pages: int, new_tokens: int, prefill_chunk=None) -> dict:
    """The paged engine serving the requests of the mix (module doc, measurement 1), its prompts prefilled
    ``prefill_chunk`` positions at a time (None: in one forward)."""
    prompts = make_prompts(model.config.vocab_size, request_tokens(slots, model.max_len), new_tokens)
    engine = Engine(model, slots, pages=pages, page_size=PAGE_SIZE, prefill_chunk=prefill_chunk)
    start = time.perf_counter()
    engine.generate(prompts, new_tokens)
    compile_seconds = time.perf_counter() - start
    result = engine.generate(prompts, new_tokens)
    finished = sum(len(tokens) == new_tokens for tokens in result.tokens)
    stats = jax.devices()[0].memory_stats() or {}
    return dict(
        requests=slots,
        finished=finished,
        new_tokens=new_tokens,
        prompt_tokens=sum(map(len, prompts)),
        seconds=result.seconds,
        first_call_seconds=compile_seconds,
        tokens_per_second=slots * new_tokens / result.seconds,
        prompt_tokens_per_second=sum(map(len, prompts)) / result.seconds,
        page_waits=engine.page_pool.waits,
        peak_bytes_in_use=stats.get("peak_bytes_in_use"),
    )


def allocation(engine: Engine) -> dict:
    """Whether ``engine.init_state()`` allocates: its bytes, or the RESOURCE_EXHAUSTED error."""
    try:
        state = jax.block_until_ready(engine.init_state())
    except jax.errors.JaxRuntimeError as error:
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        message = str(error).splitlines()[0][:300]
        del error
        gc.collect()  # the failed call's partial buffers, held by its traceback's frames
        return dict(outcome="out of memory", error=message)
    size = nbytes(dataclasses.replace(state, key=None))
    del state
    gc.collect()
    return dict(outcome="fits", bytes=size)


def budget_check(model: SpeculativeModel, count: dict, budget: int, margin: int) -> dict | None:
    """Measurement 2 of the module doc; None where the device's allocator reports no limit (the CPU)."""
    device = jax.devices()[0]
    if "bytes_limit" not in (device.memory_stats() or {}):
        return None
    gc.collect()  # the serving engine's state freed
    # the expected failure last, so that nothing it leaves behind can decide another's outcome
    engines = {
        f"dense, {count['dense_slots']} slots": Engine(model, count["dense_slots"]),
        f"paged, {count['paged_slots']} slots, {count['pages']} pages": Engine(
            model, count["paged_slots"], pages=count["pages"], page_size=PAGE_SIZE
        ),
        f"dense, {count['paged_slots']} slots": Engine(model, count["paged_slots"]),
    }
    ballast = []
    while True:
        stats = device.memory_stats()
        spare = stats["bytes_limit"] - stats["bytes_in_use"] - budget - margin
        if spare <= 0:
            break
        size = min(spare, max(BALLAST_CHUNK, spare // 2))  # halving: the last ones small, into the holes
        ballast.append(jax.block_until_ready(jnp.zeros(size, jnp.uint8)))
    stats = device.memory_stats()
    out = dict(
        free_bytes=stats["bytes_limit"] - stats["bytes_in_use"],
        largest_free_block_bytes=stats.get("largest_free_block_bytes"),
        ballast_bytes=sum(x.nbytes for x in ballast),
        engines={name: allocation(engine) for name, engine in engines.items()},
    )
    del ballast
    return out


def mib(n):
    return f"{n / 2**20:.2f}"


def print_report(report: dict) -> None:
    c, count = report["config"], report["counts"]
    print(
        f"## Serving capacity: V4-Flash caches, {c['layers']} layers ({', '.join(c['layer_types'])}), "
        f"max_len {c['max_len']}, {c['kv_cache_dtype']} caches, budget {mib(report['budget_bytes'])} MiB\n"
    )
    print("| layout | slots | bytes per request (MiB) | decode state (MiB) |")
    print("|---|---|---|---|")
    print(
        f"| dense | {count['dense_slots']} | {mib(count['dense_slot_bytes'])} | "
        f"{mib(count['dense_state_bytes'])} |"
    )
    print(
        f"| paged ({count['pages']} pages of {PAGE_SIZE}) | {count['paged_slots']} | "
        f"{mib(count['paged_request_bytes'])} | {mib(count['paged_state_bytes'])} |"
    )
    print(
        f"| dense at the paged slots | {count['paged_slots']} | {mib(count['dense_slot_bytes'])} | "
        f"{mib(count['dense_at_paged_slots_bytes'])} |"
    )
    print(f"\npaged / dense requests: {count['paged_slots'] / count['dense_slots']:.2f}")
    s = report["serving"]
    print(
        f"\nserving (paged): {s['finished']} / {s['requests']} requests finished with {s['new_tokens']} new "
        f"tokens each, {s['prompt_tokens']} prompt tokens; {s['seconds']:.2f} s "
        f"(first call {s['first_call_seconds']:.1f} s), {s['tokens_per_second']:.1f} new tokens/s, "
        f"{s['prompt_tokens_per_second']:.0f} prompt tokens/s, page waits {s['page_waits']}"
    )
    if s["peak_bytes_in_use"] is not None:
        print(f"peak bytes in use while serving: {s['peak_bytes_in_use'] / 2**30:.2f} GiB")
    check = report["budget_check"]
    if check is None:
        print("\nbudget check: skipped (no allocator limit on this platform)")
        return
    print(
        f"\nbudget check: {mib(check['free_bytes'])} MiB free (largest block "
        f"{mib(check['largest_free_block_bytes'] or 0)} MiB) after a ballast of "
        f"{check['ballast_bytes'] / 2**30:.2f} GiB\n"
    )
    print("| engine | init_state |")
    print("|---|---|")
    for name, result in check["engines"].items():
        detail = mib(result["bytes"]) + " MiB" if result["outcome"] == "fits" else result["error"]
        print(f"| {name} | {result['outcome']}: {detail} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-gib", type=float, default=0.05, help="the decode state's memory budget")
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--kv-cache-dtype", default="bfloat16", choices=list(kv.KV_CACHE_DTYPES))
    parser.add_argument("--num-heads", type=int, default=2)
    parser.add_argument("--index-heads", type=int, default=2)
    parser.add_argument("--index-topk", type=int, default=16)
    parser.add_argument("--hidden-size", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--margin-mib", type=float, default=4.0, help="free bytes beyond the budget (GPU)")
    parser.add_argument(
        "--prefill-chunk", type=int, help="prefill the served prompts this many positions at a time"
    )
    parser.add_argument("--out", help="also write the report as JSON here")
    args = parser.parse_args(argv)
    if args.budget_gib <= 0:
        raise ValueError(f"--budget-gib: must be > 0, got {args.budget_gib}")
    if not 1 <= args.new_tokens < LENGTH_MIX[0] * args.max_len - 1:
        raise ValueError(
            f"--new-tokens: must be in [1, {LENGTH_MIX[0]} * max_len - 1), got {args.new_tokens}"
        )
    config, runtime = serve_config(
        args.layers,
        args.max_len,
        args.kv_cache_dtype,
        args.num_heads,
        args.index_heads,
        args.index_topk,
        args.hidden_size,
    )
    budget = int(args.budget_gib * 2**30)
    model = SpeculativeModel(config, runtime, backend=ONLINE, rngs=nnx.Rngs(0))
    count = counts(model, budget)
    report = dict(
        config=dict(
            layers=args.layers,
            layer_types=list(config.layer_types),
            max_len=args.max_len,
            kv_cache_dtype=args.kv_cache_dtype,
            num_heads=args.num_heads,
            index_heads=args.index_heads,
            index_topk=args.index_topk,
            hidden_size=args.hidden_size,
            prefill_chunk=args.prefill_chunk,
            device=str(jax.devices()[0]),
        ),
        budget_bytes=budget,
        counts=count,
        serving=serve(model, count["paged_slots"], count["pages"], args.new_tokens, args.prefill_chunk),
        budget_check=budget_check(model, count, budget, int(args.margin_mib * 2**20)),
    )
    print_report(report)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
