"""Per-step cost of the C128 ops in the patterns a model runs, at DeepSeek-V4-Flash shapes (20 C128 layers,
head_dim 512), per speculative step (a verify of N tokens per request).

In a forward, layer l's kv_score is a projection of layer l-1's output, so the layers run one after the
other: a verify cannot batch them. Patterns, per step:

* ``model``: per layer one ``verify(..., layer=l, pending=...)``; the previous step's commit is fused into
  it (``pending``: the previous step's seq_lens per slot, as ``Controller.prepare_forward`` +
  ``write_prefix`` do), so 20 launches and no commit launch.
* ``sglang``: per layer one verify (SGLang's write_prefix_states), then one commit per layer (its
  commit_pending): 40 launches. (SGLang also launches mark_pending twice per step; not counted here.)
* ``launch``: the floor, per layer one do-nothing launch (a verify of a single padding row, slot -1):
  20 launches.
* ``kernel``: the floor of a kernel XLA compiles and launches itself (a Pallas kernel reading one element per
  row), per layer, instead of a custom call. XLA records a custom call into its command buffer by tracing
  the handler into a nested graph; ``launch`` minus ``kernel`` is what that costs over a plain kernel node.
* ``chain``: the dependency chain alone (see ``_depend``), no C128 op: what stands for the model's own
  kernels between two C128 layers. A pattern's cost minus the chain's is what its C128 ops add to a step.
* ``batched``: one verify and one commit for all 20 layers. A reference only, not a pattern a model can
  run (it needs every layer's kv_score before the first layer's attention).
* ``deferred``: a candidate design a model can run. A layer's attention needs of the verify only the entry
  of a block it closes, so per layer only that entry is computed, in jnp (the pending commit's bank
  gathered, the N tokens folded: XLA fuses it with its neighbours), and the bank writes of every layer are
  one ``verify(..., pending=...)`` of all layers at the end of the step (the layers' kv_score gathered into
  one array): 1 launch per step.
* ``skip``: a candidate design that stays exact (native math only). A layer needs the verify's entry only
  when some row's N tokens close a 128-block (``seq % 128 + N > 128``; about N / 128 of a row's steps), and
  whether one does is known before the forward. So one ``lax.cond`` per step: when a block closes, the
  ``model`` pattern; when none does, the layers run without C128 op and one ``verify(..., pending=...)`` of
  all layers writes every bank at the end of the step (its entries are all zero). Its cost per step depends
  on how many steps close a block, as in a model's decoding: the rows' positions advance by their accept
  lengths from the offsets of ``make_inputs``.

Every per-layer pattern carries the same dependency chain (see ``_depend``). Each pattern runs unrolled
``--repeat`` steps (positions advancing) inside one jit-compiled executable with the state donated. The time
per step is the slope between that executable and one of a single step, (t_repeat - t_1) / (repeat - 1),
each the median of ``--iters`` calls: host dispatch and the final sync, paid once per call, cancel. (The
unrolled executables compile in time superlinear in their length, hence a slope over a modest repeat.) Every
pattern's executables are compiled once and timed in ``--rounds`` rounds, the patterns interleaved, so that a
drift of the device's clocks reaches every pattern alike; the table gives the median slope over the rounds,
the JSON every round's (single runs of these executables read up to 50% apart between sessions). The
bandwidth floor is the bytes the model's step must move divided by the device's copy bandwidth (read +
write of a 2 GiB array, measured here).

Usage: python bench/bench_ops.py [--batches 1 8 64 256] [--draft 4]
    [--out bench/results/YYYY-MM-DD/bench_ops.json]
"""

from __future__ import annotations

import argparse
import collections
import functools
import gzip
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

import jax_oc128 as oc
from jax_oc128 import reference
from jax_oc128.engine import GPU_LOOP_OPTIONS
from jax_oc128.nn import ModelConfig
from jax_oc128.rules import BLOCK, committed_bank

V4FLASH = ModelConfig.deepseek_v4_flash()
LAYERS, DIM = V4FLASH.compressed_layers, V4FLASH.head_dim  # 20 C128 layers, head_dim 512
PATTERNS = ("chain", "launch", "kernel", "model", "model_jnp", "sglang", "batched", "deferred", "skip")
DEFAULT_OUT = pathlib.Path(__file__).resolve().parent / "results" / "bench_ops.json"


