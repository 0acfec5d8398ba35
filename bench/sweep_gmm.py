"""The Pallas grouped matmul's tilings at DeepSeek-V4-Flash's expert shapes, each against its floor.

For each weight format (``--formats``: ``bfloat16`` experts, ``fp4`` packed e2m1 codes with e8m0 scales as the
released checkpoints hold them), each ``--tokens`` (top-6 of 256 experts, random routing) and each of the two
matmuls of an expert (gate/up ``[4096, 4096]``, gated as the layer runs it; down ``[4096, 2048]``), times
:func:`jax_oc128.nn.grouped_matmul.gmm_pallas` under each tiling of ``--blocks`` (``n,k,warps,stages``; ``k``
counts stored columns: FP4 bytes; ``,swap``: the weights the left operand) and prints the ms per call against
the floor: the larger of the picked experts' bytes (in their format) over the copy bandwidth measured in the
same run and their FLOPs at ``--tflops``. Two times per cell: ``ms``, a call timed by the host (the median of
``--iters``, each waited for: the dispatch included, ~0.25 ms on the H200, which is most of a call at decode
sizes), and ``device_ms``, the kernels' own time per call on a GPU (jax's profiler over ``--iters`` calls,
:func:`bench_ops.device_kernels`: what the kernel costs inside a model's step, where nothing waits between
layers); the best tiling is the one of least device time where there is one. A tiling Triton cannot compile
(shared memory) is reported as failed. The defaults the kernel takes (``grouped_matmul.DEFAULT_BLOCKS``) come
from this sweep.

Usage (H200): python bench/sweep_gmm.py --out bench/results/sweep_gmm.json
Profile (H200; ``--once``: each cell called once, untimed): ncu -k regex:kernel --section SpeedOfLight
    python bench/sweep_gmm.py --formats fp4 --tokens 8 --blocks 128,64,4,3 --once --out /tmp/sweep_gmm.json
CPU smoke test (interpret mode): python bench/sweep_gmm.py --tokens 8 --experts 8 --hidden 64
    --intermediate 32 --blocks 16,16,4,3 --iters 1 --copy-mib 8 --interpret --out /tmp/sweep_gmm.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import pathlib
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_models import random_quantized
from bench_moe import V4_FLASH_MOE, bytes_per_expert, parse_blocks
from bench_ops import copy_bandwidth, device_kernels, timed

from jax_oc128.nn import grouped_matmul, quant

DEFAULT_BLOCKS = [
    "128,64,4,3",
    "128,128,4,3",
    "64,128,4,3",
    "64,256,4,3",
    "128,256,4,3",
    "128,128,8,3",
    "128,64,8,4",
    "256,64,8,3",
    "64,64,4,4",
    "32,128,4,3",
]


def tiling_name(blocks: grouped_matmul.Blocks) -> str:
    return ",".join(map(str, blocks[:4])) + (",swap" if blocks.swap else "")


def expert_weights(key, fmt: str, shape):
    """Random experts ``[experts, N, K]``: bfloat16 values, or FP4 codes and e8m0 scales."""
    if fmt == "bfloat16":
        return (jax.random.normal(key, shape, jnp.float32) / 64).astype(jnp.bfloat16)
    return random_quantized(key, fmt=quant.FP4, shape=shape, dtype="bfloat16")


def gmm(block_rows, blocks, gated, interpret, x, weights, rows, row_pairs, tile_expert):
    """:func:`~jax_oc128.nn.grouped_matmul.gmm_pallas` of the layout ``(rows, row_pairs, tile_expert)``
    (``block_rows``, ``blocks``, ``gated`` and ``interpret`` static; gated as the MoE layer runs its
    gate/up projection, with V4-Flash's SwiGLU limit)."""
    groups = grouped_matmul.Groups(rows, row_pairs, tile_expert, block_rows)
    limit = V4_FLASH_MOE.swiglu_limit
    return grouped_matmul.gmm_pallas(
        x, weights, groups, gated=gated, limit=limit, blocks=blocks, interpret=interpret
    )


def device_ms(compiled, operands, calls: int) -> float | None:
    """The summed time of the GPU kernels of one call of ``compiled(*operands)`` in ms, from jax's profiler
    over ``calls`` calls; None where no GPU kernel ran (the CPU)."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready([compiled(*operands) for _ in range(calls)])
        busy_us = device_kernels(trace_dir, calls)[1]
    return busy_us / 1e3 if busy_us else None


def cell_text(tiling: str, value, on_device: float | None, floor_ms: float) -> str:
    """A cell of the printed table: the tiling's host-timed and device ms (x the floor), or its failure."""
    if not isinstance(value, float):
        return f"{tiling}: {value.split(':')[0]}"
    device = f" device {on_device:.3f} ({on_device / floor_ms:.2f}x)" if on_device else ""
    return f"{tiling}: call {value:.3f} ({value / floor_ms:.2f}x){device}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", choices=["bfloat16", "fp4"], default=["bfloat16", "fp4"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 64, 512, 8192])
    parser.add_argument("--blocks", nargs="+", default=DEFAULT_BLOCKS, help="n,k,warps,stages[,swap] each")
    parser.add_argument(
        "--block-rows",
        type=int,
        nargs="+",
        default=[None],
        help="rows per tile, each in turn (default: the MoE layer's)",
    )
    parser.add_argument("--experts", type=int, default=V4_FLASH_MOE.num_experts)
    parser.add_argument("--hidden", type=int, default=V4_FLASH_MOE.hidden_size)
    parser.add_argument("--intermediate", type=int, default=V4_FLASH_MOE.intermediate_size)
    parser.add_argument("--top-k", type=int, default=V4_FLASH_MOE.num_experts_per_tok)
    parser.add_argument("--tflops", type=float, default=790.0)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--copy-mib", type=int, default=2048)
    parser.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU smoke test)")
    parser.add_argument("--once", action="store_true", help="call each cell once, untimed (under a profiler)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    tilings = [parse_blocks(b) for b in args.blocks]
    bandwidth = copy_bandwidth(10, args.copy_mib)
    shapes = {
        "gate_up": (args.experts, 2 * args.intermediate, args.hidden),
        "down": (args.experts, args.hidden, args.intermediate),
    }
    print(f"device {jax.devices()[0].device_kind}, copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print("ms per call, timed by the host and on the device (x the floor); tilings n,k,warps,stages")
    results = dict(copy_bandwidth=bandwidth, tflops=args.tflops, rows=[])
    out = pathlib.Path(args.out)
    for fmt in args.formats:
        for name, shape in shapes.items():
            weights = expert_weights(jax.random.key(len(name)), fmt, shape)
            for tokens, block_rows in itertools.product(args.tokens, args.block_rows):
                key = jax.random.key(tokens)
                # random picks (a token's may repeat: the layout takes any ids)
                ids = jax.random.randint(key, (tokens, args.top_k), 0, args.experts)
                # block_rows None: the MoE layer's for these weights
                groups = grouped_matmul.group_pairs(ids, args.experts, block_rows, weights=weights)
                distinct = len(np.unique(np.asarray(ids)))
                x = jax.random.normal(key, (groups.num_rows, shape[2]), jnp.float32).astype(jnp.bfloat16)
                read = distinct * bytes_per_expert(weights)
                flops = 2 * tokens * args.top_k * shape[1] * shape[2]
                floor_ms = 1e3 * max(read / bandwidth, flops / (args.tflops * 1e12))
                cells, device_cells = {}, {}
                for blocks in tilings:
                    gated = name == "gate_up"
                    call = jax.jit(functools.partial(gmm, groups.block_rows, blocks, gated, args.interpret))
                    operands = (x, weights, *groups[:3])
                    try:
                        compiled = call.lower(*operands).compile()
                        if args.once:
                            jax.block_until_ready(compiled(*operands))
                            cells[tiling_name(blocks)] = "called once"
                            continue
                        ms = 1e3 * timed(lambda _, c, f=compiled: f(*c), None, operands, args.iters)[0]
                        cells[tiling_name(blocks)] = ms
                        on_device = device_ms(compiled, operands, args.iters)
                        if on_device is not None:
                            device_cells[tiling_name(blocks)] = on_device
                    except Exception as error:  # a tiling past the shared memory: recorded, the sweep goes on
                        failure = f"failed: {type(error).__name__}: {str(error)[:200]}"
                        cells[tiling_name(blocks)] = failure
                row = dict(fmt=fmt, matrix=name, tokens=tokens, distinct=distinct)
                row.update(block_rows=groups.block_rows)
                row.update(floor_ms=floor_ms, bytes=read, flops=flops, ms=cells, device_ms=device_cells)
                results["rows"].append(row)
                out.write_text(json.dumps(results, indent=1) + "\n")
                timed_cells = device_cells or {b: v for b, v in cells.items() if isinstance(v, float)}
                best = min(timed_cells, key=timed_cells.get) if timed_cells else None
                text = "  ".join(cell_text(b, v, device_cells.get(b), floor_ms) for b, v in cells.items())
                print(
                    f"{fmt:8s} {name:7s} tokens {tokens:5d} experts {distinct:3d} "
                    f"rows/tile {groups.block_rows:3d} "
                    f"floor {floor_ms:.3f} | best {best} | {text}",
                    flush=True,
                )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
