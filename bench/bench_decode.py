"""The decode loop's time per step on the device alone against end to end through ``Engine.generate``, for the
shipped model and DeepSeek-V4-Flash-shaped models, online and offline C128 state, plain and speculative.

Configs (``--configs``): ``shipped``, ``v4flash-attn`` and ``v4flash-slice`` (``--layers``, ``--experts``,
``--weights bf16 released``), built and described in :mod:`bench_models`.

``--max-len`` (each in turn, the parameters shared, not rebuilt): the runtime's ``max_len`` instead of the
config's (4096; the shipped model's ``RuntimeConfig()``'s). Every forward reads only its context bucket
(``Engine(context_floor=)``, ``--context-floor``, the engine's default 256; ``none``: every forward reads
``max_len``): ``generate`` and the prefill choose theirs, and each timed ``decode`` dispatch is given the most
positions the run's rows reach (``decode(context=)``), so that a short context costs the same at any
``max_len`` (issue 40): compare the rows of two ``--max-len`` at a ``--prompt-len`` whose run stays within
the smaller (the table's ``context`` column: the bucket the timed dispatches read).

Modes (``--modes``): ``plain``; ``N``, speculative steps verifying a chain of N tokens (the bonus token and
N - 1 drafts); ``treeN``, tree speculation at the same verify width: the default draft tree of N nodes
(:meth:`jax_oc128.tree.Tree.default`), drafted level by level by the MTP head and verified in one forward.

Per row (config, weights, backend, caches, layout, mode, slots), with one engine of ``slots`` slots and K
steps per dispatch:

* *device*: every slot prefilled with a ``--prompt-len`` (200) token prompt (so the C128 state crosses a
  128-token block) and a budget no row can spend; then two warm-up dispatches (the first compiles, the
  first run on the state's buffers records the CUDA graph of the loop), then D dispatches of
  ``engine.decode(state, num_tokens=N, steps=K)`` queued back to back, the state donated and threaded,
  nothing read by the host, ``jax.block_until_ready`` once at the end; time per step = elapsed / (D * K),
  with D * K >= ``--device-steps`` (128). Method: repetitions, not a slope: the host enqueues dispatch i+1
  while the device runs dispatch i, so only the first launch and the final sync are not overlapped, paid
  once over D * K steps. Afterwards the last dispatch is checked to have run K steps with every row active.
  The prefill of all slots is timed on its own too (compiled, on a state already allocated).
* *e2e*: ``engine.generate(prompts, --tokens, num_tokens=N)`` with ``slots`` prompts of the same length,
  after a short warm-up call (the executables are compiled by then); tokens/s = generated tokens / seconds,
  time per step = seconds / result.steps, ratio = e2e / device time per step. ``generate``'s seconds include
  its prefill, which the per-step ratio charges to the steps; the table also gives e2e against the device
  time of the same work: seconds / (prefill + result.steps * device time per step).

Each phase's time (building a model; per row the prefills and decode warm-ups, whose first ones compile,
the timed dispatches, ``generate``'s calls) is printed on stderr as it ends: a run cut short shows where.

Attention (``--attention-impl``, each in turn; default the runtime's own): ``jnp``, ``kernel`` or ``auto``
(``RuntimeConfig.attention_impl``, :mod:`jax_oc128.nn.attend`).

Caches (``--kv-cache-dtype``, each in turn; default the runtime's own, ``auto``: the model's dtype):
``float32``, ``bfloat16``, ``fp8`` or ``fp8_fp4`` (``RuntimeConfig.kv_cache_dtype``: DeepSeek's FP8 entries
and FP8 or FP4 indexer keys beside a window in the model's dtype), the parameters shared, not rebuilt. Layout
(``--pages``, each in turn): ``dense`` (the default: every slot holds ``max_len`` tokens of entries) or paged
(``Engine(pages=P)``, pages of 256 tokens): ``auto`` (the flag alone: P = every slot's pages of the most
tokens it holds in this run, the device-only dispatches' or ``generate``'s prompt + ``--tokens``) or a count P
(at least that many). The device-only timing gives the slots the pool in equal parts
(``Engine.set_page_table``); ``generate`` reserves its own.

Floor (:mod:`step_floor`, per row): the weight bytes a decode step must read whatever its kernels
(:func:`step_floor.step_read_bytes`), over the device's copy bandwidth (``bench_ops.copy_bandwidth``, measured
at the start of the run, ``--copy-mib``). "x floor" is the device time per step over that floor. Per model the
run prints and records (``weights`` in the JSON) the weights' bytes on the device by kind (routed experts,
other matrices, the rest) and the same model's in bfloat16.
and the same model's in bfloat16.

Targets (the issue): e2e time per step <= 1.1x the device time per step at 8 slots, plain and N = 4; the
online C128 state never slower per step than the offline one at the V4-Flash config. Both are checked and
printed after the table, the first on the same-work ratio (a decode loop cannot make the prefill's compute
go away; the per-step ratio is printed beside it).

``--device-only`` skips the e2e part and the second prefill (a row at a long context then pays one prefill,
its compile included; the e2e columns are NaN); ``--prefill-chunk`` sets the engine's prefill chunk.

``--sweep-k 1 4 16 64`` instead measures e2e tokens/s for each K (one engine per K) at the first config and
backend, for the given modes and slots, to choose the engine's default K by measurement.

``--profile DIR`` traces one more dispatch per row with jax's profiler (under ``DIR``, a directory per row)
and prints and records its kernels per step (the largest by name, the span against the timed step).

``--mesh data=D,model=M`` runs every engine on a mesh of D x M devices (``Engine(mesh=)``): the slots split
over the D devices of the data axis (data parallel; each slot count a multiple of D), the heads, o-groups,
MLP and vocabulary over the M of the model axis (tensor parallel). Without it: one device.

Usage (from a directory other than the repository root, or with jax_oc128 installed)::

    python bench/bench_decode.py [--configs shipped v4flash-attn v4flash-slice] [--backends online offline]
        [--modes plain 2 4 tree8] [--slots 1 8 64] [--steps-per-dispatch K] [--tokens 256]
        [--kv-cache-dtype float32 bfloat16 fp8 fp8_fp4] [--pages [dense auto P]] [--weights bf16 released]
        [--layers 6] [--experts 16] [--copy-mib 2048] [--out bench/results/YYYY-MM-DD/bench_decode.json]
    python bench/bench_decode.py --configs shipped --sweep-k 1 4 16 64 --modes plain 4 --slots 8
    python bench/bench_decode.py --configs shipped --backends online --modes 8 tree8 --slots 1 8
    python bench/bench_decode.py --configs v4flash-attn --backends online --mesh data=2,model=1 --slots 8 16
    python bench/bench_decode.py --configs v4flash-attn --modes plain 4 --slots 8 64 \\
        --kv-cache-dtype float32 bfloat16 fp8 fp8_fp4 --pages dense auto
    python bench/bench_decode.py --configs v4flash-slice --experts 256 --layers 6 --weights released bf16 \\
        --modes plain 4 --slots 8 64
    python bench/bench_decode.py --configs v4flash-slice --experts 256 --weights released --backends online \\
        --modes plain 4 --slots 8 64 --pages auto --steps-per-dispatch 16 --prompt-len 3072 \\
        --max-len 4096 1048576
CPU smoke test: python bench/bench_decode.py --configs v4flash-attn --backends online --modes plain \\
    --slots 1 --tokens 8 --device-steps 8 --steps-per-dispatch 4 --kv-cache-dtype float32 fp8 \\
    --pages dense auto --copy-mib 64 --out /tmp/bd.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import itertools
import json
import math
import pathlib
import sys
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_models import CONFIGS, V4FLASH_ATTN, WEIGHTS, build_model, make_prompts, slice_config, with_runtime
from bench_ops import Phases, copy_bandwidth, device_kernels
from capacity import PAGE_SIZE
from step_floor import WeightReads, mode_width, step_read_bytes, weights_summary

from jax_oc128.controller import BACKENDS
from jax_oc128.engine import STEPS_PER_DISPATCH, Engine
from jax_oc128.nn import attend, sharding
from jax_oc128.tree import Tree

DEFAULT_OUT = pathlib.Path(__file__).resolve().parent / "results" / "bench_decode.json"
#: what a row of the table names (with its slots)
ROW_KEYS = ("config", "weights", "backend", "attention", "kv_cache_dtype", "layout", "max_len", "mode")
#: the table's columns
COLUMNS = (*ROW_KEYS, "slots", "context", "device us/step", "floor us", "x floor", "e2e us/step", "ratio")
COLUMNS += ("e2e / device, same work", "tokens/s", "mean accepted")


#: what a row gives of :func:`e2e` (NaN with ``--device-only``)
E2E_KEYS = ("e2e_us", "tokens_per_s", "mean_accepted", "ratio", "ratio_same_work")

#: dispatches of :func:`device_time` besides the timed ones: two warm-up dispatches and a profiled one
UNTIMED_DISPATCHES = 3


def timed_dispatches(
    max_len: int, prompt_len: int, width: int, steps: int, device_steps: int
) -> tuple[int, int]:
    """``(D, budget)`` of :func:`device_time`: the dispatches of ``steps`` steps timed (at least
    ``device_steps`` steps where ``max_len`` has room) and the budget each prompt of ``prompt_len`` tokens is
    given, the most it may be (no row ends: its first token and the :data:`UNTIMED_DISPATCHES` + D
    dispatches stay below it)."""
    budget = max_len - prompt_len - width
    room = (budget - 2) // (width * steps) - UNTIMED_DISPATCHES
    if room < 1:
        raise ValueError(f"max_len {max_len}: no room for a dispatch of {steps} steps of N = {width}")
    return min(max(2, math.ceil(device_steps / steps)), room), budget


def device_positions(prompt_len: int, width: int, steps: int, dispatches: int) -> int:
    """The most positions a row of :func:`device_time` reaches: its prompt, first token and the
    :data:`UNTIMED_DISPATCHES` + ``dispatches`` dispatches of ``steps`` steps of N = ``width``, and a step's
    N more."""
    return prompt_len + 1 + (UNTIMED_DISPATCHES + dispatches) * steps * width + width


def tokens_per_slot(args, max_len: int, steps: int) -> int:
    """The most tokens a slot's caches hold in this run (:func:`device_time` and :func:`e2e` at every mode):
    what a paged engine's pool must hold per slot."""
    most = 0
    for mode in args.modes:
        width = mode_width(mode)
        dispatches, _ = timed_dispatches(max_len, args.prompt_len, width, steps, args.device_steps)
        most = max(most, device_positions(args.prompt_len, width, steps, dispatches))
        most = max(most, args.prompt_len + args.tokens + width)  # what generate reserves
    return most


