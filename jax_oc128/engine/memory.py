"""Whether what the engine allocates fits its devices' free memory, checked on the host before it is allocated
or dispatched: the decode state (:func:`check_state`) and the compiled program of each dispatch's shapes and
context bucket (:func:`check_program`). Only where the backend reports its memory (:func:`free_bytes`: GPUs;
the CPU reports none, and nothing is checked there)."""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding

from jax_oc128.checks import ArgumentError
from jax_oc128.state import nbytes


def free_bytes(device) -> int | None:
    """The bytes free on ``device``: ``bytes_limit - bytes_in_use`` of its ``memory_stats()``, or None where
    the backend reports neither (the CPU)."""
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats or "bytes_in_use" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats["bytes_in_use"])


def least_free(mesh: Mesh | None) -> int | None:
    """The least :func:`free_bytes` of the engine's devices in this process (the mesh's addressable ones, else
    JAX's default device; another process checks its own), None if one reports none."""
    if mesh is None:
        devices = [jax.devices()[0]]
    else:
        devices = [device for device in mesh.devices.flat if device.process_index == jax.process_index()]
    free = [free_bytes(device) for device in devices]
    return None if None in free else min(free)


def per_device_bytes(layout, specs, mesh: Mesh | None) -> int:
    """The bytes on each device of the arrays ``layout`` (a pytree of ``jax.ShapeDtypeStruct``) split over
    ``mesh`` by ``specs`` (a pytree of PartitionSpecs, ``layout``'s tree; ignored without a mesh)."""
    if mesh is None:
        return nbytes(layout)
    leaves, treedef = jax.tree.flatten(layout)
    shards = [
        jax.ShapeDtypeStruct(NamedSharding(mesh, spec).shard_shape(leaf.shape), leaf.dtype)
        for leaf, spec in zip(leaves, treedef.flatten_up_to(specs), strict=True)
    ]
    return nbytes(shards)


def _gib(size: int) -> str:
    return f"{size} bytes ({size / 2**30:.2f} GiB)"


def check_state(need: int, mesh: Mesh | None, what: str, argument: str, remedy: str) -> None:
    """:class:`~jax_oc128.checks.ArgumentError` naming ``argument`` if a decode state of ``need`` bytes per
    device (:func:`per_device_bytes`; ``what`` says what sets them) exceeds :func:`least_free` (``remedy``:
    what to lower)."""
    free = least_free(mesh)
    if free is not None and need > free:
        raise ArgumentError(
            argument,
            f"the decode state ({what}) needs {_gib(need)} per device, {_gib(free)} free: {remedy}",
        )


def program_bytes(compiled: jax.stages.Compiled) -> int | None:
    """The bytes a compiled program allocates per device beyond its arguments: its temporaries and its
    outputs less those aliasing its donated arguments (None where the backend gives no analysis)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return stats.temp_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes


def check_program(lower, mesh: Mesh | None, describe, others: str) -> bool:
    """:class:`~jax_oc128.checks.ArgumentError` naming ``max_len`` if the program ``lower()`` gives (a
    ``jax.stages.Lowered`` of the jitted function with the arguments of the coming dispatch: its compilation
    is jit's own, reused by the dispatch) allocates more than :func:`least_free` (:func:`program_bytes`).
    ``describe()`` names the dispatch: its request, context and bucket (called only to raise); ``others``,
    what else to lower. Returns whether it checked (False where the devices report no memory: nothing
    lowered or compiled)."""
    free = least_free(mesh)
    if free is None:
        return False
    need = program_bytes(lower().compile())
    if need is not None and need > free:
        raise ArgumentError(
            "max_len",
            f"{describe()} needs {_gib(need)} per device beyond the parameters and the decode state, "
            f"{_gib(free)} free: lower max_len (a request's context, and so its bucket, is at most "
            f"max_len), or {others}",
        )
    return True
