"""The functional controller: long random schedules against the offline backend and float64, jit behaviour."""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
from harness import (
    OFFLINE_FP32,
    Request,
    assert_updated_in_place,
    count_compiles,
    ints,
    kv_score,
    record_entries,
)
from oracle import Stream, random_ape, random_tokens, state_err

from jax_oc128.controller import Controller, ForwardMode, OfflineController, active_slots
from jax_oc128.state import CompressState, OfflineState, bytes_per_slot

LAYERS, DIM, MAX_DRAFT, SLOTS, BATCH, EXTEND_WIDTH = 2, 32, 4, 20, 8, 160
ONLINE, OFFLINE = Controller(), OfflineController()


@functools.partial(jax.jit, static_argnames="mode", donate_argnums=(0, 1))
def compress_step(online, offline, kv, seq, new, slots, ape, mode):
    online = ONLINE.prepare_forward(online, mode, slots, seq)
    online, entries, blocks = ONLINE.compress(online, kv, seq, new, slots, ape)
    offline, off_entries, off_blocks = OFFLINE.compress(offline, kv, seq, new, slots, ape)
    return online, offline, (entries, blocks), (off_entries, off_blocks)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def verify_step(online, offline, kv, seq, slots, verify_bs, ape):
    """Rows >= verify_bs carry other requests' slots: only verify_bs must keep them out."""
    online = ONLINE.prepare_forward(online, ForwardMode.TARGET_VERIFY, slots, seq, verify_bs=verify_bs)
    slots = active_slots(slots, verify_bs)
    online, entries, blocks = ONLINE.write_prefix(online, kv, seq, slots, ape)
    offline, off_entries, off_blocks = OFFLINE.write_prefix(offline, kv, seq, slots, ape)
    return online, offline, (entries, blocks), (off_entries, off_blocks)


@functools.partial(jax.jit, donate_argnums=0)
def commit_step(online, slots, seq, accept):
    return ONLINE.commit(online, slots, seq, accept)


@functools.partial(jax.jit, donate_argnums=0)
def idle_step(online, slots, seq):
    return ONLINE.prepare_forward(online, ForwardMode.IDLE, slots, seq)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def alloc_step(online, offline, slots):
    return online.alloc(slots), offline.alloc(slots)


@functools.partial(jax.jit, donate_argnums=0)
def free_step(online, slots):
    return online.free(slots)


@jax.jit
def open_states(online, offline, slots, seq, ape):
    return ONLINE.open_state(online, slots, seq, ape), OFFLINE.open_state(offline, slots, seq, ape)


