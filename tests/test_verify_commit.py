"""verify + commit: bank writes that keep the online state exact under speculative decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import (
    NATIVE_VS_REFERENCE_BF16,
    NATIVE_VS_REFERENCE_FP32,
    OFFLINE_FP32,
    Requests,
    assert_outputs_match,
    assert_state_close,
    assert_untouched,
    assert_wrote_nothing,
    ints,
    jit_op,
    poisoned_state,
    record_entries,
    valid_args,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import BLOCK, random_ape, random_tokens, rel_err, state_err

import jax_oc128 as oc
from jax_oc128 import reference

LAYERS, CALL_LAYER, DIM = 3, 1, 64
CALL_LAYERS = LAYERS - CALL_LAYER


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("offset", [0, 1, 2, 63, 120, 126, 127])
def test_case_matrix(offset, n, dtype=jnp.float32, tol=NATIVE_VS_REFERENCE_FP32, offline_tol=OFFLINE_FP32):
    """One row per accept length 0..N, all starting at seq % 128 == offset (SPEC section 5)."""
    rng = np.random.default_rng(1000 * offset + n)
    rows, max_draft = n + 1, 16
    accept = np.arange(rows, dtype=np.int32)
    slots = (rng.permutation(rows) + 1).astype(np.int32)  # slot 0 and the last slot belong to nobody
    seq = (BLOCK * (1 + accept % 2) + offset).astype(np.int32)
    reqs = Requests(
        rng,
        slots,
        seq + n,
        layers=LAYERS,
        call_layer=CALL_LAYER,
        dim=DIM,
        max_draft=max_draft,
        num_slots=rows + 2,
        dtype=dtype,
    )
    reqs.compress(seq, pad=0.0)  # the prefill
    state, ape, streams = reqs.state, jnp.asarray(reqs.ape), [r.stream for r in reqs.requests]
    kv = reqs.kv_score(accept, n)  # junk after the accepted prefix
    args = (kv, jnp.asarray(seq), jnp.asarray(slots), ape)

    verified = oc.verify(state, *args, layer=CALL_LAYER)
    assert_outputs_match(verified, jit_op(reference, "verify")(state, *args, layer=CALL_LAYER), tol)
    keep = np.ones(state.shape[:3], bool)  # verify writes banks 1..N of the rows' slots, in the call's layers
    keep[CALL_LAYER:, 1 : n + 1, slots] = False
    assert_untouched(state, verified[0], keep[..., None, None])

    close = BLOCK - 1 - offset  # index of the verify token at block position 127
    entries, entry_blocks = np.asarray(verified[1]), np.asarray(verified[2])[:, 0]
    expected_blocks = (seq + close) // BLOCK if close < n else np.full(rows, -1)
    np.testing.assert_array_equal(entry_blocks, expected_blocks)
    for i in np.flatnonzero(accept > close):  # the closing token was accepted: the entry is final
        assert rel_err(entries[:, i, 0], streams[i].entry(reqs.ape, entry_blocks[i])) < offline_tol

    commit_args = (jnp.asarray(seq), jnp.asarray(accept), jnp.asarray(slots))
    committed = oc.commit(verified[0], *commit_args, layer=CALL_LAYER)
    assert_state_close(
        committed, jit_op(reference, "commit")(verified[0], *commit_args, layer=CALL_LAYER), tol
    )
    moved = (accept > 0) & ((seq + accept) % BLOCK != 0)
    keep = np.ones(state.shape[:3], bool)
    keep[CALL_LAYER:, 0, slots[moved]] = False
    assert_untouched(verified[0], committed, keep[..., None, None])
    for i in np.flatnonzero(moved):
        bank0 = np.asarray(committed[CALL_LAYER:, 0, slots[i]])
        np.testing.assert_array_equal(bank0, np.asarray(verified[0][CALL_LAYER:, accept[i], slots[i]]))
        errors = state_err(bank0, *streams[i].open_state(reqs.ape, seq[i] + accept[i]))
        assert max(errors) < offline_tol, f"accept {accept[i]}: bank 0 errors (max, sum, mean) {errors}"


@pytest.mark.parametrize("offset", [1, 126])
def test_case_matrix_bf16(offset):
    """bf16 state: one rounding per stored bank (prefill and verify each fold in fp32), so 2 bf16 ulps."""
    test_case_matrix(offset, 8, jnp.bfloat16, NATIVE_VS_REFERENCE_BF16, offline_tol=2**-7)


class Schedule(Requests):
    """Requests sharing one state through prefill, decode, chunked prefill and verify/commit rounds.

    After every step: each entry emitted for a block whose tokens were all accepted equals the offline
    pooling of the accepted stream, and bank 0 equals the online state of its open block.
    """

    def __init__(self, ops, seed, requests, num_slots, max_draft, length):
        self.ops, rng = ops, np.random.default_rng(seed)
        slots = rng.permutation(num_slots).astype(np.int32)
        self.other_slot = slots[requests]
        super().__init__(
            rng,
            slots[:requests],
            length,
            layers=LAYERS,
            call_layer=CALL_LAYER,
            dim=DIM,
            max_draft=max_draft,
            num_slots=num_slots,
        )

    def compress(self, new_lens, width):  # padding is junk
        super().compress(new_lens, width, ops=self.ops)
        self.check()

    def other_forward(self):
        """A prefill of an unrelated request in a slot of its own."""
        kv = jnp.asarray(random_tokens(self.rng, (CALL_LAYERS, 1, 50), DIM))
        ape = jnp.asarray(self.ape)
        self.state = self.ops.compress(
            self.state, kv, ints(0), ints(50), ints(self.other_slot), ape, layer=CALL_LAYER
        )[0]

    def verify_commit(self, accept, n, between=None):
        accept = np.asarray(accept, np.int32)
        kv = self.kv_score(accept, n)  # junk after the accepted prefix
        seq, slots, ape = jnp.asarray(self.seq), jnp.asarray(self.slots), jnp.asarray(self.ape)
        self.state, entries, blocks = self.ops.verify(self.state, kv, seq, slots, ape, layer=CALL_LAYER)
        if between is not None:  # an unrelated forward between verify and commit
            between()
        self.state = self.ops.commit(self.state, seq, jnp.asarray(accept), slots, layer=CALL_LAYER)
        record_entries(self.requests, blocks, entries, accepted=self.seq + accept)
        self.advance(accept)
        self.check()


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_random_schedules_keep_the_offline_result(data):
    """Random prefill, then rounds of verify with random acceptance (rejected drafts are junk), decode
    and chunked prefill, over requests sharing the state; sometimes another forward runs between a
    verify and its commit."""
    n = data.draw(st.sampled_from([1, 2, 4]), label="N")
    sched = Schedule(oc, data.draw(st.integers(0, 2**31), label="seed"), 3, 5, max_draft=4, length=4000)
    sched.compress(data.draw(st.lists(st.integers(1, 300), min_size=3, max_size=3), label="prefill"), 300)
    for _ in range(data.draw(st.integers(5, 20), label="rounds")):
        kind = data.draw(st.sampled_from(["verify", "verify", "verify", "decode", "chunk"]))
        if kind == "decode":
            sched.compress([1, 1, 1], 1)
        elif kind == "chunk":
            sched.compress(data.draw(st.lists(st.integers(0, 130), min_size=3, max_size=3)), 130)
        else:
            accept = data.draw(st.lists(st.integers(0, n), min_size=3, max_size=3), label="accept")
            interleave = data.draw(st.booleans(), label="another forward before the commit")
            sched.verify_commit(accept, n, between=sched.other_forward if interleave else None)


def test_reference_follows_the_same_schedule():
    """The jnp twin keeps the invariants too."""
    sched = Schedule(reference, 7, 3, 6, max_draft=4, length=2000)
    sched.compress([127, 200, 1], 200)
    rng = np.random.default_rng(0)
    for r in range(40):
        sched.verify_commit(rng.integers(0, 5, 3), 4, between=sched.other_forward if r % 3 == 0 else None)
        if r % 7 == 0:
            sched.compress([1, 1, 1], 1)


def test_out_of_range_slots_and_accepts_write_nothing():
    """Traced values: a slot outside the state, a negative position or an accept beyond max_draft is
    skipped."""
    rng = np.random.default_rng(11)
    state = poisoned_state(rng, 2, 3, DIM, 4)
    kv = jnp.asarray(random_tokens(rng, (2, 3, 4), DIM))
    ape = jnp.asarray(random_ape(rng, 2, DIM))
    seq, slots = jnp.asarray([5, -1, 7], jnp.int32), jnp.asarray([3, 0, -1], jnp.int32)
    for ops in (oc, reference):
        assert_wrote_nothing(jax.jit(ops.verify)(state, kv, seq, slots, ape), state)
        bad = (jnp.asarray([5, 5, -5], jnp.int32), jnp.asarray([5, -1, 1], jnp.int32), jnp.asarray([0, 1, 2]))
        out = jax.jit(ops.commit)(state, *bad)
        np.testing.assert_array_equal(out, state)


def test_all_layers_in_one_call_and_a_layer_range():
    """commit covers every layer from `layer` on in one call, or `num_layers` of them."""
    rng = np.random.default_rng(12)
    state = poisoned_state(rng, 4, 2, DIM, 3)
    args = (jnp.asarray([5, 9], jnp.int32), jnp.asarray([2, 3], jnp.int32), jnp.asarray([1, 0], jnp.int32))
    out = np.asarray(oc.commit(state, *args, layer=1, num_layers=2))
    ref = np.asarray(state).copy()
    ref[1:3, 0, 1], ref[1:3, 0, 0] = ref[1:3, 2, 1], ref[1:3, 3, 0]
    np.testing.assert_array_equal(out, ref)
    ref[3, 0, 1], ref[3, 0, 0] = ref[3, 2, 1], ref[3, 3, 0]
    np.testing.assert_array_equal(oc.commit(state, *args, layer=1), ref)


def test_vmap_runs_the_op_per_element():
    """Under jit and vmap (a batch of states, per-element rows; the slots shared) verify and commit run once
    per element: the reference's results, element by element."""
    rng = np.random.default_rng(13)
    states = jnp.stack([poisoned_state(rng, 2, 3, DIM, 4) for _ in range(3)])
    kv = jnp.asarray(random_tokens(rng, (3, 2, 2, 4), DIM))
    ape = jnp.asarray(random_ape(rng, 2, DIM))
    seq, accept = jnp.asarray(rng.integers(0, 300, (3, 2)), jnp.int32), jnp.asarray([[1, 4], [0, 2], [3, 3]])
    slots = jnp.asarray([2, 0], jnp.int32)

    def step(ops, state, kv, seq, accept):
        state, entries, blocks = ops.verify(state, kv, seq, slots, ape)
        return ops.commit(state, seq, accept.astype(jnp.int32), slots), entries, blocks

    native = jax.jit(jax.vmap(lambda *a: step(oc, *a)))(states, kv, seq, accept)
    for i in range(3):
        ref = step(reference, states[i], kv[i], seq[i], accept[i])
        assert_outputs_match([x[i] for x in native], ref, NATIVE_VS_REFERENCE_FP32)


