"""The decode loop's time per step on the device alone against end to end through ``Engine.generate``, for the
shipped model and DeepSeek-V4-Flash-shaped models, online and offline C128 state, plain and speculative.

Configs:

* ``shipped``: the model shipped in the package (``checkpoint.load``; 4 layers, 2 of them C128, byte-level).
  Prompts are slices of the demo's text, so that the drafts are accepted as in use.
* ``v4flash-attn``: the attention of DeepSeek-V4-Flash (``ModelConfig.deepseek_v4_flash``) at its shapes
  (hidden 4096, 64 heads x 512, q and o LoRA rank 1024, 8 o-groups, rope_dim 64 with the compress RoPE's YaRN,
  window 128) in 6 layers alternating sliding and C128, a dense SwiGLU MLP of 2048 and one residual stream
  (the small MTP head), float32, random weights (``nnx.Rngs(0)``, the same for both backends), ``max_len``
  4096 (the 64-slot caches stay small), ``max_draft`` 4. The vocabulary is 4096, not V4's 129280: the point
  is the attention and the C128 state, and a full-size LM head (2 GiB of float32, read at every step and
  every draft) would dominate the small-batch steps. Prompts are random token ids; the random MTP head's
  drafts are almost never accepted (mean accepted length about 1), which does not matter for the time per
  step.
* ``v4flash-slice``: DeepSeek-V4-Flash as released (``ModelConfig.deepseek_v4_flash``: its config.json), its
  first 6 layers (sliding, sliding, CSA, HCA, CSA, HCA; hash-routed MoE in the first 3, top-k in the others):
  hidden 4096, 64 heads x 512, q and o LoRA rank 1024, 8 o-groups, rope_dim 64 (compress RoPE YaRN x16 from
  65536), window 128, the CSA indexer's 64 heads x 128 and top-512, MoE experts of 2048 with 6 routed per
  token and a shared one, routed scaling 1.5, SwiGLU limit 10, hyper-connections of 4 streams with 20
  Sinkhorn iterations, the vocabulary of 129280, and DeepSeek-V4's MTP layer as the draft head; but 16 routed
  experts instead of 256 (the MoE computes every expert for every token) so that it fits one GPU: 4.9 billion
  parameters, 9.8 GB in bfloat16 (the matrices; norms, hyper-connections and biases float32). Random weights
  made one at a time (each drawn in float32, stored in bfloat16; the constructor under ``jit`` would hold
  every float32 draw at once, 39 GB), ``max_len`` 4096, ``max_draft`` 4; random prompts.

Modes (``--modes``): ``plain``; ``N``, speculative steps verifying a chain of N tokens (the bonus token and
N - 1 drafts); ``treeN``, tree speculation at the same verify width: the default draft tree of N nodes
(:meth:`jax_oc128.tree.Tree.default`), drafted level by level by the MTP head and verified in one forward.

Per (config, backend, mode, slots), with one engine of ``slots`` slots and K steps per dispatch:

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

Targets (the issue): e2e time per step <= 1.1x the device time per step at 8 slots, plain and N = 4; the
online C128 state never slower per step than the offline one at the V4-Flash config. Both are checked and
printed after the table, the first on the same-work ratio (a decode loop cannot make the prefill's compute
go away; the per-step ratio is printed beside it).

``--sweep-k 1 4 16 64`` instead measures e2e tokens/s for each K (one engine per K) at the first config and
backend, for the given modes and slots, to choose the engine's default K by measurement.

``--mesh data=D,model=M`` runs every engine on a mesh of D x M devices (``Engine(mesh=)``): the slots split
over the D devices of the data axis (data parallel; each slot count a multiple of D), the heads, o-groups,
MLP and vocabulary over the M of the model axis (tensor parallel). Without it: one device.

Usage (from a directory other than the repository root, or with jax_oc128 installed)::

    python bench/bench_decode.py [--configs shipped v4flash-attn v4flash-slice] [--backends online offline]
        [--modes plain 2 4 tree8] [--slots 1 8 64] [--steps-per-dispatch K] [--tokens 256]
        [--out bench/results/YYYY-MM-DD/bench_decode.json]
    python bench/bench_decode.py --configs shipped --sweep-k 1 4 16 64 --modes plain 4 --slots 8
    python bench/bench_decode.py --configs shipped --backends online --modes 8 tree8 --slots 1 8
    python bench/bench_decode.py --configs v4flash-attn --backends online --mesh data=2,model=1 --slots 8 16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import time

import jax
import numpy as np
from flax import nnx

from jax_oc128 import checkpoint
from jax_oc128.controller import BACKENDS
from jax_oc128.engine import STEPS_PER_DISPATCH, Engine
from jax_oc128.nn import ModelConfig, SpeculativeModel, sharding
from jax_oc128.nn.attention import HCA, SLIDING
from jax_oc128.tree import Tree

DEFAULT_OUT = pathlib.Path(__file__).resolve().parent / "results" / "bench_decode.json"
CONFIGS = ("shipped", "v4flash-attn", "v4flash-slice")
#: DeepSeek-V4-Flash's attention shapes in 6 layers (see the module doc)
V4FLASH_ATTN = dataclasses.replace(
    ModelConfig.deepseek_v4_flash(max_len=4096, max_draft=4),
    vocab_size=4096,
    layer_types=(SLIDING, HCA) * 3,
    mlp_layer_types=None,
    hc_mult=None,
)
#: DeepSeek-V4-Flash's first 6 layers with 16 experts, in bfloat16 (see the module doc)
V4FLASH_SLICE = ModelConfig.deepseek_v4_flash(
    num_layers=6, num_experts=16, max_len=4096, max_draft=4, dtype="bfloat16"
)
#: the demo's prompts (byte-level text for the shipped model)
TEXT = (
    "Return a new list containing all items from the iterable in ascending order. A custom key function "
    "can be supplied to customize the sort order, and the reverse flag can be set to request the result in "
    "descending order. Open file and return a corresponding file object. If the file cannot be opened, an "
    "OSError is raised. This module provides access to some variables used or maintained by the interpreter "
    "and to functions that interact strongly with the interpreter. It is always available. Create a new "
    "thread "
)


def build_model(config: str, backend: str) -> SpeculativeModel:
    if config == "shipped":
        return checkpoint.load(backend=BACKENDS[backend])[0]
    if config == "v4flash-attn":
        return SpeculativeModel(V4FLASH_ATTN, backend=BACKENDS[backend], rngs=nnx.Rngs(0))
    if config == "v4flash-slice":
        return SpeculativeModel(V4FLASH_SLICE, backend=BACKENDS[backend], rngs=nnx.Rngs(0))
    raise ValueError(f"unknown config {config!r}")


def make_prompts(model_config: ModelConfig, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens: slices of :data:`TEXT` at different offsets for a byte-level
    model, else random token ids."""
    if model_config.vocab_size == 256:
        text = TEXT.encode("ascii")
        text = text * (length // len(text) + 2)
        return [list(text[(61 * i) % len(TEXT) :][:length]) for i in range(count)]
    rng = np.random.default_rng(seed)
    return [rng.integers(0, model_config.vocab_size, length).tolist() for _ in range(count)]


def device_time(engine: Engine, prompts, mode: dict, steps: int, device_steps: int) -> dict:
    """Device-only time per step of ``engine.decode`` (see the module doc), the prefill's time and the
    first calls' (compile) times."""
    n, max_len = mode_width(mode), engine.model.config.max_len
    dispatches = max(2, math.ceil(device_steps / steps))
    budget = max_len - len(prompts[0]) - n  # the most a prompt of this length may be given
    # no row may end: its first token (from the prefill) and 2 warm-up + D dispatches of K steps stay below
    room = (budget - 2) // (n * steps) - 2
    if room < 1:
        raise ValueError(f"max_len {max_len}: no room for a dispatch of {steps} steps of N = {n}")
    dispatches = min(dispatches, room)
    assignments = dict(enumerate(prompts))
    state, prefill = engine.init_state(0), []
    for _ in range(2):  # the first compiles; the second is the prefill's time
        start = time.perf_counter()
        state, _ = engine.prefill(state, assignments, budget, **mode)
        jax.block_until_ready(state)
        prefill.append(time.perf_counter() - start)
    warm_up = []
    for _ in range(2):  # the first compiles, the first run on these buffers records the CUDA graph
        start = time.perf_counter()
        state, output = engine.decode(state, steps=steps, **mode)
        jax.block_until_ready((state, output))
        warm_up.append(time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(dispatches):
        state, output = engine.decode(state, steps=steps, **mode)
    jax.block_until_ready((state, output))
    elapsed = time.perf_counter() - start
    if int(output.steps) != steps or not np.all(np.asarray(output.active)):
        raise RuntimeError("a row ended during the device-only timing: the budget is too small")
    del state, output
    return dict(
        device_us=elapsed / (dispatches * steps) * 1e6,
        dispatches=dispatches,
        prefill_ms=prefill[1] * 1e3,
        compile_s=prefill[0] + warm_up[0],
    )


def e2e(engine: Engine, prompts, mode: dict, tokens: int) -> dict:
    """``Engine.generate``'s tokens/s and time per step, after a short warm-up call."""
    engine.generate(prompts, 4, **mode)
    result = engine.generate(prompts, tokens, **mode)
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


def mode_width(mode: dict) -> int:
    """Tokens a step of ``mode`` verifies (1: plain)."""
    return mode["tree"].size if "tree" in mode else mode.get("num_tokens", 1)


def mode_name(mode: dict) -> str:
    if "tree" in mode:
        return f"tree N={mode['tree'].size}"
    return f"N={mode['num_tokens']}" if mode else "plain"


def measure(args) -> list[dict]:
    rows = []
    print(
        "| config | backend | mode | slots | device us/step | e2e us/step | ratio | e2e / device, same work "
        "| tokens/s | mean accepted |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for config in args.configs:
        for backend in args.backends:
            model = build_model(config, backend)
            for slots in args.slots:
                engine = Engine(model, slots, steps_per_dispatch=args.steps_per_dispatch, mesh=args.mesh)
                prompts = make_prompts(model.config, slots, args.prompt_len)
                for mode in args.modes:
                    row = dict(config=config, backend=backend, mode=mode_name(mode), slots=slots)
                    row.update(
                        device_time(engine, prompts, mode, engine.steps_per_dispatch, args.device_steps)
                    )
                    row.update(e2e(engine, prompts, mode, args.tokens))
                    floor_s = row["prefill_ms"] / 1e3 + row["steps"] * row["device_us"] / 1e6
                    row.update(
                        ratio=row["e2e_us"] / row["device_us"], ratio_same_work=row["seconds"] / floor_s
                    )
                    rows.append(row)
                    print(
                        f"| {config} | {backend} | {row['mode']} | {slots} | {row['device_us']:.1f} | "
                        f"{row['e2e_us']:.1f} | {row['ratio']:.2f} | {row['ratio_same_work']:.2f} | "
                        f"{row['tokens_per_s']:.0f} | {row['mean_accepted']:.2f} |",
                        flush=True,
                    )
                del engine
            del model
    return rows


def check_targets(rows) -> list[str]:
    """The issue's targets, as lines of text."""
    lines = []
    for row in rows:
        if row["slots"] == 8 and row["mode"] in ("plain", "N=4"):
            ok = row["ratio_same_work"] <= 1.1
            lines.append(
                f"e2e <= 1.1x device, {row['config']} {row['backend']} {row['mode']} 8 slots: "
                f"{row['ratio_same_work']:.2f} for the same work (prefill + steps), {row['ratio']:.2f} per "
                f"step with generate's prefill counted against steps alone: {'met' if ok else 'NOT met'}"
            )
    by_key = {(r["config"], r["backend"], r["mode"], r["slots"]): r for r in rows}
    for (config, backend, mode, slots), row in by_key.items():
        other = by_key.get((config, "offline", mode, slots))
        if config.startswith("v4flash") and backend == "online" and other is not None:
            x = row["device_us"] / other["device_us"]
            lines.append(
                f"online <= offline per step, {config} {mode} {slots} slots: online/offline {x:.3f} "
                f"{'met' if x <= 1.0 else 'NOT met'}"
            )
    return lines


def sweep(args) -> list[dict]:
    """E2E tokens/s per K at the first config and backend."""
    config, backend = args.configs[0], args.backends[0]
    model = build_model(config, backend)
    rows = []
    print(f"K sweep: {config}, {backend} state, {args.tokens} new tokens per request")
    print("| mode | slots | K | tokens/s | e2e us/step | dispatches | mean accepted | compile s |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in args.modes:
        for slots in args.slots:
            prompts = make_prompts(model.config, slots, args.prompt_len)
            for k in args.sweep_k:
                engine = Engine(model, slots, steps_per_dispatch=k, mesh=args.mesh)
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
        "--steps-per-dispatch", type=int, default=STEPS_PER_DISPATCH, help="K: decoding steps per dispatch"
    )
    parser.add_argument("--tokens", type=int, default=256, help="new tokens per request (e2e)")
    parser.add_argument("--prompt-len", type=int, default=200, help="prompt tokens per slot")
    parser.add_argument("--device-steps", type=int, default=128, help="steps timed on the device, at least")
    parser.add_argument(
        "--sweep-k", type=int, nargs="+", default=None, help="measure e2e tokens/s per K only"
    )
    parser.add_argument(
        "--mesh", default=None, help="data=D,model=M: the engines on a mesh of D x M devices (default: one)"
    )
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args()
    try:
        args.modes = [parse_mode(m) for m in args.modes]
    except ValueError:
        parser.error(f"--modes: 'plain', integers N >= 2 or treeN, got {args.modes}")
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
        configs={
            "shipped": "checkpoint.load() (the shipped model)",
            "v4flash-attn": dataclasses.asdict(V4FLASH_ATTN),
            "v4flash-slice": dataclasses.asdict(V4FLASH_SLICE),
        },
    )
    if args.sweep_k:
        results["sweep"] = sweep(args)
    else:
        results["rows"] = rows = measure(args)
        targets = check_targets(rows)
        results["targets"] = targets
        print("\n".join(targets))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
