"""Benchmark verify + commit for all C128 layers at DeepSeek-V4-Flash shapes (20 layers, head_dim 512).

Per speculative step a server runs one verify (all layers, one launch) and one commit (all layers, one
launch). This script times both inside one jit-compiled executable with the state donated, unrolled
``--repeat`` times so that host dispatch is amortised, and reports against two floors:

* launch floor: the same executable with a do-nothing launch in place of each op (commit of one padding
  row), i.e. what two kernel launches cost in this setting;
* bandwidth floor: bytes the step must move / the copy bandwidth of the device (read + write of a
  large array, measured here).

A per-layer variant (one verify and one commit launch per layer, as SGLang does) is timed for comparison.
Usage: python bench/bench_ops.py [--batches 8 256] [--draft 4] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_oc128 as oc

LAYERS, DIM, BLOCK = 20, 512, 128


def timed(fn, *args, iters=20):
    """Median seconds per call of fn(*args) (fn returns its donated first argument first)."""
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(iters):
        args = (out[0] if isinstance(out, tuple) else out, *args[1:])
        start = time.perf_counter()
        out = fn(*args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def copy_bandwidth():
    """Bytes/s of a device copy (read + write) of a 2 GiB array."""
    x = jnp.ones((512 * 1024 * 1024,), jnp.float32)
    fn = jax.jit(lambda x: x * 1.0001)
    t = timed(lambda x: (fn(x),), x)
    return 2 * x.nbytes / t


def step_bytes(rows, n, dtype_bytes):
    """Bytes one verify + commit must move for all layers (ape is shared by all rows and not counted)."""
    state_row = 3 * DIM * dtype_bytes
    verify = state_row + n * 2 * DIM * 4 + n * state_row + DIM * 4  # bank 0 in, tokens in, banks + entry out
    commit = 2 * state_row
    return LAYERS * rows * (verify + commit), LAYERS * rows * verify, LAYERS * rows * commit


def make_inputs(rows, n, dtype, seed=0):
    rng = np.random.default_rng(seed)
    state = oc.init_state(LAYERS, rows, DIM, n, dtype)
    kv = jnp.asarray(rng.normal(size=(LAYERS, rows, n, 2 * DIM)).astype(np.float32))
    ape = jnp.asarray(rng.normal(size=(LAYERS, BLOCK, DIM)).astype(np.float32))
    seq = jnp.asarray(1024 + rng.choice([1, 2, 63, 120, 126, 127], rows), jnp.int32)  # mostly partial blocks
    slots = jnp.arange(rows, dtype=jnp.int32)
    accept = jnp.asarray(rng.integers(1, n + 1, rows), jnp.int32)
    return state, kv, seq, slots, ape, accept


def build(kind, repeat):
    """A jitted step running ``kind`` ``repeat`` times, the state donated."""

    def step(state, kv, seq, slots, ape, accept):
        for _ in range(repeat):
            if kind == "fused":
                state, _, _ = oc.verify(state, kv, seq, slots, ape)
                state = oc.commit(state, seq, accept, slots)
            elif kind == "verify":
                state, _, _ = oc.verify(state, kv, seq, slots, ape)
            elif kind == "commit":
                state = oc.commit(state, seq, accept, slots)
            elif kind == "per_layer":
                for layer in range(LAYERS):
                    state, _, _ = oc.verify(
                        state, kv[layer : layer + 1], seq, slots, ape[layer : layer + 1], layer=layer
                    )
                for layer in range(LAYERS):
                    state = oc.commit(state, seq, accept, slots, layer=layer, num_layers=1)
            elif kind == "launch":  # two do-nothing launches: commit of a single padding row
                pad = jnp.full((1,), -1, jnp.int32)
                state = oc.commit(state, pad, pad, pad, num_layers=1)
                state = oc.commit(state, pad, pad, pad, num_layers=1)
        return (state,)

    return jax.jit(step, donate_argnums=0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--draft", type=int, nargs="+", default=[4])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    bandwidth = copy_bandwidth()
    print(f"device: {jax.devices()[0].device_kind}  copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    results = {"device": jax.devices()[0].device_kind, "copy_bandwidth": bandwidth, "rows": []}
    print(
        "dtype     N  batch | launch2 us | fused us  x_launch | verify us  commit us | fused GB/s  %copy",
        end="",
    )
    print(" | per-layer us")
    for dtype in args.dtypes:
        for n in args.draft:
            for rows in args.batches:
                t = {}
                for kind in ("launch", "fused", "verify", "commit", "per_layer"):
                    repeat = max(1, args.repeat // 4) if kind == "per_layer" else args.repeat  # 40 calls each
                    fn = build(kind, repeat)
                    t[kind] = timed(fn, *make_inputs(rows, n, jnp.dtype(dtype))) / repeat
                total, verify_bytes, commit_bytes = step_bytes(rows, n, jnp.dtype(dtype).itemsize)
                row = {
                    "dtype": dtype,
                    "draft": n,
                    "batch": rows,
                    "launch2_us": t["launch"] * 1e6,
                    "fused_us": t["fused"] * 1e6,
                    "verify_us": t["verify"] * 1e6,
                    "commit_us": t["commit"] * 1e6,
                    "per_layer_us": t["per_layer"] * 1e6,
                    "bytes": total,
                    "fused_bandwidth": total / t["fused"],
                    "verify_bandwidth": verify_bytes / t["verify"],
                    "commit_bandwidth": commit_bytes / t["commit"],
                }
                results["rows"].append(row)
                x_launch = row["fused_us"] / (row["launch2_us"] / 2)
                pct_copy = 100 * row["fused_bandwidth"] / bandwidth
                print(
                    f"{dtype:8s} {n:2d} {rows:6d} | {row['launch2_us']:10.2f} | {row['fused_us']:8.2f} "
                    f"{x_launch:8.2f} | {row['verify_us']:9.2f} {row['commit_us']:10.2f} "
                    f"| {row['fused_bandwidth'] / 1e9:10.0f} {pct_copy:5.0f}% "
                    f"| {row['per_layer_us']:12.2f}"
                )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
