"""The ops on a mesh of 4 CPU devices, the state sharded over its slots: the same state bits and outputs as
on one device, for random calls whose rows address slots of every device (padding, repeated and invalid
slots included), with the rows replicated or split like the slots; the compiled step gathers nothing and
copies no state."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import poisoned_state, state_bits
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from oracle import random_ape, random_tokens

import jax_oc128 as oc

LAYERS, CALL_LAYER, SLOTS, DIM, MAX_DRAFT, ROWS = 3, 1, 8, 32, 4, 8
#: (mesh shape, the mesh axes of the state's slots): slots over 4, 2 (the other axis replicated) or 1 device
MESHES = {
    "4x1": ((4, 1), "data"),
    "2x2": ((2, 2), "data"),
    "2x2-both": ((2, 2), ("data", "model")),
    "1x4": ((1, 4), "data"),
}
STATIC = {"compress": ("layer",), "verify": ("layer",), "commit": ("layer", "num_layers")}
#: the calls the tests make: each op, and a verify of a draft tree (static, a constant of the call)
CALLS = ["compress", "verify", "verify_tree", "commit"]
TREE = (-1, 0, 0, 1)


def op_of(call):
    return call.removesuffix("_tree")


def statics(call):
    """The static arguments of ``call``."""
    layers = dict(layer=CALL_LAYER) | (dict(num_layers=LAYERS - CALL_LAYER) if call == "commit" else {})
    return layers | (dict(tree=TREE) if call == "verify_tree" else {})


def mesh_of(shape):
    return Mesh(np.array(jax.devices()[:4]).reshape(shape), ("data", "model"))


def random_call(rng, call, slots):
    """Keyword arguments of ``call`` (one of ``CALLS``) whose rows address ``slots`` ``[ROWS]`` (numpy)."""
    op = op_of(call)
    seq = rng.integers(0, 3 * 128, ROWS).astype(np.int32)
    seq[rng.random(ROWS) < 0.2] = 127  # closes a block inside the call
    state = np.asarray(poisoned_state(rng, LAYERS, SLOTS, DIM, MAX_DRAFT))  # numpy: each call gets a copy
    args = dict(state=state, seq_lens=seq, slots=slots)
    if op == "commit":
        accept_lens, accept_banks = rng.integers(0, MAX_DRAFT + 1, (2, ROWS)).astype(np.int32)
        return args | dict(accept_lens=accept_lens, accept_banks=accept_banks)
    width = {"compress": 130, "verify": MAX_DRAFT}[op]
    args |= dict(
        kv_score=random_tokens(rng, (LAYERS - CALL_LAYER, ROWS, width), DIM),
        ape=random_ape(rng, LAYERS - CALL_LAYER, DIM),
    )
    if op == "compress":  # rows 0 and 1 fill a block from its start, kv channel 0 -0.0: a -0.0 in their entry
        args["kv_score"][..., 0] = -0.0
        args["seq_lens"][:2] = 256
        new_lens = np.r_[width, width, rng.integers(0, width + 1, ROWS - 2)]
        return args | dict(new_lens=new_lens.astype(np.int32))
    pending = np.where(rng.random(SLOTS) < 0.5, rng.integers(0, 3 * 128, SLOTS), -1).astype(np.int32)
    return args | dict(pending=pending, pending_banks=rng.integers(0, MAX_DRAFT + 1, SLOTS).astype(np.int32))


@functools.cache
def jitted(op, shardings=None):
    """``op`` (one of ``CALLS``) jitted with the state donated, on one device (``shardings`` None) or with
    the arguments placed by ``shardings`` (a tuple of (name, sharding))."""
    call = jax.jit(functools.partial(getattr(oc, op_of(op)), **statics(op)), donate_argnames="state")
    if shardings is None:
        return call
    shardings = dict(shardings)
    return lambda **args: call(**{name: jax.device_put(x, shardings[name]) for name, x in args.items()})


def layout(mesh, slot_axes, split_rows, names):
    """The arguments' shardings: the state and pending over ``slot_axes``, the rows split like them or
    replicated, the rest replicated."""
    rows = slot_axes if split_rows else None
    specs = dict(
        state=P(None, None, slot_axes),
        pending=P(slot_axes),
        pending_banks=P(slot_axes),
        accept_banks=P(rows),
        kv_score=P(None, rows),
        seq_lens=P(rows),
        new_lens=P(rows),
        slots=P(rows),
        accept_lens=P(rows),
        ape=P(),
    )
    return tuple((name, NamedSharding(mesh, specs[name])) for name in names)


def assert_same(got, want, op):
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    np.testing.assert_array_equal(state_bits(got[0]), state_bits(want[0]), err_msg=f"{op}: state")
    for name, x, y in zip(("entries", "entry_blocks")[: len(got) - 1], got[1:], want[1:], strict=True):
        np.testing.assert_array_equal(np.asarray(x).view(np.uint32), np.asarray(y).view(np.uint32), name)


def assert_sharded(x, spec):
    assert x.sharding.is_equivalent_to(NamedSharding(x.sharding.mesh, spec), x.ndim), (x.sharding, spec)


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("op", CALLS)
def test_replicated_rows_give_one_devices_results(op, mesh_name):
    """Rows in any order, each device owning some: padding (-1), a slot repeated (the first valid row takes
    it), slots outside the state, negative lengths: bit for bit one device's state and outputs."""
    shape, slot_axes = MESHES[mesh_name]
    mesh = mesh_of(shape)
    rng = np.random.default_rng(hash((op, mesh_name)) % 2**32)
    for trial in range(3):
        slots = rng.permutation(SLOTS)[:ROWS].astype(np.int32)
        slots[rng.random(ROWS) < 0.25] = -1
        if trial:  # a repeated slot, a slot past the state, a negative length
            slots[[1, 4]] = slots[6]
            slots[2] = SLOTS + trial
        args = random_call(rng, op, slots)
        if trial:
            args["seq_lens"][3] = -1
        want = jitted(op)(**args)
        if op == "compress" and slots[0] >= 0:
            assert np.signbit(want[1][:, 0]).any()  # the all-reduce must keep it
        got = jitted(op, layout(mesh, slot_axes, False, tuple(args)))(**args)
        assert_sharded(jax.tree.leaves(got)[0], P(None, None, slot_axes))
        assert_same(got, want, op)


