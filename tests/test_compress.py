"""compress: prefill, chunked prefill and decode fold tokens into bank 0 and emit closed blocks' entries."""

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
    assert_untouched,
    assert_updated_in_place,
    assert_wrote_nothing,
    ints,
    jit_op,
    poisoned_state,
    valid_args,
)
from oracle import BLOCK, random_ape, random_tokens, rel_err

import jax_oc128 as oc
from jax_oc128 import reference

LAYERS, CALL_LAYER, DIM, MAX_DRAFT = 3, 1, 64, 4  # calls cover state layers 1..2; layer 0 must stay untouched
CALL_LAYERS = LAYERS - CALL_LAYER


class Compressions(Requests):
    """Several requests, each in its own slot, fed to the native compress and its reference in chunks of any
    lengths (padding NaN: never read)."""

    def __init__(self, rng, slots, length, dtype=jnp.float32, dim=DIM, score_offset=0.0):
        super().__init__(
            rng,
            slots,
            length,
            layers=LAYERS,
            call_layer=CALL_LAYER,
            dim=dim,
            max_draft=MAX_DRAFT,
            dtype=dtype,
            score_offset=score_offset,
        )

    def step(self, new_lens, width=None, tol=NATIVE_VS_REFERENCE_FP32):
        """Compress ``new_lens[i]`` more tokens of request i (padded to ``width``) with the native op and the
        reference, check them against each other, and return the native outputs."""
        new_lens = np.asarray(new_lens, np.int32)
        kv = self.kv_score(new_lens, width, pad=np.nan)  # padding tokens must never be read
        args = (kv, *map(jnp.asarray, (self.seq, new_lens, self.slots, self.ape)))
        before = self.state
        native = oc.compress(before, *args, layer=CALL_LAYER)
        ref = jit_op(reference, "compress")(before, *args, layer=CALL_LAYER)
        assert_outputs_match(native, ref, tol)
        self.check_untouched(before, native[0])
        self.state = native[0]
        self.advance(new_lens)
        return native

    def check_untouched(self, before, after):
        """compress writes bank 0 of the call's layers and the requests' slots, nothing else."""
        keep = np.ones(before.shape[:3], bool)
        keep[CALL_LAYER:, 0, self.slots[self.slots >= 0]] = False
        assert_untouched(before, after, keep[..., None, None])

    def check_against_offline(self, outputs, seq_before, tol=OFFLINE_FP32, state_tol=OFFLINE_FP32):
        """Every emitted entry is the offline pooling of its block; bank 0 is the open block's state."""
        _, entries, entry_blocks = map(np.asarray, outputs)
        for i, request in enumerate(self.requests):
            blocks = list(range(seq_before[i] // BLOCK, request.seq // BLOCK))
            got = [b for b in entry_blocks[i] if b >= 0]
            assert got == blocks, f"request {i}: entry_blocks {entry_blocks[i]}, expected {blocks}"
            for e, block in enumerate(blocks):
                assert rel_err(entries[:, i, e], request.stream.entry(self.ape, block)) < tol
            assert not np.any(entries[:, i, len(blocks) :]), "entries past the closed blocks must be zero"
            if request.seq > seq_before[i]:
                request.check_open(self.ape, self.bank0(i), state_tol, name=f"request {i}")


def test_prefill_crossing_several_blocks_with_ragged_rows():
    rng = np.random.default_rng(1)
    req = Compressions(rng, slots=[3, 0, 5, 1], length=700)
    new_lens = [3 * BLOCK + 57, 2 * BLOCK, 1, 0]  # ends open, ends exactly on a boundary, one token, none
    out = req.step(new_lens, width=4 * BLOCK + 1)
    req.check_against_offline(out, seq_before=np.zeros(4, np.int32))
    assert out[1].shape == (CALL_LAYERS, 4, 5, DIM) and out[2].shape == (4, 5)


def test_chunked_prefill_in_uneven_chunks():
    rng = np.random.default_rng(2)
    req = Compressions(rng, slots=[2, 4, 0], length=900)
    chunks = [[37, 128, 127], [128, 1, 2], [1, 200, 129], [200, 127, 255], [91, 2, 1]]
    for new_lens in chunks:
        seq_before = req.seq.copy()
        req.check_against_offline(req.step(new_lens), seq_before)


def test_token_by_token_decode_across_block_boundaries():
    rng = np.random.default_rng(3)
    req = Compressions(rng, slots=[1, 0, 2], length=400)
    req.step([120, 126, 1])  # start just before a boundary, then decode across it
    for _ in range(140):
        seq_before = req.seq.copy()
        req.check_against_offline(req.step([1, 1, 1]), seq_before)


def test_padding_rows_read_and_write_nothing():
    rng = np.random.default_rng(4)
    req = Compressions(rng, slots=[0, -1, 2, -1], length=300)
    out = req.step([150, 150, 150, 0])  # a padding row with tokens must still write nothing
    assert np.all(np.asarray(out[2])[[1, 3]] == -1)
    assert not np.any(np.asarray(out[1])[:, [1, 3]])


def test_large_scores_do_not_overflow():
    """The running max keeps every exp() argument <= 0: scores around 80 (exp overflows fp32 near 88)."""
    rng = np.random.default_rng(5)
    req = Compressions(rng, slots=[0, 1], length=400, score_offset=80.0)
    for new_lens in ([100, 3], [100, 200], [1, 1]):
        seq_before = req.seq.copy()
        req.check_against_offline(req.step(new_lens), seq_before)


@pytest.mark.parametrize("dim", [32, 96, 512])
def test_any_head_dim_multiple_of_32(dim):
    rng = np.random.default_rng(dim)
    req = Compressions(rng, slots=[1, 0], length=300, dim=dim)
    for new_lens in ([130, 5], [1, 200]):
        seq_before = req.seq.copy()
        req.check_against_offline(req.step(new_lens), seq_before)


def test_bf16_state():
    """bf16 storage of (max, sum, mean). Within one call the fold runs in fp32, so a prefill rounds the state
    once (tolerance: one bf16 ulp, 2**-8). Token-by-token decode stores it after every token, the worst
    case: each store adds a relative error of at most 2**-9, and after k stores of a growing sum these
    add up like a random walk of RMS about 2**-9 * sqrt(k / 9) (0.7% at k = 127); the largest of 128
    channels is about 3.5 RMS (2.5%). The tolerance, 5%, is 7 RMS: a systematic error (a wrong rescale
    of the sum, a truncating instead of rounding conversion) grows linearly in k and exceeds it."""
    rng = np.random.default_rng(6)
    req = Compressions(rng, slots=[0, 1], length=500, dtype=jnp.bfloat16)
    seq_before = req.seq.copy()
    req.check_against_offline(req.step([300, 131], tol=NATIVE_VS_REFERENCE_BF16), seq_before, state_tol=2**-8)
    for _ in range(130):
        seq_before = req.seq.copy()
        out = req.step([1, 1], tol=NATIVE_VS_REFERENCE_BF16)
        req.check_against_offline(out, seq_before, tol=5e-2, state_tol=5e-2)


def test_bf16_store_rescales_the_sum_to_the_rounded_max():
    """A bf16 store rounds the max and rescales the sum to it, so the stored pair weighs what the float32 pair
    does: ``s' * exp(m') == s * exp(m)`` up to the rounding of ``s'`` (2**-9, bound 2**-8). Maxima in [8, 16)
    round by up to 2**-5, so a sum left unscaled would be off by up to 3%. Under jit on the default backend:
    XLA on GPUs elides a float32 -> bfloat16 -> float32 round trip unless it is done on the bits."""
    rng = np.random.default_rng(11)
    m = rng.uniform(8, 16, size=4096).astype(np.float32)
    s = rng.uniform(1, 100, size=4096).astype(np.float32)
    rows = jax.jit(reference.store_state, static_argnums=3)(m, s, s, jnp.bfloat16)
    stored_m, stored_s = np.asarray(rows[0], np.float64), np.asarray(rows[1], np.float64)
    assert np.any(stored_m != m)  # the case at hand: maxima that bf16 rounds
    weight = stored_s * np.exp(stored_m - m.astype(np.float64))
    assert np.max(np.abs(weight / s - 1)) < 2**-8


def test_empty_batch_and_no_tokens():
    state = oc.init_state(2, 4, DIM, MAX_DRAFT)
    ape = jnp.zeros((2, BLOCK, DIM), jnp.float32)
    empty = jnp.zeros((0,), jnp.int32)
    out = oc.compress(state, jnp.zeros((2, 0, 5, 2 * DIM), jnp.float32), empty, empty, empty, ape)
    assert out[1].shape == (2, 0, 1, DIM) and out[2].shape == (0, 1)
    one = jnp.zeros((1,), jnp.int32)
    out = oc.compress(out[0], jnp.zeros((2, 1, 0, 2 * DIM), jnp.float32), one, one - 1 + 1, one, ape)
    assert out[1].shape == (2, 1, 1, DIM) and int(out[2][0, 0]) == -1
    np.testing.assert_array_equal(out[0], state)


def test_donated_state_is_updated_in_place():
    """Under jit with the state donated, the op writes into the caller's buffer: no copy is made."""
    rng = np.random.default_rng(7)
    state = oc.init_state(LAYERS, 4, DIM, MAX_DRAFT)
    kv = jnp.asarray(random_tokens(rng, (CALL_LAYERS, 2, 200), DIM))
    ape = jnp.asarray(random_ape(rng, CALL_LAYERS, DIM))
    rows = (ints(0, 200), ints(200, 200), ints(1, 3))
    step = jax.jit(lambda s, *a: oc.compress(s, *a, layer=CALL_LAYER), donate_argnums=0)
    assert_updated_in_place(step, state, kv, *rows, ape)


@pytest.mark.gpu
def test_cuda_lowering_uses_the_native_target():
    """The CUDA dispatch, checked without a GPU: lowering for CUDA emits the native custom call."""
    if "oc128_compress" not in oc.ops.native_targets("cuda"):
        pytest.skip("the CUDA module was not built here")
    state = oc.init_state(1, 2, DIM, 2)
    args = (
        jnp.zeros((1, 2, 3, 2 * DIM), jnp.float32),
        *(jnp.zeros((2,), jnp.int32),) * 3,
        jnp.zeros((1, BLOCK, DIM), jnp.float32),
    )
    lowered = jax.jit(oc.compress).trace(state, *args).lower(lowering_platforms=("cuda",))
    assert 'custom_call_target="oc128_compress"' in lowered.as_text() or "oc128_compress" in lowered.as_text()


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(state=jnp.zeros((2, 5, 4, 64))), ValueError, "state: expected shape"),
        (dict(state=jnp.zeros((2, 5, 4, 3, 64), jnp.float16)), TypeError, "state: dtype"),
        (dict(state=jnp.zeros((2, 5, 4, 3, 48))), ValueError, "state: head_dim"),
        (dict(kv_score=jnp.zeros((2, 2, 3, 64))), ValueError, "kv_score: expected shape"),
        (dict(kv_score=jnp.zeros((2, 2, 3), jnp.float32)), ValueError, "kv_score: expected rank 4"),
        (dict(kv_score=jnp.zeros((2, 2, 3, 128), jnp.bfloat16)), TypeError, "kv_score: expected dtype"),
        (dict(kv_score=jnp.zeros((3, 2, 3, 128))), ValueError, "layer: layers"),
        (dict(seq_lens=jnp.zeros((3,), jnp.int32)), ValueError, "seq_lens: expected shape"),
        (
            dict(seq_lens=jnp.zeros((2,), jnp.int64 if jax.config.x64_enabled else jnp.float32)),
            TypeError,
            "seq_lens",
        ),
        (dict(new_lens=jnp.asarray([1, 4], jnp.int32)), ValueError, "new_lens: values"),
        (dict(new_lens=jnp.asarray([-1, 0], jnp.int32)), ValueError, "new_lens: values"),
        (dict(slots=jnp.asarray([0, 4], jnp.int32)), ValueError, "slots: values"),
        (dict(slots=jnp.asarray([0, -2], jnp.int32)), ValueError, "slots: values"),
        (dict(seq_lens=jnp.asarray([0, -5], jnp.int32)), ValueError, "seq_lens: must be >= 0"),
        (dict(ape=jnp.zeros((2, 64, 64))), ValueError, "ape: expected shape"),
    ],
)
def test_bad_arguments_are_named(change, error, match):
    args = valid_args("compress") | change
    with pytest.raises(error, match=match):
        oc.compress(**args)