class Phases:
    """Prints the time each phase took on stderr as it ends, after ``label`` (so that a run cut short shows
    where its time went: in the phase after the last line), in whichever process runs it."""

    def __init__(self, label: str):
        self.label, self.clock = label, time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        print(f"{self.label}: {name} {now - self.clock:.1f} s", file=sys.stderr, flush=True)
        self.clock = now


def timed(fn, carry, consts, iters, warmup_s=0.2):
    """``(median seconds per call, carry)`` of ``carry = fn(carry, consts)`` (carry donated), after
    ``warmup_s`` seconds of untimed calls (the first compiles; the rest bring the device's clocks up)."""
    start = time.perf_counter()
    while time.perf_counter() - start < warmup_s:
        carry = fn(carry, consts)
        jax.block_until_ready(carry)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        carry = fn(carry, consts)
        jax.block_until_ready(carry)
        times.append(time.perf_counter() - start)
    return float(np.median(times)), carry


def copy_bandwidth(iters, mib=2048):
    """Bytes/s of a device copy (read + write) of a ``mib`` MiB (default 2 GiB) array."""
    fn = jax.jit(lambda x, _: x * 1.0001)
    x = jnp.ones((mib * 256 * 1024,), jnp.float32)
    return 2 * x.nbytes / timed(fn, x, None, iters)[0]


def kernel_events(trace_dir):
    """The kernels of the newest trace under ``trace_dir`` (jax's profiler:
    ``plugins/profile/*/*.trace.json.gz``): the complete events of a GPU process's stream threads (not its
    XLA module and op summary lines), each a dict with ``name``, ``ts``, ``dur`` (us) and ``args``."""
    path = max(
        pathlib.Path(trace_dir).glob("plugins/profile/*/*.trace.json.gz"), key=lambda p: p.stat().st_mtime
    )
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    names = ("process_name", "thread_name")
    meta = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e.get("name") in names}
    on_gpu = [e for e in events if e.get("ph") == "X" and "GPU" in meta.get((e["pid"], None), "")]
    return [e for e in on_gpu if "Stream" in meta.get((e["pid"], e.get("tid")), "")]


def device_kernels(trace_dir, calls: int):
    """``(span_us, kernels_us, by_kernel)`` per call of the newest trace under ``trace_dir``
    (:func:`kernel_events`) of ``calls`` calls: the span of the GPU streams' kernels (first start to last
    end) over ``calls``, their summed durations over ``calls``, and each kernel name's summed microseconds
    per call, largest first."""
    kernels = kernel_events(trace_dir)
    if not kernels:
        return 0.0, 0.0, []
    span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    by_kernel = collections.Counter()
    for e in kernels:
        by_kernel[e["name"]] += e["dur"] / calls
    total = sum(by_kernel.values())
    return span / calls, total, by_kernel.most_common()


def step_bytes(rows, n, dtype_bytes):
    """Bytes the model's step must move, all layers (ape, shared by all rows, is not counted): per row and
    layer, read the accepted bank and write it to bank 0 (the fused commit), read the N tokens' kv_score,
    write N banks and the entry."""
    state_row = 3 * DIM * dtype_bytes
    return LAYERS * rows * (2 * state_row + n * 2 * DIM * 4 + n * state_row + DIM * 4)


def make_inputs(rows, n, dtype, seed=0):
    """``(state, kv_score [L, rows, n, 2D], seq_lens, slots, ape [L, 128, D], accept)`` at Flash shapes."""
    rng = np.random.default_rng(seed)
    state = oc.init_state(LAYERS, rows, DIM, n, dtype)
    kv = jnp.asarray(rng.normal(size=(LAYERS, rows, n, 2 * DIM)).astype(np.float32))
    ape = jnp.asarray(rng.normal(size=(LAYERS, BLOCK, DIM)).astype(np.float32))
    seq = jnp.asarray(1024 + rng.choice([1, 2, 63, 120, 126, 127], rows), jnp.int32)  # mostly partial blocks
    slots = jnp.arange(rows, dtype=jnp.int32)
    accept = jnp.asarray(rng.integers(1, n + 1, rows), jnp.int32)
    return state, kv, seq, slots, ape, accept


