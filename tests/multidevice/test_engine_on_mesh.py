"""The engine on meshes of 4 CPU devices (data x model: 4x1, 2x2, 1x4), the engine tests' small model: the
same greedy tokens as one device, plain, speculative and tree speculative, with slots reused; the decode state
keeps its layout from call to call and the compiled steps move no cache or state between devices."""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engines import NEW_TOKENS, SLOTS, N, engine, model, one_device
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from models import prompts

from jax_oc128.checks import ArgumentError
from jax_oc128.engine import Engine, memory
from jax_oc128.engine.arguments import stop_array
from jax_oc128.nn import sharding
from jax_oc128.tree import Tree

MESHES = [(4, 1), (2, 2), (1, 4)]


@pytest.mark.parametrize("shape", MESHES, ids=[f"{d}x{m}" for d, m in MESHES])
def test_same_greedy_tokens_as_one_device(shape):
    on_mesh = engine(shape)
    for num_tokens in (None, N):
        tokens = on_mesh.generate(prompts(), NEW_TOKENS, num_tokens=num_tokens).tokens
        assert tokens == one_device(num_tokens), f"N = {num_tokens}"
    state = on_mesh._idle_state  # what generate left: the layout the steps keep
    mesh = on_mesh.mesh
    assert state.cache.compressed.banks.sharding.is_equivalent_to(
        NamedSharding(mesh, P(None, None, "data")), 5
    )
    for leaf in [*jax.tree.leaves(state.cache.layers), state.token, state.hidden, state.draft_cache.window]:
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), leaf.ndim)
    q_b_proj = on_mesh.params["target"]["blocks"][0]["attn"]["q_b_proj"][...]
    assert q_b_proj.sharding.is_equivalent_to(NamedSharding(mesh, P("model")), 2)


COLLECTIVE = re.compile(r"= (\S+) (all-gather|all-to-all|collective-permute|reduce-scatter|all-reduce)\(")


def collectives(compiled) -> list[tuple[str, str, str]]:
    """(kind, shape, jax operation) of each collective of a compiled step."""
    found = []
    for line in compiled.as_text().splitlines():
        match = COLLECTIVE.search(line)
        if match:
            op = re.search(r'op_name="[^"]*/(\w+)"', line)
            found.append((match.group(2), match.group(1).split("{")[0], op.group(1) if op else ""))
    return found


HLO_TYPES = {"float32": "f32", "int32": "s32", "bool": "pred"}


def hlo_shape(dtype, shape) -> str:
    return f"{HLO_TYPES[jnp.dtype(dtype).name]}[{','.join(map(str, shape))}]"


def kind_of(collective, outputs) -> str:
    """What a collective of the compiled prefill or decode moves: "counts" (the loop's condition and counts),
    "output" (the dispatch's output, gathered once at its end for the host), "tensor parallel" (an all-reduce
    of a split contraction, an all-gather of a vocabulary-split argmax), "sampling" (an all-reduce of a
    per-row reduction of the sampler's top-k / top-p over the vocabulary-split logits: its max, sum,
    cumulative sum or threshold, or the rows' logits gathered whole for top-p's cumulative sum), or
    "other"."""
    kind, shape, op = collective
    if kind == "all-reduce" and shape == "s32[]":
        return "counts"
    if kind == "all-gather" and shape in outputs:
        return "output"
    if (kind, op) in (("all-reduce", "dot_general"), ("all-gather", "reduce")):
        return "tensor parallel"
    if (kind == "all-reduce" and op in ("reduce_max", "reduce_sum", "window_sum", "gather")) or (
        kind == "all-gather" and op == "reduce_window_sum"
    ):
        return "sampling"
    return "other"


def steps_collectives(on_mesh):
    """The collectives of the compiled prefill and decode (N = 4), each with its :func:`kind_of` (those
    that generate ran: after test_same_greedy_tokens_as_one_device, they are compiled already)."""
    state = on_mesh.init_state()
    stops, steps = stop_array(()), on_mesh.steps_per_dispatch
    context = on_mesh.bound(on_mesh.model.max_len)
    decode = on_mesh._decode.lower(
        on_mesh.params, state, stops, np.bool_(False), steps, Tree.chain(N), context
    ).compile()
    tokens, lengths = np.zeros((SLOTS, 256), np.int32), np.ones(SLOTS, np.int32)
    starts = np.zeros(SLOTS, np.int32)
    prefill = on_mesh._prefill.lower(
        on_mesh.params, state, tokens, starts, lengths, lengths, state.sampling, stops, None, 0
    ).compile()
    outputs = {hlo_shape(bool, [SLOTS])}
    for k, n in ((1, 1), (steps, N)):
        outputs |= {hlo_shape(np.int32, [k, SLOTS, n]), hlo_shape(np.int32, [k, SLOTS])}
    return [(kind_of(c, outputs), c) for c in collectives(prefill) + collectives(decode)]


