"""Where the slice's decode step on the attention kernel loses its time on the GPU (issue 40; RESULTS
sections 29 and 30: `bench_decode.py --attention-impl kernel` printed no row within 200 s, where the jnp
row did).

Each stage runs in a child process of its own with a time limit (`--timeout`), its lines printed as they
come, so that a stage that hangs is reported after its last line and the next one still runs. Stages
(`--stages`, in this order by default):

* `op`: the op alone (jit), once per layer kind, on a decode's inputs at the slice's shapes (8 slots, one
  query each, 64 heads of 512, float32 as nn/attend.py passes them, the context bucket of 512 that
  bench_decode's row reads, slots 6 and 7 idle: only their own new key), the pool rows no query names
  NaN; checked against the jnp twin; its time per call.
* `loop`: the three layers' ops in a `lax.fori_loop` of 16 steps (each step's q from the last step's
  output), compiled with XLA's default options.
* `loop_cmdbuf`: the same loop compiled with the engine's decode options (`GPU_LOOP_OPTIONS`: the loop as
  one CUDA graph, WHILE / CONDITIONAL / CUSTOM_CALL in command buffers), as `Engine.decode` compiles it.
  In a fresh process its kernels (the split's combine kernel among them) are first launched while XLA
  captures the handler into the graph; `loop_cmdbuf_warm` first calls each layer's op once outside it.
* `engine_jnp`, `engine_nocmdbuf`, `engine`: the slice (`--layers`, default 4: two sliding, one CSA, one
  HCA layer; `--experts` 8; bf16 random weights), `Engine(8 slots, K=16)`, 200-token prompts: the
  prefill, then three decode dispatches at the same context bucket, each timed; on the jnp path, on the
  kernel with XLA's command buffers off (`XLA_FLAGS=--xla_gpu_enable_command_buffer=`), on the kernel with
  CUDA's modules loaded eagerly (`CUDA_MODULE_LOADING=EAGER`: no kernel loaded lazily during a graph's
  capture; the prefill never launches the combine kernel, the decode's split does) and on the kernel as
  the engine compiles it.

Run: `python3 bench/results/2026-12-06/s6_kdecode_probe.py [--timeout 150] [--stages op loop ...]` (after
the CUDA build). Every line is flushed as it is printed.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import time

SLOTS, IDLE, HEADS, DIM, STEPS, CONTEXT, PROMPT = 8, 2, 64, 512, 16, 512, 200
STAGES = (
    "op",
    "loop",
    "loop_cmdbuf",
    "loop_cmdbuf_warm",
    "engine_jnp",
    "engine_nocmdbuf",
    "engine_eager",
    "engine",
)


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def decode_inputs(kind: str, seed: int = 0):
    """The op's operands in a decode step of layer ``kind`` (sliding, csa, hca), as nn/attend.py's _kernel
    builds them: the window's ring (sliding window 128 + max_draft 4 rows) and the new key, then a CSA
    layer's picks (one row per pick) or an HCA layer's entries (one range); the last IDLE slots idle."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    ring, window = 132, 128
    width = ring + 1  # the ring's rows, then the one new key (its own)
    positions = np.array([PROMPT + 7 * s for s in range(SLOTS - IDLE)] + [0] * IDLE)
    active = np.arange(SLOTS) < SLOTS - IDLE
    index = np.full((SLOTS, 1, width), -1, np.int32)
    for s in range(SLOTS):
        if active[s]:  # the window's last 127 ring rows (by position) and the new key
            rows = (positions[s] - np.arange(1, window)) % ring
            index[s, 0, rows] = rows
        index[s, 0, ring] = ring
    pool, ranges = width, np.zeros((SLOTS, 1, 0, 2), np.int32)
    if kind == "csa":
        picks = min(512, CONTEXT // 4)  # top-k of the bucket's entries
        seen = np.where(active, (positions + 1) // 4, 0)
        extra = np.where(np.arange(picks) < np.minimum(seen, picks)[:, None], width + np.arange(picks), -1)
        index = np.concatenate([index, extra[:, None].astype(np.int32)], axis=-1)
        pool += picks
    if kind == "hca":
        entries = CONTEXT // 128
        seen = np.where(active, (positions + 1) // 128, 0)
        ranges = np.stack([np.full(SLOTS, width), width + seen], axis=-1)[:, None, None].astype(np.int32)
        pool += entries
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (SLOTS, 1, HEADS, DIM), jnp.float32)
    kv = np.array(jax.random.normal(keys[1], (SLOTS, pool, DIM), jnp.float32))
    named = np.zeros((SLOTS, pool), bool)
    for s in range(SLOTS):
        named[s, index[s, 0][index[s, 0] >= 0]] = True
        for begin, end in ranges[s, 0]:
            named[s, begin:end] = True
    kv[~named] = np.nan  # a kernel that reads a row no query names fails the check
    sinks = jax.random.normal(keys[2], (HEADS,), jnp.float32)
    return q, jnp.asarray(kv), jnp.asarray(index), jnp.asarray(ranges), sinks


def timed(fn, *args, reps=20) -> float:
    import jax

    start = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps * 1e3


def stage_op() -> None:
    import jax
    import numpy as np

    from jax_oc128 import attention_op

    for kind in ("sliding", "csa", "hca"):
        q, kv, index, ranges, sinks = decode_inputs(kind)
        keys = index.shape[2] + ranges.shape[2] * kv.shape[1]
        parts = attention_op.splits(SLOTS, HEADS, keys)
        say(
            f"op {kind}: pool {kv.shape[1]}, picks {index.shape[2]}, ranges {ranges.shape[2]}, splits {parts}"
        )
        op = jax.jit(lambda *a: attention_op.attention(*a, scale=DIM**-0.5))
        start = time.perf_counter()
        out = jax.block_until_ready(op(q, kv, index, ranges, sinks))
        say(f"op {kind}: first call (compile) {time.perf_counter() - start:.2f} s")
        twin = attention_op.attention_reference(q, kv, index, ranges, sinks, scale=DIM**-0.5)
        error = float(np.max(np.abs(np.asarray(out) - np.asarray(twin))))
        finite = bool(np.all(np.isfinite(np.asarray(out))))
        per_call = timed(op, q, kv, index, ranges, sinks)
        say(f"op {kind}: max |op - twin| {error:.3g}, finite {finite}, {per_call:.3f} ms per call")


def stage_loop(options, warm: bool) -> None:
    import jax

    from jax_oc128 import attention_op

    layers = [decode_inputs(kind, seed) for seed, kind in enumerate(("sliding", "csa", "hca"))]

    def run(q0):
        def step(_, q):
            for _q, kv, index, ranges, sinks in layers:
                q = attention_op.attention(q, kv, index, ranges, sinks, scale=DIM**-0.5) + q
            return q

        return jax.lax.fori_loop(0, STEPS, step, q0)

    loop = jax.jit(run, compiler_options=options)
    q = layers[0][0]
    if warm:
        for _q, kv, index, ranges, sinks in layers:
            jax.block_until_ready(attention_op.attention(q, kv, index, ranges, sinks, scale=DIM**-0.5))
        say("loop: each layer's op called once outside the loop (its kernels loaded)")
    start = time.perf_counter()
    compiled = loop.lower(q).compile()
    say(f"loop: compile {time.perf_counter() - start:.2f} s, options {options}")
    start = time.perf_counter()
    out = jax.block_until_ready(compiled(q))
    finite = bool(jax.numpy.all(jax.numpy.isfinite(out)))
    say(f"loop: first run {time.perf_counter() - start:.3f} s, finite {finite}")
    say(f"loop: {timed(compiled, q, reps=5):.3f} ms per loop of {STEPS} steps x 3 ops")


def stage_engine(impl: str, layers: int, experts: int) -> None:
    import jax
    import numpy as np
    from flax import nnx

    from jax_oc128.controller import ONLINE
    from jax_oc128.engine import Engine
    from jax_oc128.nn import ModelConfig, RuntimeConfig, SpeculativeModel

    env = {name: os.environ.get(name, "") for name in ("XLA_FLAGS", "CUDA_MODULE_LOADING")}
    say(f"engine {impl}: {env}, building {layers} layers, {experts} experts")
    config = ModelConfig.deepseek_v4_flash(num_layers=layers, num_experts=experts, dtype="bfloat16")
    runtime = RuntimeConfig(max_len=4096, max_draft=4, attention_impl=impl)
    model = SpeculativeModel(config, runtime, backend=ONLINE, rngs=nnx.Rngs(0))
    engine = Engine(model, SLOTS, steps_per_dispatch=STEPS)
    say(f"engine {impl}: built, layer types {[t.value for t in config.layer_types]}")
    rng = np.random.default_rng(0)
    prompts = {s: rng.integers(0, config.vocab_size, PROMPT).astype(np.int32) for s in range(SLOTS)}
    state = engine.init_state(0)
    start = time.perf_counter()
    state, _ = engine.prefill(state, prompts, 1024)
    jax.block_until_ready(state)
    say(f"engine {impl}: prefill (compiles) {time.perf_counter() - start:.2f} s")
    for n in range(3):
        start = time.perf_counter()
        state, output = engine.decode(state, steps=STEPS, context=CONTEXT)
        jax.block_until_ready((state, output))
        seconds = time.perf_counter() - start
        say(f"engine {impl}: decode dispatch {n} {seconds:.3f} s, steps {int(output.steps)}")


def child(stage: str, args) -> None:
    import jax

    from jax_oc128.engine import GPU_LOOP_OPTIONS

    say(f"stage {stage}: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    if stage == "op":
        stage_op()
    elif stage.startswith("loop"):
        graph = stage != "loop" and jax.default_backend() == "gpu"
        stage_loop(GPU_LOOP_OPTIONS if graph else None, warm=stage == "loop_cmdbuf_warm")
    else:
        stage_engine("jnp" if stage == "engine_jnp" else "kernel", args.layers, args.experts)
    say(f"stage {stage}: done")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds per stage")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--child", choices=STAGES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args)
    root = pathlib.Path(__file__).resolve().parents[3]
    for stage in args.stages:
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(root))
        if stage == "engine_nocmdbuf":
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
        if stage == "engine_eager":
            env["CUDA_MODULE_LOADING"] = "EAGER"
        command = [sys.executable, __file__, "--child", stage, "--layers", str(args.layers)]
        command += ["--experts", str(args.experts)]
        start = time.perf_counter()
        try:  # the child's lines go straight to this process's output, as they are printed
            code = subprocess.run(command, env=env, timeout=args.timeout).returncode
            say(f"== {stage}: exit {code}, {time.perf_counter() - start:.1f} s")
        except subprocess.TimeoutExpired:
            say(f"== {stage}: TIMEOUT after {args.timeout:.0f} s (in the step after its last line)")


if __name__ == "__main__":
    main()