def _depend(kv, blocks):
    """Layer l's kv_score ``[1, rows, N, 2D]`` made to depend on layer l-1's output ``blocks`` ``[rows, 1]``.

    The term is 1 where ``entry_blocks == -2``, which never happens (blocks are -1 or >= 0), so it adds 0.0
    and the data stay as they are; XLA cannot know that, so this layer's verify must wait for the previous
    one's output, as a real layer's kv_score (a projection of the previous layer's output) must. The term goes
    into one element per row, in place (kv is carried and donated), so the chain costs one tiny fusion per
    layer and no copy of kv. Every per-layer pattern pays the same chain.
    """
    return kv.at[0, :, 0, 0].add((blocks[:, 0] == -2).astype(kv.dtype))


def _layers(state, kv, blocks, seq, slots, ape, pending=None, ops=oc):
    """One verify per layer along the dependency chain (``ops.verify``: the native op, or with
    ``ops=oc.reference`` its jnp twin); returns ``(state, kv, blocks)``."""
    kv = list(kv)
    for layer in range(LAYERS):
        kv[layer] = _depend(kv[layer], blocks)
        state, _, blocks = ops.verify(state, kv[layer], seq, slots, ape[layer], layer=layer, pending=pending)
    return state, kv, blocks


def _noop_kernel(kv):
    """``blocks`` ``[rows, 1]`` (-1, as kv is finite) read from ``kv[0, :, 0, 0]`` by one Pallas kernel."""

    def body(kv_ref, blocks_ref):
        blocks_ref[...] = jnp.where(jnp.isnan(kv_ref[0, :, 0, :]), -2, -1).astype(jnp.int32)

    rows = kv.shape[1]
    return pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct((rows, 1), jnp.int32),
        in_specs=[pl.BlockSpec((1, rows, 1, 1), lambda: (0, 0, 0, 0))],
        out_specs=pl.BlockSpec((rows, 1), lambda: (0, 0)),
        interpret=jax.default_backend() == "cpu",
    )(kv)


def _chain_blocks(kv):
    """``blocks`` ``[rows, 1]`` (-1, as kv is finite) read from ``kv[0, :, 0, 0]`` by an XLA fusion."""
    return jnp.where(jnp.isnan(kv[0, :, :1, 0]), -2, -1).astype(jnp.int32)


def _chain_step(c, k, blocks_of=_chain_blocks):
    """The dependency chain alone: the next layer's input depends on this one's through ``blocks_of``."""
    kv, blocks = list(c["kv"]), c["blocks"]
    for layer in range(LAYERS):
        kv[layer] = _depend(kv[layer], blocks)
        blocks = blocks_of(kv[layer])
    return dict(c, kv=kv, blocks=blocks)


def _entry(state, kv, seq, slots, ape, committing, layer):
    """The entry ``[1, rows, D]`` of the block a verify of ``kv`` ``[1, rows, N, 2D]`` closes (0 where none)
    for ``layer``, in jnp, from the banks as they are before the step's writes: the bank the pending commit
    keeps (``committing``), then the N tokens folded. Rows as in the model's step: valid, one per slot."""
    before = committing[slots]
    accept = seq - before
    bank = jnp.where(before >= 0, committed_bank(before, accept, state.shape[1]), 0)
    m, s, num = reference.load_state(state[layer, bank, slots][None])
    return reference.fold_verify(m, s, num, kv, seq % BLOCK, ape)[1]


def _verified(c, k, state, **updates):
    """The carry after a step's verifies at ``c["seq"]`` left ``state``: the positions advanced by the
    accepts and this step's seq_lens pending (prepare_forward(TARGET_VERIFY): what was pending is committed
    by this step's verifies, fused; the next step's seq_lens - pending is this step's accept)."""
    pending = c["pending"].at[k["slots"]].set(c["seq"], mode="drop")
    return dict(c, state=state, seq=c["seq"] + k["accept"], pending=pending, **updates)


def _verify_all_layers(c, k, kv):
    """One verify of every layer's banks (``kv`` the layers' kv_score), the pending commit fused."""
    kv = jnp.concatenate(kv)
    return oc.verify(c["state"], kv, c["seq"], k["slots"], k["ape_all"], pending=c["pending"])[0]


def _deferred_step(c, k):
    kv, entry = list(c["kv"]), c["entry"]
    for layer in range(LAYERS):
        # the next layer's input depends on this layer's attention, which reads the entry
        kv[layer] = kv[layer].at[0, :, 0, 0].add((entry[0, :, 0] == -3e38).astype(kv[layer].dtype))
        entry = _entry(c["state"], kv[layer], c["seq"], k["slots"], k["ape"][layer], c["pending"], layer)
    return _verified(c, k, _verify_all_layers(c, k, kv), kv=kv, entry=entry)