class Simulation:
    """Requests in slots, driven through the online and the offline backend in lockstep."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.ape_np = random_ape(self.rng, LAYERS, DIM)
        self.ape = jnp.asarray(self.ape_np)
        self.online = CompressState.create(LAYERS, SLOTS, DIM, MAX_DRAFT)
        self.offline = OfflineState.create(LAYERS, SLOTS, DIM, MAX_DRAFT)
        self.requests: dict[int, Request] = {}
        self.stats = collections.Counter()

    def batch(self, candidates):
        """Up to BATCH slots of ``candidates`` in random order, padded with -1."""
        chosen = self.rng.permutation(candidates)[: self.rng.integers(1, BATCH + 1)]
        return np.concatenate([chosen, np.full(BATCH - len(chosen), -1)]).astype(np.int32)

    def seqs(self, slots):
        return np.asarray([self.requests[s].seq if s >= 0 else 0 for s in slots], np.int32)

    def record(self, requests, online, offline, accepted=None):
        """Keep the entries, online and offline, whose blocks' tokens were all accepted; check them later."""
        np.testing.assert_array_equal(online[1], offline[1])
        record_entries(requests, online[1], online[0], offline[0], accepted=accepted)

    def new_request(self):
        slot = self.rng.choice([s for s in range(SLOTS) if s not in self.requests])
        self.online, self.offline = alloc_step(self.online, self.offline, jnp.asarray([slot], jnp.int32))
        self.requests[slot] = Request(self.rng, LAYERS, 4000, DIM, prompt=int(self.rng.integers(1, 400)))

    def extend(self, mode, candidates, width):
        slots = self.batch(candidates)
        seq = self.seqs(slots)
        requests = [self.requests.get(slot) for slot in slots]  # None: a padding row
        new = np.zeros(BATCH, np.int32)
        kv = random_tokens(self.rng, (LAYERS, BATCH, width), DIM)
        for i, req in enumerate(requests):
            if req is not None:
                left = req.prompt - req.seq if mode is ForwardMode.EXTEND else 1
                new[i] = min(left, self.rng.integers(1, width + 1))
        args = (kv_score(requests, new, kv), jnp.asarray(seq), jnp.asarray(new), jnp.asarray(slots), self.ape)
        self.online, self.offline, out, off = compress_step(self.online, self.offline, *args, mode=mode)
        self.record(requests, out, off)
        for req, n in zip(requests, new, strict=True):
            if req is not None:
                req.seq += int(n)

    def verify(self, candidates):
        n = int(self.rng.choice([1, 2, 4]))
        slots = self.batch(candidates)
        verify_bs = int(np.sum(slots >= 0))
        others = [s for s in self.requests if s not in slots]
        slots[verify_bs:] = self.rng.choice(others, BATCH - verify_bs) if others else -1
        seq = self.seqs(np.where(np.arange(BATCH) < verify_bs, slots, -1))
        accept = np.where(np.arange(BATCH) < verify_bs, self.rng.integers(0, n + 1, BATCH), 0).astype(
            np.int32
        )
        requests = [self.requests[slots[i]] if i < verify_bs else None for i in range(BATCH)]
        kv = kv_score(requests, accept, random_tokens(self.rng, (LAYERS, BATCH, n), DIM))  # drafts, then junk
        args = (kv, jnp.asarray(seq), jnp.asarray(slots), jnp.asarray(verify_bs), self.ape)
        self.online, self.offline, out, off = verify_step(self.online, self.offline, *args)
        self.record(requests, out, off, accepted=seq + accept)
        if self.rng.random() < 0.5:  # eager commit; otherwise it stays pending until the slot's next forward
            active = active_slots(jnp.asarray(slots), verify_bs)
            self.online = commit_step(self.online, active, jnp.asarray(seq), jnp.asarray(accept))
            self.stats["eager commits"] += 1
        for req, n in zip(requests[:verify_bs], accept[:verify_bs], strict=True):
            req.seq += int(n)

    def step(self):
        generating = [s for s, r in self.requests.items() if r.seq >= r.prompt]
        prefilling = [s for s, r in self.requests.items() if r.seq < r.prompt]
        kind = self.rng.choice(["new", "extend", "decode", "verify", "verify", "verify", "idle", "free"])
        if (kind == "new" and len(self.requests) < 16) or not self.requests:
            self.new_request()
        elif kind == "extend" and prefilling:
            self.extend(ForwardMode.EXTEND, prefilling, EXTEND_WIDTH)
        elif kind == "decode" and generating:
            self.extend(ForwardMode.DECODE, generating, 1)
        elif kind == "verify" and generating:
            self.verify(generating)
        elif kind == "idle":
            self.online = idle_step(
                self.online, jnp.asarray(self.batch(list(self.requests))), jnp.zeros(BATCH, jnp.int32)
            )
        elif kind == "free" and len(self.requests) > 12:
            slot = self.rng.choice(list(self.requests))
            self.online = free_step(self.online, jnp.asarray([slot], jnp.int32))
            del self.requests[slot]
        else:
            kind = "skipped"
        self.stats[kind] += 1

    def check(self):
        """Entries and the open block's state of every request: online == offline == float64."""
        slots = np.asarray(list(self.requests), np.int32)
        seq = self.seqs(slots)
        online, offline = open_states(
            self.online, self.offline, jnp.asarray(slots), jnp.asarray(seq), self.ape
        )
        for i, slot in enumerate(slots):
            req = self.requests[slot]
            req.check(self.ape_np, last=2, name=f"slot {slot}")  # the entries of the last steps
            for backend in (online, offline):
                rows = np.stack([np.asarray(f)[:, i] for f in backend], axis=-2)
                req.check_open(self.ape_np, rows, name=f"slot {slot}")


def test_long_random_schedule_matches_offline_and_float64():
    """Thousands of steps: 16 requests in 20 slots, prefill in chunks, decode, verify with random N and
    acceptance, eager and lazy commits with other forwards and idle steps in between, frees and
    reallocations; checked after every step. Each jitted step compiles once per shape and mode."""
    sim = Simulation(seed=0)
    with count_compiles() as compiles:
        for _ in range(2000):
            sim.step()
            sim.check()
    assert sim.stats["verify"] > 500 and sim.stats["free"] > 20 and sim.stats["eager commits"] > 100
    steps = (compress_step, verify_step, commit_step, idle_step, alloc_step, free_step)
    counts = {step.__name__.removesuffix("_step"): compiles[step.__name__] for step in steps}
    assert counts == {"compress": 2, "verify": 3, "commit": 1, "idle": 1, "alloc": 1, "free": 1}, counts


