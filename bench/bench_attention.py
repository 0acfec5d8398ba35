"""The attention op (jax_oc128.attention_op, the CUDA kernel) against the jnp path (nn.attend's einsums) at
V4-Flash's attention shapes: 64 heads, head_dim 512, a window of 128, a 32k context (its 256 HCA entries, or
top-512 picks among its 8192 CSA entries), for one request's prefill chunks of 2048 and 8192 tokens and for
decode steps of 8 and 64 rows. Per case: the median time of each, the FLOP floor (the attention's FLOPs over
the visible keys at the bf16 matmul rate measured in the same run) and XLA's temporaries
(``compiled.memory_analysis()``). The op takes bf16 q and pool; the jnp path takes float32 as the model gives
it (activations float32), its keys as the model builds them (the window's by query block, the CSA picks
gathered per query).

    python bench/bench_attention.py [--out bench/results/bench_attention.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_oc128.attention_op import attention
from jax_oc128.nn import attend

HEADS, DIM, WINDOW, TOPK, CONTEXT, QUERY_BLOCK = 64, 512, 128, 512, 32768, 128
CASES = (("prefill", 1, 2048), ("prefill", 1, 8192), ("decode", 8, 1), ("decode", 64, 1))
DEFAULT_OUT = pathlib.Path(__file__).resolve().parent / "results" / "bench_attention.json"


def timed(fn, *args, iters=10):
    """Median seconds per call of the compiled ``fn`` after two untimed calls."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def matmul_rate(n=8192):
    """FLOP/s of an n x n x n bf16 matmul (float32 accumulation)."""
    a = jnp.ones((n, n), jnp.bfloat16)
    fn = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    return 2 * n**3 / timed(fn, a, a)


def operands(kind, rows, tokens, layer, rng):
    """The op's operands and the jnp path's for one case; the number of keys each query sees in total."""
    hca, csa = CONTEXT // 128, CONTEXT // 4
    first = CONTEXT - tokens  # the chunk's first position: the chunk ends the 32k context
    extra = hca if layer == "hca" else csa
    pool = WINDOW + tokens + extra
    kv = jnp.asarray(rng.standard_normal((rows, pool, DIM)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((rows, tokens, HEADS, DIM)), jnp.bfloat16)
    sinks = jnp.zeros(HEADS, jnp.float32)
    t = np.arange(tokens)[:, None]
    ring = np.arange(WINDOW)[None]  # ring row r: position first - WINDOW + r
    ring_index = np.where(ring > t, ring, -1)  # in the window of query t
    # the chunk's own keys in the window of query t: [t - WINDOW + 1, t]
    causal = np.stack([WINDOW + np.maximum(t[:, 0] - WINDOW + 1, 0), WINDOW + t[:, 0] + 1], axis=-1)
    if layer == "hca":
        index = ring_index
        seen = (first + t[:, 0] + 1) // 128
        entries = np.stack([np.full(tokens, WINDOW + tokens), WINDOW + tokens + seen], -1)
        ranges = np.stack([causal, entries], 1)
        picks = seen
    else:
        picks = np.stack([rng.choice(csa, TOPK, replace=False) for _ in range(tokens)])
        index = np.concatenate([ring_index, WINDOW + tokens + picks], axis=1)
        ranges = causal[:, None]
        picks = np.full(tokens, TOPK)
    visible_keys = int(np.sum((ring_index >= 0).sum(1) + causal[:, 1] - causal[:, 0] + picks)) * rows
    op_args = (
        q,
        kv,
        jnp.asarray(np.broadcast_to(index, (rows, *index.shape)), jnp.int32),
        jnp.asarray(np.broadcast_to(ranges, (rows, *ranges.shape)), jnp.int32),
        sinks,
    )
    # the jnp path: keys by query block (the ring and the window - 1 + block new keys before each block's end)
    block = min(tokens, QUERY_BLOCK)
    blocks, width = tokens // block, WINDOW + (WINDOW - 1 + block if tokens > QUERY_BLOCK else tokens)
    keys = jnp.zeros((rows, blocks, width, DIM), jnp.float32)
    visible = jnp.ones((rows, blocks, block, width), bool)
    if layer == "hca":
        extra_keys = kv[:, WINDOW + tokens :].astype(jnp.float32)
        extra_visible = jnp.arange(extra)[None, None] < jnp.asarray(seen)[None, :, None]
        extra_visible = jnp.broadcast_to(extra_visible, (rows, tokens, extra))
    else:
        extra_keys = jnp.zeros((rows, tokens, TOPK, DIM), jnp.float32)  # gathered per query
        extra_visible = jnp.ones((rows, tokens, TOPK), bool)
    jnp_args = (q.astype(jnp.float32), keys, visible, extra_keys, extra_visible, sinks)
    return op_args, jnp_args, visible_keys


def measure(fn, args):
    """``(seconds, temporaries in bytes, None)`` of ``fn`` jitted on ``args``; ``(None, None, the error)``
    where it fails."""
    try:
        compiled = jax.jit(fn).lower(*args).compile()
        return timed(compiled, *args), compiled.memory_analysis().temp_size_in_bytes, None
    except Exception as error:  # an out-of-memory jnp case is a result
        return None, None, f"{type(error).__name__}: {str(error)[:200]}"


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    rate = matmul_rate()
    print(f"{jax.devices()[0].device_kind}: bf16 matmul {rate / 1e12:.0f} TFLOP/s")
    rng, results = np.random.default_rng(0), []
    scale = DIM**-0.5
    for kind, rows, tokens in CASES:
        for layer in ("hca", "csa"):
            op_args, jnp_args, keys = operands(kind, rows, tokens, layer, rng)
            flops = 4 * HEADS * DIM * keys  # q.k and p.v per visible key and head
            op_s, op_temp, op_error = measure(lambda *a: attention(*a, scale=scale), op_args)
            jnp_s, jnp_temp, jnp_error = measure(lambda *a: attend._jnp(*a, scale), jnp_args)
            row = dict(
                case=f"{kind} {rows}x{tokens}",
                layer=layer,
                keys_per_query=keys / rows / tokens,
                flops=flops,
                floor_s=flops / rate,
                op_s=op_s,
                op_temp=op_temp,
                op_error=op_error,
                jnp_s=jnp_s,
                jnp_temp=jnp_temp,
                jnp_error=jnp_error,
            )
            results.append(row)
            shown = {k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in row.items()}
            print(json.dumps(shown), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    device = jax.devices()[0].device_kind
    args.out.write_text(json.dumps({"device": device, "matmul_flops": rate, "cases": results}, indent=1))


if __name__ == "__main__":
    main()