def test_empty_batch():
    state = oc.init_state(2, 3, DIM, 4)
    empty = jnp.zeros((0,), jnp.int32)
    out = oc.verify(state, jnp.zeros((2, 0, 3, 2 * DIM)), empty, empty, jnp.zeros((2, BLOCK, DIM)))
    assert out[1].shape == (2, 0, 1, DIM) and out[2].shape == (0, 1)
    np.testing.assert_array_equal(oc.commit(out[0], empty, empty, empty), state)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (
            valid_args("verify", tokens=5),
            ValueError,
            "kv_score: N = 5 verify tokens, but the state holds max_draft = 4",
        ),
        (valid_args("verify", tokens=0), ValueError, "kv_score: N = 0"),
        (dict(kv_score=jnp.zeros((2, 2, 3, 2 * DIM), jnp.bfloat16)), TypeError, "kv_score: expected dtype"),
        (dict(slots=jnp.asarray([0, 9], jnp.int32)), ValueError, "slots: values"),
        (dict(seq_lens=jnp.zeros((2, 1), jnp.int32)), ValueError, "seq_lens: expected shape"),
        (dict(ape=jnp.zeros((1, BLOCK, DIM))), ValueError, "ape: expected shape"),
    ],
)
def test_verify_bad_arguments_are_named(change, error, match):
    with pytest.raises(error, match=match):
        oc.verify(**(valid_args("verify") | change))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            dict(accept_lens=jnp.asarray([0, 5], jnp.int32)),
            ValueError,
            "accept_lens: values must be in \\[0, 4\\]",
        ),
        (dict(accept_lens=jnp.asarray([0, 1, 2], jnp.int32)), ValueError, "accept_lens: expected shape"),
        (
            dict(slots=jnp.asarray([0, 1], jnp.int64 if jax.config.x64_enabled else jnp.uint32)),
            TypeError,
            "slots",
        ),
        (dict(layer=2), ValueError, "layer: layers \\[2, 2\\)"),
        (dict(num_layers=3), ValueError, "layer: layers \\[0, 3\\)"),
    ],
)
def test_commit_bad_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        oc.commit(**(valid_args("commit") | kwargs))


