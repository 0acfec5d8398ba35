"""The ops on a mesh: a state sharded over its slots, each device running the op on its own slots.

Under ``jax.jit`` with sharded operands, XLA's SPMD partitioner calls :func:`by_slots`' rule, which picks
each operand's layout from the state's:

* The state ``[L, 1 + B, S, 3, D]`` keeps its slot axis (dimension 2) split over the mesh axes it is split
  over, in shards of ``S / n`` slots (``n`` devices along them; ``S`` must divide, or the state is
  gathered); ``pending`` and ``pending_banks`` ``[S]`` are split the same way. Every other dimension of
  every operand (the verify's ``tree`` too), and every other mesh axis, is replicated: the devices of one
  slot shard run the same op on the same slots.
* The per-row operands (``kv_score``, ``seq_lens``, ``new_lens``, ``slots``, ``accept_lens``,
  ``accept_banks``) and results (``entries``, ``entry_blocks``) are either

  - **split like the slots** (their row axis over the same mesh axes, in the same order, and ``n``
    dividing the rows): the rows of device d address the slots of device d, as in a model whose batch row
    b is slot b. A row whose slot lives on another device is skipped, like a padding row: nothing is
    written anywhere, its entries are 0 and its ``entry_blocks`` -1. Nothing is communicated.
  - or **replicated** (rows sharded any other way are gathered first: they are small, the state is not):
    every device sees every row and runs those whose slots it owns. Each row's results then come from the
    device owning its slot (those of a row without one, a padding row, from the first slot shard), combined
    over the slot axes by an all-reduce per result: a sum of their bits as integers, the other devices
    contributing zeros, so the results are bit for bit those of one device.

On each device the op runs on its local state with the rows' global slots made local: ``slot - first`` for
the slots of its shard (``first`` = its shard index times ``S / n``), -1 (padding) for every other slot. The
state is never gathered nor copied: the op updates each device's shard in place. On one device, in eager
calls (outside ``jax.jit``) and inside ``shard_map`` (where the operands are a device's already), the op is
called as it is.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

#: the axis of each operand or result that holds the state's slots
SLOT_AXIS = {"state": 2, "pending": 0, "pending_banks": 0}
#: the operands that are empty where the caller gives none (verify's pending tables, commit's banks)
OPTIONAL = ("pending", "pending_banks", "accept_banks")
#: the axis of each operand or result that holds the call's rows
ROW_AXIS = {
    "kv_score": 1,
    "seq_lens": 0,
    "new_lens": 0,
    "slots": 0,
    "accept_lens": 0,
    "accept_banks": 0,
    "entries": 1,
    "entry_blocks": 0,
}


def by_slots(fn, arg_names, ret_names, results, operands):
    """``fn(results, *operands)`` partitioned over the state's slots (see the module doc).

    Args:
      fn: runs the op: ``fn(results, *operands)`` returns the results (a tuple, or the array where there is
        one) of the shapes and dtypes ``results`` gives, for operands of any slot and row count.
      arg_names, ret_names: the operands' and results' names (those of ``SLOT_AXIS`` and ``ROW_AXIS``
        are split; ``state`` and ``slots`` must be among the operands).
      results: ``jax.ShapeDtypeStruct`` per result, of the global (unpartitioned) call.
      operands: the arrays, in ``arg_names``' order.

    Called outside ``jax.jit`` (no operand traced), or inside ``shard_map`` (whose operands are each device's
    own), the op runs as it is.
    """
    eager = not any(isinstance(x, jax.core.Tracer) for x in operands)
    if eager or jax.sharding.get_abstract_mesh().manual_axes:
        return fn(results, *operands)
    call = custom_partitioning(lambda *operands: fn(results, *operands))
    num_slots = operands[arg_names.index("state")].shape[SLOT_AXIS["state"]]
    rule, replicated = _sharding_rule(arg_names, ret_names, [x.shape for x in operands], results, num_slots)
    call.def_partition(
        lambda mesh, arg_shapes, result_shape: _partition(
            fn, arg_names, ret_names, results, mesh, arg_shapes
        ),
        sharding_rule=rule,
        need_replication_factors=replicated,
    )
    return _sequential_under_vmap(call)(*operands)


def _sequential_under_vmap(call):
    """``call`` with a batching rule (custom_partitioning has none): under ``jax.vmap``, one call per batch
    element in sequence (a ``lax.map``), as the native call's own ``vmap_method="sequential"``."""
    batchable = jax.custom_batching.custom_vmap(call)

    @batchable.def_vmap
    def rule(axis_size, in_batched, *operands):
        def one(batched):
            it = iter(batched)
            return batchable(*(next(it) if b else x for x, b in zip(operands, in_batched, strict=True)))

        out = jax.lax.map(one, [x for x, b in zip(operands, in_batched, strict=True) if b])
        return out, jax.tree.map(lambda _: True, out)

    return batchable


