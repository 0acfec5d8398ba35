"""The FP8 linear layers of DeepSeek-V4-Flash as released, one layer's worth: the model's layer
(``linear.linear``: on CUDA at decode sizes the quantized grouped matmul op or the Pallas kernel, as
``linear.LINEAR_KERNEL_ROWS``'s rule picks) against the op for every weight (``linear.linear_op``), the
Pallas kernel for every weight (``linear.linear_pallas``) and XLA's matmul of the weight dequantized whole
(``functional.linear_jnp``), by the kernels' time on the device.

The layers (``ModelConfig.deepseek_v4_flash``): the attention's q_a (1024 x 4096), q_b (32768 x 1024), kv
(512 x 4096), o_a (8 groups of 1024 x 4096) and o_b (4096 x 8192); the CSA indexer's q_b (8192 x 1024); the
shared expert's gate, up (2048 x 4096) and down (4096 x 2048); each an FP8 weight (e4m3 codes, e8m0 128 x 128
block scales kept per row, :func:`bench_models.random_quantized`) in a bfloat16 model, on ``tokens`` rows.

Per (tokens, layer), each way (:data:`WAYS`), the summed duration of its kernels per call (jax's profiler,
``bench_ops.device_kernels``, over ``--calls`` calls; the op's split of K counts its combine kernel), against
the floor: the weight's codes and scales over the device's copy bandwidth (``bench_ops.copy_bandwidth``); the
op's parts of K (``quant_gmm.splits``); and the sum over the layers (a CSA layer's projections). ``--sweep``
also times the Pallas kernel at each tiling of :data:`SWEEP` and gives the fastest (``linear.LINEAR_BLOCKS``
is chosen so). Off GPUs the op is its CPU handler and the Pallas kernel runs in interpret mode.

Usage: ``python bench/bench_linear.py [--tokens 8 64 256] [--sweep] [--out bench/results/bench_linear.json]``
CPU smoke test: ``python bench/bench_linear.py --tokens 2 --copy-mib 64 --calls 1 --out /tmp/bl.json``
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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_models import random_quantized
from bench_ops import copy_bandwidth, device_kernels

from jax_oc128.nn import ModelConfig, grouped_matmul, linear, quant_gmm
from jax_oc128.nn.functional import linear_jnp
from jax_oc128.nn.quant import FP8

DEFAULT_OUT = pathlib.Path(__file__).resolve().parent / "results" / "bench_linear.json"


def v4_flash_layers(c: ModelConfig) -> dict[str, tuple[int, int, int | None]]:
    """The FP8 linear layers of one CSA layer of ``c``: name -> (out, in, groups)."""
    heads = c.num_heads * c.head_dim
    return {
        "q_a": (c.q_lora_rank, c.hidden_size, None),
        "q_b": (heads, c.q_lora_rank, None),
        "kv": (c.head_dim, c.hidden_size, None),
        "o_a": (c.o_groups * c.o_lora_rank, heads // c.o_groups, c.o_groups),
        "o_b": (c.hidden_size, c.o_groups * c.o_lora_rank, None),
        "indexer q_b": (c.index_n_heads * c.index_head_dim, c.q_lora_rank, None),
        "shared gate": (c.mlp_hidden, c.hidden_size, None),
        "shared up": (c.mlp_hidden, c.hidden_size, None),
        "shared down": (c.hidden_size, c.mlp_hidden, None),
    }


def kernels_us(fn, args, calls: int) -> float:
    """The summed kernel microseconds per call of ``fn(*args)`` (compiled first)."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready([fn(*args) for _ in range(calls)])
        return device_kernels(trace_dir, calls)[1]


#: the ways each layer is timed: the model's layer, the op and the Pallas kernel whatever the weight's size
#: (off GPUs: the op's CPU handler, the kernel in interpret mode), the weight dequantized whole by XLA
WAYS = {
    "layer_us": linear.linear,
    "op_us": linear.linear_op,
    "pallas_us": linear.linear_pallas,
    "dequantized_us": linear_jnp,
}
#: ``--sweep``'s tilings of the Pallas kernel: columns per program, reduction step, the operands' order
SWEEP = [
    grouped_matmul.Blocks(n, k, 4, 3, swap)
    for n, k, swap in itertools.product((16, 32, 64, 128), (128, 256), (False, True))
]


def print_row(row: dict) -> None:
    """A row of the table: the floor and the op's parts of K, then each way's time and its ratio to the floor;
    the sweep's best."""
    cells = [str(row["tokens"]), row["name"], f"{row['floor_us']:.1f}", str(row.get("splits", ""))]
    for way in WAYS:
        cells += [f"{row[way]:.1f}", f"{row[way] / row['floor_us']:.2f}"]
    if "sweep" in row:
        cells += ["; ".join(f"{us:.1f} {','.join(map(str, blocks))}" for us, blocks in row["sweep"][:3])]
    print(f"| {' | '.join(cells)} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--calls", type=int, default=10, help="calls per trace")
    parser.add_argument("--copy-mib", type=int, default=2048, help="the copy bandwidth's array (MiB)")
    parser.add_argument("--sweep", action="store_true", help="also time the kernel at each tiling of SWEEP")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args()

    bandwidth = copy_bandwidth(10, args.copy_mib)
    device = jax.devices()[0].device_kind
    print(f"device: {device}, jax {jax.__version__}, copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    header = ["tokens", "layer", "floor us", "op parts of K"]
    for way in WAYS:
        header += [way.removesuffix("_us").replace("_", " ") + " us", "x floor"]
    header += ["the sweep's fastest (us n,k,warps,stages,swap)"] if args.sweep else []
    print(f"| {' | '.join(header)} |\n" + "|---" * len(header) + "|")
    ways = dict(
        WAYS, pallas_us=functools.partial(WAYS["pallas_us"], interpret=jax.default_backend() != "gpu")
    )
    rows, key = [], jax.random.key(0)
    for tokens in args.tokens:
        total = dict(tokens=tokens, name="all", floor_us=0.0, **dict.fromkeys(ways, 0.0))
        for name, (out, width, groups) in v4_flash_layers(ModelConfig.deepseek_v4_flash()).items():
            weight = random_quantized(key, fmt=FP8, shape=(out, width), dtype="bfloat16")
            x = jax.random.normal(key, (tokens, *([groups] if groups else []), width), jnp.float32)
            splits = quant_gmm.splits(FP8, out // (groups or 1), width, groups or 1, False)
            row = dict(tokens=tokens, name=name, splits=splits)
            row["floor_us"] = (weight.codes.nbytes + weight.scales.nbytes) / bandwidth * 1e6
            for way, fn in ways.items():
                row[way] = kernels_us(jax.jit(functools.partial(fn, groups=groups)), (x, weight), args.calls)
            if args.sweep:
                kernel = functools.partial(ways["pallas_us"], groups=groups)
                tiled = [(jax.jit(functools.partial(kernel, blocks=b)), b) for b in SWEEP]
                row["sweep"] = sorted((kernels_us(fn, (x, weight), args.calls), b) for fn, b in tiled)
            rows.append(row)
            for k in ("floor_us", *ways):
                total[k] += row[k]
            print_row(row)
        rows.append(total)
        print_row(total)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            dict(bench="linear", device=device, jax=jax.__version__, bandwidth=bandwidth, rows=rows), indent=1
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
