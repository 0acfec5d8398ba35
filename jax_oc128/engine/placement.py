"""Where an engine's arrays lie and how its device steps run: on one device, or on a mesh of the axes
``("data", "model")`` (:mod:`jax_oc128.nn.sharding`); and the engine's jitted functions as module functions
of the model's graph definition and the placement (each device's slots through a ``shard_map``)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_oc128.engine import steps as step_fns
from jax_oc128.engine.state import DecodeOutput, DecodeState
from jax_oc128.nn import sharding
from jax_oc128.sampling import Sampling


class Placement:
    """Where an engine's arrays lie and how its steps run: on one device (``mesh`` None), or on a mesh of the
    axes ``("data", "model")``: the decode state split by slot over ``"data"``, each device running the steps
    on its own slots (a ``shard_map``), the parameters split over ``"model"`` by their rules
    (:mod:`jax_oc128.nn.sharding`), the dispatch's output gathered on every device.

    Args:
      mesh: the mesh, or None; params: the model's parameters; state: the decode state's layout.

    Attributes:
      axis: the mesh axis of the slots inside the steps (None without a mesh).
      prefill_specs, decode_specs: ``(in_specs, out_specs)`` of :func:`prefill` and :func:`decode` after
        the parameters.
    """

    def __init__(self, mesh: Mesh | None, params, state: DecodeState):
        self.mesh = mesh
        self.axis = None if mesh is None else sharding.DATA
        self.params = None if mesh is None else sharding.param_specs(params, mesh)
        self.state = dataclasses.replace(sharding.slot_specs(state), key=P())  # the PRNG key everywhere
        per_step, row = sharding.slots_at(1), sharding.slots_at(0)
        self.output = DecodeOutput(per_step, per_step, row, P(), P(), P())
        self.prefill_specs = (
            (self.state, row, row, row, row, Sampling(row, row, row), P()),
            (self.state, self.output),
        )
        self.decode_specs = ((self.state, P(), P()), (self.state, self.output))

    def put_params(self, params):
        """The parameters on the device, or split over the mesh."""
        return jax.device_put(params, None if self.mesh is None else sharding.named(self.params, self.mesh))

    def per_slot_shard(self, fn, in_specs, out_specs):
        """``fn(params, state, *args) -> (state, output)`` on each device's slots (the parameters whole, the
        state and the args by ``in_specs``, the first of which is the state's), or ``fn`` itself without a
        mesh.

        The state's zero-sized leaves (the compressed caches of sliding-attention layers) stay outside the
        ``shard_map`` and are rebuilt inside at their per-device shape: jax 0.11.2's partitioner (Shardy)
        crashes on a zero-sized operand of a ``shard_map`` manual over ``"data"`` alone
        (``scripts/repro_data_parallel_crash.py``)."""
        if self.mesh is None:
            return fn
        axis, devices = self.axis, self.mesh.shape[self.axis]

        def run(params, state, *args):
            leaves, treedef = jax.tree.flatten(state)
            specs = treedef.flatten_up_to(in_specs[0])
            empty = [leaf.size == 0 for leaf in leaves]

            def on_device(params, kept, *args):
                per_device = [  # made inside: a closed-over array would be an operand
                    jnp.zeros(_per_device_shape(leaf.shape, spec, axis, devices), leaf.dtype)
                    for leaf, spec in zip(leaves, specs, strict=True)
                    if leaf.size == 0
                ]
                state, output = fn(params, treedef.unflatten(_merge(kept, per_device, empty)), *args)
                return _split(treedef.flatten_up_to(state), empty)[0], output

            kept, empties = _split(leaves, empty)
            kept_specs = _split(specs, empty)[0]
            # check_vma off: the C128 ops' custom calls and platform branches carry no varying-axes types
            kept, output = jax.shard_map(
                on_device,
                mesh=self.mesh,
                in_specs=(P(), kept_specs, *in_specs[1:]),
                out_specs=(kept_specs, out_specs[1]),
                axis_names={axis},
                check_vma=False,
            )(params, kept, *args)
            return treedef.unflatten(_merge(kept, empties, empty)), output

        return run

    def jit_options(self, in_specs, out_specs) -> dict:
        """``jax.jit``'s placement of a step's arguments (the parameters first, then by ``in_specs``) and of
        its ``(state, output)``: the state as it came, the output, small, whole on every device (every
        process reads it)."""
        if self.mesh is None:
            return {}
        return dict(
            in_shardings=sharding.named((self.params, *in_specs), self.mesh),
            out_shardings=sharding.named((out_specs[0], P()), self.mesh),
        )

    def state_options(self) -> dict:
        """``jax.jit``'s placement of a function's decode state result."""
        return {} if self.mesh is None else dict(out_shardings=sharding.named(self.state, self.mesh))

    def host_rows(self, array):
        """A host array of the slots as a step takes it: on a mesh, each process gives its devices their slots
        (every process holds the whole array)."""
        if self.mesh is None:
            return array
        placement = NamedSharding(self.mesh, sharding.slots_at(0))
        return jax.make_array_from_callback(array.shape, placement, lambda index: array[index])


def _per_device_shape(shape: tuple[int, ...], spec: P, axis: str, devices: int) -> tuple[int, ...]:
    """The shape on each device of an array of ``shape`` split by ``spec`` over ``axis`` of ``devices``."""
    split = [axis == axes or (isinstance(axes, tuple) and axis in axes) for axes in spec]
    split += [False] * (len(shape) - len(split))
    return tuple(size // devices if is_split else size for size, is_split in zip(shape, split, strict=True))


def _split(leaves: list, empty: list[bool]) -> tuple[list, list]:
    """``leaves`` as (those not marked ``empty``, those marked)."""
    pairs = list(zip(leaves, empty, strict=True))
    return [x for x, e in pairs if not e], [x for x, e in pairs if e]


def _merge(kept: list, empties: list, empty: list[bool]) -> list:
    """The inverse of :func:`_split`."""
    kept, empties = iter(kept), iter(empties)
    return [next(empties) if e else next(kept) for e in empty]


def _on_model(step, graphdef, params, *args, **static):
    """``step(model, *args, **static)`` with the model of ``graphdef`` and ``params`` (a device's view of
    them inside a ``shard_map``)."""
    return step(nnx.merge(graphdef, params), *args, **static)


def prefill(
    graphdef,
    placement: Placement,
    params,
    state,
    tokens,
    starts,
    lengths,
    budgets,
    sampling,
    stop_tokens,
    chunk,
    start_bound,
    *,
    floor,
):
    """:func:`~jax_oc128.engine.steps.prefill` of the model ``graphdef`` with ``params``, on each device's
    slots of ``placement``; ``chunk`` (None or the prefill's chunk), ``start_bound`` (at least every row's
    start) and ``floor`` (None or the context buckets' floor) static
    (:func:`~jax_oc128.engine.steps.feed`)."""
    step = functools.partial(
        _on_model,
        step_fns.prefill,
        graphdef,
        chunk=chunk,
        floor=floor,
        start_bound=start_bound,
        axis=placement.axis,
    )
    run = placement.per_slot_shard(step, *placement.prefill_specs)
    return run(params, state, tokens, starts, lengths, budgets, sampling, stop_tokens)


def decode(graphdef, placement: Placement, params, state, stop_tokens, waiting, steps, tree, context):
    """:func:`~jax_oc128.engine.steps.decode_loop` of the model ``graphdef`` with ``params``, on each
    device's slots of ``placement``; ``steps`` (the most steps), ``tree`` (None: plain steps) and ``context``
    (None or the dispatch's context bound) static."""
    loop = functools.partial(
        _on_model,
        step_fns.decode_loop,
        graphdef,
        steps=steps,
        tree=tree,
        context=context,
        axis=placement.axis,
    )
    return placement.per_slot_shard(loop, *placement.decode_specs)(params, state, stop_tokens, waiting)
