"""Prefill of one long prompt against its FLOP floor (issue 40): prompt tokens/s, time per prompt token across
prompt lengths, the compiled prefill's temporaries, and DeepSeek-V4-Flash's 43-layer TTFT projected from the
slice's.

Per row (config, weights, prompt length P in ``--prompt-lens``, chunk C in ``--chunks``): one
``Engine(model, 1, prefill_chunk=C)`` (context buckets from the engine's default floor), the model's runtime
``max_len`` the least multiple of 128 holding P + 2 (``--max-len``: that instead; ``--attention-impl`` and
``--kv-cache-dtype`` its other fields, default the model's), one random prompt of P tokens (at most C: one
forward, no chunks), ``engine.prefill(state, {0: prompt}, 1)``: the first call compiles (``compile s``,
apart), then ``--reps`` calls each on a fresh state (``engine.init_state``, not timed), ``prefill ms`` their
median (``jax.block_until_ready`` on the state). ``tokens/s`` = P / that, ``ms/1k`` its time per 1000 prompt
tokens.

* Floor (:mod:`prefill_floor`): the prompt's FLOPs (every matmul once per token, the LM head once, the
  attention over the keys each position sees and the CSA indexer's scores) over the bf16 matmul rate
  measured at the start of the run (``bench_attention.matmul_rate``, ``--matmul-n``); ``x floor`` = prefill
  ms / floor ms.
* Memory: ``temp GiB``, the temporaries of the compiled prefill (``memory_analysis()`` of the engine's
  prefill at the row's shapes, ``Engine.lower_prefill``: the scan over the chunks, one chunk's activations);
  ``peak GiB``, the device's peak bytes in use so far in the process (``memory_stats()``, where the device has
  it; weights and caches included, never reset).
* Projection (printed after the table, ``projection`` in the JSON): per measured P, the slice's prefill time
  charged to its parts (its layers by kind: sliding, CSA, HCA, each with its MLP; the draft head; the LM head)
  in proportion to their FLOPs, giving a time per layer of each kind; DeepSeek-V4-Flash's TTFT = the sum over
  its 43 layers (``ModelConfig.deepseek_v4_flash``'s pattern: 2 sliding, 21 CSA, 20 HCA) of its kind's time
  per layer, plus the draft head and LM head as measured. This assumes each kind runs at the slice's average
  fraction of its floor: a FLOP-share split of one measurement, not a timing of each layer. The slice's
  layers are V4-Flash's only with its 256 experts (``--experts``' default; fewer: smaller routers).

Targets (issue 40, checked and printed after the table for the first config): >= 30k prompt tokens/s and
<= 2.5x the floor at every P; ms per 1k tokens from the shortest to the longest P within 1.5x per chunk;
temporaries below 2 GiB at chunk 8192 and the longest P.

Configs (``--configs``): ``v4flash-slice`` (``--layers``, ``--experts``, ``--weights``, as
:mod:`bench_models` builds them; default 6 layers, 256 experts, released weights), ``v4flash-attn``,
``shipped``, and ``tiny`` (:data:`TINY`: a small V4 with every layer kind, for a CPU smoke run).

GPU (H100, the issue's rows)::

    python bench/bench_prefill.py --configs v4flash-slice --layers 6 --experts 256 --weights released \\
        --prompt-lens 8192 32768 131072 --chunks 2048 8192 --reps 3 \\
        --out bench/results/YYYY-MM-DD/bench_prefill.json

CPU smoke run: python bench/bench_prefill.py --configs tiny --prompt-lens 256 512 --chunks 128 --reps 2 \\
    --matmul-n 256 --out /tmp/bp.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import pathlib
import statistics
import sys
import time

import jax
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_attention import matmul_rate
from bench_models import CONFIGS, RUNTIME, WEIGHTS, build_model, make_prompts, slice_config, with_runtime
from prefill_floor import DRAFT, HEAD, by_kind, prefill_flops

from jax_oc128.controller import BACKENDS
from jax_oc128.engine import Engine
from jax_oc128.nn import CSA, HCA, SLIDING, ModelConfig, SpeculativeModel, attend
from jax_oc128.nn.kv_cache import KV_CACHE_DTYPES
from jax_oc128.nn.moe import HASH_MOE, MOE

DEFAULT_OUT = pathlib.Path(__file__).resolve().parent / "results" / "bench_prefill.json"
#: a small DeepSeek-V4 with every layer kind (sliding, CSA, HCA), hash and top-k MoE and hyper-connections
TINY = ModelConfig.tiny(
    layer_types=(SLIDING, CSA, HCA),
    mlp_layer_types=(HASH_MOE, MOE, MOE),
    hc_mult=2,
    mlp_hidden=64,
    index_topk=8,
)
#: the table's columns
COLUMNS = ("config", "weights", "prompt", "chunk", "max_len", "compile s", "prefill ms", "tokens/s", "ms/1k")
COLUMNS += ("floor ms", "x floor", "temp GiB", "peak GiB")
#: the issue's targets: tokens/s, x floor, ms/1k spread over P, temporaries (GiB) at chunk 8192
TARGETS = dict(tokens_per_s=30e3, x_floor=2.5, spread=1.5, temp_gib=2.0, temp_chunk=8192)
GIB = 2**30


def least_max_len(prompt_len: int) -> int:
    """The least multiple of 128 holding a prompt of ``prompt_len`` tokens and one new token and the step
    after it."""
    return -(-(prompt_len + 2) // 128) * 128


def build(name: str, args, weights: str | None):
    """The model of a ``--configs`` entry (the slice's in ``weights``)."""
    if name == "tiny":
        return SpeculativeModel(TINY, RUNTIME, backend=BACKENDS[args.backend], rngs=nnx.Rngs(0))
    return build_model(name, args.backend, weights, args.slice)


def timed_prefill(engine: Engine, prompt: list[int], reps: int) -> dict:
    """The compile call's and the median of ``reps`` timed calls' seconds of ``engine.prefill`` of
    ``prompt`` in slot 0 (each on a fresh state), and the compiled prefill's temporaries in bytes
    (``Engine.lower_prefill``: the calls' executable)."""
    times, state = [], None
    for _ in range(reps + 1):
        del state
        state = engine.init_state()
        jax.block_until_ready(state)
        start = time.perf_counter()
        state, output = engine.prefill(state, {0: prompt}, 1)
        jax.block_until_ready((state, output))
        times.append(time.perf_counter() - start)
    memory = engine.lower_prefill(len(prompt)).compile().memory_analysis()
    return dict(compile_s=times[0], prefill_s=statistics.median(times[1:]), temp=memory.temp_size_in_bytes)


def peak_bytes() -> int | None:
    """The device's peak bytes in use in this process, None where the device does not tell."""
    stats = jax.devices()[0].memory_stats()
    return None if stats is None else stats.get("peak_bytes_in_use")


def measure_row(model, prompt: list[int], chunk: int, rate: float, reps: int) -> dict:
    """One row's numbers (see the module doc) for ``prompt`` through ``model`` in chunks of ``chunk``."""
    engine = Engine(model, 1, prefill_chunk=chunk)
    timing = timed_prefill(engine, prompt, reps)
    del engine
    gc.collect()
    seconds, flops = timing["prefill_s"], prefill_flops(model.config, len(prompt))
    floor_s, peak = sum(flops.values()) / rate, peak_bytes()
    return dict(
        prompt=len(prompt),
        chunk=chunk,
        max_len=model.max_len,
        compile_s=timing["compile_s"],
        prefill_ms=seconds * 1e3,
        tokens_per_s=len(prompt) / seconds,
        ms_per_1k=seconds * 1e6 / len(prompt),
        floor_ms=floor_s * 1e3,
        x_floor=seconds / floor_s,
        temp_gib=timing["temp"] / GIB,
        peak_gib=None if peak is None else peak / GIB,
        flops=flops,
    )


def measure(args, rate: float) -> tuple[list[dict], dict]:
    """The rows of the table (see the module doc), printed as they come, and each config's
    :class:`ModelConfig` by name."""
    rows, configs = [], {}
    for name in args.configs:
        for weights in args.weights if name == "v4flash-slice" else [None]:
            base = build(name, args, weights)
            configs[name] = base.config
            weights = weights or base.config.dtype  # the other configs: their dtype
            for prompt_len in args.prompt_lens:
                runtime = dict(attention_impl=args.attention_impl, kv_cache_dtype=args.kv_cache_dtype)
                max_len = args.max_len or least_max_len(prompt_len)
                model = with_runtime(base, args.backend, max_len=max_len, **runtime)
                prompt = make_prompts(base.config, 1, prompt_len)[0]
                for chunk in args.chunks:
                    rows.append(
                        dict(config=name, weights=weights)
                        | measure_row(model, prompt, chunk, rate, args.reps)
                    )
                    print(table_row(rows[-1]), flush=True)
            del base, model
            gc.collect()
    return rows, configs


def table_row(row: dict) -> str:
    """A markdown row of :data:`COLUMNS`."""
    keys = ("config", "weights", "prompt", "chunk", "max_len", "compile_s", "prefill_ms", "tokens_per_s")
    keys += ("ms_per_1k", "floor_ms", "x_floor", "temp_gib", "peak_gib")
    formats = dict(compile_s="{:.1f}", prefill_ms="{:.1f}", tokens_per_s="{:.0f}", ms_per_1k="{:.2f}")
    formats |= dict(floor_ms="{:.2f}", x_floor="{:.2f}", temp_gib="{:.3f}", peak_gib="{:.2f}")
    cells = ["-" if row[k] is None else formats[k].format(row[k]) if k in formats else row[k] for k in keys]
    return "| " + " | ".join(map(str, cells)) + " |"


def projection(rows: list[dict], slice_: ModelConfig, full: ModelConfig) -> list[dict]:
    """Per row of ``slice_``'s (a prompt length, chunk and weights), ``full``'s prefill time from the
    slice's by FLOP share (see the module doc): the slice's ms per layer of each kind, and the projected
    TTFT in ms and its prompt tokens/s."""
    out = []
    for row in rows:
        kinds = by_kind(slice_, row["flops"])
        ms_per_flop = row["prefill_ms"] / sum(row["flops"].values())
        per_layer = {k: kinds["flops"][k] / n * ms_per_flop for k, n in kinds["layers"].items()}
        full_kinds = by_kind(full, prefill_flops(full, row["prompt"]))
        missing = sorted(set(full_kinds["layers"]) - set(per_layer))
        if missing:  # a kind the slice lacks: charged the slice's ms per FLOP
            per_layer |= {k: full_kinds["flops"][k] / full_kinds["layers"][k] * ms_per_flop for k in missing}
        ttft = sum(per_layer[k] * n for k, n in full_kinds["layers"].items())
        ttft += sum(kinds["flops"].get(part, 0.0) * ms_per_flop for part in (DRAFT, HEAD))
        out.append(
            dict(
                weights=row["weights"],
                prompt=row["prompt"],
                chunk=row["chunk"],
                layers=full_kinds["layers"],
                ms_per_layer=per_layer,
                ttft_ms=ttft,
                tokens_per_s=row["prompt"] / ttft * 1e3,
            )
        )
    return out


def check_targets(rows: list[dict]) -> list[str]:
    """The issue's targets on the first config's rows, a line each (see the module doc)."""
    first = [r for r in rows if (r["config"], r["weights"]) == (rows[0]["config"], rows[0]["weights"])]
    lines = []
    for row in first:
        ok = row["tokens_per_s"] >= TARGETS["tokens_per_s"] and row["x_floor"] <= TARGETS["x_floor"]
        lines.append(
            f"P {row['prompt']} chunk {row['chunk']}: {row['tokens_per_s']:.0f} tokens/s (>= 30k), "
            f"{row['x_floor']:.2f}x floor (<= 2.5): {'met' if ok else 'NOT met'}"
        )
    for chunk in sorted({r["chunk"] for r in first}):
        per_k = [r["ms_per_1k"] for r in sorted(first, key=lambda r: r["prompt"]) if r["chunk"] == chunk]
        spread = max(per_k) / min(per_k)
        ok = spread <= TARGETS["spread"]
        lines.append(
            f"chunk {chunk}: ms/1k tokens spread {spread:.2f}x (<= 1.5): {'met' if ok else 'NOT met'}"
        )
    at = [r for r in first if r["chunk"] == TARGETS["temp_chunk"]]
    if at:
        row = max(at, key=lambda r: r["prompt"])
        ok = row["temp_gib"] < TARGETS["temp_gib"]
        lines.append(
            f"P {row['prompt']} chunk {row['chunk']}: temporaries {row['temp_gib']:.3f} GiB (< 2): "
            f"{'met' if ok else 'NOT met'}"
        )
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", nargs="+", choices=(*CONFIGS, "tiny"), default=["v4flash-slice"])
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="online")
    parser.add_argument("--weights", nargs="+", choices=WEIGHTS, default=["released"])
    parser.add_argument("--layers", type=int, default=6, help="v4flash-slice's layers (V4-Flash's first L)")
    parser.add_argument("--experts", type=int, default=256, help="v4flash-slice's routed experts")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--chunks", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--attention-impl", choices=attend.IMPLS, default=None, help="default: the runtime's")
    parser.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None, help="default: the runtime's"
    )
    parser.add_argument("--max-len", type=int, default=None, help="every row's max_len (default: per P)")
    parser.add_argument("--reps", type=int, default=3, help="timed prefills per row (median)")
    parser.add_argument("--matmul-n", type=int, default=8192, help="the bf16 matmul rate's n x n x n")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    try:
        args.slice = slice_config(args.layers, args.experts)
    except (TypeError, ValueError) as error:
        parser.error(f"--layers / --experts: {error}")
    for name in ("prompt_lens", "chunks", "reps", "matmul_n"):
        values = getattr(args, name)
        if any(v < 1 for v in (values if isinstance(values, list) else [values])):
            parser.error(f"--{name.replace('_', '-')}: must be >= 1, got {values}")
    if args.max_len is not None and args.max_len < least_max_len(max(args.prompt_lens)):
        parser.error(f"--max-len: at least {least_max_len(max(args.prompt_lens))} for the longest prompt")

    device = jax.devices()[0].device_kind
    rate = matmul_rate(args.matmul_n)
    runtime = dict(attention_impl=args.attention_impl, kv_cache_dtype=args.kv_cache_dtype)
    print(f"device: {device}, jax {jax.__version__}; bf16 matmul {rate / 1e12:.1f} TFLOP/s (the floor's)")
    print(f"runtime (None: the model's default): {runtime}")
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS), flush=True)
    rows, configs = measure(args, rate)
    projected = []
    if "v4flash-slice" in configs:
        slice_rows = [r for r in rows if r["config"] == "v4flash-slice"]
        projected = projection(slice_rows, configs["v4flash-slice"], ModelConfig.deepseek_v4_flash())
    for p in projected:
        per_layer = ", ".join(f"{k} {v:.2f}" for k, v in p["ms_per_layer"].items())
        name = f"V4-Flash 43 layers ({p['weights']}), P {p['prompt']} chunk {p['chunk']}"
        ttft = f"TTFT {p['ttft_ms']:.0f} ms ({p['tokens_per_s']:.0f} tokens/s)"
        print(f"{name}: {ttft}; ms per layer: {per_layer}")
    targets = check_targets(rows)
    print("\n".join(targets))
    results = dict(
        bench="prefill",
        device=device,
        jax=jax.__version__,
        matmul_flops=rate,
        reps=args.reps,
        runtime=runtime,
        configs={name: dataclasses.asdict(config) for name, config in configs.items()},
        rows=rows,
        projection=projected,
        targets=targets,
    )
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
