"""Soak: the engine under random traffic, online vs offline C128 backend, greedy. Requests arrive at random
dispatches and take free slots while others generate, with prompts across 128-token blocks, random budgets
and stop tokens; N changes from one workload to the next. Both backends serve the same workloads: their
tokens must never diverge, every request must end exactly at its first stop token or its budget, nothing
may compile after the warm-up, and memory must stay flat (module :data:`HOST_GROWTH_BOUND` and
:func:`test_soak` say how flat).

A workload is served either by :meth:`Engine.generate` (all its requests at once, one budget) or by a
driver of :meth:`Engine.prefill` and :meth:`Engine.decode` (arrivals at random dispatches, two budgets, a
random K per dispatch where the run has several). The default run is quick: ``QUICK_STEPS`` decoding steps
(of the online engine) over N in ``QUICK_NUM_TOKENS`` and one K. ``JAX_OC128_SOAK_STEPS=n`` runs n steps
over N in ``LONG_NUM_TOKENS`` and K in ``LONG_STEPS_PER_DISPATCH``, the long run (``-s`` shows the report)::

    cd tests && JAX_OC128_SOAK_STEPS=10000 python -m pytest -q -s -m soak test_soak.py

Host memory is read from ``/proc/self/status`` (Linux); device memory from ``memory_stats()`` of the first
device where the backend has it (a GPU; not the CPU).
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import gc
import os
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from harness import count_compiles
from models import DECODE_CONFIG as CONFIG
from models import make_model

from jax_oc128.controller import OFFLINE, ONLINE
from jax_oc128.engine import Engine
from jax_oc128.rules import BLOCK

pytestmark = pytest.mark.soak

QUICK_STEPS = 1000
LONG_STEPS = os.environ.get("JAX_OC128_SOAK_STEPS")
TARGET_STEPS = int(LONG_STEPS or QUICK_STEPS)
# each (N, K) compiles the decode loop once per backend (5 to 10 s each on a 2-core CPU): few of them
QUICK_NUM_TOKENS, LONG_NUM_TOKENS = (None, 4), (None, 2, 3, 4)
QUICK_STEPS_PER_DISPATCH, LONG_STEPS_PER_DISPATCH = (8,), (3, 8)
NUM_TOKENS = LONG_NUM_TOKENS if LONG_STEPS else QUICK_NUM_TOKENS
STEPS_PER_DISPATCH = LONG_STEPS_PER_DISPATCH if LONG_STEPS else QUICK_STEPS_PER_DISPATCH

SLOTS = 3
# prompts of 1 to 2 blocks, often at a block edge, all padded to one width (prefill compiles once per
# width, 5 s on a 2-core CPU)
LONGEST_PROMPT = 2 * BLOCK
PROMPT_EDGES = (1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK - 1, 2 * BLOCK)
MAX_NEW_TOKENS = 100
MAX_STOP_TOKENS = 3
SEED = 13
# The workloads before the memory baseline: the allocators' pools and Python's caches fill in them.
WARM_UP_WORKLOADS = 2
# Host RSS at the end of the soak may exceed its highest sample over the first half by less than this.
# Over the first half it climbs to a plateau while the allocators' arenas and pools fill (the 10,000-step
# run: +32 MiB over its first ~25 workloads, then not a page over its last ~70), and inside the whole
# suite's process it also dips and comes back (a CI run: 745.9 MiB after the warm-up, 720.9 at the middle,
# 746.0 at the end), so the reference is the first half's peak, not its last sample; a leak keeps growing
# past every earlier peak at its rate: one of 4 KiB per decoding step fails the long run (5,000 steps in
# its second half). Leaked jax arrays are caught exactly by the live-array count, compilations by the
# compile count.
HOST_GROWTH_BOUND = 16 * 2**20
PROC_STATUS = Path("/proc/self/status")
try:
    LIBC = ctypes.CDLL("libc.so.6")  # glibc, for malloc_trim
except OSError:
    LIBC = None


@dataclasses.dataclass(frozen=True)
class Request:
    """A prompt (``[length]`` int32), its max new tokens, and the dispatch before which it arrives (driver
    workloads; a request of a :meth:`Engine.generate` workload waits from the start)."""

    prompt: np.ndarray
    budget: int
    arrival: int


@dataclasses.dataclass(frozen=True)
class Workload:
    """Requests served together with one N (``num_tokens``, None: plain steps) and one set of stop tokens,
    through :meth:`Engine.generate` (``through_generate``; one budget) or the driver (:func:`serve`), whose
    choices of K come from ``seed``."""

    requests: tuple[Request, ...]
    num_tokens: int | None
    stop_tokens: tuple[int, ...]
    through_generate: bool
    seed: int


@dataclasses.dataclass(frozen=True)
class Served:
    """A workload's output: ``tokens[i]`` request i's, the decoding steps run, and the admissions of requests
    while other requests were generating (driver workloads only)."""

    tokens: list[list[int]]
    steps: int
    joins: int


@dataclasses.dataclass(frozen=True)
class Memory:
    """Host RSS (bytes), the live jax arrays (count, bytes) and the device's bytes in use (None where the
    backend keeps no memory stats)."""

    host_rss: int
    live_arrays: int
    live_bytes: int
    device_in_use: int | None


def prompt_length(rng: np.random.Generator) -> int:
    """Half at a block edge, half uniform in [1, LONGEST_PROMPT]."""
    if rng.random() < 0.5:
        return int(rng.choice(PROMPT_EDGES))
    return int(rng.integers(1, LONGEST_PROMPT + 1))


def random_workload(rng: np.random.Generator) -> Workload:
    """SLOTS + 1 to 2 * SLOTS requests (more than the slots), arriving over 4 dispatches per request, with
    one budget (through generate) or two, in [1, MAX_NEW_TOKENS]; N from NUM_TOKENS; 0 to MAX_STOP_TOKENS
    stop tokens."""
    through_generate = bool(rng.random() < 0.25)
    budgets = rng.integers(1, MAX_NEW_TOKENS + 1, size=1 if through_generate else 2)
    count = int(rng.integers(SLOTS + 1, 2 * SLOTS + 1))
    requests = tuple(
        Request(
            rng.integers(0, CONFIG.vocab_size, prompt_length(rng), dtype=np.int32),
            int(rng.choice(budgets)),
            int(rng.integers(0, 4 * count)),
        )
        for _ in range(count)
    )
    stops = rng.choice(CONFIG.vocab_size, size=rng.integers(0, MAX_STOP_TOKENS + 1), replace=False)
    num_tokens = NUM_TOKENS[rng.integers(len(NUM_TOKENS))]
    return Workload(requests, num_tokens, tuple(map(int, stops)), through_generate, int(rng.integers(2**32)))


def serve(engine: Engine, state, workload: Workload):
    """Serves a workload; returns ``(state, Served)`` (``state``, the driver's decode state, donated).

    The driver: before each dispatch the requests that have arrived (``arrival`` <= the dispatch's number)
    take free slots, one prefill per budget; each dispatch runs up to K steps (K drawn from
    STEPS_PER_DISPATCH) and leaves early when a row ends while requests wait. An idle engine skips ahead to
    the next arrival."""
    if workload.through_generate:
        result = engine.generate(
            [r.prompt for r in workload.requests],
            workload.requests[0].budget,
            num_tokens=workload.num_tokens,
            stop_tokens=workload.stop_tokens,
        )
        return state, Served(result.tokens, result.steps, joins=0)
    requests, rng = workload.requests, np.random.default_rng(workload.seed)
    options = dict(num_tokens=workload.num_tokens, stop_tokens=workload.stop_tokens)
    arrivals = collections.deque(sorted(range(len(requests)), key=lambda r: requests[r].arrival))
    outputs = [[] for _ in requests]
    owner = {}  # slot -> request
    steps = joins = dispatch = 0

    def take(output, slots_owner):
        """Appends a prefill's or a dispatch's tokens to their requests; frees the slots of ended ones."""
        host = jax.device_get(output)
        for slot, request in slots_owner.items():
            for step in range(host.tokens.shape[0]):  # counts are 0 past the steps run
                outputs[request].extend(host.tokens[step, slot, : host.counts[step, slot]].tolist())
            if not host.active[slot]:
                del owner[slot]
        return int(host.steps)

    while arrivals or owner:
        if not owner:
            dispatch = max(dispatch, requests[arrivals[0]].arrival)
        free = [slot for slot in range(SLOTS) if slot not in owner]
        rng.shuffle(free)
        admitted = {}
        while arrivals and free and requests[arrivals[0]].arrival <= dispatch:
            admitted[free.pop()] = arrivals.popleft()
        joins += bool(admitted and owner)
        for budget in sorted({requests[r].budget for r in admitted.values()}):
            group = {slot: r for slot, r in admitted.items() if requests[r].budget == budget}
            state, first = engine.prefill(
                state, {slot: requests[r].prompt for slot, r in group.items()}, budget, **options
            )
            owner.update(group)
            take(first, group)
        if owner:
            waiting = bool(arrivals) and requests[arrivals[0]].arrival <= dispatch
            steps_now = int(rng.choice(STEPS_PER_DISPATCH))
            state, output = engine.decode(state, steps=steps_now, waiting=waiting, **options)
            steps += take(output, dict(owner))
        dispatch += 1
    return state, Served(outputs, steps, joins)


def warm_up(engine: Engine, state):
    """Compiles everything the soak runs: prefill, decode at each (N, K) and context bucket (the bounded set
    the engine's dispatches choose from), and generate's restart. Returns the donated ``state``'s
    successor."""
    state, _ = engine.prefill(state, {0: [0]}, 1)  # the request ends at its first token
    buckets = sorted({engine.bound(n) for n in range(1, engine.model.max_len + 1)})
    for num_tokens in NUM_TOKENS:
        for steps in STEPS_PER_DISPATCH:
            for context in buckets:
                state, _ = engine.decode(state, num_tokens=num_tokens, steps=steps, context=context)
    engine.generate([[0]], 1)
    return state


def ends_right(tokens: list[int], request: Request, stop_tokens: tuple[int, ...]) -> bool:
    """The output has 1 to ``budget`` tokens, a stop token at most as its last, and fewer than ``budget``
    only when it ends at a stop token."""
    stops = [i for i, token in enumerate(tokens) if token in stop_tokens]
    ended = len(tokens) == request.budget or bool(stops)
    return 1 <= len(tokens) <= request.budget and stops in ([], [len(tokens) - 1]) and ended


def divergence(online: list[list[int]], offline: list[list[int]]) -> str:
    """Where the two backends' outputs first differ: the request and the token."""
    for request, (a, b) in enumerate(zip(online, offline, strict=True)):
        if a != b:
            i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            return f"request {request} token {i}: online {a[i : i + 4]} offline {b[i : i + 4]}"
    return "none"


def host_memory(field: str) -> int:
    """A size of ``/proc/self/status`` in bytes: ``VmRSS`` (resident now) or ``VmHWM`` (its peak)."""
    fields = dict(line.split(":", 1) for line in PROC_STATUS.read_text().splitlines())
    size, unit = fields[field].split()
    assert unit == "kB", fields[field]
    return int(size) * 1024


def memory_now() -> Memory:
    """The process's memory now, after a garbage collection (so that only reachable arrays are live) and, with
    glibc, ``malloc_trim``: host RSS then counts what the process holds, not the free pages the allocator
    keeps for reuse (in a process that has run the rest of the suite, enough of them come and go to move RSS
    by over 16 MiB); memory that leaks stays allocated and counted."""
    gc.collect()
    if LIBC is not None:
        LIBC.malloc_trim(0)
    live = jax.live_arrays()
    stats = jax.devices()[0].memory_stats()
    return Memory(
        host_rss=host_memory("VmRSS"),
        live_arrays=len(live),
        live_bytes=sum(array.nbytes for array in live),
        device_in_use=None if stats is None else stats["bytes_in_use"],
    )


def mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


@pytest.mark.skipif(not PROC_STATUS.exists(), reason="reads host memory from /proc (Linux)")
def test_soak(record_property):
    """Random workloads until the online engine has run TARGET_STEPS decoding steps: both backends give
    every request the same tokens, each ending right; requests join others mid-generation and end both at
    stop tokens and at budgets; after the warm-up nothing compiles, the live jax arrays stay exactly the
    same (count and bytes: no array outlives its workload), the device's bytes in use grow by less than
    one decode state (they are the live arrays; where the backend reports them), and host RSS ends less
    than HOST_GROWTH_BOUND above its first half's peak. Reports the memory after the warm-up, at the
    middle and at the end, and the peaks (host RSS over the soak, the process's high-water mark, the
    device's peak bytes in use where reported)."""
    engines = {
        backend: Engine(
            make_model(backend),
            slots=SLOTS,
            prompt_bucket=LONGEST_PROMPT,
            steps_per_dispatch=STEPS_PER_DISPATCH[-1],  # generate's K, one of the driver's
        )
        for backend in (ONLINE, OFFLINE)
    }
    states = {backend: warm_up(engine, engine.init_state()) for backend, engine in engines.items()}
    rng = np.random.default_rng(SEED)
    steps = collections.Counter()
    totals = collections.Counter()
    samples = []
    start = time.perf_counter()
    with count_compiles() as compiles:
        while steps[ONLINE] < TARGET_STEPS:
            workload = random_workload(rng)
            served = {}
            for backend, engine in engines.items():
                states[backend], served[backend] = serve(engine, states[backend], workload)
                steps[backend] += served[backend].steps
            online, offline = served[ONLINE].tokens, served[OFFLINE].tokens
            assert online == offline, f"workload {totals['workloads']}: {divergence(online, offline)}"
            for tokens, request in zip(online, workload.requests, strict=True):
                assert ends_right(tokens, request, workload.stop_tokens), (request, workload, tokens)
                totals["stopped"] += len(tokens) < request.budget
            totals.update(
                workloads=1, requests=len(online), tokens=sum(map(len, online)), joins=served[ONLINE].joins
            )
            if totals["workloads"] >= WARM_UP_WORKLOADS:
                samples.append(memory_now())
    seconds = time.perf_counter() - start
    assert not compiles, f"compiled after the warm-up: {dict(compiles)}"
    assert totals["joins"] > 0, "no request arrived while others were generating"
    assert 0 < totals["stopped"] < totals["requests"], "requests must end both at stop tokens and budgets"

    baseline, middle, end = samples[0], samples[len(samples) // 2], samples[-1]
    peak_rss = max(sample.host_rss for sample in samples)
    high_water = host_memory("VmHWM")
    report = {
        "steps_online": steps[ONLINE],
        "steps_offline": steps[OFFLINE],
        **totals,
        "seconds": round(seconds, 1),
        "host_rss_baseline": baseline.host_rss,
        "host_rss_middle": middle.host_rss,
        "host_rss_end": end.host_rss,
        "host_rss_peak": peak_rss,
        "host_high_water": high_water,
        "live_arrays": baseline.live_arrays,
        "live_bytes": baseline.live_bytes,
    }
    stats = jax.devices()[0].memory_stats()
    if stats is not None:
        report.update(device_in_use_baseline=baseline.device_in_use, device_in_use_end=end.device_in_use)
        report.update(device_peak=stats["peak_bytes_in_use"])
    for name, value in report.items():
        record_property(name, value)
    print(
        f"\nsoak: {report}\nhost RSS baseline {mib(baseline.host_rss)}, middle {mib(middle.host_rss)}, "
        f"end {mib(end.host_rss)}, peak {mib(peak_rss)}, process high-water {mib(high_water)}"
    )

    live = {(sample.live_arrays, sample.live_bytes) for sample in samples}
    assert len(live) == 1, f"live jax arrays (count, bytes) changed: {sorted(live)}"
    if stats is not None:
        state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(states[ONLINE]))
        growth = max(sample.device_in_use for sample in samples) - baseline.device_in_use
        assert growth < state_bytes, f"device bytes in use grew {growth} (a decode state is {state_bytes})"
    first_half_peak = max(sample.host_rss for sample in samples[: len(samples) // 2 + 1])
    assert end.host_rss - first_half_peak < HOST_GROWTH_BOUND, (
        f"host RSS grew {mib(end.host_rss - first_half_peak)} over the second half: "
        f"from the first half's peak {mib(first_half_peak)} to {mib(end.host_rss)}"
    )
