"""Misuse of the public ops (init_state, compress, verify, commit): every case either raises at trace time, a
ValueError or TypeError whose message starts with the argument's name, or follows the on-device policy of
:mod:`jax_oc128.ops`, where a skipped row is a padding row and native == reference. Then the score domain:
a -inf score has weight zero, alike in the online native op, its reference and the offline pooling.

(The cases already in test_compress.py and test_verify_commit.py are not repeated here.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import (
    NATIVE_VS_REFERENCE_BF16,
    NATIVE_VS_REFERENCE_FP32,
    OFFLINE_FP32,
    assert_outputs_match,
    ints,
    jit_op,
    poisoned_state,
)
from oracle import BLOCK, random_ape, random_tokens

import jax_oc128 as oc
from jax_oc128 import OfflineState, reference

LAYERS, SLOTS, DIM, MAX_DRAFT = 3, 5, 32, 4
TOKENS, N = 5, 3  # compress width, verify tokens
SLOT_OF_ROW = (3, 0, 4)


def arguments(op):
    """Valid keyword arguments of ``op`` ("compress", "verify", "commit"): three rows in distinct slots
    whose tokens close a block (row 0) and fill an open one, the calls covering state layers 1..2."""
    rng = np.random.default_rng(0)
    args = dict(
        state=poisoned_state(rng, LAYERS, SLOTS, DIM, MAX_DRAFT),
        seq_lens=ints(126, 5, 250),
        slots=ints(*SLOT_OF_ROW),
        layer=1,
    )
    if op == "commit":
        return args | dict(accept_lens=ints(1, 2, 4), num_layers=2)
    args |= dict(ape=jnp.asarray(random_ape(rng, LAYERS - 1, DIM)))
    if op == "compress":
        kv = random_tokens(rng, (LAYERS - 1, len(SLOT_OF_ROW), TOKENS), DIM)
        return args | dict(kv_score=jnp.asarray(kv), new_lens=ints(5, 3, 5))
    pending = np.full(SLOTS, -1, np.int32)
    pending[[3, 0]] = [124, 3]  # rows 0 and 1 first commit 2 tokens of a previous verify
    kv = random_tokens(rng, (LAYERS - 1, len(SLOT_OF_ROW), N), DIM)
    return args | dict(kv_score=jnp.asarray(kv), pending=jnp.asarray(pending))


OPS = {"compress": oc.compress, "verify": oc.verify, "commit": oc.commit}


def zeros_state(shape):
    return jnp.zeros(shape, jnp.float32)


# ---------------------------------------------------------------------------------------------------------
# Trace time: an exception naming the argument

ERRORS = [
    # every op: the state
    *(
        pytest.param(op, change, error, match, id=f"{op}-{name}")
        for op in OPS
        for name, change, error, match in [
            (
                "head_dim 0",
                dict(state=zeros_state((LAYERS, 1 + MAX_DRAFT, SLOTS, 3, 0))),
                ValueError,
                "state: head_dim must be a positive multiple of 32, got 0",
            ),
            (
                "no slot",
                dict(state=zeros_state((LAYERS, 1 + MAX_DRAFT, 0, 3, DIM))),
                ValueError,
                "state: needs at least one layer and one slot",
            ),
            (
                "rank 4",
                dict(state=zeros_state((LAYERS, 1 + MAX_DRAFT, SLOTS, 3 * DIM))),
                ValueError,
                "state:",
            ),
            (
                "float16",
                dict(state=jnp.zeros((LAYERS, 1 + MAX_DRAFT, SLOTS, 3, DIM), jnp.float16)),
                TypeError,
                "state: dtype",
            ),
            ("not an array", dict(state="state"), TypeError, "state: expected an array, got str"),
            ("seq_lens None", dict(seq_lens=None), TypeError, "seq_lens: expected an array"),
            ("slots ragged", dict(slots=[[0], [1, 2]]), TypeError, "slots: expected an array, got list"),
            ("slots float", dict(slots=jnp.zeros(3)), TypeError, "slots: expected dtype int32"),
            ("slots rank 2", dict(slots=jnp.zeros((3, 1), jnp.int32)), ValueError, "slots: expected shape"),
            (
                "repeated slot",
                dict(slots=ints(3, 0, 3)),
                ValueError,
                "slots: slot 3 is in rows 0 and 2; the rows of a call must use distinct slots",
            ),
            ("layer -1", dict(layer=-1), ValueError, "layer: must be >= 0, got -1"),
            ("layer bool", dict(layer=True), TypeError, "layer: must be an int"),
            ("layer past the state", dict(layer=2), ValueError, r"layer: layers \[2, 4\)"),
        ]
    ),
    # the row values where test_compress.py and test_verify_commit.py do not check them
    *(
        pytest.param(op, change, error, match, id=f"{op}-{name}")
        for op, name, change, error, match in [
            (
                "verify",
                "slots -2",
                dict(slots=ints(3, -2, 4)),
                ValueError,
                r"slots: values must be in \[-1, 4\]",
            ),
            (
                "commit",
                "slots -2",
                dict(slots=ints(3, -2, 4)),
                ValueError,
                r"slots: values must be in \[-1, 4\]",
            ),
            (
                "commit",
                "slot past the state",
                dict(slots=ints(3, 5, 4)),
                ValueError,
                "slots: values must be in",
            ),
            (
                "verify",
                "negative seq_lens",
                dict(seq_lens=ints(126, -1, 250)),
                ValueError,
                "seq_lens: must be >= 0",
            ),
            (
                "commit",
                "negative seq_lens",
                dict(seq_lens=ints(126, -1, 250)),
                ValueError,
                "seq_lens: must be >= 0",
            ),
        ]
    ),
    # compress and verify: kv_score and ape
    *(
        pytest.param(op, change, error, match, id=f"{op}-{name}")
        for op, width in (("compress", TOKENS), ("verify", N))
        for name, change, error, match in [
            ("kv_score None", dict(kv_score=None), TypeError, "kv_score: expected an array"),
            (
                "kv_score rank 3",
                dict(kv_score=jnp.zeros((2, 3, 2 * DIM))),
                ValueError,
                "kv_score: expected rank 4",
            ),
            (
                "kv_score head_dim",
                dict(kv_score=jnp.zeros((2, 3, width, 2 * DIM + 32))),
                ValueError,
                "kv_score: expected shape",
            ),
            (
                "kv_score rows",
                dict(kv_score=jnp.zeros((2, 2, width, 2 * DIM))),
                ValueError,
                r"seq_lens: expected shape \[2\]",
            ),
            ("ape head_dim", dict(ape=jnp.zeros((2, BLOCK, 2 * DIM))), ValueError, "ape: expected shape"),
            (
                "ape bfloat16",
                dict(ape=jnp.zeros((2, BLOCK, DIM), jnp.bfloat16)),
                TypeError,
                "ape: expected dtype",
            ),
            ("ape layers", dict(ape=jnp.zeros((3, BLOCK, DIM))), ValueError, "ape: expected shape"),
        ]
    ),
    # compress: new_lens
    pytest.param(
        "compress", dict(new_lens=ints(5, 3)), ValueError, "new_lens: expected shape", id="new_lens-rows"
    ),
    pytest.param(
        "compress", dict(new_lens=jnp.zeros(3)), TypeError, "new_lens: expected dtype", id="new_lens-float"
    ),
    # verify: pending
    pytest.param(
        "verify", dict(pending=jnp.zeros(SLOTS)), TypeError, "pending: expected dtype", id="pending-float"
    ),
    pytest.param(
        "verify", dict(pending=[-1] * 4), ValueError, r"pending: expected shape \[5\]", id="pending-slots"
    ),
    pytest.param("verify", dict(pending="x"), TypeError, "pending: expected an array", id="pending-str"),
    # commit: accept_lens and num_layers
    pytest.param(
        "commit", dict(accept_lens=ints(1, -1, 4)), ValueError, "accept_lens: values", id="accept<0"
    ),
    pytest.param(
        "commit", dict(accept_lens=jnp.zeros(3)), TypeError, "accept_lens: expected dtype", id="accept-float"
    ),
    pytest.param(
        "commit", dict(seq_lens=jnp.int32(5)), ValueError, "seq_lens: expected shape", id="seq_lens-rank0"
    ),
    pytest.param(
        "commit", dict(num_layers=0), ValueError, "num_layers: must be >= 1, got 0", id="num_layers-0"
    ),
    pytest.param(
        "commit", dict(num_layers=2.0), TypeError, "num_layers: must be an int", id="num_layers-float"
    ),
]


@pytest.mark.parametrize("op, change, error, match", ERRORS)
def test_misuse_raises_naming_the_argument(op, change, error, match):
    with pytest.raises(error, match=match):
        OPS[op](**(arguments(op) | change))


@pytest.mark.parametrize(
    "change, error, match",
    [
        pytest.param(dict(layers=0), ValueError, "layers: must be >= 1, got 0", id="layers=0"),
        pytest.param(dict(layers=1.5), TypeError, "layers: must be an int", id="layers=1.5"),
        pytest.param(dict(slots=0), ValueError, "slots: must be >= 1, got 0", id="slots=0"),
        pytest.param(dict(slots="4"), TypeError, "slots: must be an int", id='slots="4"'),
        pytest.param(dict(head_dim=0), ValueError, "head_dim: must be >= 1, got 0", id="head_dim=0"),
        pytest.param(
            dict(head_dim=48),
            ValueError,
            "head_dim: must be a positive multiple of 32, got 48",
            id="head_dim=48",
        ),
        pytest.param(
            dict(head_dim=np.float32(64)),
            TypeError,
            "head_dim: must be an int",
            id="head_dim=np.float32(64)",
        ),
        pytest.param(dict(max_draft=-1), ValueError, "max_draft: must be >= 0, got -1", id="max_draft=-1"),
        pytest.param(dict(max_draft=17), ValueError, "max_draft: at most 16, got 17", id="max_draft=17"),
        pytest.param(dict(max_draft=True), TypeError, "max_draft: must be an int", id="max_draft=True"),
        pytest.param(
            dict(dtype=jnp.float16), TypeError, "dtype: must be float32 or bfloat16", id="dtype=jnp.float16"
        ),
    ],
)
def test_init_state_misuse_raises_naming_the_argument(change, error, match):
    with pytest.raises(error, match=match):
        oc.init_state(**(dict(layers=2, slots=3, head_dim=64, max_draft=4) | change))


def test_native_handler_refuses_a_state_without_slots():
    """The handler reached without the Python checks (a raw custom call) refuses it too, naming the state.
    (A commit's only result is the state: XLA does not run a call whose results are all empty.)"""
    args = arguments("compress")
    state = zeros_state((LAYERS, 1 + MAX_DRAFT, 0, 3, DIM))
    results = (
        jax.ShapeDtypeStruct(state.shape, state.dtype),
        jax.ShapeDtypeStruct((2, 3, 1, DIM), jnp.float32),
        jax.ShapeDtypeStruct((3, 1), jnp.int32),
    )
    call = jax.ffi.ffi_call("oc128_compress", results, input_output_aliases={0: 0})
    operands = [args[name] for name in oc.ops.OPERANDS["oc128_compress"].args[1:]]
    with pytest.raises(Exception, match="jax_oc128: state: needs at least one slot"):
        jax.block_until_ready(call(state, *operands, layer=np.int64(1)))


@pytest.mark.parametrize("op", list(OPS))
def test_array_likes_are_accepted(op):
    """Lists and numpy arrays work where jax arrays do, with the same result, and -1 (padding) may repeat."""
    args = arguments(op)
    rows = ("seq_lens", "slots", "new_lens", "accept_lens", "pending")
    as_lists = {name: np.asarray(v).tolist() if name in rows else v for name, v in args.items()}
    as_numpy = {
        name: np.asarray(v) if name in rows or name in ("kv_score", "ape") else v for name, v in args.items()
    }
    want = OPS[op](**args)
    for given in (as_lists, as_numpy):
        for got, expected in zip(jax.tree.leaves(OPS[op](**given)), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(got, expected)
    OPS[op](**(as_lists | dict(slots=[-1, 0, -1])))  # padding may repeat


# ---------------------------------------------------------------------------------------------------------
# On device: a skipped row is a padding row, native == reference

# (op, the misuse: argument -> {row: value}, the call it must equal: argument -> {row: value})
PADDING = dict(slots={1: -1})
POLICIES = [
    *(
        pytest.param(op, bad, same, id=f"{op}-{name}")
        for op in OPS
        for name, bad, same in [
            ("slot past the state", dict(slots={1: SLOTS}), PADDING),
            ("slot below -1", dict(slots={1: -7}), PADDING),
            ("negative seq_lens", dict(seq_lens={1: -1}), PADDING),
            ("repeated slot", dict(slots={2: SLOT_OF_ROW[0]}), dict(slots={2: -1})),
            (
                "repeated slot of an invalid row",
                dict(slots={2: SLOT_OF_ROW[0]}, seq_lens={0: -4}),
                dict(slots={0: -1, 2: SLOT_OF_ROW[0]}),
            ),
        ]
    ),
    pytest.param("compress", dict(new_lens={1: -1}), PADDING, id="compress-negative new_lens"),
    pytest.param("compress", dict(new_lens={1: TOKENS + 1}), PADDING, id="compress-new_lens past T"),
    pytest.param(
        "compress", dict(new_lens={0: 0}), dict(slots={0: -1}), id="compress-new_lens 0 inside a block"
    ),
    pytest.param(
        "compress",
        dict(new_lens={0: 0}, slots={2: SLOT_OF_ROW[0]}),
        dict(slots={0: -1, 2: -1}),
        id="compress-repeated slot of a row with new_lens 0",
    ),
    pytest.param(
        "compress",
        dict(new_lens={0: TOKENS + 1}, slots={2: SLOT_OF_ROW[0]}),
        dict(slots={0: -1, 2: SLOT_OF_ROW[0]}),
        id="compress-repeated slot of a row with new_lens past T",
    ),
    pytest.param("verify", dict(pending={0: 9}), dict(pending={0: -1}), id="verify-pending past seq_lens"),
    pytest.param(
        "verify", dict(pending={0: 0}), dict(pending={0: -1}), id="verify-pending accept past max_draft"
    ),
    pytest.param(
        "verify",
        dict(slots={2: SLOT_OF_ROW[0]}, seq_lens={2: 126}),
        dict(slots={2: -1}),
        id="verify-repeated slot with its pending commit",
    ),
    pytest.param("commit", dict(accept_lens={1: -1}), PADDING, id="commit-negative accept_lens"),
    pytest.param(
        "commit", dict(accept_lens={1: MAX_DRAFT + 1}), PADDING, id="commit-accept_lens past max_draft"
    ),
    pytest.param("commit", dict(accept_lens={1: 0}), PADDING, id="commit-accept_lens 0"),
    pytest.param(
        "commit",
        dict(accept_lens={0: MAX_DRAFT + 1}, slots={2: SLOT_OF_ROW[0]}),
        dict(slots={0: -1, 2: SLOT_OF_ROW[0]}),
        id="commit-repeated slot of a row with accept_lens past max_draft",
    ),
]


def with_rows(args, changes):
    """``args`` with the row values ``changes`` (argument -> {row: value}) set."""
    changed = dict(args)
    for name, rows in changes.items():
        values = np.array(args[name])
        for row, value in rows.items():
            values[row] = value
        changed[name] = jnp.asarray(values)
    return changed


@pytest.mark.parametrize("op, bad, same", POLICIES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_on_device_policy(op, bad, same, dtype):
    """Traced (jitted), the misused call gives exactly what the call ``same`` (its skipped rows made padding)
    gives, natively and in the reference, and native and reference agree."""
    args = arguments(op)
    args["state"] = args["state"].astype(dtype)
    outputs = {}
    for impl in (oc, reference):
        call = jit_op(impl, op)
        got, want = call(**with_rows(args, bad)), call(**with_rows(args, same))
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(x, y)
        outputs[impl] = got
    tol = NATIVE_VS_REFERENCE_FP32 if dtype == jnp.float32 else NATIVE_VS_REFERENCE_BF16
    if op == "commit":
        np.testing.assert_array_equal(outputs[oc], outputs[reference])  # a bitwise copy
    else:
        assert_outputs_match(outputs[oc], outputs[reference], tol)


# ---------------------------------------------------------------------------------------------------------
# The score domain: a -inf score has weight zero


def assert_pooled_close(x, y, tol):
    """(max, sum, mean) rows or entries: no NaN, the same infinities, finite values close."""
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    assert not np.any(np.isnan(x)) and not np.any(np.isnan(y))
    np.testing.assert_allclose(x, y, rtol=tol, atol=tol)


CHUNKS = (1, 1, 100, 60, 140)  # compress calls ending at 1, 2, 102, 162, 302


def compress_in_chunks(kv, ape, dtype):
    """Feed ``kv`` (one row, slot 0) in ``CHUNKS`` to the native compress, its reference and the offline
    pooling. Returns, per one of them (``oc``, ``reference``, ``"offline"``), after each chunk the open
    block's float32 (max, sum, mean) ``[1, 3, DIM]`` (bank 0, or the offline open block), and the entries
    emitted, in block order."""
    states = {impl: oc.init_state(1, 1, DIM, MAX_DRAFT, dtype) for impl in (oc, reference)}
    states["offline"] = OfflineState.create(1, 1, DIM, MAX_DRAFT)
    opened = {name: [] for name in states}
    entries = {name: [] for name in states}
    seq = 0
    for n in CHUNKS:
        args = (jnp.asarray(kv[:, :, seq : seq + n]), ints(seq), ints(n), ints(0), ape)
        for name in states:
            if name == "offline":
                states[name], e, blocks = states[name].write(*args)
                pooled = states[name].open_block(ints(0), ints(seq + n), ape)
                opened[name].append(jnp.stack([x[:, 0] for x in pooled], axis=1))
            else:
                states[name], e, blocks = name.compress(states[name], *args)
                opened[name].append(states[name][:, 0, 0].astype(jnp.float32))
            entries[name] += [e[:, 0, i] for i in range(e.shape[2]) if blocks[0, i] >= 0]
        seq += n
    return states, opened, entries


def scores_with_minus_inf(rng):
    """One row of 302 tokens ``[1, 1, 302, 2*DIM]`` whose scores are -inf at positions 0 and 1 (leading),
    70, through the whole block 1 (128..255), and in channels 0..7 everywhere but at positions 5 and 300
    (those channels' block 0 and open block 2 have one token of weight each)."""
    kv = random_tokens(rng, (1, 1, sum(CHUNKS)), DIM)
    score = kv[..., DIM:]
    score[:, :, [0, 1, 70]] = -np.inf
    score[:, :, BLOCK : 2 * BLOCK] = -np.inf
    score[:, :, ~np.isin(np.arange(sum(CHUNKS)), [5, 300]), :8] = -np.inf
    return kv


def test_minus_inf_scores_online_equals_offline():
    """The online native op and its reference agree with the offline pooling, with no NaN, where scores are
    -inf: a block with no weight has the entry 0 and the state (-inf, 0, 0), a single token of weight
    gives its own kv."""
    rng = np.random.default_rng(4)
    kv = scores_with_minus_inf(rng)
    _, opened, entries = compress_in_chunks(kv, jnp.asarray(random_ape(rng, 1, DIM)), jnp.float32)
    for impl in (oc, reference):
        for got, want in zip(opened[impl], opened["offline"], strict=True):
            assert_pooled_close(got, want, OFFLINE_FP32)
        assert len(entries[impl]) == len(entries["offline"]) == 2
        for got, want in zip(entries[impl], entries["offline"], strict=True):
            assert_pooled_close(got, want, OFFLINE_FP32)
    for after_chunk in (1, 3):  # 2 tokens of block 0, 34 of block 1: all of no weight
        np.testing.assert_array_equal(opened[oc][after_chunk][0, 0], -np.inf)
        np.testing.assert_array_equal(opened[oc][after_chunk][0, 1:], 0.0)
    np.testing.assert_array_equal(entries[oc][1], 0.0)  # block 1
    np.testing.assert_array_equal(entries[oc][0][0, :8], kv[0, 0, 5, :8])  # block 0, channels 0..7: token 5
    np.testing.assert_array_equal(opened[oc][-1][0, 2, :8], kv[0, 0, 300, :8])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_minus_inf_scores_native_equals_reference(dtype):
    """The same stream, and then verifies of 3 tokens of no weight (from the open block and from a block
    start): native and reference agree, with no NaN; tokens of no weight leave the state as it is, or
    (-inf, 0, 0) from a block start."""
    tol = NATIVE_VS_REFERENCE_FP32 if dtype == jnp.float32 else NATIVE_VS_REFERENCE_BF16
    rng = np.random.default_rng(4)
    kv = scores_with_minus_inf(rng)
    ape = jnp.asarray(random_ape(rng, 1, DIM))
    states, opened, entries = compress_in_chunks(kv, ape, dtype)
    for got, want in zip(opened[oc] + entries[oc], opened[reference] + entries[reference], strict=True):
        assert_pooled_close(got, want, tol)
    drafts = random_tokens(rng, (1, 1, 3), DIM)
    drafts[..., DIM:] = -np.inf
    state = states[oc]
    for start in (sum(CHUNKS), 3 * BLOCK):
        args = (jnp.asarray(drafts), ints(start), ints(0), ape)
        native, ref = oc.verify(state, *args), reference.verify(state, *args)
        for got, want in zip(native, ref, strict=True):
            assert_pooled_close(got, want, tol)
        banks = np.asarray(native[0][0, 1:4, 0], np.float32)
        if start % BLOCK:
            unchanged = np.broadcast_to(opened[oc][-1][0], banks.shape)
            np.testing.assert_allclose(banks, unchanged, rtol=tol, atol=tol)
        else:
            np.testing.assert_array_equal(banks[:, 0], -np.inf)
            np.testing.assert_array_equal(banks[:, 1:], 0.0)


def test_nan_and_plus_inf_scores_stay_in_their_block():
    """Outside the domain: a NaN or +inf score leaves its block's state and entry unspecified, but the
    row's next block is exact and every other slot untouched."""
    rng = np.random.default_rng(5)
    kv = random_tokens(rng, (1, 2, BLOCK + 10), DIM)
    clean = kv.copy()
    clean[:, 0, :BLOCK] = kv[:, 1, :BLOCK]  # row 0's block 0 without the scores out of the domain
    kv[:, 0, 3, DIM] = np.nan
    kv[:, 0, [4, 5], DIM + 1] = np.inf
    ape = jnp.asarray(random_ape(rng, 1, DIM))
    state = poisoned_state(rng, 1, 3, DIM, MAX_DRAFT)
    args = (ints(0, 0), ints(BLOCK + 10, BLOCK + 10), ints(0, 1), ape)
    for impl in (oc, reference):
        got, entries, _ = impl.compress(state, jnp.asarray(kv), *args)
        want, clean_entries, _ = impl.compress(state, jnp.asarray(clean), *args)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got[:, :, 2], state[:, :, 2])
        np.testing.assert_array_equal(entries[:, 1], clean_entries[:, 1])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("op", OPS)
def test_grad_through_an_op_names_it(op, jit):
    """jax.grad through an op (by the state, and by kv_score where the op has one): a NotImplementedError
    naming the op and saying the ops are not differentiable (before: custom_partitioning's "Differentiation
    rule ... not implemented", no op named); its jnp twin, which the message points to, differentiates."""
    args = arguments(op)
    wrt = "kv_score" if "kv_score" in args else "state"

    def loss(x, fn):
        out = fn(**(args | {wrt: x}))
        return jnp.sum(out if op == "commit" else out[0]) + jnp.sum(out[1] if op != "commit" else 0.0)

    grad = jax.grad(loss)
    if jit:
        grad = jax.jit(grad, static_argnums=1)
    with pytest.raises(NotImplementedError, match=rf"jax_oc128\.ops\.{op} \(oc128_{op}\): the ops are not "):
        grad(args[wrt], OPS[op])
    twin = getattr(reference, op)
    assert np.all(np.isfinite(grad(args[wrt], twin)))