@pytest.mark.parametrize("mesh_name", ["4x1", "2x2", "2x2-both"])
@pytest.mark.parametrize("op", CALLS)
def test_rows_split_like_the_slots(op, mesh_name):
    """Rows split over the slots' devices, each row addressing a slot of its own device (shuffled within the
    device, some padding): one device's results; a row addressing another device's slot is skipped (one
    device's results for the call with that row made padding)."""
    shape, slot_axes = MESHES[mesh_name]
    mesh = mesh_of(shape)
    shards = int(np.prod([mesh.shape[a] for a in np.atleast_1d(slot_axes)]))
    rng = np.random.default_rng(hash((op, mesh_name, "split")) % 2**32)
    per_shard = SLOTS // shards  # ROWS == SLOTS: a device's rows address its own slots, shuffled
    slots = np.concatenate([rng.permutation(per_shard) + d * per_shard for d in range(shards)])
    slots = slots.astype(np.int32)
    slots[rng.random(ROWS) < 0.25] = -1
    args = random_call(rng, op, slots)
    sharded = jitted(op, layout(mesh, slot_axes, True, tuple(args)))
    got = sharded(**args)
    assert_sharded(jax.tree.leaves(got)[0], P(None, None, slot_axes))
    if op != "commit":
        assert_sharded(got[1], P(None, slot_axes))
    assert_same(got, jitted(op)(**args), op)

    elsewhere = slots.copy()
    elsewhere[0] = per_shard * (shards - 1) + 1  # row 0 is device 0's; this slot is the last device's
    args = random_call(rng, op, elsewhere)
    want = jitted(op)(**args | dict(slots=np.where(np.arange(ROWS) == 0, -1, elsewhere).astype(np.int32)))
    assert_same(sharded(**args), want, op)


HLO_COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "reduce-scatter", "all-reduce")


def compiled_text(op, mesh, slot_axes, split_rows):
    rng = np.random.default_rng(0)
    args = random_call(rng, op, np.arange(ROWS, dtype=np.int32))
    shardings = dict(layout(mesh, slot_axes, split_rows, tuple(args)))
    step = jax.jit(
        lambda *a: getattr(oc, op_of(op))(**dict(zip(args, a, strict=True)), **statics(op)),
        in_shardings=tuple(shardings[name] for name in args),
        donate_argnums=0,
    )
    return step.lower(*args.values()).compile().as_text()


@pytest.mark.parametrize("split_rows", [False, True], ids=["replicated-rows", "split-rows"])
@pytest.mark.parametrize("op", CALLS)
def test_no_gather_or_copy_of_the_state(op, split_rows):
    """The compiled call (4x1 mesh, state donated) runs the native op on each device's [.., 2, ..] slot shard
    in place: no copy of it and no collective at all, except (replicated rows) one all-reduce per per-row
    output, none of the state's shape."""
    hlo = compiled_text(op, mesh_of((4, 1)), "data", split_rows)
    local_state = f"f32[{LAYERS},{1 + MAX_DRAFT},{SLOTS // 4},3,{DIM}]"
    calls = [line for line in hlo.splitlines() if f'custom_call_target="oc128_{op_of(op)}"' in line]
    assert len(calls) == 1 and local_state in calls[0], calls
    assert "output_to_operand_aliasing" in calls[0]
    assert not [line for line in hlo.splitlines() if local_state in line and " copy(" in line]
    collective = re.compile(r"= \S+ (" + "|".join(HLO_COLLECTIVES) + ")")
    collectives = [line for line in hlo.splitlines() if collective.search(line)]
    expected = 0 if split_rows or op == "commit" else 2  # entries (sum) and entry_blocks (max)
    assert len(collectives) == expected, collectives
    assert all(" all-reduce(" in line and local_state not in line for line in collectives)


def test_state_is_donated_and_updated_in_place():
    """Each device's shard of the output state is the buffer of its input shard."""
    mesh = mesh_of((4, 1))
    rng = np.random.default_rng(5)
    args = random_call(rng, "commit", np.arange(ROWS, dtype=np.int32))
    state = jax.device_put(args.pop("state"), NamedSharding(mesh, P(None, None, "data")))
    pointers = [shard.data.unsafe_buffer_pointer() for shard in state.addressable_shards]
    step = jax.jit(functools.partial(oc.commit, layer=0), donate_argnames="state")
    out = step(state, **{name: jnp.asarray(x) for name, x in args.items()})
    assert state.is_deleted()
    assert [shard.data.unsafe_buffer_pointer() for shard in out.addressable_shards] == pointers