def _skip_step(c, k):
    closes = jnp.any(c["seq"] % BLOCK + c["kv"][0].shape[2] > BLOCK)

    def deferred(c, k):
        c = _chain_step(c, k)
        return _verified(c, k, _verify_all_layers(c, k, c["kv"]))

    return jax.lax.cond(closes, _model_step, deferred, c, k)


def _model_step(c, k, ops=oc):
    state, kv, blocks = _layers(
        c["state"], c["kv"], c["blocks"], c["seq"], k["slots"], k["ape"], c["pending"], ops
    )
    return _verified(c, k, state, kv=kv, blocks=blocks)


def _sglang_step(c, k):
    state, kv, blocks = _layers(c["state"], c["kv"], c["blocks"], c["seq"], k["slots"], k["ape"])
    for layer in range(LAYERS):
        state = oc.commit(state, c["seq"], k["accept"], k["slots"], layer=layer, num_layers=1)
    return dict(c, state=state, kv=kv, blocks=blocks, seq=c["seq"] + k["accept"])


def _launch_step(c, k):
    state, kv, blocks = _layers(c["state"], c["kv"], c["blocks"], c["seq"], k["slots"], k["ape"])
    return dict(c, state=state, kv=kv, blocks=blocks)


def _batched_step(c, k):
    state, _, _ = oc.verify(c["state"], k["kv_all"], c["seq"], k["slots"], k["ape_all"])
    state = oc.commit(state, c["seq"], k["accept"], k["slots"])
    return dict(c, state=state, seq=c["seq"] + k["accept"])


STEPS = {
    "chain": _chain_step,
    "launch": _launch_step,
    "kernel": functools.partial(_chain_step, blocks_of=_noop_kernel),
    "model": _model_step,
    "model_jnp": functools.partial(_model_step, ops=oc.reference),
    "sglang": _sglang_step,
    "batched": _batched_step,
    "deferred": _deferred_step,
    "skip": _skip_step,
}


def setup(pattern, rows, n, dtype):
    """``(carry, consts)`` of ``pattern``: carry (donated) holds what a step updates."""
    state, kv, seq, slots, ape, accept = make_inputs(rows, n, dtype)
    if pattern == "launch":  # one padding row
        kv, seq, slots = kv[:, :1], jnp.zeros((1,), jnp.int32), jnp.full((1,), -1, jnp.int32)
    carry = dict(
        state=state,
        kv=[kv[layer : layer + 1] for layer in range(LAYERS)],
        blocks=jnp.full((seq.shape[0], 1), -1, jnp.int32),
        seq=seq,
        pending=jnp.full((rows,), -1, jnp.int32),
    )
    consts = dict(slots=slots, accept=accept, ape=[ape[layer : layer + 1] for layer in range(LAYERS)])
    if pattern == "batched":
        carry.pop("kv")
        consts.update(kv_all=kv, ape_all=ape)
    if pattern == "skip":
        consts.update(ape_all=ape)
    if pattern == "deferred":
        carry.pop("blocks")
        carry["entry"] = jnp.zeros((1, rows, DIM), jnp.float32)
        consts.update(ape_all=ape)
    return carry, consts


