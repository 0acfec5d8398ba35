"""The functional controller: random and hypothesis-driven sequences of transitions against the offline
backend, a model of what is pending and float64; retried and abandoned verifies, commits that do not fit,
misuse errors, jit behaviour."""

from __future__ import annotations

import collections
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import (
    OFFLINE_FP32,
    Request,
    assert_updated_in_place,
    copy_tree,
    count_compiles,
    ints,
    kv_score,
    poisoned_state,
    record_entries,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import Stream, random_ape, random_tokens, state_err

from jax_oc128.controller import (
    BACKENDS,
    CompressController,
    Controller,
    ForwardMode,
    OfflineController,
    active_slots,
)
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
    """Rows >= verify_bs carry other requests' slots: only verify_bs must keep them out. One write_prefix
    per layer, as a model calls it."""
    online = ONLINE.prepare_forward(online, ForwardMode.TARGET_VERIFY, slots, seq, verify_bs=verify_bs)
    slots = active_slots(slots, verify_bs)
    outputs = []
    for layer in range(LAYERS):
        online, entries, blocks = ONLINE.write_prefix(
            online, kv[layer : layer + 1], seq, slots, ape[layer : layer + 1], layer=layer
        )
        offline, off_entries, off_blocks = OFFLINE.write_prefix(
            offline, kv[layer : layer + 1], seq, slots, ape[layer : layer + 1], layer=layer
        )
        outputs.append((entries, blocks, off_entries, off_blocks))
    entries, blocks, off_entries, off_blocks = zip(*outputs, strict=True)
    stack = functools.partial(jnp.concatenate, axis=0)
    return online, offline, (stack(entries), blocks[0]), (stack(off_entries), off_blocks[0])


@functools.partial(jax.jit, donate_argnums=0)
def commit_step(online, slots, seq, accept):
    return ONLINE.commit(online, slots, seq, accept)


@functools.partial(jax.jit, static_argnames="mode", donate_argnums=0)
def prepare_step(online, slots, seq, verify_bs, mode):
    """prepare_forward alone: an idle or draft forward, or a forward prepared and then abandoned."""
    return ONLINE.prepare_forward(online, mode, slots, seq, verify_bs=verify_bs)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def alloc_step(online, offline, slots):
    return online.alloc(slots), offline.alloc(slots)


@functools.partial(jax.jit, donate_argnums=0)
def free_step(online, slots):
    return online.free(slots)


@jax.jit
def open_states(online, offline, slots, seq, ape):
    return ONLINE.open_state(online, slots, seq, ape), OFFLINE.open_state(offline, slots, seq, ape)


#: what a step of the simulation does (``Simulation.step``)
KINDS = (
    "new",  # a request in a free slot
    "extend",  # chunked prefill
    "decode",
    "verify",  # begun, written in every layer, committed eagerly (half of them) or left pending
    "retry",  # a verify begun at other lengths (or the same) and begun again, then written
    "abandon",  # a forward prepared and never run: a verify, or a decode or extend (which commits)
    "bad commit",  # a commit that does not fit: nothing pending, another length, or accept > N
    "bad lengths",  # a decode or extend prepared at lengths that do not fit the pending verify
    "idle",  # idle and draft forwards
    "free",
)


class Simulation:
    """Requests in slots, driven through the online and the offline backend in lockstep, with a model of
    what is pending for each slot (``pending``: slot -> (length at the verify, N)). Every transition is
    checked against it, and ``check`` compares each request's state (bank 0, or bank 0 once the pending
    verify is committed) with the float64 pooling of its accepted tokens: the state of feeding them one
    by one."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.ape_np = random_ape(self.rng, LAYERS, DIM)
        self.ape = jnp.asarray(self.ape_np)
        self.online = CompressState.create(LAYERS, SLOTS, DIM, MAX_DRAFT)
        self.offline = OfflineState.create(LAYERS, SLOTS, DIM, MAX_DRAFT)
        self.requests: dict[int, Request] = {}
        self.pending: dict[int, tuple[int, int]] = {}
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
        self.pending.pop(slot, None)

    def prefilled(self, count):
        """``count`` new requests, prefilled."""
        for _ in range(count):
            self.new_request()
        while prefilling := [s for s, r in self.requests.items() if r.seq < r.prompt]:
            self.extend(ForwardMode.EXTEND, prefilling, EXTEND_WIDTH)

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
        self.committed(slots)
        for req, n in zip(requests, new, strict=True):
            if req is not None:
                req.seq += int(n)

    def committed(self, slots):
        for slot in slots:
            self.pending.pop(int(slot), None)

    def forward_batch(self, candidates):
        """``(slots, verify_bs)``: a forward's rows; those past ``verify_bs`` carry other requests' slots."""
        slots = self.batch(candidates)
        verify_bs = int(np.sum(slots >= 0))
        others = [s for s in self.requests if s not in slots]
        slots[verify_bs:] = self.rng.choice(others, BATCH - verify_bs) if others else -1
        return slots, verify_bs

    def verify(self, candidates, retry=False):
        n = int(self.rng.choice([1, 2, 4]))
        slots, verify_bs = self.forward_batch(candidates)
        seq = self.seqs(np.where(np.arange(BATCH) < verify_bs, slots, -1))
        if retry:  # begun first at other lengths (or the same), then begun again: the retry
            other = seq + self.rng.integers(-1, MAX_DRAFT + 3, BATCH) * self.rng.integers(0, 2, BATCH)
            self.prepare(slots, other, verify_bs, ForwardMode.TARGET_VERIFY)
        accept = np.where(np.arange(BATCH) < verify_bs, self.rng.integers(0, n + 1, BATCH), 0).astype(
            np.int32
        )
        requests = [self.requests[slots[i]] if i < verify_bs else None for i in range(BATCH)]
        kv = kv_score(requests, accept, random_tokens(self.rng, (LAYERS, BATCH, n), DIM))  # drafts, then junk
        args = (kv, jnp.asarray(seq), jnp.asarray(slots), jnp.asarray(verify_bs), self.ape)
        self.online, self.offline, out, off = verify_step(self.online, self.offline, *args)
        self.record(requests, out, off, accepted=seq + accept)
        self.pending |= {int(slot): (int(seq[i]), n) for i, slot in enumerate(slots[:verify_bs])}
        if self.rng.random() < 0.5:  # eager commit; otherwise it stays pending until the slot's next forward
            active = active_slots(jnp.asarray(slots), verify_bs)
            self.online = commit_step(self.online, active, jnp.asarray(seq), jnp.asarray(accept))
            self.committed(slots[:verify_bs])
            self.stats["eager commits"] += 1
        for req, n in zip(requests[:verify_bs], accept[:verify_bs], strict=True):
            req.seq += int(n)

    def prepare(self, slots, seq, verify_bs, mode):
        self.online = prepare_step(
            self.online, jnp.asarray(slots), jnp.asarray(seq, jnp.int32), jnp.asarray(verify_bs), mode=mode
        )

    def abandon(self, candidates):
        """A forward prepared and never run. A verify's begin changes nothing that is read later; a decode
        or extend at the true lengths commits what is pending (as the forward would have)."""
        mode = self.rng.choice([ForwardMode.TARGET_VERIFY, ForwardMode.DECODE, ForwardMode.EXTEND])
        slots, verify_bs = self.forward_batch(candidates)
        seq = self.seqs(np.where(np.arange(BATCH) < verify_bs, slots, -1))
        if mode is ForwardMode.TARGET_VERIFY:
            self.unchanged(lambda: self.prepare(slots, seq, verify_bs, mode), pending_only=True)
        else:
            self.prepare(slots, seq, verify_bs, mode)
            self.committed(slots[:verify_bs])

    def bad_commit(self, candidates):
        """An eager commit that does not fit a slot's pending verify: nothing pending (any accept), another
        length, or an accept past its N (up to max_draft + 1; banks past N hold an older verify). Changes
        nothing."""
        slots = self.batch(candidates)
        seq, accept = np.zeros(BATCH, np.int32), np.zeros(BATCH, np.int32)
        for i, slot in enumerate(slots):
            if slot < 0:
                continue
            if slot not in self.pending:
                seq[i], accept[i] = self.requests[slot].seq, self.rng.integers(MAX_DRAFT + 1)
            elif self.rng.random() < 0.5:
                at, n = self.pending[slot]
                seq[i], accept[i] = at, self.rng.integers(n + 1, MAX_DRAFT + 2)
            else:
                at, n = self.pending[slot]
                seq[i], accept[i] = at + self.rng.choice([-1, 1]) * self.rng.integers(1, 4), n
        args = (jnp.asarray(slots), jnp.asarray(seq), jnp.asarray(accept))
        self.unchanged(lambda: setattr(self, "online", commit_step(self.online, *args)))

    def bad_lengths(self, candidates):
        """A decode or extend prepared at lengths that do not fit the pending verify (accept < 0 or > N;
        any length where nothing is pending): its lazy commit changes nothing."""
        slots = self.batch(candidates)
        seq = np.zeros(BATCH, np.int32)
        for i, slot in enumerate(slots):
            at, n = self.pending.get(int(slot), (self.rng.integers(500), MAX_DRAFT))
            seq[i] = at + self.rng.choice([-1 - self.rng.integers(3), n + 1 + self.rng.integers(3)])
        mode = self.rng.choice([ForwardMode.DECODE, ForwardMode.EXTEND])
        self.unchanged(lambda: self.prepare(slots, seq, BATCH, mode))

    def unchanged(self, transition, pending_only=False):
        """Run ``transition`` and check it changed nothing (but ``to_commit`` when ``pending_only``)."""
        before = copy_tree(self.online)
        transition()
        for name in ("banks", "pending", "pending_tokens") + (() if pending_only else ("to_commit",)):
            np.testing.assert_array_equal(getattr(self.online, name), getattr(before, name), err_msg=name)

    def step(self, kind=None):
        """One transition of ``kind`` (one of KINDS; random when None), or "skipped" when it has nothing to
        act on."""
        kind = self.rng.choice(KINDS) if kind is None else kind
        generating = [s for s, r in self.requests.items() if r.seq >= r.prompt]
        prefilling = [s for s, r in self.requests.items() if r.seq < r.prompt]
        if (kind == "new" and len(self.requests) < 16) or not self.requests:
            self.new_request()
        elif kind == "extend" and prefilling:
            self.extend(ForwardMode.EXTEND, prefilling, EXTEND_WIDTH)
        elif kind == "decode" and generating:
            self.extend(ForwardMode.DECODE, generating, 1)
        elif kind in ("verify", "retry") and generating:
            self.verify(generating, retry=kind == "retry")
        elif kind == "abandon" and generating:
            self.abandon(generating)
        elif kind == "bad commit":
            self.bad_commit(list(self.requests))
        elif kind == "bad lengths":
            self.bad_lengths(list(self.requests))
        elif kind == "idle":
            mode = self.rng.choice([ForwardMode.IDLE, ForwardMode.DRAFT_EXTEND])
            slots = self.batch(list(self.requests))
            self.unchanged(lambda: self.prepare(slots, self.rng.integers(0, 500, BATCH), BATCH, mode))
        elif kind == "free" and len(self.requests) > 12:
            slot = self.rng.choice(list(self.requests))
            self.online = free_step(self.online, jnp.asarray([slot], jnp.int32))
            del self.requests[slot]
            self.pending.pop(int(slot), None)
        else:
            kind = "skipped"
        self.stats[kind] += 1

    def check(self):
        """What is pending equals the model; entries and the open block's state of every request: online
        (bank 0 where nothing is pending, and as the next forward commits it) == offline == float64."""
        pending, tokens = np.asarray(self.online.pending), np.asarray(self.online.pending_tokens)
        for slot in self.requests:
            at, n = self.pending.get(slot, (-1, None))
            assert pending[slot] == at, f"slot {slot}: pending {pending[slot]}, expected {at}"
            assert n is None or tokens[slot] == n, f"slot {slot}: N {tokens[slot]}, expected {n}"
        slots = np.asarray(list(self.requests), np.int32)
        seq = self.seqs(slots)
        backends = open_states(self.online, self.offline, jnp.asarray(slots), jnp.asarray(seq), self.ape)
        open_rows = [np.stack([np.asarray(f) for f in backend], axis=-2) for backend in backends]
        bank0 = np.asarray(self.online.banks[:, 0])
        for i, slot in enumerate(slots):
            req = self.requests[slot]
            req.check(self.ape_np, last=2, name=f"slot {slot}")  # the entries of the last steps
            for rows in open_rows:
                req.check_open(self.ape_np, rows[:, i], name=f"slot {slot}")
            if slot not in self.pending:
                req.check_open(self.ape_np, bank0[:, slot], name=f"slot {slot} bank 0")


STEPS = (compress_step, verify_step, commit_step, prepare_step, alloc_step, free_step)


def test_long_random_schedule_matches_offline_and_float64():
    """1500 steps: 16 requests in 20 slots, prefill in chunks, decode, verify with random N and
    acceptance, eager and lazy commits with other forwards, idle steps, abandoned and retried verifies
    and commits that do not fit in between, frees and reallocations; checked after every step. Each
    jitted step compiles once per shape and mode."""
    sim = Simulation(seed=0)
    with count_compiles() as compiles:
        for _ in range(1500):
            sim.step()
            sim.check()
    assert all(sim.stats[kind] > 100 for kind in KINDS if kind != "free"), sim.stats
    assert sim.stats["free"] > 20 and sim.stats["eager commits"] > 80, sim.stats
    counts = {step.__name__.removesuffix("_step"): compiles[step.__name__] for step in STEPS}
    assert counts == {"compress": 2, "verify": 3, "commit": 1, "prepare": 5, "alloc": 1, "free": 1}, counts


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    kinds=st.lists(st.sampled_from([k for k in KINDS if k not in ("new", "free")]), min_size=1, max_size=40),
)
def test_any_sequence_of_transitions_keeps_every_commit(seed, kinds):
    """Hypothesis picks the transitions after four prefilled requests (every kind but new requests and
    frees): whatever the order, every commit lands once, and misfits change nothing."""
    sim = Simulation(seed)
    sim.prefilled(4)
    for kind in kinds:
        sim.step(kind)
        sim.check()


# ---------------------------------------------------------------------------------------------------------
# Request A in slot 2 of a 4-slot state, one transition at a time

A, JUNK = 2, 7.0


def prefilled(seed, length=100):
    """``(cs, stream, ape)``: request A's stream, its first ``length`` tokens compressed into slot A."""
    rng = np.random.default_rng(seed)
    ape = jnp.asarray(random_ape(rng, LAYERS, DIM))
    stream = Stream(rng, LAYERS, 400, DIM)
    cs = CompressState.create(LAYERS, 4, DIM, MAX_DRAFT)
    kv = jnp.asarray(stream.rows[:, None, :length])
    return ONLINE.compress(cs, kv, ints(0), ints(length), ints(A), ape)[0], stream, ape


def begin(cs, seq, slot=A):
    return ONLINE.prepare_forward(cs, ForwardMode.TARGET_VERIFY, ints(slot), ints(seq))


def write(cs, stream, ape, seq, n, kept, slot=A, layers=range(LAYERS)):
    """write_prefix of ``layers``, one call each: ``n`` tokens at ``seq``, the first ``kept`` from the
    stream, junk after."""
    drafts = stream.rows[:, None, seq : seq + n].copy()
    drafts[:, :, kept:] = JUNK
    for layer in layers:
        kv = jnp.asarray(drafts[layer : layer + 1])
        cs = ONLINE.write_prefix(cs, kv, ints(seq), ints(slot), ape[layer : layer + 1], layer=layer)[0]
    return cs


def verify(cs, stream, ape, seq, n, kept, slot=A):
    """A whole verify forward; nothing committed."""
    return write(begin(cs, seq, slot), stream, ape, seq, n, kept, slot)


def prepare(cs, mode, seq, slot=A):
    return ONLINE.prepare_forward(cs, mode, ints(slot), ints(seq))


def assert_bank0(cs, stream, ape, length, slot=A):
    """Bank 0 of ``slot`` is the state of feeding the stream's first ``length`` tokens one by one."""
    errors = state_err(np.asarray(cs.banks[:, 0, slot]), *stream.open_state(np.asarray(ape), length))
    assert max(errors) < OFFLINE_FP32, errors


def assert_same(cs, before):
    for name in ("banks", "pending", "pending_tokens", "to_commit"):
        np.testing.assert_array_equal(getattr(cs, name), getattr(before, name), err_msg=name)


def test_pending_commit_survives_unrelated_forwards_and_idle():
    """SGLang's lost lazy commit: verify A, then a prefill of B and an idle step, then A's next forward."""
    cs, stream, ape = prefilled(seed=1)
    other = Stream(np.random.default_rng(2), LAYERS, 400, DIM)
    cs = verify(cs, stream, ape, 100, 4, kept=3)
    cs = prepare(cs, ForwardMode.EXTEND, 0, slot=0)  # B's prefill
    cs, _, _ = ONLINE.compress(cs, jnp.asarray(other.rows[:, None, :50]), ints(0), ints(50), ints(0), ape)
    cs = prepare(cs, ForwardMode.IDLE, 0, slot=-1)
    assert int(cs.pending[A]) == 100
    cs = prepare(cs, ForwardMode.DECODE, 103)  # A kept 3 tokens
    assert int(cs.pending[A]) == -1
    assert_bank0(cs, stream, ape, 103)


# What runs between A's verify at 100 (3 of 4 tokens kept: A is at 103) and A's next forward at 103.
BETWEEN = {
    "verify begun, abandoned": lambda cs, s, ape: begin(cs, 103),
    "verify begun twice": lambda cs, s, ape: begin(begin(cs, 103), 103),
    "verify begun at other lengths": lambda cs, s, ape: begin(begin(cs, 150), 101),
    "verify begun, then B's verify": lambda cs, s, ape: verify(begin(cs, 103), s, ape, 0, 2, kept=2, slot=0),
    "verify begun, then idle and draft": lambda cs, s, ape: prepare(
        prepare(begin(cs, 103), ForwardMode.IDLE, 103), ForwardMode.DRAFT_EXTEND, 7
    ),
    "verify retried at other lengths": lambda cs, s, ape: verify(begin(cs, 110), s, ape, 103, 2, kept=0),
    "verify retried at the same lengths": lambda cs, s, ape: verify(begin(cs, 103), s, ape, 103, 4, kept=0),
}


@pytest.mark.parametrize("between", BETWEEN)
def test_retried_or_abandoned_verify_keeps_the_pending_commit(between):
    """A verify begun and never written changes nothing a later forward reads: the pending commit lands
    at A's next forward (or inside the verify that is finally written), exactly once."""
    cs, stream, ape = prefilled(seed=3)
    cs = verify(cs, stream, ape, 100, 4, kept=3)
    cs = BETWEEN[between](cs, stream, ape)
    cs = prepare(cs, ForwardMode.DECODE, 103)
    assert int(cs.pending[A]) == -1 and int(cs.to_commit[A]) == -1
    assert_bank0(cs, stream, ape, 103)


def test_the_last_layer_closes_the_verify():
    """The pending verify stays until write_prefix of the last layer, which commits it in its layer too;
    then the new verify is pending, with its N."""
    cs, stream, ape = prefilled(seed=4)
    cs = verify(cs, stream, ape, 100, 4, kept=3)
    cs = write(begin(cs, 103), stream, ape, 103, 2, kept=2, layers=range(LAYERS - 1))
    assert (int(cs.pending[A]), int(cs.pending_tokens[A]), int(cs.to_commit[A])) == (100, 4, 100)
    cs = write(cs, stream, ape, 103, 2, kept=2, layers=[LAYERS - 1])
    assert (int(cs.pending[A]), int(cs.pending_tokens[A]), int(cs.to_commit[A])) == (103, 2, -1)
    assert_bank0(cs, stream, ape, 103)
    assert_bank0(prepare(cs, ForwardMode.DECODE, 105), stream, ape, 105)


def test_commit_with_nothing_pending_changes_nothing():
    """Bank 0 stays as it is, also for a slot whose verify was committed already (a second commit)."""
    cs = CompressState.create(LAYERS, 4, DIM, MAX_DRAFT)
    cs = cs.replace(banks=poisoned_state(np.random.default_rng(5), LAYERS, 4, DIM, MAX_DRAFT))
    assert_same(ONLINE.commit(cs, ints(0, 1, 3, -1), ints(5, 130, 0, 9), ints(1, 4, 2, 3)), cs)
    cs, stream, ape = prefilled(seed=5)
    cs = ONLINE.commit(verify(cs, stream, ape, 100, 4, kept=2), ints(A), ints(100), ints(2))
    assert_same(ONLINE.commit(cs, ints(A), ints(100), ints(3)), cs)
    assert_bank0(cs, stream, ape, 102)


def test_commit_that_does_not_fit_changes_nothing():
    """An older verify (N = 4) left its prefixes in banks 3 and 4; the pending verify has N = 2. A commit
    of more than N tokens, or at another length, eager or lazy, changes nothing and the verify stays
    pending; the commit that fits keeps it."""
    cs, stream, ape = prefilled(seed=6)
    cs = ONLINE.commit(verify(cs, stream, ape, 100, 4, kept=2), ints(A), ints(100), ints(2))
    cs = verify(cs, stream, ape, 102, 2, kept=2)
    for bad in (
        lambda cs: ONLINE.commit(cs, ints(A), ints(102), ints(3)),
        lambda cs: ONLINE.commit(cs, ints(A), ints(101), ints(1)),
        lambda cs: ONLINE.commit(cs, ints(A), ints(102), ints(-1)),
        lambda cs: prepare(cs, ForwardMode.DECODE, 105),
        lambda cs: prepare(cs, ForwardMode.EXTEND, 101),
    ):
        assert_same(bad(cs), cs)
    assert_bank0(ONLINE.commit(cs, ints(A), ints(102), ints(2)), stream, ape, 104)
    assert_bank0(prepare(cs, ForwardMode.DECODE, 104), stream, ape, 104)


def test_verify_at_lengths_that_do_not_fit_drops_the_pending_verify():
    """A verify's banks replace the pending verify's: where its lengths do not fit it (here 3 tokens past
    a verify of N = 2), it is dropped without copying a bank into bank 0."""
    cs, stream, ape = prefilled(seed=7)
    cs = ONLINE.commit(verify(cs, stream, ape, 100, 4, kept=2), ints(A), ints(100), ints(2))
    cs = verify(cs, stream, ape, 102, 2, kept=2)
    bank0 = np.asarray(cs.banks[:, 0, A])
    cs = verify(cs, stream, ape, 105, 2, kept=2)
    np.testing.assert_array_equal(cs.banks[:, 0, A], bank0)
    assert (int(cs.pending[A]), int(cs.pending_tokens[A])) == (105, 2)


ROWS = jnp.zeros((2,), jnp.int32)
#: valid keyword arguments of each controller method (but the state), for the misuse tests to change
VALID = {
    "prepare_forward": dict(mode=ForwardMode.DECODE, slots=ROWS, seq_lens=ROWS),
    "commit": dict(slots=ROWS, seq_lens=ROWS, accept_lens=ROWS),
    "open_state": dict(slots=ROWS, seq_lens=ROWS, ape=jnp.zeros((LAYERS, 128, DIM))),
}
MISUSE = [
    ("prepare_forward", dict(mode="decode"), TypeError, "mode: expected a ForwardMode, got 'decode'"),
    ("prepare_forward", dict(slots=jnp.zeros((2, 1), jnp.int32)), ValueError, "slots: expected shape"),
    ("prepare_forward", dict(seq_lens=jnp.zeros(3, jnp.int32)), ValueError, r"seq_lens: .* shape \[2\]"),
    ("prepare_forward", dict(seq_lens=jnp.zeros(2)), TypeError, "seq_lens: expected dtype int32"),
    ("prepare_forward", dict(slots=[0, 1]), TypeError, "slots: expected an int32 array"),
    ("prepare_forward", dict(verify_bs=jnp.ones(2, jnp.int32)), ValueError, "verify_bs: expected a scalar"),
    ("commit", dict(accept_lens=jnp.zeros(1, jnp.int32)), ValueError, r"accept_lens: expected shape \[2\]"),
    ("commit", dict(slots=jnp.zeros(2, jnp.uint32)), TypeError, "slots: expected dtype int32"),
    ("commit", dict(accept_banks=jnp.zeros(3, jnp.int32)), ValueError, r"accept_banks: expected shape \[2\]"),
    ("prepare_forward", dict(accept_banks=jnp.zeros(2)), TypeError, "accept_banks: expected dtype int32"),
    (
        "open_state",
        dict(accept_banks=jnp.zeros((2, 1), jnp.int32)),
        ValueError,
        "accept_banks: expected shape",
    ),
    ("open_state", dict(seq_lens=jnp.zeros((), jnp.int32)), ValueError, "seq_lens: expected shape"),
]


@pytest.mark.parametrize("backend", ["online", "offline"])
@pytest.mark.parametrize("method, change, error, match", MISUSE)
def test_misuse_is_named_at_trace_time(backend, method, change, error, match):
    """Wrong shapes or dtypes of the per-row arguments and a mode that is not a ForwardMode raise while
    tracing, naming the argument, outside jit and inside."""
    backend = BACKENDS[backend]
    state = backend.create(LAYERS, 4, DIM, MAX_DRAFT)

    def call(state):
        return getattr(backend.controller, method)(state, **(VALID[method] | change))

    for run in (call, jax.jit(call)):
        with pytest.raises(error, match=match):
            run(state)


def test_both_backends_implement_the_protocol_in_full():
    """Every method of CompressController, with its parameters (names, kinds, defaults), in both."""
    methods = [name for name in vars(CompressController) if not name.startswith("_")]
    assert set(methods) == {
        "begin_verify",
        "prepare_forward",
        "write_prefix",
        "commit",
        "compress",
        "open_state",
    }

    def parameters(function):
        return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]

    for backend in BACKENDS.values():
        for name in methods:
            assert parameters(getattr(backend.controller, name)) == parameters(
                getattr(CompressController, name).__get__(backend.controller)
            ), (backend.name, name)


def test_the_offline_state_refuses_a_tree_by_name():
    state = OfflineState.create(LAYERS, 4, DIM, MAX_DRAFT)
    kv = jnp.zeros((1, 2, 3, 2 * DIM), jnp.float32)
    with pytest.raises(ValueError, match=r"^tree: the offline C128 state verifies chains only"):
        OFFLINE.write_prefix(state, kv, ROWS, ROWS, jnp.zeros((1, 128, DIM)), tree=(-1, 0, 0))


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
    assert bytes_per_slot(CompressState, 20, 512, 4) == 20 * 5 * 3 * 512 * 4 + 4 * 4
    assert bytes_per_slot(OfflineState, 20, 512, 4) == 20 * 132 * 2 * 512 * 4
    assert bytes_per_slot(CompressState, 20, 512, 4, jnp.bfloat16) == 20 * 5 * 3 * 512 * 2 + 4 * 4
