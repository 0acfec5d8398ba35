"""The decode dispatch's compile at two max_len (issue 40; RESULTS section 33: the released slice's first
decode dispatch took 105 s at max_len 4096, and at 1048576 it had not ended when the run's time limit
came).

Builds the slice (`--layers`, `--experts`, DeepSeek's released precision laid out as
`bench_models.released_model` lays it: FP8 / FP4 QuantizedArrays) with shapes only (`build_abstract`: no
weight exists, nothing is allocated), then lowers and compiles the engine's decode dispatch
(`placement.decode` jitted as `Engine` jits it: the state donated, `loop_compiler_options` on a GPU) at
`--slots`, K = `--steps` plain steps, bounded by the context bucket of a dispatch whose rows reach
`--context` positions (the engine's floor, 256). Each (max_len, XLA options) runs in a fresh child process
(XLA's in-process autotuning results would otherwise carry over from one compile to the next). Per run it
prints the lowering and compile seconds, the StableHLO's size and counts (while loops, custom calls,
constants), its largest constant / iota, and the optimized program's instructions that do work of a size
that follows max_len (`bench/hlo_shapes.py`: a dimension of the decode state that max_len 1024 has not
and no parameter has; expected none on a GPU, whose XLA writes bfloat16 caches in place).

Run (the lead's GPU call, < 3 min on the H100 if a compile takes at most ~80 s):
  PYTHONPATH=$PWD python3 bench/results/2026-12-06/s7_decode_compile.py [--max-len 4096 1048576]
    [--xla-options '' xla_gpu_autotune_level=0]
`--xla-options`: per run, none ('') or comma-separated key=value compiler options added to the engine's.
"""

from __future__ import annotations

import argparse
import functools
import math
import re
import subprocess
import sys
import time
from collections import Counter

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, "bench")
import hlo_shapes
from bench_models import BACKENDS, slice_config

from jax_oc128 import pretrained
from jax_oc128.engine import placement
from jax_oc128.engine.arguments import MAX_STOP_TOKENS
from jax_oc128.engine.scheduler import loop_compiler_options
from jax_oc128.engine.state import init_state
from jax_oc128.engine.steps import bound
from jax_oc128.nn import RuntimeConfig, SpeculativeModel
from jax_oc128.nn.functional import build_abstract, variable_at
from jax_oc128.nn.quant import FP4

TENSOR = re.compile(r"(stablehlo\.(?:constant|iota)).*tensor<([0-9x]+)x[a-z0-9]+>")


def abstract_model(args, max_len: int):
    """The slice with every parameter a ShapeDtypeStruct (released: the quantized ones as the loader's
    abstract QuantizedArrays)."""
    config = slice_config(args.layers, args.experts)
    runtime = RuntimeConfig(max_len=max_len, max_draft=4)
    backend = BACKENDS[args.backend]
    model = build_abstract(lambda rngs: SpeculativeModel(config, runtime, backend=backend, rngs=rngs))
    if args.weights == "released":
        paths = pretrained.parameter_paths(model)
        for name, fmt in pretrained.released_formats(paths, FP4, optional=True).items():
            variable = variable_at(model, paths[name])
            want = variable.get_value()
            variable.set_value(pretrained.quantized_leaves(want, fmt, "F8_E8M0", config.dtype))
    return model


def state_layout(model, slots: int):
    return jax.eval_shape(functools.partial(init_state, model, slots, 0), 0)


def lower_decode(model, args, options: dict):
    """The engine's decode dispatch of ``model`` lowered from shapes alone, and its context bound."""
    graphdef, params = nnx.split(model)
    layout = state_layout(model, args.slots)
    decode = jax.jit(
        functools.partial(placement.decode, graphdef, placement.Placement(None, params, layout)),
        static_argnames=("steps", "tree", "context"),
        donate_argnames="state",
        compiler_options={**(loop_compiler_options(None) or {}), **options} or None,
    )
    stops = jax.ShapeDtypeStruct((MAX_STOP_TOKENS,), jnp.int32)
    waiting = jax.ShapeDtypeStruct((), jnp.bool_)
    context = bound(args.context, model.max_len, 256)
    return decode.lower(params, layout, stops, waiting, args.steps, None, context), context


