"""The functional controller: long random schedules against the offline backend and float64, jit behaviour."""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
from checks import OFFLINE_FP32
from oracle import BLOCK, Stream, random_ape, random_tokens, rel_err, state_err

from jax_oc128.controller import Controller, ForwardMode, OfflineController, active_slots
from jax_oc128.state import CompressState, OfflineState, bytes_per_slot

LAYERS, DIM, MAX_DRAFT, SLOTS, BATCH, EXTEND_WIDTH = 2, 32, 4, 20, 8, 160
ONLINE, OFFLINE = Controller(), OfflineController()
TRACES = collections.Counter()  # jitted step -> times traced


def traced(name):
    """Count traces of a jitted function (a retrace is a recompile)."""

    def wrap(fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            TRACES[name] += 1
            return fn(*args, **kwargs)

        return counted

    return wrap


@functools.partial(jax.jit, static_argnames="mode", donate_argnums=(0, 1))
@traced("compress")
def compress_step(online, offline, kv, seq, new, slots, ape, mode):
    online = ONLINE.prepare_forward(online, mode, slots, seq)
    online, entries, blocks = ONLINE.compress(online, kv, seq, new, slots, ape)
    offline, off_entries, off_blocks = OFFLINE.compress(offline, kv, seq, new, slots, ape)
    return online, offline, (entries, blocks), (off_entries, off_blocks)


@functools.partial(jax.jit, donate_argnums=(0, 1))
@traced("verify")
def verify_step(online, offline, kv, seq, slots, verify_bs, ape):
    """Rows >= verify_bs carry other requests' slots: only verify_bs must keep them out."""
    online = ONLINE.prepare_forward(online, ForwardMode.TARGET_VERIFY, slots, seq, verify_bs=verify_bs)
    slots = active_slots(slots, verify_bs)
    online, entries, blocks = ONLINE.write_prefix(online, kv, seq, slots, ape)
    offline, off_entries, off_blocks = OFFLINE.write_prefix(offline, kv, seq, slots, ape)
    return online, offline, (entries, blocks), (off_entries, off_blocks)


@functools.partial(jax.jit, donate_argnums=0)
@traced("commit")
def commit_step(online, slots, seq, accept):
    return ONLINE.commit(online, slots, seq, accept)


@functools.partial(jax.jit, donate_argnums=0)
@traced("idle")
def idle_step(online, slots, seq):
    return ONLINE.prepare_forward(online, ForwardMode.IDLE, slots, seq)


@functools.partial(jax.jit, donate_argnums=(0, 1))
@traced("alloc")
def alloc_step(online, offline, slots):
    return online.alloc(slots), offline.alloc(slots)


@functools.partial(jax.jit, donate_argnums=0)
@traced("free")
def free_step(online, slots):
    return online.free(slots)


@jax.jit
def open_states(online, offline, slots, seq, ape):
    return ONLINE.open_state(online, slots, seq, ape), OFFLINE.open_state(offline, slots, seq, ape)


class Request:
    def __init__(self, rng, prompt):
        self.stream = Stream(rng, LAYERS, 4000, DIM)
        self.prompt, self.seq, self.entries = prompt, 0, {}


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

    def record(self, slots, entries, blocks, final, offline):
        """Keep the entries that are final (their block's tokens were all accepted); check them later."""
        entries, blocks, off_entries = np.asarray(entries), np.asarray(blocks), np.asarray(offline[0])
        np.testing.assert_array_equal(blocks, np.asarray(offline[1]))
        for i, slot in enumerate(slots):
            for e, block in enumerate(blocks[i]):
                if slot >= 0 and block >= 0 and final[i, e]:
                    self.requests[slot].entries[int(block)] = (entries[:, i, e], off_entries[:, i, e])

    def new_request(self):
        slot = self.rng.choice([s for s in range(SLOTS) if s not in self.requests])
        self.online, self.offline = alloc_step(self.online, self.offline, jnp.asarray([slot], jnp.int32))
        self.requests[slot] = Request(self.rng, int(self.rng.integers(1, 400)))

    def extend(self, mode, candidates, width):
        slots = self.batch(candidates)
        seq = self.seqs(slots)
        new = np.zeros(BATCH, np.int32)
        kv = random_tokens(self.rng, (LAYERS, BATCH, width), DIM)
        for i, slot in enumerate(slots):
            if slot >= 0:
                req = self.requests[slot]
                left = req.prompt - req.seq if mode is ForwardMode.EXTEND else 1
                new[i] = min(left, self.rng.integers(1, width + 1))
                kv[:, i, : new[i]] = req.stream.rows[:, req.seq : req.seq + new[i]]
        args = (jnp.asarray(kv), jnp.asarray(seq), jnp.asarray(new), jnp.asarray(slots), self.ape)
        self.online, self.offline, out, off = compress_step(self.online, self.offline, *args, mode=mode)
        self.record(slots, *out, np.ones(out[1].shape, bool), off)
        for slot, n in zip(slots, new, strict=True):
            if slot >= 0:
                self.requests[slot].seq += int(n)

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
        kv = random_tokens(self.rng, (LAYERS, BATCH, n), DIM)  # rejected drafts are junk
        for i in range(verify_bs):
            kv[:, i, : accept[i]] = self.requests[slots[i]].stream.rows[:, seq[i] : seq[i] + accept[i]]
        args = (jnp.asarray(kv), jnp.asarray(seq), jnp.asarray(slots), jnp.asarray(verify_bs), self.ape)
        self.online, self.offline, out, off = verify_step(self.online, self.offline, *args)
        closing = BLOCK - 1 - seq % BLOCK  # verify token that closes a block, if < n
        self.record(np.where(np.arange(BATCH) < verify_bs, slots, -1), *out, (closing < accept)[:, None], off)
        if self.rng.random() < 0.5:  # eager commit; otherwise it stays pending until the slot's next forward
            active = active_slots(jnp.asarray(slots), verify_bs)
            self.online = commit_step(self.online, active, jnp.asarray(seq), jnp.asarray(accept))
            self.stats["eager commits"] += 1
        for i in range(verify_bs):
            self.requests[slots[i]].seq += int(accept[i])

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
            assert sorted(req.entries) == list(range(req.seq // BLOCK)), f"slot {slot}: missing entries"
            for block, (entry, off_entry) in list(req.entries.items())[-2:]:  # those of the last steps
                expected = req.stream.entry(self.ape_np, block)
                assert rel_err(entry, expected) < OFFLINE_FP32 and rel_err(off_entry, expected) < OFFLINE_FP32
            if req.seq % BLOCK:
                expected = req.stream.open_state(self.ape_np, req.seq)
                for backend in (online, offline):
                    rows = np.stack([np.asarray(f)[:, i] for f in backend], axis=-2)
                    errors = state_err(rows, *expected)
                    assert max(errors) < OFFLINE_FP32, f"slot {slot} at {req.seq}: errors {errors}"


def test_long_random_schedule_matches_offline_and_float64():
    """Thousands of steps: 16 requests in 20 slots, prefill in chunks, decode, verify with random N and
    acceptance, eager and lazy commits with other forwards and idle steps in between, frees and
    reallocations; checked after every step. Each jitted step compiles once per shape and mode."""
    sim = Simulation(seed=0)
    TRACES.clear()
    for _ in range(2000):
        sim.step()
        sim.check()
    assert sim.stats["verify"] > 500 and sim.stats["free"] > 20 and sim.stats["eager commits"] > 100
    assert TRACES == {"compress": 2, "verify": 3, "commit": 1, "idle": 1, "alloc": 1, "free": 1}, TRACES


def test_pending_commit_survives_unrelated_forwards_and_idle():
    """SGLang's lost lazy commit: verify A, then a prefill of B and an idle step, then A's next forward."""
    rng = np.random.default_rng(1)
    ape = jnp.asarray(random_ape(rng, LAYERS, DIM))
    stream_a, stream_b = Stream(rng, LAYERS, 400, DIM), Stream(rng, LAYERS, 400, DIM)
    cs = CompressState.create(LAYERS, 4, DIM, MAX_DRAFT)
    one = lambda *v: jnp.asarray(v, jnp.int32)  # noqa: E731
    cs, _, _ = ONLINE.compress(cs, jnp.asarray(stream_a.rows[:, None, :100]), one(0), one(100), one(2), ape)
    cs = ONLINE.prepare_forward(cs, ForwardMode.TARGET_VERIFY, one(2), one(100))
    drafts = stream_a.rows[:, None, 100:104].copy()
    drafts[:, :, 3] = 7.0  # the last draft is rejected
    cs, _, _ = ONLINE.write_prefix(cs, jnp.asarray(drafts), one(100), one(2), ape)
    cs = ONLINE.prepare_forward(cs, ForwardMode.EXTEND, one(0), one(0))  # B's prefill
    cs, _, _ = ONLINE.compress(cs, jnp.asarray(stream_b.rows[:, None, :50]), one(0), one(50), one(0), ape)
    cs = ONLINE.prepare_forward(cs, ForwardMode.IDLE, one(-1), one(0))
    assert int(cs.pending[2]) == 100
    cs = ONLINE.prepare_forward(cs, ForwardMode.DECODE, one(2), one(103))  # A kept 3 tokens
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
    hlo = step.lower(cs, kv, seq, slots).compile().as_text()
    shape = f"f32[{LAYERS},{MAX_DRAFT + 1},{6},3,{DIM}]"
    assert not [line for line in hlo.splitlines() if shape in line and " copy(" in line]
    pointer = cs.banks.unsafe_buffer_pointer()
    new = step(cs, kv, seq, slots)
    assert cs.banks.is_deleted() and cs.pending.is_deleted()
    assert new.banks.unsafe_buffer_pointer() == pointer


def test_state_bytes():
    assert bytes_per_slot(CompressState, 20, 512, 4) == 20 * 5 * 3 * 512 * 4 + 2 * 4
    assert bytes_per_slot(OfflineState, 20, 512, 4) == 20 * 132 * 2 * 512 * 4
    assert bytes_per_slot(CompressState, 20, 512, 4, jnp.bfloat16) == 20 * 5 * 3 * 512 * 2 + 2 * 4