def build(pattern, repeat):
    """A jitted function running ``repeat`` steps of ``pattern``, the carry donated, compiled as the engine
    compiles its decode loop (on a GPU with :data:`~jax_oc128.engine.GPU_LOOP_OPTIONS`: a ``lax.cond`` is a
    conditional node of the command buffer, not a return to the host)."""

    def run(carry, consts):
        for _ in range(repeat):
            carry = STEPS[pattern](carry, consts)
        return carry

    options = GPU_LOOP_OPTIONS if jax.default_backend() == "gpu" else None
    return jax.jit(run, donate_argnums=0, compiler_options=options)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--draft", type=int, nargs="+", default=[4])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeat", type=int, default=10, help="steps unrolled in one executable (>= 2)")
    parser.add_argument("--iters", type=int, default=50, help="timed calls per round (median)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, the patterns interleaved (median)")
    parser.add_argument("--patterns", nargs="+", choices=PATTERNS, default=list(PATTERNS))
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args()
    if args.repeat < 2:
        parser.error("--repeat: at least 2 (the time per step is a slope)")

    device = jax.devices()[0].device_kind
    bandwidth = copy_bandwidth(args.iters)
    print(f"device: {device}, copy bandwidth {bandwidth / 1e9:.0f} GB/s, N = {args.draft}")
    print(
        f"us per speculative step, {LAYERS} C128 layers, head_dim {DIM}, {args.repeat} steps per executable:"
    )
    print("(in parentheses: the pattern minus the chain, what its C128 ops add)")
    print("dtype     N batch | " + " | ".join(f"{p:>9s} (-chain)" for p in args.patterns) + " | bw floor")
    results = dict(
        device=device,
        copy_bandwidth=bandwidth,
        layers=LAYERS,
        head_dim=DIM,
        repeat=args.repeat,
        iters=args.iters,
        rounds=args.rounds,
        patterns=dict(
            chain=f"the dependency chain of {LAYERS} layers alone, no C128 op",
            launch=f"{LAYERS} do-nothing launches (verify of one padding row), same dependency chain",
            kernel=f"{LAYERS} do-nothing kernels XLA launches itself (Pallas), same dependency chain",
            model=f"{LAYERS} verify launches, the previous step's commit fused (pending)",
            model_jnp="the model's pattern with the jnp twin of verify (XLA fuses it with its neighbours)",
            sglang=f"{LAYERS} verify + {LAYERS} commit launches",
            batched="1 verify + 1 commit for all layers: reference only, not a pattern a model can run",
            deferred="per layer the closed block's entry in jnp, then 1 verify of all layers' banks",
            skip="per step a cond: the model pattern when a row closes a block, else 1 verify of all layers",
        ),
        rows=[],
    )
    for dtype in args.dtypes:
        for n in args.draft:
            for rows in args.batches:
                runs = {}  # (pattern, repeat): [executable, carry, consts]
                for pattern in args.patterns:
                    for repeat in (1, args.repeat):
                        runs[pattern, repeat] = [
                            build(pattern, repeat),
                            *setup(pattern, rows, n, jnp.dtype(dtype)),
                        ]
                slopes = {pattern: [] for pattern in args.patterns}
                raw = {pattern: {"1": [], str(args.repeat): []} for pattern in args.patterns}
                for _ in range(args.rounds):
                    for pattern in args.patterns:
                        seconds = {}
                        for repeat in (1, args.repeat):
                            fn, carry, consts = runs[pattern, repeat]
                            seconds[repeat], runs[pattern, repeat][1] = timed(fn, carry, consts, args.iters)
                            raw[pattern][str(repeat)].append(seconds[repeat] * 1e6)
                        slopes[pattern].append((seconds[args.repeat] - seconds[1]) / (args.repeat - 1) * 1e6)
                us = {pattern: float(np.median(slopes[pattern])) for pattern in args.patterns}
                total = step_bytes(rows, n, jnp.dtype(dtype).itemsize)
                row = dict(dtype=dtype, draft=n, batch=rows, **{f"{k}_us": v for k, v in us.items()})
                launch = us.get("launch", float("nan"))
                row.update(
                    launch_per_launch_us=launch / LAYERS,
                    bytes=total,
                    floor_us=total / bandwidth * 1e6,
                    **{f"{p}_x_launch": us[p] / launch for p in us},
                    call_us=raw,
                    round_us=slopes,
                )
                if "chain" in us:  # what each pattern's C128 ops add to the chain
                    row.update({f"{p}_c128_us": us[p] - us["chain"] for p in us if p != "chain"})
                if "model" in us and "sglang" in us:
                    row["model_x_sglang"] = us["model"] / us["sglang"]
                results["rows"].append(row)
                chain = us.get("chain", float("nan"))
                cells = " | ".join(f"{us[p]:9.1f} ({us[p] - chain:6.1f})" for p in args.patterns)
                print(f"{dtype:8s} {n:2d} {rows:5d} | {cells} | {row['floor_us']:8.2f}")
                spread = ", ".join(f"{p} {min(v):.1f}-{max(v):.1f}" for p, v in slopes.items())
                print(f"{'':17s}   rounds: {spread}")
    print("* batched: one verify + one commit for all layers, a reference, not a pattern a model can run")
    print("* deferred: per layer the closed block's entry in jnp, then one verify of every layer's banks")
    print("* skip: the model pattern on steps where a block closes, else one verify of every layer's banks")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