def test_verify_with_pending_commits_first():
    """verify(pending=p) does, per row, what commit(accept = seq_lens - p) followed by verify does; rows
    without a pending verify (-1), or whose commit rule keeps bank 0, start from bank 0."""
    rng = np.random.default_rng(13)
    max_draft, rows = 4, 6
    state = poisoned_state(rng, LAYERS, 8, DIM, max_draft)
    slots = jnp.asarray([0, 3, 5, 7, -1, 2], jnp.int32)
    seq = jnp.asarray([130, 257, 640, 70, 9, 300], jnp.int32)
    pending = np.full(8, -1, np.int32)
    pending[[0, 3, 5, 7, 2]] = [127, 253, 637, 70, 299]  # accept 3, 4, 3 (closes a block), 0, 1
    pending = jnp.asarray(pending)
    kv = jnp.asarray(random_tokens(rng, (CALL_LAYERS, rows, 3), DIM))
    ape = jnp.asarray(random_ape(rng, CALL_LAYERS, DIM))
    before = jnp.where(slots >= 0, pending[jnp.maximum(slots, 0)], -1)
    commit_args = (
        jnp.maximum(before, 0),
        jnp.where(before >= 0, seq - before, 0),
        jnp.where(before >= 0, slots, -1),
    )
    for ops in (oc, reference):
        fused = ops.verify(state, kv, seq, slots, ape, layer=CALL_LAYER, pending=pending)
        committed = ops.commit(state, *commit_args, layer=CALL_LAYER)
        np.testing.assert_array_equal(
            np.asarray(committed[CALL_LAYER:, 0]), np.asarray(fused[0][CALL_LAYER:, 0])
        )
        two_step = ops.verify(committed, kv, seq, slots, ape, layer=CALL_LAYER)
        for got, want in zip(fused, two_step, strict=True):
            np.testing.assert_array_equal(got, want)
    assert_outputs_match(
        oc.verify(state, kv, seq, slots, ape, layer=CALL_LAYER, pending=pending),
        reference.verify(state, kv, seq, slots, ape, pending, layer=CALL_LAYER),
        NATIVE_VS_REFERENCE_FP32,
    )
    with pytest.raises(ValueError, match="pending: expected shape"):
        oc.verify(state, kv, seq, slots, ape, pending=pending[:4])
