"""Placing a checkpoint's tensors straight into their parameters' final layout: on one device, or split
over a mesh as an :class:`~jax_oc128.engine.Engine` on it places them, each device given only its shard.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jax_oc128.loading.names import Part
from jax_oc128.nn import sharding
from jax_oc128.nn.quant import QuantizedArray


def placing(path: tuple, value, mesh: Mesh | None):
    """The :class:`Shards` of the parameter at ``path`` of abstract ``value`` (a :class:`QuantizedArray`:
    one of its codes' and of its scales'), split as the engine places it on ``mesh``
    (:func:`~jax_oc128.nn.sharding.param_spec`), or on the default device (``mesh`` None)."""
    if mesh is None:
        return jax.tree.map(lambda leaf: Shards(leaf, None), value)
    specs = sharding.param_spec(tuple(str(step) for step in path), value, mesh)
    return jax.tree.map(Shards, value, sharding.named(specs, mesh))


class Shards:
    """An array of the abstract value ``abstract`` (shape and dtype) written part by part straight into its
    shards of ``placement`` (a sharding; None: the default device, uncommitted): each distinct shard's piece
    of a part is cut from the part once (from a memory-mapped tensor only that piece is read), cast to the
    dtype and put on each device holding that shard; a shard made of several parts (DeepSeek's per-expert
    tensors) is a zero buffer of the shard's shape on its device, the parts written into it in place. No
    device holds more than its shard, the host no more than one piece beyond what it has placed.
    """

    def __init__(self, abstract, placement: jax.sharding.Sharding | None):
        self.shape, self.dtype, self.placement = abstract.shape, abstract.dtype, placement
        whole = (slice(None),) * len(self.shape)
        indices = (
            {None: whole} if placement is None else placement.addressable_devices_indices_map(self.shape)
        )
        self.devices = {}  # each shard's bounds, per axis (start, stop) -> the devices holding it
        for device, index in indices.items():
            bounds = tuple(axis.indices(size)[:2] for axis, size in zip(index, self.shape, strict=True))
            self.devices.setdefault(bounds, []).append(device)
        self.buffers = {}  # device -> its shard as written so far

    def write(self, region: tuple[tuple[int, int], ...], value: np.ndarray) -> None:
        """Write ``value`` (a host array: a memory-mapped tensor, or one made from it) as ``region`` (per
        axis (start, stop)) of the array."""
        for bounds, devices in self.devices.items():
            overlap = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(region, bounds, strict=True))
            if any(start >= stop for start, stop in overlap):
                continue
            cut = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(overlap, region, strict=True))
            piece = np.array(value[cut], dtype=self.dtype)  # read, cast, owned
            starts = tuple(np.int32(lo - c) for (lo, _), (c, _) in zip(overlap, bounds, strict=True))
            for device in devices:
                if overlap == bounds:
                    self.buffers[device] = jax.device_put(piece, device)
                    continue
                if device not in self.buffers:
                    shape = tuple(stop - start for start, stop in bounds)
                    self.buffers[device] = jnp.zeros(shape, self.dtype, device=device)
                self.buffers[device] = _set_slice(self.buffers[device], piece, starts)

    def array(self) -> jax.Array:
        """The array of the parts written (every shard must be whole)."""
        if self.placement is None:
            return self.buffers[None]
        devices = self.placement.addressable_devices_indices_map(self.shape)
        return jax.make_array_from_single_device_arrays(
            self.shape, self.placement, [self.buffers[device] for device in devices]
        )


@functools.partial(jax.jit, donate_argnums=0)
def _set_slice(buffer, value, starts):
    """``buffer`` with ``value`` written at ``starts`` (one index per axis)."""
    return jax.lax.dynamic_update_slice(buffer, value, starts)


def place(placing, part: Part, value: np.ndarray) -> None:
    """Write ``value`` into its ``part`` of the parameter being placed by ``placing`` (its :class:`Shards`,
    or a :class:`QuantizedArray` of its codes' and its scales': ``part.scale`` picks)."""
    if isinstance(placing, QuantizedArray):
        placing = placing.scales if part.scale else placing.codes
    if part.expert is None:
        placing.write(tuple((0, size) for size in placing.shape), value)
        return
    rows = placing.shape[1] if part.half is None else placing.shape[1] // 2
    row = 0 if part.half is None else part.half * rows
    rest = tuple((0, size) for size in placing.shape[2:])
    placing.write(((part.expert, part.expert + 1), (row, row + rows), *rest), value[None])
