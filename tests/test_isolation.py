"""Isolation: random sequences of valid and invalid calls (padding rows, slots out of range, negative lengths,
repeated slots, new_lens 0, accepts out of range, scores out of the domain), jitted so that every row value
reaches the device, leave every (layer, bank, slot) row of the state that no processed row addresses byte for
byte as it was, and give the skipped rows a padding row's outputs. The state starts as random bits (NaNs
with payloads, infinities, denormals), so a stray write or a conversion of untouched data shows.

Runs the native ops (the CPU handlers, and the CUDA handlers where a GPU is present) and their reference.
JAX_OC128_ISOLATION_EXAMPLES sets the number of random sequences (default: a quick run).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import jit_op, state_bits
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import random_ape, random_tokens

import jax_oc128 as oc
from jax_oc128 import reference

LAYERS, CALL_LAYER, SLOTS, DIM, MAX_DRAFT, ROWS = 3, 1, 5, 32, 4, 4
WIDTHS = (2, 130)  # compress tokens per row
EXAMPLES = int(os.environ.get("JAX_OC128_ISOLATION_EXAMPLES", "8"))

SLOT_VALUES = st.sampled_from([-1, -2, SLOTS, SLOTS + 7, *range(SLOTS)])  # in range more often than not
SEQ_VALUES = st.one_of(st.just(-1), st.integers(0, 3 * 128), st.sampled_from([127, 128, 255]))


@st.composite
def calls(draw):
    """One call: ``(op, keyword arguments as numpy, seed of its kv_score)``; it covers the state layers
    ``CALL_LAYER..`` (layer 0 is never addressed)."""

    def rows(values, size=ROWS):
        return np.asarray(draw(st.lists(values, min_size=size, max_size=size)), np.int32)

    op = draw(st.sampled_from(["compress", "verify", "commit"]))
    args = dict(slots=rows(SLOT_VALUES), seq_lens=rows(SEQ_VALUES), layer=CALL_LAYER)
    if op == "compress":
        width = draw(st.sampled_from(WIDTHS))
        args |= dict(new_lens=rows(st.integers(-1, width + 1)), width=width)
    elif op == "verify":
        args |= dict(width=draw(st.sampled_from([1, MAX_DRAFT])))
        if draw(st.booleans()):
            args |= dict(pending=rows(SEQ_VALUES, SLOTS))
    else:
        args |= dict(accept_lens=rows(st.integers(-1, MAX_DRAFT + 1)))
    return op, args, draw(st.integers(0, 2**31))


def processed_rows(slots, seq_lens, counts=None, max_count=None):
    """The rows an op processes, by the policy of :mod:`jax_oc128.ops` (written here independently): valid
    (slot in range, seq_lens >= 0, count in [0, max_count]) and the first valid row of their slot."""
    taken, processed = set(), []
    for row, (slot, seq) in enumerate(zip(slots, seq_lens, strict=True)):
        valid = 0 <= slot < SLOTS and seq >= 0 and (counts is None or 0 <= counts[row] <= max_count)
        processed.append(valid and slot not in taken)
        if valid:
            taken.add(slot)
    return processed


def writable(op, args):
    """``[layers, banks, slots]`` bool: the state rows the call may write, and the rows it processes."""
    mask = np.zeros((LAYERS, 1 + MAX_DRAFT, SLOTS), bool)
    layers = slice(args["layer"], LAYERS)
    counts = {"compress": ("new_lens", args.get("width")), "commit": ("accept_lens", MAX_DRAFT)}
    name, max_count = counts.get(op, (None, None))
    processed = processed_rows(args["slots"], args["seq_lens"], args.get(name), max_count)
    for row, slot in enumerate(args["slots"]):
        if not processed[row]:
            continue
        if op == "compress" and args["new_lens"][row] > 0:
            mask[layers, 0, slot] = True
        elif op == "verify":
            mask[layers, 1 : 1 + args["width"], slot] = True
            mask[layers, 0, slot] = "pending" in args and args["pending"][slot] >= 0
        elif op == "commit" and args["accept_lens"][row] > 0:
            mask[layers, 0, slot] = True
    return mask, processed


def kv_score(seed, layers, width):
    """Random tokens ``[layers, ROWS, width, 2*DIM]`` with some NaN, +inf and -inf scores and kv."""
    rng = np.random.default_rng(seed)
    kv = random_tokens(rng, (layers, ROWS, width), DIM)
    special = rng.random(kv.shape) < 0.02
    kv[special] = rng.choice([np.nan, np.inf, -np.inf], size=int(special.sum()))
    return kv


def random_bits(rng, dtype):
    """A state of random bits: ``[LAYERS, 1 + MAX_DRAFT, SLOTS, 3, DIM]`` of ``dtype``."""
    shape = (LAYERS, 1 + MAX_DRAFT, SLOTS, 3, DIM)
    if dtype == jnp.float32:
        return rng.integers(0, 2**32, shape, np.uint32).view(np.float32)
    return rng.integers(0, 2**16, shape, np.uint16).view(jnp.bfloat16)


def run(impl, op, args, seed, state, device):
    """The jitted call of ``impl`` (jax_oc128 or reference) on ``device``; its outputs as numpy."""
    call_layers = LAYERS - args["layer"]
    arrays = dict(state=state, slots=args["slots"], seq_lens=args["seq_lens"])
    if op == "commit":
        arrays |= dict(accept_lens=args["accept_lens"])
    else:
        ape = random_ape(np.random.default_rng(seed), call_layers, DIM)
        arrays |= dict(kv_score=kv_score(seed, call_layers, args["width"]), ape=ape)
    if op == "compress":
        arrays |= dict(new_lens=args["new_lens"])
    if "pending" in args:
        arrays |= dict(pending=args["pending"])
    arrays = {name: jax.device_put(x, device) for name, x in arrays.items()}
    statics = dict(layer=args["layer"]) | (dict(num_layers=call_layers) if op == "commit" else {})
    outputs = jit_op(impl, op)(**arrays, **statics)
    return [np.asarray(x) for x in jax.tree.leaves(outputs)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("platform", ["cpu", pytest.param("gpu", marks=pytest.mark.cuda)])
@settings(max_examples=EXAMPLES, deadline=None)
@given(sequence=st.lists(calls(), min_size=1, max_size=4), seed=st.integers(0, 2**31))
def test_calls_touch_only_what_their_processed_rows_address(platform, dtype, sequence, seed):
    device = jax.devices(platform)[0]
    if platform == "gpu":
        assert "oc128_compress" in oc.ops.native_targets("cuda")
    start = random_bits(np.random.default_rng(seed), dtype)
    for impl in (oc, reference):
        state = start
        for op, args, kv_seed in sequence:
            mask, processed = writable(op, args)
            outputs = run(impl, op, args, kv_seed, state, device)
            keep = np.broadcast_to(~mask[..., None, None], state.shape)
            name = f"{impl.__name__}.{op}"
            np.testing.assert_array_equal(state_bits(outputs[0])[keep], state_bits(state)[keep], err_msg=name)
            if op != "commit":
                skipped = ~np.asarray(processed)
                entries, blocks = outputs[1], outputs[2]
                assert np.all(entries[:, skipped] == 0), f"{name}: entries of a skipped row"
                assert np.all(blocks[skipped] == -1), f"{name}: entry_blocks of a skipped row"
            state = outputs[0]