@pytest.mark.parametrize("shape", MESHES, ids=[f"{d}x{m}" for d, m in MESHES])
def test_each_device_holds_its_share_of_the_decode_state(shape):
    """The decode state (caches, C128 state, lengths) is split by slot over ``"data"``: each device holds 1/D
    of it, and the same on every device of ``"model"`` (docs/multi-device.md: a CPU mesh's devices share one
    host's memory, so a model axis of M holds M copies). Only a few bytes (the PRNG key) are whole."""
    data = shape[0]
    on_mesh = engine(shape)
    leaves = jax.tree.leaves(on_mesh.init_state())
    held = collections.Counter()
    for leaf in leaves:
        for shard in leaf.addressable_shards:
            held[shard.device] += shard.data.nbytes
    total = sum(leaf.nbytes for leaf in leaves)
    whole = sum(leaf.nbytes for leaf in leaves if sharding.DATA not in leaf.sharding.spec)
    assert whole * 1000 < total, (whole, total)
    assert len(held) == 4 and set(held.values()) == {(total - whole) // data + whole}, held
    assert on_mesh._state_bytes == (total - whole) // data + whole  # what the memory check counts


def test_the_state_must_fit_every_device_of_the_mesh(monkeypatch):
    """The memory check (:mod:`jax_oc128.engine.memory`) compares each device's share of the decode state
    with the least free memory of the mesh's devices: one device short refuses it."""
    on_mesh = engine((2, 2))
    need, last = on_mesh._state_bytes, on_mesh.mesh.devices.flat[-1]
    monkeypatch.setattr(memory, "free_bytes", lambda device: need - 1 if device == last else 2**50)
    with pytest.raises(ArgumentError, match=f"^max_len: the decode state .* needs {need} bytes"):
        on_mesh.init_state()


def test_tree_speculation_on_a_mesh_gives_the_plain_greedy_tokens():
    """The 2x2 mesh (slots and heads split): a draft tree's greedy tokens are one device's plain ones."""
    tokens = engine((2, 2)).generate(prompts(), NEW_TOKENS, tree=Tree.default(8)).tokens
    assert tokens == one_device(None)


def test_data_parallel_steps_communicate_only_the_loops_counts():
    """4x1: each device prefills and decodes its own slots; the collectives are the all-reduces of the loop's
    condition and counts (scalars) and the gathering of the output."""
    found = steps_collectives(engine((4, 1)))
    assert {kind for kind, _ in found} == {"counts", "output"}, found


def test_tensor_parallel_steps_move_no_cache_or_state():
    """2x2: the model axis adds the all-reduces of the split contractions (o-projection, MLP down), the
    all-gathers of the vocabulary-split argmax and the sampler's per-row reductions over the vocabulary-split
    logits (one number per row); no other collective than the output's has the shape of an array of the
    decode state (whole or one device's)."""
    on_mesh = engine((2, 2))
    state_shapes = set()
    layout = jax.tree.leaves(on_mesh._state_layout)
    for leaf, spec in zip(layout, jax.tree.leaves(sharding.slot_specs(on_mesh._state_layout)), strict=True):
        if leaf.dtype.name in HLO_TYPES:
            for shape in (leaf.shape, NamedSharding(on_mesh.mesh, spec).shard_shape(leaf.shape)):
                state_shapes.add(hlo_shape(leaf.dtype, shape))
    found = steps_collectives(on_mesh)
    assert {kind for kind, _ in found} == {"counts", "output", "tensor parallel", "sampling"}, found
    # the sampler moves per row of a device's slots (per node of a verify) a number or a row of logits
    rows, per_node = str(SLOTS // 2), {"1", str(N), str(on_mesh.model.vocab_size)}
    for kind, (_, shape, _) in found:
        dims = shape[shape.index("[") + 1 : -1].split(",")
        assert kind != "sampling" or (dims[0] == rows and set(dims[1:]) <= per_node), found
    moved = [c for kind, c in found if kind not in ("output", "sampling") and c[1] in state_shapes]
    assert not moved, found


def test_a_mesh_of_explicit_axes_gives_one_devices_tokens():
    """jax.make_mesh's 2x2 mesh (Explicit axes, its default on jax >= 0.10; once a ShardingTypeError inside
    attention) is taken as the same devices and axes with Auto types: one device's speculative tokens."""
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    on_mesh = Engine(model(), SLOTS, prompt_bucket=256, mesh=mesh)
    assert np.array_equal(on_mesh.mesh.devices, mesh.devices) and on_mesh.mesh.axis_names == mesh.axis_names
    assert on_mesh.mesh.axis_types == (AxisType.Auto,) * 2
    assert on_mesh.generate(prompts(), NEW_TOKENS, num_tokens=N).tokens == one_device(N)


def test_slots_must_split_evenly_over_the_data_axis():
    with pytest.raises(ValueError, match=r"slots: must be a multiple of the mesh's data axis \(4\), got 6"):
        Engine(model(), 6, mesh=sharding.make_mesh(4, 1))