def test_pending_commit_survives_unrelated_forwards_and_idle():
    """SGLang's lost lazy commit: verify A, then a prefill of B and an idle step, then A's next forward."""
    rng = np.random.default_rng(1)
    ape = jnp.asarray(random_ape(rng, LAYERS, DIM))
    stream_a, stream_b = Stream(rng, LAYERS, 400, DIM), Stream(rng, LAYERS, 400, DIM)
    cs = CompressState.create(LAYERS, 4, DIM, MAX_DRAFT)
    cs, _, _ = ONLINE.compress(
        cs, jnp.asarray(stream_a.rows[:, None, :100]), ints(0), ints(100), ints(2), ape
    )
    cs = ONLINE.prepare_forward(cs, ForwardMode.TARGET_VERIFY, ints(2), ints(100))
    drafts = stream_a.rows[:, None, 100:104].copy()
    drafts[:, :, 3] = 7.0  # the last draft is rejected
    cs, _, _ = ONLINE.write_prefix(cs, jnp.asarray(drafts), ints(100), ints(2), ape)
    cs = ONLINE.prepare_forward(cs, ForwardMode.EXTEND, ints(0), ints(0))  # B's prefill
    cs, _, _ = ONLINE.compress(cs, jnp.asarray(stream_b.rows[:, None, :50]), ints(0), ints(50), ints(0), ape)
    cs = ONLINE.prepare_forward(cs, ForwardMode.IDLE, ints(-1), ints(0))
    assert int(cs.pending[2]) == 100
    cs = ONLINE.prepare_forward(cs, ForwardMode.DECODE, ints(2), ints(103))  # A kept 3 tokens
    assert int(cs.pending[2]) == -1
    errors = state_err(np.asarray(cs.banks[:, 0, 2]), *stream_a.open_state(np.asarray(ape), 103))
    assert max(errors) < OFFLINE_FP32


def test_alloc_clears_the_slot_and_its_pending_verify():
    cs = CompressState.create(LAYERS, 3, DIM, MAX_DRAFT)
    cs = cs.replace(
        banks=cs.banks + 1.0, pending=cs.pending.at[1].set(50), to_commit=cs.to_commit.at[1].set(9)
    )
    cs = cs.alloc(jnp.asarray([1, -1], jnp.int32))
    assert (
        not np.any(np.asarray(cs.banks[:, :, 1])) and int(cs.pending[1]) == -1 and int(cs.to_commit[1]) == -1
    )
    assert np.all(np.asarray(cs.banks[:, :, [0, 2]]) == 1.0)
    assert cs.replace(pending=cs.pending.at[2].set(7)).free(jnp.asarray([2], jnp.int32)).pending[2] == -1


def test_step_is_in_place_under_jit():
    """A verify step with the CompressState donated: the donated leaves are consumed and the state array
    is updated in its own buffer (no state-sized copy in the compiled step)."""
    rng = np.random.default_rng(2)
    cs = CompressState.create(LAYERS, 6, DIM, MAX_DRAFT)
    ape = jnp.asarray(random_ape(rng, LAYERS, DIM))

    @functools.partial(jax.jit, donate_argnums=0)
    def step(cs, kv, seq, slots):
        cs = ONLINE.prepare_forward(cs, ForwardMode.TARGET_VERIFY, slots, seq)
        return ONLINE.write_prefix(cs, kv, seq, slots, ape)[0]

    kv = jnp.asarray(random_tokens(rng, (LAYERS, 3, 4), DIM))
    seq, slots = jnp.asarray([5, 9, 200], jnp.int32), jnp.asarray([4, 0, 2], jnp.int32)
    assert_updated_in_place(step, cs, kv, seq, slots)
    assert cs.pending.is_deleted()


def test_state_bytes():
    assert bytes_per_slot(CompressState, 20, 512, 4) == 20 * 5 * 3 * 512 * 4 + 2 * 4
    assert bytes_per_slot(OfflineState, 20, 512, 4) == 20 * 132 * 2 * 512 * 4
    assert bytes_per_slot(CompressState, 20, 512, 4, jnp.bfloat16) == 20 * 5 * 3 * 512 * 2 + 2 * 4
