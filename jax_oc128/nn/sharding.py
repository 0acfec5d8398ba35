"""Where the model, its caches and the C128 state lie on a mesh of two axes, in one place.

* ``"data"`` (:data:`DATA`) splits the slots: the batch rows of every cache and the slots of the C128 state
  (:data:`SLOT_AXES`). Batch row b of a forward is slot b, so a device's rows address its own slots: the
  engine runs each device's slots on their own (``shard_map``), and the C128 ops alone partition so too
  (:mod:`jax_oc128.partition`).
* ``"model"`` (:data:`MODEL`) splits the parameters by :data:`PARAM_RULES`: the attention heads and
  o-groups, the MLP's hidden units, the experts and the LM head's vocabulary (tensor parallel; XLA adds the
  all-reduces of the contractions). The caches, of one KV head, and the C128 state are replicated over it.

Parameters that no rule names are replicated, and so is a dimension the mesh axis does not divide. A quantized
parameter (:class:`~jax_oc128.nn.quant.QuantizedArray`) splits its codes by its rule and its per-row scales
like them: along the same leading axes and rows, and along the columns only where each device's columns are
whole scale groups (else the scales, 1/32 or 1/128 of the codes, are whole on every device).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_oc128.checks import ArgumentError, ArgumentTypeError, check_int
from jax_oc128.nn import weights
from jax_oc128.nn.quant import FP4, GROUP, QuantizedArray
from jax_oc128.state import CompressState, OfflineState

DATA, MODEL = "data", "model"

#: each logical axis of :mod:`jax_oc128.nn.weights` -> the mesh axis it splits over
LOGICAL_AXES = {
    weights.HEADS: MODEL,
    weights.GROUPS: MODEL,
    weights.MLP: MODEL,
    weights.EXPERT: MODEL,
    weights.VOCAB: MODEL,
}
#: parameter path (its last names) -> the split of its axes: the first rule whose names end the path applies
#: (each parameter's logical axes, :class:`jax_oc128.nn.weights.Weight`, on the mesh)
PARAM_RULES = tuple(
    (weight.path, P(*(LOGICAL_AXES.get(axis) for axis in weight.axes)))
    for weight in (*weights.TOP, *weights.LAYER, *weights.MTP)
    if weight.axes
)

#: the slot axis of each array of the compressed states (the arrays of every other cache: their first axis)
SLOT_AXES = {CompressState: {"banks": 2}, OfflineState: {"rows": 1}}


def data_devices(mesh: Mesh | None) -> int:
    """The devices of ``mesh``'s ``"data"`` axis, over which the slots are split (1 without a mesh)."""
    return 1 if mesh is None else mesh.shape[DATA]


def traced_model_devices() -> int:
    """The devices of the ``"model"`` axis in the mesh of the trace (the engine's; 1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True)).get(MODEL, 1)


def make_mesh(data: int, model: int = 1, devices=None) -> Mesh:
    """A mesh of ``data`` x ``model`` devices (of ``devices``, default ``jax.devices()``), axes
    ``("data", "model")``."""
    devices = jax.devices() if devices is None else list(devices)
    check_int("data", data, 1)
    check_int("model", model, 1)
    if data * model > len(devices):
        raise ArgumentError("data", f"{data} x model {model} devices, but {len(devices)} are available")
    return Mesh(np.array(devices[: data * model]).reshape(data, model), (DATA, MODEL))


def check_mesh(mesh) -> Mesh:
    """``mesh`` must be a :class:`jax.sharding.Mesh` of the axes ``("data", "model")``, of any axis types
    (``jax.make_mesh``'s are Explicit). Returns its devices and axes with Auto types: the engine gives every
    array it places a sharding by these rules and splits its steps by ``shard_map``; Explicit axes would
    also type each intermediate array by its sharding, which the model's reshapes of split heads refuse."""
    if not isinstance(mesh, Mesh):
        raise ArgumentTypeError("mesh", f"must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if tuple(mesh.axis_names) != (DATA, MODEL):
        raise ArgumentError("mesh", f"axes must be ('data', 'model'), got {tuple(mesh.axis_names)}")
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def param_specs(params, mesh: Mesh):
    """A :class:`~jax.sharding.PartitionSpec` per array of ``params`` (a model's ``nnx.State``, or any pytree
    of arrays whose paths end in a module's attribute names) by :data:`PARAM_RULES`, on ``mesh``: a
    :class:`~jax_oc128.nn.quant.QuantizedArray` of the specs of its codes and scales for a quantized one
    (:func:`param_spec`)."""

    def spec(path, x):
        return param_spec(path_names(path), x, mesh)

    return jax.tree_util.tree_map_with_path(spec, params, is_leaf=lambda x: isinstance(x, QuantizedArray))


def param_spec(names: tuple[str, ...], x, mesh: Mesh):
    """The spec of the parameter ``x`` (an array, or a :class:`~jax_oc128.nn.quant.QuantizedArray`: one
    of the same kind of the specs of its codes and scales) at the path ``names`` (:func:`path_names`), by
    the first rule of :data:`PARAM_RULES` whose names end ``names`` (none: replicated), on ``mesh``."""
    rule = next((spec for tail, spec in PARAM_RULES if names[-len(tail) :] == tail), P())
    if not isinstance(x, QuantizedArray):
        return _divisible(rule, x.shape, mesh)
    codes = _divisible(rule, x.codes.shape, mesh)
    *lead, columns = tuple(codes) + (None,) * (x.ndim - len(codes))
    groups = x.codes.shape[-1] * (2 if x.fmt == FP4 else 1) // GROUP[x.fmt]  # whole groups per column split
    whole = columns is not None and groups % mesh.shape[columns] == 0 and x.shape[-1] % GROUP[x.fmt] == 0
    return dataclasses.replace(x, codes=codes, scales=P(*lead, columns if whole else None))


def slot_specs(tree):
    """A :class:`~jax.sharding.PartitionSpec` per array of ``tree`` (caches, compressed states, or any pytree
    of arrays whose first axis is the slots) splitting its slot axis over ``"data"``."""

    def specs(node):
        if type(node) not in SLOT_AXES:
            return slots_at(0)
        axes = SLOT_AXES[type(node)]
        return dataclasses.replace(
            node, **{f.name: slots_at(axes.get(f.name, 0)) for f in dataclasses.fields(node)}
        )

    return jax.tree.map(specs, tree, is_leaf=lambda node: type(node) in SLOT_AXES)


def slots_at(axis: int) -> P:
    """The spec of an array whose axis ``axis`` holds the slots."""
    return P(*(None,) * axis, DATA)


def named(specs, mesh: Mesh):
    """A :class:`~jax.sharding.NamedSharding` on ``mesh`` per spec of the pytree ``specs``."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))


def path_names(path) -> tuple[str, ...]:
    """The names of a pytree path (dict keys, attributes, sequence indices as strings), without the final
    ``value`` of an ``nnx.Variable``'s array and a quantized array's ``codes`` or ``scales``: the path the
    rules match."""

    def name(key):
        for field in ("key", "name", "idx"):
            if hasattr(key, field):
                return str(getattr(key, field))
        return str(key)

    names = tuple(name(key) for key in path)
    if names[-2:] in (("value", "codes"), ("value", "scales")):
        names = names[:-1]
    return names[:-1] if names and names[-1] == "value" else names


def _divisible(spec: P, shape, mesh: Mesh) -> P:
    """``spec`` without the splits of the dimensions its mesh axes do not divide."""
    return P(
        *(
            None if axis is not None and size % mesh.shape[axis] else axis
            for axis, size in zip(spec, shape, strict=False)
        )
    )
