"""One MoE layer at DeepSeek-V4-Flash's shapes, per dispatch, against its floor.

The layer is :class:`jax_oc128.nn.moe.MoE` (router, top-k routing, routed experts, shared expert, SwiGLU
limit) at DeepSeek-V4-Flash's shapes (hidden 4096, 256 routed experts of 2048, top-6, one shared expert,
bfloat16; :data:`V4_FLASH_MOE`, from :meth:`ModelConfig.deepseek_v4_flash`) on random weights and
activations, for each ``--tokens`` and each dispatch (``--dispatches``, names of
:data:`jax_oc128.nn.moe.DISPATCHES`): ``dense`` (every expert on every token), ``grouped_jnp`` (the grouped
layout, a jnp loop over tiles), ``grouped_pallas`` (the Pallas kernel), ``grouped_ragged_dot`` (XLA's ragged
dot on the same layout), ``grouped_quant_op`` (quantized experts: the native op, its CUDA kernel on GPUs).
``grouped`` (the default dispatch) is ``grouped_pallas`` on CUDA (FP4 experts at decode sizes: the op),
``grouped_jnp`` elsewhere. ``dense`` and ``grouped_ragged_dot`` (which XLA lowers on GPUs as a dense masked
matmul) hold O(tokens x experts) intermediates: they are skipped above ``--dense-max-tokens``.

``--experts-format fp4`` or ``fp8`` makes the routed experts quantized
(:class:`~jax_oc128.nn.quant.QuantizedArray`, e8m0 scales, as the released checkpoints hold them; random
codes and exponents, ``bench_models.random_quantized``): FP4 packed e2m1 codes (half a byte a parameter plus
a scale per 32), FP8 e4m3 codes (a byte plus a scale per 128 of a row); ``--dtype`` is then the dtype they
are dequantized to.
``grouped_pallas`` dequantizes each weight tile in registers, ``grouped_jnp`` one picked expert per tile,
``dense`` and ``grouped_ragged_dot`` every expert.

Floor: the larger of the bytes the layer must read (the distinct experts the tokens picked, in their format:
codes and scales when quantized; the shared expert, the router) over the device's copy bandwidth (measured in
the same run, bench_ops.copy_bandwidth) and the FLOPs of the picked experts and the shared expert at
``--tflops`` (790: the H200's dense bf16 peak).

Timing as in bench_ops.py: each (tokens, dispatch) executable compiled once, then ``--rounds`` rounds with
the dispatches interleaved, each round the median of ``--iters`` calls; the table gives the median over
rounds, the JSON every round's.

``--loop R`` also times each (tokens, dispatch) as a decode loop runs a layer: R calls inside one
``lax.fori_loop`` (one CUDA graph on a GPU, no host between the calls), each call's input the previous
one's plus 1e-6 times its output (so no call can be hoisted out of the loop; the routing stays that of the
first), per call the slope between the loops of R and of 1 calls (``loop`` columns of the JSON, a line
per tokens).

``--profile DIR`` also traces ``--profile-calls`` calls of each (tokens, dispatch) with jax's profiler (the
traces under DIR) and reports the device's side of a call: the span from its first kernel's start to its
last kernel's end, the kernels' summed time and each kernel's (:func:`device_kernels`), so that what a call
spends around its matmuls (launches, gaps, the small kernels) is seen apart from the host's dispatch, which
the timing above includes.

Usage (H200): python bench/bench_moe.py --out bench/results/bench_moe.json
FP4 experts (H200): python bench/bench_moe.py --experts-format fp4 --tokens 1 8 64 512 \\
    --dispatches grouped_jnp grouped_pallas --out bench/results/bench_moe_fp4.json
CPU smoke test: python bench/bench_moe.py --tokens 1 8 --experts 8 --hidden 64 --intermediate 32 --top-k 2 \\
    --iters 2 --rounds 1 --copy-mib 8 --out /tmp/bench_moe.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_models import random_quantized
from bench_ops import copy_bandwidth, device_kernels, timed

from jax_oc128.nn import ModelConfig, grouped_matmul, quant
from jax_oc128.nn.moe import DISPATCHES, MOE, MoE, MoEConfig

DEFAULT_OUT = pathlib.Path(__file__).resolve().parent / "results" / "bench_moe.json"
DEFAULT_DISPATCHES = ("dense", "grouped_jnp", "grouped_pallas", "grouped_ragged_dot")
#: DeepSeek-V4-Flash's MoE layer (its preset's first top-k routed layer), in bfloat16
V4_FLASH = ModelConfig.deepseek_v4_flash(dtype="bfloat16")
V4_FLASH_MOE = V4_FLASH.moe(V4_FLASH.mlp_layer_types.index(MOE))


def bytes_per_expert(*weights) -> int:
    """Bytes of one expert's share of the stacked ``[experts, ...]`` ``weights`` (a quantized one's codes and
    scales)."""
    return sum(leaf.nbytes // leaf.shape[0] for leaf in jax.tree.leaves(weights))


def parse_blocks(text: str) -> grouped_matmul.Blocks:
    """A tiling of :func:`~jax_oc128.nn.grouped_matmul.gmm_pallas`: ``n,k,warps,stages[,swap]``."""
    n, k, warps, stages, *swap = text.split(",")
    if swap not in ([], ["swap"]):
        raise ValueError(f"--blocks: n,k,warps,stages[,swap], got {text!r}")
    return grouped_matmul.Blocks(int(n), int(k), int(warps), int(stages), swap=bool(swap))


def floor_seconds(
    config: MoEConfig, expert_bytes: int, distinct: int, tokens: int, bandwidth: float, flops_per_s: float
):
    """``(floor, bytes, flops)`` of one layer call: ``distinct`` experts (``expert_bytes`` each) picked by
    ``tokens`` tokens."""
    expert = 3 * config.intermediate_size * config.hidden_size  # gate, up and down, elements
    itemsize = jnp.dtype(config.dtype).itemsize
    read = distinct * expert_bytes + (expert + config.num_experts * config.hidden_size) * itemsize
    flops = 2 * tokens * (config.num_experts_per_tok + 1) * expert
    return max(read / bandwidth, flops / flops_per_s), read, flops


def in_loop(graphdef, state, x, ids, *, calls: int):
    """``calls`` calls of the layer in one ``fori_loop``, each on the previous input plus 1e-6 times its
    output (a dependence, so that XLA runs every call; the routing stays the first input's)."""
    layer = nnx.merge(graphdef, state)
    return jax.lax.fori_loop(0, calls, lambda _, x: x + 1e-6 * layer(x, ids), x)


def loop_name(dispatch: str, calls: int) -> str:
    """The name of ``dispatch``'s loop of ``calls`` calls (:func:`in_loop`) in a row's ``round_ms``."""
    return f"{dispatch} in a loop of {calls}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 2048, 8192])
    parser.add_argument(
        "--dispatches", nargs="+", choices=sorted(DISPATCHES), default=list(DEFAULT_DISPATCHES)
    )
    parser.add_argument("--experts", type=int, default=V4_FLASH_MOE.num_experts)
    parser.add_argument("--hidden", type=int, default=V4_FLASH_MOE.hidden_size)
    parser.add_argument("--intermediate", type=int, default=V4_FLASH_MOE.intermediate_size)
    parser.add_argument("--top-k", type=int, default=V4_FLASH_MOE.num_experts_per_tok)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=V4_FLASH_MOE.dtype)
    parser.add_argument(
        "--experts-format",
        choices=["float", quant.FP8, quant.FP4],
        default="float",
        help="the routed experts'",
    )
    parser.add_argument("--dense-max-tokens", type=int, default=2048, help="dense and ragged_dot: at most")
    parser.add_argument("--tflops", type=float, default=790.0, help="the FLOPs floor's rate (TFLOP/s)")
    parser.add_argument("--iters", type=int, default=10, help="timed calls per round (median)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the dispatches interleaved (median)")
    parser.add_argument("--bandwidth-iters", type=int, default=20)
    parser.add_argument("--copy-mib", type=int, default=2048, help="the copy bandwidth's array (MiB)")
    parser.add_argument(
        "--blocks",
        nargs="+",
        metavar="ROWS:TILING",
        help="the Pallas kernel's tilings (n,k,warps,stages[,swap]) of the experts' format for tiles of at "
        "least ROWS rows, each replacing grouped_matmul.DEFAULT_BLOCKS' entry of ROWS for this run",
    )
    parser.add_argument(
        "--loop", type=int, default=0, help="R: also time R calls in one fori_loop (the slope from 1)"
    )
    parser.add_argument(
        "--profile", help="a directory: trace each (tokens, dispatch) there and report its kernels"
    )
    parser.add_argument("--profile-calls", type=int, default=5, help="calls per trace")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args()
    config = dataclasses.replace(
        V4_FLASH_MOE,
        num_experts=args.experts,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_experts_per_tok=args.top_k,
        dtype=args.dtype,
    )

    fmt = args.dtype if args.experts_format == "float" else args.experts_format
    for entry in args.blocks or ():  # the kernel's table of tilings, for this run
        rows, text = entry.split(":")
        grouped_matmul.DEFAULT_BLOCKS[fmt, int(rows)] = parse_blocks(text)
    device = jax.devices()[0].device_kind
    bandwidth = copy_bandwidth(args.bandwidth_iters, args.copy_mib)
    layer = MoE(config, rngs=nnx.Rngs(0))
    if args.experts_format != "float":
        weights = (layer.experts_gate_up, layer.experts_down)
        for key, weight in zip(jax.random.split(jax.random.key(1)), weights, strict=True):
            value = random_quantized(key, fmt=args.experts_format, shape=weight.shape, dtype=config.dtype)
            weight.set_value(value)
    state = nnx.state(layer)
    expert_bytes = bytes_per_expert(layer.experts_gate_up[...], layer.experts_down[...])
    print(f"device: {device}, copy bandwidth {bandwidth / 1e9:.0f} GB/s, {config}")
    print(f"routed experts: {args.experts_format}, {expert_bytes / 2**20:.2f} MiB each")
    print("ms per MoE layer call (x the floor)")
    print("tokens experts | " + " | ".join(f"{d:>20s}" for d in args.dispatches) + " |    floor")
    results = dict(device=device, copy_bandwidth=bandwidth, config=dataclasses.asdict(config), rows=[])
    results.update(experts_format=args.experts_format, expert_bytes=expert_bytes)
    results.update(iters=args.iters, rounds=args.rounds, tflops=args.tflops, blocks=args.blocks)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for tokens in args.tokens:
        key = jax.random.key(tokens)
        x = jax.random.normal(key, (1, tokens, config.hidden_size), jnp.float32)
        token_ids = jax.random.randint(key, (1, tokens), 0, config.vocab_size)
        distinct = len(np.unique(np.asarray(layer.route(x, token_ids)[0])))
        runs, loops, notes = {}, {}, {}  # loops: per dispatch, the loops of 1 and --loop calls
        for dispatch in args.dispatches:
            if dispatch in ("dense", "grouped_ragged_dot") and tokens > args.dense_max_tokens:
                notes[dispatch] = f"skipped: O(tokens x experts) above {args.dense_max_tokens} tokens"
                continue
            layer.config = dataclasses.replace(config, dispatch=dispatch)
            graphdef = nnx.graphdef(layer)
            try:
                call = jax.jit(lambda state, x, ids, g=graphdef: nnx.merge(g, state)(x, ids))
                compiled = call.lower(state, x, token_ids).compile()
                jax.block_until_ready(compiled(state, x, token_ids))  # its buffers fit
            except Exception as error:  # an out-of-memory or lowering failure is recorded, the run goes on
                notes[dispatch] = f"failed: {type(error).__name__}: {str(error)[:300]}"
                continue
            runs[dispatch] = lambda _, consts, compiled=compiled: compiled(*consts)
            for calls in (1, args.loop) if args.loop > 1 else ():
                looped = jax.jit(functools.partial(in_loop, graphdef, calls=calls))
                compiled = looped.lower(state, x, token_ids).compile()
                loops[loop_name(dispatch, calls)] = lambda _, consts, compiled=compiled: compiled(*consts)
        timed_runs = {**runs, **loops}
        seconds = {name: [] for name in timed_runs}
        for _ in range(args.rounds):
            for name, fn in timed_runs.items():
                seconds[name].append(timed(fn, None, (state, x, token_ids), args.iters)[0])
        all_ms = {name: float(np.median(s)) * 1e3 for name, s in seconds.items()}
        ms = {dispatch: all_ms[dispatch] for dispatch in runs}
        loop_ms = {
            d: (all_ms[loop_name(d, args.loop)] - all_ms[loop_name(d, 1)]) / (args.loop - 1)
            for d in runs
            if loop_name(d, 1) in loops
        }
        profiles = {}
        for dispatch, fn in runs.items() if args.profile else ():
            trace_dir = pathlib.Path(args.profile) / f"{tokens}_{dispatch}"
            with jax.profiler.trace(str(trace_dir)):
                jax.block_until_ready([fn(None, (state, x, token_ids)) for _ in range(args.profile_calls)])
            span, busy, by_kernel = device_kernels(trace_dir, args.profile_calls)
            profiles[dispatch] = dict(span_us=span, kernels_us=busy, by_kernel=by_kernel[:40])
        floor, read, flops = floor_seconds(
            config, expert_bytes, distinct, tokens, bandwidth, args.tflops * 1e12
        )
        floor_ms = floor * 1e3
        row = dict(tokens=tokens, distinct_experts=distinct, floor_ms=floor_ms, bytes=read, flops=flops)
        row.update(
            {f"{d}_ms": v for d, v in ms.items()}, **{f"{d}_x_floor": v / floor_ms for d, v in ms.items()}
        )
        row.update({f"{d}_loop_ms": v for d, v in loop_ms.items()})
        row.update({f"{d}_loop_x_floor": v / floor_ms for d, v in loop_ms.items()})
        row.update(round_ms={name: [t * 1e3 for t in s] for name, s in seconds.items()}, notes=notes)
        row.update(profiles=profiles)
        results["rows"].append(row)
        out.write_text(json.dumps(results, indent=1) + "\n")  # after every row: a later failure keeps these
        cells = " | ".join(
            f"{ms[d]:9.3f} ({ms[d] / floor_ms:6.2f}x)" if d in ms else f"{notes[d].split(':')[0]:>20s}"
            for d in args.dispatches
        )
        print(f"{tokens:6d} {distinct:7d} | {cells} | {floor_ms:8.3f}", flush=True)
        if loop_ms:
            cells = " | ".join(f"{loop_ms[d]:9.3f} ({loop_ms[d] / floor_ms:6.2f}x)" for d in loop_ms)
            print(f"{'in a loop of ' + str(args.loop):>14s} | {cells} |", flush=True)
        for dispatch, note in notes.items():
            print(f"{'':15s}{dispatch}: {note}")
        for dispatch, p in profiles.items():
            print(
                f"{'':15s}{dispatch} on the device, per call: span {p['span_us']:.1f} us "
                f"({p['span_us'] / 1e3 / floor_ms:.2f}x the floor), kernels {p['kernels_us']:.1f} us"
            )
            for name, us in p["by_kernel"][:15]:
                print(f"{'':17s}{us:9.1f} us  {name[:110]}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
