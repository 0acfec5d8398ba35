"""Differential fuzzing, native op vs its jnp reference: compress, verify (with a pending commit) and commit
on random states, lengths near and across block boundaries, slots with padding and out-of-range rows,
out-of-range new and accept lengths, in a layer range of the state. Both must write the same rows (bit
for bit untouched elsewhere), the same entry blocks, and agree to rounding.

Shapes are fixed per variant (dtype, N, layer range), so each variant compiles once and the examples
only change values. The default run is quick: ``QUICK_EXAMPLES`` examples per op of one variant
(float32). ``JAX_OC128_FUZZ_EXAMPLES=n`` runs n examples per op over every variant, the long run::

    cd tests && JAX_OC128_FUZZ_EXAMPLES=10000 python -m pytest -q -m fuzz test_fuzz.py
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import NATIVE_VS_REFERENCE_BF16, NATIVE_VS_REFERENCE_FP32, assert_outputs_match, poisoned_state
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import BLOCK, random_ape, random_tokens

import jax_oc128 as oc
from jax_oc128 import reference
from jax_oc128.rules import valid_rows

pytestmark = pytest.mark.fuzz

QUICK_EXAMPLES = 20
LONG_EXAMPLES = os.environ.get("JAX_OC128_FUZZ_EXAMPLES")
EXAMPLES = int(LONG_EXAMPLES or QUICK_EXAMPLES)
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def variants(quick, *others):
    """The variant of the quick run, or in the long run any of them."""
    return st.sampled_from([quick, *others]) if LONG_EXAMPLES else st.just(quick)


# The state: LAYERS layers, the calls cover CALL_LAYERS of them from CALL_LAYER (compress and verify).
LAYERS, CALL_LAYER, SLOTS, ROWS, DIM, MAX_DRAFT, WIDTH = 3, 1, 5, 4, 32, 4, 160
CALL_LAYERS = LAYERS - CALL_LAYER
TOLERANCES = {
    jnp.dtype(jnp.float32): NATIVE_VS_REFERENCE_FP32,
    jnp.dtype(jnp.bfloat16): NATIVE_VS_REFERENCE_BF16,
}
DTYPES = variants(jnp.float32, jnp.bfloat16)

STATIC = {"compress": ("layer",), "verify": ("layer",), "commit": ("layer", "num_layers")}
native_ops = {name: jax.jit(getattr(oc, name), static_argnames=static) for name, static in STATIC.items()}
reference_ops = {
    name: jax.jit(getattr(reference, name), static_argnames=static) for name, static in STATIC.items()
}

# A length: a block, and an offset in it, often at an edge; block -1 makes the row invalid (negative).
EDGES = (0, 1, 2, 63, 64, 120, 126, 127)
LENGTHS = st.builds(
    lambda block, offset: block * BLOCK + offset,
    st.integers(-1, 3),
    st.one_of(st.sampled_from(EDGES), st.integers(0, BLOCK - 1)),
)


def per_row(strategy):
    return st.lists(strategy, min_size=ROWS, max_size=ROWS)


@st.composite
def row_slots(draw):
    """``[ROWS]`` slots: distinct slots of the state, padding (-1), or outside the state."""
    order = draw(st.permutations(range(SLOTS)))
    kinds = draw(per_row(st.sampled_from(["slot", "slot", "slot", "padding", "outside"])))
    return [
        order[i] if kind == "slot" else -1 if kind == "padding" else SLOTS + i for i, kind in enumerate(kinds)
    ]


def ints(values):
    return jnp.asarray(values, jnp.int32)


def random_data(seed, dtype, tokens):
    """``(state, kv_score, ape)``: a poisoned state of ``dtype`` and ``tokens`` random tokens per row."""
    rng = np.random.default_rng(seed)
    state = poisoned_state(rng, LAYERS, SLOTS, DIM, MAX_DRAFT, dtype)
    return (
        state,
        random_tokens(rng, (CALL_LAYERS, ROWS, tokens), DIM),
        jnp.asarray(random_ape(rng, CALL_LAYERS, DIM)),
    )


def assert_same_rows_written(native, ref, state):
    """Native and reference change the same ``(layer, bank, slot)`` rows of the state."""
    before = np.asarray(state, np.float32)
    written = [np.any(np.asarray(x, np.float32) != before, axis=(3, 4)) for x in (native, ref)]
    np.testing.assert_array_equal(written[0], written[1])


def assert_match(op, state, *args, **kwargs):
    native, ref = native_ops[op](state, *args, **kwargs), reference_ops[op](state, *args, **kwargs)
    if op == "commit":  # a copy of a bank: exact
        np.testing.assert_array_equal(native, ref)
        return
    assert_same_rows_written(native[0], ref[0], state)
    assert_outputs_match(native, ref, TOLERANCES[jnp.dtype(state.dtype)])


def read_rows(slots, seq):
    """``[ROWS]`` bool: the rows an op reads (the others are skipped)."""
    return np.asarray(valid_rows(ints(slots), ints(seq), SLOTS))


@FUZZ
@given(
    seed=st.integers(0, 2**32 - 1),
    dtype=DTYPES,
    slots=row_slots(),
    seq=per_row(LENGTHS),
    new=per_row(st.one_of(st.integers(0, WIDTH), st.sampled_from([-1, 0, 1, WIDTH, WIDTH + 1]))),
)
def test_compress(seed, dtype, slots, seq, new):
    """Padding tokens (past ``new_lens``) and skipped rows are NaN: they must never be read."""
    state, kv, ape = random_data(seed, dtype, WIDTH)
    new = np.asarray(new)
    valid = read_rows(slots, seq) & (new >= 0) & (new <= WIDTH)
    kv[:, np.arange(WIDTH)[None] >= np.where(valid, new, 0)[:, None]] = np.nan
    args = (jnp.asarray(kv), ints(seq), ints(new), ints(slots), ape)
    assert_match("compress", state, *args, layer=CALL_LAYER)


def test_compress_of_no_tokens_writes_nothing():
    """A valid row without new tokens inside a block leaves its bank 0 bit for bit (it was re-rounded)."""
    state, kv, ape = random_data(0, jnp.float32, WIDTH)
    slots, zeros = ints(range(ROWS)), ints([0] * ROWS)
    out = native_ops["compress"](
        state, jnp.asarray(kv), ints([1, 5, 130, 300]), zeros, slots, ape, layer=CALL_LAYER
    )
    np.testing.assert_array_equal(out[0], state)


@FUZZ
@given(
    seed=st.integers(0, 2**32 - 1),
    dtype=DTYPES,
    n=variants(2, 1, 4),
    slots=row_slots(),
    seq=per_row(LENGTHS),
    accept=per_row(st.one_of(st.none(), st.integers(-1, MAX_DRAFT + 1))),
    with_pending=variants(True, False),
)
def test_verify(seed, dtype, n, slots, seq, accept, with_pending):
    """Each row's slot has a pending verify ``accept`` tokens back (None: nothing pending; accepts outside
    ``[0, max_draft]`` are skipped). Rows the op skips carry NaN tokens."""
    state, kv, ape = random_data(seed, dtype, n)
    pending = np.full(SLOTS, -1, np.int32)
    for slot, length, back in zip(slots, seq, accept, strict=True):
        if 0 <= slot < SLOTS and back is not None:
            pending[slot] = length - back
    kv[:, ~read_rows(slots, seq)] = np.nan
    pending = ints(pending) if with_pending else None
    assert_match(
        "verify", state, jnp.asarray(kv), ints(seq), ints(slots), ape, layer=CALL_LAYER, pending=pending
    )


@FUZZ
@given(
    seed=st.integers(0, 2**32 - 1),
    dtype=DTYPES,
    layers=variants((0, None), (1, 1), (1, None)),
    slots=row_slots(),
    seq=per_row(LENGTHS),
    accept=per_row(st.integers(-1, MAX_DRAFT + 1)),
)
def test_commit(seed, dtype, layers, slots, seq, accept):
    state, _, _ = random_data(seed, dtype, 1)
    layer, num_layers = layers
    assert_match("commit", state, ints(seq), ints(accept), ints(slots), layer=layer, num_layers=num_layers)