def device_time(
    engine: Engine,
    prompts,
    mode: dict,
    steps: int,
    device_steps: int,
    phase: Phases,
    profile: pathlib.Path | None = None,
    prefills: int = 2,
) -> dict:
    """Device-only time per step of ``engine.decode`` (see the module doc), the prefill's time and the
    first calls' (compile) times, and ``context``: the bucket every dispatch reads (None: ``max_len``), each
    told the most positions the rows reach (:func:`device_positions`). A paged engine's slots are given its
    pool in equal parts, in order.
    ``profile``: a directory where one more dispatch, after the timed ones, is traced by jax's profiler;
    the row then gives its kernels per step (:func:`bench_ops.device_kernels`: ``span_us``, ``kernels_us``
    and the 40 largest of ``by_kernel``). ``phase``: told as each phase ends. ``prefills``: 2 (the first
    compiles, the second is ``prefill_ms``) or 1 (no ``prefill_ms``: None)."""
    n, max_len = mode_width(mode), engine.model.max_len
    dispatches, budget = timed_dispatches(max_len, len(prompts[0]), n, steps, device_steps)
    decode = functools.partial(
        engine.decode,
        steps=steps,
        context=min(max_len, device_positions(len(prompts[0]), n, steps, dispatches)),
        **mode,
    )
    assignments = dict(enumerate(prompts))
    state, prefill = engine.init_state(0), []
    if engine.pages is not None:
        each = min(engine.pages // engine.slots, max_len // engine.page_size)
        table = np.full((engine.slots, max_len // engine.page_size), -1, np.int32)
        table[:, :each] = np.arange(engine.slots)[:, None] * each + np.arange(each)
        state = engine.set_page_table(state, table)
    for _ in range(prefills):  # the first compiles; the second is the prefill's time
        start = time.perf_counter()
        state, _ = engine.prefill(state, assignments, budget, **mode)
        jax.block_until_ready(state)
        prefill.append(time.perf_counter() - start)
        phase(f"prefill {len(prefill)} of {prefills} (the first compiles)")
    warm_up = []
    for _ in range(2):  # the first compiles, the first run on these buffers records the CUDA graph
        start = time.perf_counter()
        state, output = decode(state)
        jax.block_until_ready((state, output))
        warm_up.append(time.perf_counter() - start)
        phase(f"decode warm-up dispatch {len(warm_up)} of 2 (the first compiles)")
    start = time.perf_counter()
    for _ in range(dispatches):
        state, output = decode(state)
    jax.block_until_ready((state, output))
    elapsed = time.perf_counter() - start
    phase(f"{dispatches} timed dispatches")
    kernels = {}
    if profile is not None:
        with jax.profiler.trace(str(profile)):
            state, output = decode(state)
            jax.block_until_ready((state, output))
        span, busy, by_kernel = device_kernels(profile, steps)
        kernels = dict(profile=dict(span_us=span, kernels_us=busy, by_kernel=by_kernel[:40]))
    if int(output.steps) != steps or not np.all(np.asarray(output.active)):
        raise RuntimeError("a row ended during the device-only timing: the budget is too small")
    del state, output
    return dict(
        device_us=elapsed / (dispatches * steps) * 1e6,
        dispatches=dispatches,
        context=engine.bound(decode.keywords["context"]),
        prefill_ms=prefill[1] * 1e3 if prefills > 1 else None,
        compile_s=prefill[0] + warm_up[0],
        **kernels,
    )


def e2e(engine: Engine, prompts, mode: dict, tokens: int, phase: Phases | None = None) -> dict:
    """``Engine.generate``'s tokens/s and time per step, after a short warm-up call (``phase``, if given:
    told as each call ends)."""
    phase = phase or (lambda name: None)
    engine.generate(prompts, 4, **mode)
    phase("generate warm-up (compiles)")
    result = engine.generate(prompts, tokens, **mode)
    phase("generate")
    generated = sum(map(len, result.tokens))
    return dict(
        e2e_us=result.seconds / max(1, result.steps) * 1e6,
        tokens_per_s=generated / result.seconds,
        generated=generated,
        seconds=result.seconds,
        steps=result.steps,
        e2e_dispatches=result.dispatches,
        mean_accepted=result.mean_accepted,
    )


def parse_mode(text: str) -> dict:
    """A ``--modes`` entry as ``Engine.generate``'s keyword arguments: ``plain`` ({}), ``N`` (a chain of N:
    ``num_tokens``) or ``treeN`` (the default draft tree of N nodes, :meth:`jax_oc128.tree.Tree.default`)."""
    if text == "plain":
        return {}
    if text.startswith("tree") and text[4:].isdigit():
        return dict(tree=Tree.default(int(text[4:])))
    if text.isdigit() and int(text) >= 2:
        return dict(num_tokens=int(text))
    raise ValueError(text)


def mode_name(mode: dict) -> str:
    if "tree" in mode:
        return f"tree N={mode['tree'].size}"
    return f"N={mode['num_tokens']}" if mode else "plain"


def page_count(spec: str, slots: int, per_slot: int, page_size: int) -> int | None:
    """An engine's ``pages`` for a ``--pages`` entry: None for ``dense``; ``auto``: every slot's
    ``per_slot`` tokens in whole pages; a count as given, which must hold as much (a ValueError
    otherwise)."""
    if spec == "dense":
        return None
    need = slots * -(-per_slot // page_size)
    if spec == "auto":
        return need
    if int(spec) < need:
        raise ValueError(
            f"--pages: {spec} pages of {page_size} tokens hold less than {slots} slots x {per_slot}"
        )
    return int(spec)


def measure(args, bandwidth: float) -> tuple[list[dict], list[dict]]:
    """The rows of every (config, weights, backend, caches, layout, slots, mode), and each model's weights
    (:func:`weights_summary`)."""
    rows, summaries = [], []
    for config in args.configs:
        for weights in args.weights if config == "v4flash-slice" else [None]:
            reads = None
            for backend in args.backends:
                phase = Phases(f"{config} {weights or ''} {backend}")
                base = build_model(config, backend, weights, args.slice)
                phase("building the model")
                weights_name = weights or base.config.dtype
                if reads is None:
                    summary, reads = weights_summary(config, weights_name, base)
                    summaries.append(summary)
                    print(f"\n| {' | '.join(COLUMNS)} |\n" + "|---" * len(COLUMNS) + "|")
                for impl, kv_cache_dtype, max_len in itertools.product(
                    args.attention_impl, args.kv_cache_dtype, args.max_len
                ):
                    model = with_runtime(
                        base, backend, attention_impl=impl, kv_cache_dtype=kv_cache_dtype, max_len=max_len
                    )
                    cache = model.runtime.cache_dtypes(model.config.dtype)
                    kv_name = model.runtime.kv_cache_dtype
                    kv_name += f" ({cache.entries})" if kv_name == "auto" else ""
                    for layout in args.pages:
                        rows += measure_model(
                            args,
                            model,
                            bandwidth,
                            reads,
                            dict(
                                config=config,
                                weights=weights_name,
                                backend=backend,
                                attention=model.runtime.attention_impl,
                                kv_cache_dtype=kv_name,
                                cache_dtypes=dataclasses.asdict(cache),
                                layout="dense" if layout == "dense" else "paged",
                                max_len=model.max_len,
                            ),
                            layout,
                        )
                    del model
                del base
                gc.collect()  # the models' buffers before the next is built (tens of GB for the slice)
    return rows, summaries


def measure_model(args, model, bandwidth: float, reads: WeightReads, keys: dict, layout: str) -> list[dict]:
    """The rows of ``model`` (``keys``: what the rows record of it) at every slots and mode, its engines
    paged as ``layout`` (a ``--pages`` entry) says."""
    rows, steps = [], args.steps_per_dispatch
    per_slot = tokens_per_slot(args, model.max_len, steps)
    for slots in args.slots:
        pages = page_count(layout, slots, per_slot, PAGE_SIZE)
        engine = Engine(
            model,
            slots,
            steps_per_dispatch=steps,
            mesh=args.mesh,
            pages=pages,
            page_size=PAGE_SIZE,
            context_floor=args.context_floor,
            **({} if args.prefill_chunk is None else dict(prefill_chunk=args.prefill_chunk)),
        )
        prompts = make_prompts(model.config, slots, args.prompt_len)
        for mode in args.modes:
            row = dict(keys, mode=mode_name(mode), slots=slots, pages=pages, page_size=PAGE_SIZE)
            profile = None if args.profile is None else pathlib.Path(args.profile) / row_name(row)
            phase = Phases(row_name(row))
            prefills = 1 if args.device_only else 2
            row.update(device_time(engine, prompts, mode, steps, args.device_steps, phase, profile, prefills))
            read = step_read_bytes(reads, mode, slots, model.config.num_experts_per_tok)
            row.update(read_bytes=read, floor_us=read / bandwidth * 1e6)
            if args.device_only:
                row.update(dict.fromkeys(E2E_KEYS, math.nan))
            else:
                row.update(e2e(engine, prompts, mode, args.tokens, phase))
                floor_s = row["prefill_ms"] / 1e3 + row["steps"] * row["device_us"] / 1e6
                row.update(ratio=row["e2e_us"] / row["device_us"], ratio_same_work=row["seconds"] / floor_s)
            row["x_floor"] = row["device_us"] / row["floor_us"]
            rows.append(row)
            numbers = (row["device_us"], row["floor_us"], row["x_floor"], row["e2e_us"], row["ratio"])
            numbers += (row["ratio_same_work"], row["tokens_per_s"], row["mean_accepted"])
            formats = (".1f", ".1f", ".2f", ".1f", ".2f", ".2f", ".0f", ".2f")
            cells = [str(row[key]) for key in (*ROW_KEYS, "slots")] + [str(row["context"] or "max_len")]
            cells += [format(x, f) for x, f in zip(numbers, formats, strict=True)]
            print(f"| {' | '.join(cells)} |", flush=True)
            if "profile" in row:
                print_profile(row)
        del engine
    return rows


def row_name(row: dict) -> str:
    """A row's name for its files: its keys and slots joined by ``_``."""
    return "_".join(str(row[key]) for key in (*ROW_KEYS, "slots")).replace(" ", "").replace("/", "-")


def print_profile(row: dict, top: int = 25) -> None:
    """A profiled row's kernels per step: the span and the busy time against the timed step, then the
    ``top`` largest by name."""
    p, step = row["profile"], row["device_us"]
    print(
        f"  profile, per step: span {p['span_us']:.1f} us ({p['span_us'] / step:.2f}x the timed step), "
        f"kernels {p['kernels_us']:.1f} us"
    )
    for name, us in p["by_kernel"][:top]:
        print(f"  {us:9.1f} us  {us / step:6.1%}  {name[:110]}")


def check_targets(rows) -> list[str]:
    """The issue's targets, as lines of text."""
    lines = []
    for row in rows:
        if row["slots"] == 8 and row["mode"] in ("plain", "N=4") and not math.isnan(row["ratio"]):
            ok = row["ratio_same_work"] <= 1.1
            what = " ".join(str(row[key]) for key in ROW_KEYS)
            lines.append(
                f"e2e <= 1.1x device, {what} 8 slots: {row['ratio_same_work']:.2f} for the same work "
                f"(prefill + steps), {row['ratio']:.2f} per step with generate's prefill counted against "
                f"steps alone: {'met' if ok else 'NOT met'}"
            )
    names = [key for key in (*ROW_KEYS, "slots") if key != "backend"]
    by_key = {(row["backend"], *(row[name] for name in names)): row for row in rows}
    for (backend, *key), row in by_key.items():
        other = by_key.get(("offline", *key))
        if key[0].startswith("v4flash") and backend == "online" and other is not None:
            x = row["device_us"] / other["device_us"]
            lines.append(
                f"online <= offline per step, {' '.join(map(str, key[:-1]))} {key[-1]} slots: online/offline "
                f"{x:.3f} {'met' if x <= 1.0 else 'NOT met'}"
            )
    return lines


def sweep(args) -> list[dict]:
    """E2E tokens/s per K at the first config and backend."""
    config, backend = args.configs[0], args.backends[0]
    model = with_runtime(
        build_model(config, backend, args.weights[0], args.slice), backend, max_len=args.max_len[0]
    )
    rows = []
    print(f"K sweep: {config}, {backend} state, {args.tokens} new tokens per request")
    print("| mode | slots | K | tokens/s | e2e us/step | dispatches | mean accepted | compile s |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in args.modes:
        for slots in args.slots:
            prompts = make_prompts(model.config, slots, args.prompt_len)
            for k in args.sweep_k:
                engine = Engine(
                    model, slots, steps_per_dispatch=k, mesh=args.mesh, context_floor=args.context_floor
                )
                start = time.perf_counter()
                engine.generate(prompts, 4, **mode)  # compiles
                compile_s = time.perf_counter() - start
                row = dict(config=config, backend=backend, mode=mode_name(mode), slots=slots, k=k)
                row.update(e2e(engine, prompts, mode, args.tokens), compile_s=compile_s)
                rows.append(row)
                print(
                    f"| {row['mode']} | {slots} | {k} | {row['tokens_per_s']:.0f} | {row['e2e_us']:.1f} | "
                    f"{row['e2e_dispatches']} | {row['mean_accepted']:.2f} | {compile_s:.1f} |",
                    flush=True,
                )
                del engine
    return rows


def parse_mesh(text: str, parser) -> dict[str, int]:
    """``--mesh data=D,model=M`` as ``{"data": D, "model": M}`` (an axis left out has size 1); a parser error
    for anything else or more devices than there are."""
    sizes = {"data": 1, "model": 1}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if name not in sizes or not size.isdigit() or int(size) < 1:
            parser.error(f"--mesh: expected data=D,model=M with sizes >= 1, got {text!r}")
        sizes[name] = int(size)
    if sizes["data"] * sizes["model"] > jax.device_count():
        parser.error(
            f"--mesh: {text} needs {sizes['data'] * sizes['model']} devices, {jax.device_count()} found"
        )
    return sizes


def parse_pages(values, parser) -> list[str]:
    """``--pages`` entries: ``dense``, ``auto`` or a page count (the flag alone: ``auto``; absent:
    ``dense``)."""
    if values is None:
        return ["dense"]
    for value in values:
        if value not in ("dense", "auto") and not (value.isdigit() and int(value) >= 1):
            parser.error(f"--pages: 'dense', 'auto' or page counts >= 1, got {value!r}")
    return values or ["auto"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--backends", nargs="+", choices=sorted(BACKENDS), default=["online", "offline"])
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["plain", "2", "4"],
        help="plain, N (a chain of N) and/or treeN (the default draft tree of N nodes)",
    )
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument(
        "--attention-impl",
        nargs="+",
        choices=attend.IMPLS,
        default=[None],
        help="the attention math (RuntimeConfig.attention_impl), each in turn (default: the runtime's own)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        choices=["float32", "bfloat16", "fp8", "fp8_fp4"],
        default=[None],
        help="the caches' storage (RuntimeConfig.kv_cache_dtype), each in turn (default: the runtime's own)",
    )
    parser.add_argument(
        "--pages",
        nargs="*",
        default=None,
        help="paged caches: 'auto' (the flag alone: a pool holding every slot's tokens of the run), a page "
        f"count, or 'dense'; several in turn (default: dense); pages of {PAGE_SIZE} tokens",
    )
    parser.add_argument(
        "--weights",
        nargs="+",
        choices=WEIGHTS,
        default=["bf16"],
        help="v4flash-slice's weights, each in turn",
    )
    parser.add_argument("--layers", type=int, default=6, help="v4flash-slice's layers (V4-Flash's first L)")
    parser.add_argument(
        "--experts", type=int, default=16, help="v4flash-slice's routed experts (V4-Flash: 256)"
    )
    parser.add_argument(
        "--steps-per-dispatch", type=int, default=STEPS_PER_DISPATCH, help="K: decoding steps per dispatch"
    )
    parser.add_argument(
        "--max-len",
        type=int,
        nargs="+",
        default=[None],
        help="the runtime's max_len, each in turn (default: the config's own, 4096)",
    )
    parser.add_argument(
        "--context-floor",
        default="256",
        help="Engine(context_floor=): the smallest context bucket, or 'none' (every forward reads max_len)",
    )
    parser.add_argument("--tokens", type=int, default=256, help="new tokens per request (e2e)")
    parser.add_argument(
        "--device-only",
        action="store_true",
        help="the device-only time alone: one prefill (it compiles), no e2e (long prompts: fewer prefills)",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="Engine(prefill_chunk=): positions per prefill forward (default: the engine's own)",
    )
    parser.add_argument("--prompt-len", type=int, default=200, help="prompt tokens per slot")
    parser.add_argument("--device-steps", type=int, default=128, help="steps timed on the device, at least")
    parser.add_argument("--copy-mib", type=int, default=2048, help="the copy bandwidth's array (MiB)")
    parser.add_argument("--bandwidth-iters", type=int, default=20, help="timed copies (median)")
    parser.add_argument(
        "--sweep-k", type=int, nargs="+", default=None, help="measure e2e tokens/s per K only"
    )
    parser.add_argument(
        "--mesh", default=None, help="data=D,model=M: the engines on a mesh of D x M devices (default: one)"
    )
    parser.add_argument(
        "--profile",
        default=None,
        help="a directory: trace one more dispatch per row there and print its kernels",
    )
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args()
    try:
        args.modes = [parse_mode(m) for m in args.modes]
    except ValueError:
        parser.error(f"--modes: 'plain', integers N >= 2 or treeN, got {args.modes}")
    args.pages = parse_pages(args.pages, parser)
    if args.context_floor != "none" and not args.context_floor.isdigit():
        parser.error(f"--context-floor: a multiple of 128 or 'none', got {args.context_floor!r}")
    args.context_floor = None if args.context_floor == "none" else int(args.context_floor)
    try:
        args.slice = slice_config(args.layers, args.experts)
    except (TypeError, ValueError) as error:
        parser.error(f"--layers / --experts: {error}")
    mesh_shape = None if args.mesh is None else parse_mesh(args.mesh, parser)
    args.mesh = None if mesh_shape is None else sharding.make_mesh(mesh_shape["data"], mesh_shape["model"])
    if mesh_shape is not None and any(slots % mesh_shape["data"] for slots in args.slots):
        parser.error(f"--slots: each must be a multiple of the mesh's data axis ({mesh_shape['data']})")

    device = jax.devices()[0].device_kind
    k = args.sweep_k or args.steps_per_dispatch
    on = "1 device" if mesh_shape is None else f"mesh data={mesh_shape['data']} x model={mesh_shape['model']}"
    print(f"device: {device} ({on}), jax {jax.__version__}, K = {k}, prompts of {args.prompt_len} tokens")
    results = dict(
        bench="decode",
        device=device,
        mesh=mesh_shape,
        jax=jax.__version__,
        steps_per_dispatch=args.steps_per_dispatch,
        tokens=args.tokens,
        prompt_len=args.prompt_len,
        device_steps=args.device_steps,
        attention_impls=args.attention_impl,
        kv_cache_dtypes=args.kv_cache_dtype,
        pages=args.pages,
        context_floor=args.context_floor,
        configs={
            "shipped": "checkpoint.load() (the shipped model)",
            "v4flash-attn": dataclasses.asdict(V4FLASH_ATTN),
            "v4flash-slice": dataclasses.asdict(args.slice),
        },
    )
    if args.sweep_k:
        results["sweep"] = sweep(args)
    else:
        bandwidth = copy_bandwidth(args.bandwidth_iters, args.copy_mib)
        print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (the floor's)")
        results["copy_bandwidth"] = bandwidth
        results["rows"], results["weights"] = rows, _ = measure(args, bandwidth)
        targets = check_targets(rows)
        results["targets"] = targets
        print("\n".join(targets))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
