"""Probe (issue 42: the bf16 MoE at 8192 tokens <= 1.3x; the FP4 experts at prefill sizes at the tensor
cores' rate): jax's own Mosaic GPU ragged dot (`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`, wgmma +
TMA) against the project's Pallas (Triton) grouped matmul, bf16, at V4-Flash's expert
shapes: the (token, expert) rows of random top-6 routing over 256 experts, the gate/up projection (N 4096, K
4096) and the down projection (N 4096, K 2048). Kernel us by CUPTI (jax's mosaic profiler), TFLOP/s against
a dense bf16 matmul measured in the same run. A probe: its tilings are a small sweep, nothing here is the
project's code path."""

import functools
import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import profiler
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

from jax_oc128.nn import grouped_matmul

E, TOPK = 256, 6


def kernel_us(fn, *args):
    _, t = profiler.measure(fn, iterations=5)(*args)
    return float(np.median(t) if isinstance(t, list) else t) * 1e3


def main(tokens_list):
    key = jax.random.key(0)
    a = jax.random.normal(key, (8192, 4096), jnp.bfloat16)
    b = jax.random.normal(key, (4096, 4096), jnp.bfloat16)
    dense_us = kernel_us(jax.jit(lambda a, b: a @ b), a, b)
    peak = 2 * 8192 * 4096 * 4096 / dense_us / 1e6
    print(f"dense bf16 8192x4096x4096: {dense_us:.1f} us, {peak:.0f} TFLOP/s", flush=True)
    for tokens in tokens_list:
        ids = jax.random.randint(jax.random.key(tokens), (tokens, TOPK), 0, E)
        sizes = jnp.bincount(ids.reshape(-1), length=E).astype(jnp.int32)
        m = tokens * TOPK
        for name, n, k in (("gate_up", 4096, 4096), ("down", 4096, 2048)):
            w = (
                jax.random.normal(key, (E, n, k), jnp.bfloat16) * 0.02
            )  # [experts, N, K], the project's layout
            x = jax.random.normal(key, (m, k), jnp.bfloat16)
            flops = 2 * m * n * k
            floor = flops / peak / 1e6
            rows = {}
            best = (np.inf, None)
            for bm, bn, steps, gbn in itertools.product((64, 128), (128, 256), (3, 4), (1, 4)):
                fn = jax.jit(
                    functools.partial(
                        ragged_dot_mgpu.ragged_dot,
                        group_sizes=sizes,
                        block_m=bm,
                        block_n=bn,
                        block_k=64,
                        max_concurrent_steps=steps,
                        grid_block_n=gbn,
                        transpose_rhs=True,
                    )
                )
                try:
                    us = kernel_us(fn, x, w)
                except Exception as error:  # shared memory, a tiling it refuses
                    print(f"  mgpu {bm},{bn},{steps},{gbn}: {type(error).__name__} {str(error)[:120]}")
                    continue
                best = min(best, (us, (bm, bn, steps, gbn)))
            rows["mosaic ragged_dot (best)"] = best
            out = jax.jit(
                functools.partial(
                    ragged_dot_mgpu.ragged_dot,
                    group_sizes=sizes,
                    block_m=best[1][0],
                    block_n=best[1][1],
                    block_k=64,
                    max_concurrent_steps=best[1][2],
                    grid_block_n=best[1][3],
                    transpose_rhs=True,
                )
            )(x, w)
            # the first two experts' rows against float32 (XLA's ragged_dot expands to [experts, M, N])
            n0, n1 = int(sizes[0]), int(sizes[1])
            ref = jnp.concatenate(
                [
                    jnp.dot(x[:n0], w[0].T, preferred_element_type=jnp.float32),
                    jnp.dot(x[n0 : n0 + n1], w[1].T, preferred_element_type=jnp.float32),
                ]
            )
            got = out[: n0 + n1].astype(jnp.float32)
            err = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
            groups = grouped_matmul.group_pairs(ids, E, weights=w)
            padded = jax.random.normal(key, (groups.num_rows, k), jnp.bfloat16)
            rows["project Pallas gmm (padded layout)"] = (
                kernel_us(jax.jit(functools.partial(grouped_matmul.gmm_pallas, groups=groups)), padded, w),
                None,
            )
            print(
                f"tokens {tokens} {name} (M {m}, N {n}, K {k}): floor {floor:.1f} us; mosaic vs f32 ref "
                f"max rel err {err:.2e}",
                flush=True,
            )
            for what, (us, cfg) in rows.items():
                print(
                    f"  {what:40s} {us:9.1f} us  {us / floor:5.2f}x floor  {flops / us / 1e6:6.0f} TFLOP/s"
                    + (f"  tiling {cfg}" if cfg else ""),
                    flush=True,
                )
            del w


if __name__ == "__main__":
    main([int(t) for t in sys.argv[1:]] or [2048, 8192])