def max_len_sizes(model, args) -> set[int]:
    """The dimensions of ``model``'s decode state that follow its max_len (those it has not at max_len
    1024), less any a parameter has (a dimension of the model's own: 8192 is V4-Flash's query width)."""

    def dims(tree):
        return {d for leaf in jax.tree.leaves(tree) for d in leaf.shape}

    small = state_layout(abstract_model(args, 1024), args.slots)
    return dims(state_layout(model, args.slots)) - dims(small) - dims(nnx.state(model))


def describe(text: str) -> str:
    """The StableHLO's size, its op counts and its largest constant / iota."""
    ops = Counter(re.findall(r"(stablehlo\.[a-z_]+|func\.call)", text))
    largest = max(
        ((math.prod(map(int, dims.split("x"))), op, dims) for op, dims in TENSOR.findall(text)), default=None
    )
    return (
        f"  stablehlo {len(text) / 1e6:.2f} MB, {text.count(chr(10))} lines: while {ops['stablehlo.while']}, "
        f"custom_call {ops['stablehlo.custom_call']}, constant {ops['stablehlo.constant']}, "
        f"func.call {ops['func.call']}; largest constant/iota {largest}"
    )


def option_value(text: str):
    """An XLA option's value from the command line: an int, a bool (true / false) or the text."""
    if text.lstrip("-").isdigit():
        return int(text)
    return {"true": True, "false": False}.get(text.lower(), text)


def run_one(args) -> None:
    """One lowering and compile (this process: ``--max-len`` one value, ``--xla-options`` one)."""
    options = {
        key: option_value(value)
        for key, value in (kv.split("=", 1) for kv in args.xla_options[0].split(",") if kv)
    }
    max_len = args.max_len[0]
    start = time.perf_counter()
    model = abstract_model(args, max_len)
    lowered, context = lower_decode(model, args, options)
    lower_s = time.perf_counter() - start
    print(
        f"max_len {max_len}, context bound {context}, options {options}: lowering {lower_s:.1f} s", flush=True
    )
    print(describe(lowered.as_text()), flush=True)
    start = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start
    hlo = compiled.as_text()
    sizes = max_len_sizes(model, args)
    found = hlo_shapes.sized(hlo, sizes)
    print(
        f"  XLA compile {compile_s:.1f} s; optimized HLO {len(hlo) / 1e6:.2f} MB; "
        f"temp {compiled.memory_analysis().temp_size_in_bytes / 2**20:.1f} MiB; "
        f"work of max_len's size {sorted(sizes)}: {len(found)} {found[:4]}",
        flush=True,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--weights", choices=("released", "bf16"), default="released")
    parser.add_argument("--backend", default="online")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--context", type=int, default=3072 + 32, help="positions the dispatch's rows reach")
    parser.add_argument("--max-len", type=int, nargs="+", default=[4096, 1048576])
    parser.add_argument("--xla-options", nargs="+", default=[""])
    parser.add_argument("--timeout", type=float, default=170, help="seconds per child")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return run_one(args)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; {vars(args)}", flush=True)
    for options in args.xla_options:
        for max_len in args.max_len:
            argv = list(sys.argv[1:])
            argv += ["--child", "--max-len", str(max_len), "--xla-options", options]
            start = time.perf_counter()
            try:
                subprocess.run([sys.executable, __file__, *argv], timeout=args.timeout, check=False)
            except subprocess.TimeoutExpired:
                print(f"max_len {max_len}, options {options!r}: not done in {args.timeout:.0f} s", flush=True)
            print(f"  (child {time.perf_counter() - start:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