def _split_axis(name, shape, num_slots):
    """``("slot" | "row" | None, axis)``: which axis of operand or result ``name`` of ``shape`` is split. An
    optional operand left empty (none given) has none."""
    if name in OPTIONAL and not math.prod(shape):
        return None, None
    if name in SLOT_AXIS:
        return "slot", SLOT_AXIS[name]
    if name in ROW_AXIS:
        return "row", ROW_AXIS[name]
    return None, None


def _sharding_rule(arg_names, ret_names, arg_shapes, results, num_slots):
    """The Shardy rule of the call: one factor for the slot axes, one for the row axes, and a factor of its
    own, to be replicated, for every other axis. Returns ``(rule, replicated factors)``."""
    names = [*arg_names, *ret_names]
    shapes = [*arg_shapes, *(r.shape for r in results)]
    replicated, mapped = [], []
    for i, (name, shape) in enumerate(zip(names, shapes, strict=True)):
        kind, split = _split_axis(name, shape, num_slots)
        factors = [kind if axis == split else f"v{i}_{axis}" for axis in range(len(shape))]
        replicated += [factor for axis, factor in enumerate(factors) if axis != split]
        mapped.append(" ".join(factors))
    rule = f"{', '.join(mapped[: len(arg_names)])} -> {', '.join(mapped[len(arg_names) :])}"
    return rule, tuple(replicated)


def _mesh_axes(sharding, axis) -> tuple[str, ...]:
    """The mesh axes over which ``sharding`` (a NamedSharding) splits array axis ``axis``, major first."""
    spec = sharding.spec
    entry = spec[axis] if axis < len(spec) else None
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _partition(fn, arg_names, ret_names, results, mesh, arg_shapes):
    """The per-device layout and computation (custom_partitioning's ``partition``): see the module doc."""
    state = arg_shapes[arg_names.index("state")]
    num_slots = state.shape[SLOT_AXIS["state"]]
    slot_axes = _mesh_axes(state.sharding, SLOT_AXIS["state"])
    shards = math.prod(mesh.shape[axis] for axis in slot_axes)
    if num_slots % shards:
        slot_axes, shards = (), 1
    row_operand = arg_shapes[arg_names.index("slots")]
    rows = row_operand.shape[ROW_AXIS["slots"]]
    split_rows = bool(slot_axes) and (
        _mesh_axes(row_operand.sharding, ROW_AXIS["slots"]) == slot_axes and rows % shards == 0
    )

    def sharding(name, shape):
        kind, split = _split_axis(name, shape, num_slots)
        spec = [None] * len(shape)
        if kind == "slot" or (kind == "row" and split_rows):
            spec[split] = slot_axes or None
        return NamedSharding(mesh, PartitionSpec(*spec))

    arg_shardings = tuple(sharding(name, x.shape) for name, x in zip(arg_names, arg_shapes, strict=True))
    ret_shardings = tuple(sharding(name, r.shape) for name, r in zip(ret_names, results, strict=True))
    local_results = tuple(
        jax.ShapeDtypeStruct(shard.shard_shape(r.shape), r.dtype)
        for shard, r in zip(ret_shardings, results, strict=True)
    )
    local_slots = num_slots // shards
    slot_index = arg_names.index("slots")

    def run(*operands):
        if not slot_axes:
            return fn(local_results, *operands)
        shard = jax.lax.axis_index(slot_axes)
        slots = operands[slot_index]
        local = slots - shard * local_slots
        owned = (local >= 0) & (local < local_slots)
        out = fn(local_results, *_replace(operands, slot_index, jnp.where(owned, local, -1)))
        if split_rows:
            return out
        # each row's results from the device owning its slot, a padding row's from the first shard
        reports = jnp.where((slots >= 0) & (slots < num_slots), owned, shard == 0)
        combined = [
            _from_one(x, reports, ROW_AXIS[name], slot_axes) if name in ROW_AXIS else x
            for name, x in zip(ret_names, out if isinstance(out, tuple) else (out,), strict=True)
        ]
        return tuple(combined) if isinstance(out, tuple) else combined[0]

    ret_sharding = ret_shardings if len(ret_shardings) > 1 else ret_shardings[0]
    return mesh, run, ret_sharding, arg_shardings


def _replace(items, index, value):
    """``items`` as a list with ``items[index]`` replaced by ``value``."""
    return [value if i == index else item for i, item in enumerate(items)]


def _from_one(x, rows, row_axis, axes):
    """``x`` (a per-row result) of the device where ``rows`` (bool, per row) is set, for every row, on every
    device along mesh ``axes``: a sum of the bits, the other devices' zeros, exact for any value."""
    unsigned = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
    bits = x if jnp.issubdtype(x.dtype, jnp.integer) else jax.lax.bitcast_convert_type(x, unsigned)
    mask = jnp.expand_dims(rows, tuple(a for a in range(x.ndim) if a != row_axis))
    summed = jax.lax.psum(jnp.where(mask, bits, 0), axes)
    return summed if bits is x else jax.lax.bitcast_convert_type(summed, x.dtype)
