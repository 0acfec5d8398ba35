"""Benchmark verify + commit for all C128 layers at DeepSeek-V4-Flash shapes (20 layers, head_dim 512).

Per speculative step a server runs one verify (all layers, one launch) and one commit (all layers, one
launch). This script times both inside one jit-compiled executable with the state donated, unrolled
``--repeat`` times so that host dispatch is amortised, and reports against two floors:

* launch floor: the same executable with do-nothing launches (commits of one padding row), i.e. what
  one kernel launch costs in this setting;
* bandwidth floor: bytes the step must move / the copy bandwidth of the device (read + write of a
  large array, measured here).

Steps timed: ``ops`` (verify + commit ops), ``lazy_step`` and ``eager_step`` (the controller's two
paths, with its pending-table updates), ``verify`` and ``commit`` alone, and ``per_layer`` (one verify and
one commit launch per layer, as SGLang does) for comparison.
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
from jax_oc128.controller import Controller, ForwardMode
from jax_oc128.state import CompressState

CONTROLLER = Controller()

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
    """Bytes one verify + commit must move for all layers (ape is shared by all rows and not counted):
    verify reads bank 0 and the tokens and writes N banks and the entry; commit copies one slot's row."""
    state_row = 3 * DIM * dtype_bytes
    verify = state_row + n * 2 * DIM * 4 + n * state_row + DIM * 4
    return LAYERS * rows * (verify + 2 * state_row)


def make_inputs(rows, n, dtype, seed=0):
    rng = np.random.default_rng(seed)
    state = oc.init_state(LAYERS, rows, DIM, n, dtype)
    kv = jnp.asarray(rng.normal(size=(LAYERS, rows, n, 2 * DIM)).astype(np.float32))
    ape = jnp.asarray(rng.normal(size=(LAYERS, BLOCK, DIM)).astype(np.float32))
    seq = jnp.asarray(1024 + rng.choice([1, 2, 63, 120, 126, 127], rows), jnp.int32)  # mostly partial blocks
    slots = jnp.arange(rows, dtype=jnp.int32)
    accept = jnp.asarray(rng.integers(1, n + 1, rows), jnp.int32)
    return state, kv, seq, slots, ape, accept


def _ops_step(state, kv, seq, slots, ape, accept):
    state, _, _ = oc.verify(state, kv, seq, slots, ape)
    return oc.commit(state, seq, accept, slots), seq + accept


def _per_layer_step(state, kv, seq, slots, ape, accept):
    for layer in range(LAYERS):
        state, _, _ = oc.verify(state, kv[layer : layer + 1], seq, slots, ape[layer : layer + 1], layer=layer)
    for layer in range(LAYERS):
        state = oc.commit(state, seq, accept, slots, layer=layer, num_layers=1)
    return state, seq + accept


def _lazy_step(cs, kv, seq, slots, ape, accept):
    """Controller, lazy path: prepare_forward commits the previous verify, then write_prefix."""
    cs = CONTROLLER.prepare_forward(cs, ForwardMode.TARGET_VERIFY, slots, seq)
    return CONTROLLER.write_prefix(cs, kv, seq, slots, ape)[0], seq + accept


def _eager_step(cs, kv, seq, slots, ape, accept):
    """Controller, eager path: write_prefix, then commit once acceptance is known."""
    cs = CONTROLLER.write_prefix(cs, kv, seq, slots, ape)[0]
    return CONTROLLER.commit(cs, slots, seq, accept), seq + accept


def _launch_step(state, kv, seq, slots, ape, accept):
    """Two do-nothing launches: commits of a single padding row."""
    pad = jnp.full((1,), -1, jnp.int32)
    for _ in range(2):
        state = oc.commit(state, pad, pad, pad, num_layers=1)
    return state, seq


STEPS = {
    "launch2": _launch_step,
    "ops": _ops_step,
    "verify": lambda state, kv, seq, slots, ape, accept: (oc.verify(state, kv, seq, slots, ape)[0], seq),
    "commit": lambda state, kv, seq, slots, ape, accept: (oc.commit(state, seq, accept, slots), seq),
    "per_layer": _per_layer_step,
    "lazy_step": _lazy_step,
    "eager_step": _eager_step,
}


def build(kind, repeat):
    """A jitted function running step ``kind`` ``repeat`` times (positions advancing), the state donated."""

    def run(state, kv, seq, slots, ape, accept):
        for _ in range(repeat):
            state, seq = STEPS[kind](state, kv, seq, slots, ape, accept)
        return (state,)

    return jax.jit(run, donate_argnums=0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--draft", type=int, nargs="+", default=[4])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    bandwidth = copy_bandwidth()
    device = jax.devices()[0].device_kind
    print(f"device: {device}  copy bandwidth {bandwidth / 1e12:.2f} TB/s  (us per step, all {LAYERS} layers)")
    print(
        "dtype     N batch | launch |  ops  x_launch | lazy   x_launch | eager  x_launch | verify commit |",
        end="",
    )
    print(" ops GB/s %copy | per-layer")
    results = {"device": device, "copy_bandwidth": bandwidth, "layers": LAYERS, "head_dim": DIM, "rows": []}
    for dtype in args.dtypes:
        for n in args.draft:
            for rows in args.batches:
                us = {}
                for kind in STEPS:
                    repeat = max(1, args.repeat // 4) if kind == "per_layer" else args.repeat  # 40 calls each
                    state, *inputs = make_inputs(rows, n, jnp.dtype(dtype))
                    if kind.endswith("_step"):
                        state = CompressState.create(LAYERS, rows, DIM, n, dtype).replace(state=state)
                    us[kind] = timed(build(kind, repeat), state, *inputs) / repeat * 1e6
                launch = us["launch2"] / 2
                total = step_bytes(rows, n, jnp.dtype(dtype).itemsize)
                row = dict(
                    dtype=dtype,
                    draft=n,
                    batch=rows,
                    launch_us=launch,
                    bytes=total,
                    **{f"{k}_us": v for k, v in us.items()},
                )
                row["ops_bandwidth"] = total / (us["ops"] * 1e-6)
                results["rows"].append(row)
                ratio = {k: v / launch for k, v in us.items()}
                print(
                    f"{dtype:8s} {n:2d} {rows:5d} | {launch:6.2f} | {us['ops']:6.1f} {ratio['ops']:5.2f} | "
                    f"{us['lazy_step']:6.1f} {ratio['lazy_step']:5.2f} | {us['eager_step']:6.1f} "
                    f"{ratio['eager_step']:5.2f} | {us['verify']:6.1f} {us['commit']:6.1f} | "
                    f"{row['ops_bandwidth'] / 1e9:8.0f} {100 * row['ops_bandwidth'] / bandwidth:4.0f}% | "
                    f"{us['per_layer']:8.1f}"
                )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