def test_bad_layer_argument():
    with pytest.raises(ValueError, match="layer: layers"):
        oc.compress(**valid_args("compress"), layer=1)
    with pytest.raises(TypeError, match="layer: must be an int"):
        oc.compress(**valid_args("compress"), layer=jnp.int32(0))


def test_native_handler_rejects_bad_shapes():
    """A handler reached without the Python checks returns an FFI error instead of reading out of bounds."""
    args = valid_args("compress")
    results = (
        jax.ShapeDtypeStruct(args["state"].shape, args["state"].dtype),
        jax.ShapeDtypeStruct((2, 2, 1, DIM), jnp.float32),
        jax.ShapeDtypeStruct((2, 1), jnp.int32),
    )
    call = jax.ffi.ffi_call("oc128_compress", results, input_output_aliases={0: 0})
    bad_ape = jnp.zeros((2, 64, DIM), jnp.float32)
    operands = (args["state"], args["kv_score"], args["seq_lens"], args["new_lens"], args["slots"], bad_ape)
    with pytest.raises(Exception, match="jax_oc128: ape: expected shape"):
        jax.block_until_ready(call(*operands, layer=np.int64(0)))


def test_out_of_range_values_under_jit_are_skipped():
    """Traced values cannot be checked: rows with a bad slot, seq_len or new_len are skipped on device."""
    rng = np.random.default_rng(8)
    state = poisoned_state(rng, 2, 3, DIM, MAX_DRAFT)
    kv = jnp.asarray(random_tokens(rng, (2, 4, 5), DIM))
    ape = jnp.asarray(random_ape(rng, 2, DIM))
    seq = jnp.asarray([0, -3, 0, 0], jnp.int32)
    new = jnp.asarray([5, 5, 6, -1], jnp.int32)
    slots = jnp.asarray([3, 0, 1, 2], jnp.int32)  # slot 3 is outside the 3 slots
    for fn in (oc.compress, reference.compress):
        assert_wrote_nothing(jax.jit(fn)(state, kv, seq, new, slots, ape), state)
