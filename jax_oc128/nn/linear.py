"""The model's linear layers: every matmul of the model by a weight, float or quantized, and its
tensor-parallel split.

A float weight runs as XLA's matmul. A quantized weight (:class:`~jax_oc128.nn.quant.QuantizedArray`) at
decode sizes on CUDA runs as a grouped matmul of one group per weight group (:func:`linear_layout`), its codes
and scales read and dequantized in registers, never whole: through the quantized grouped matmul op
(:func:`linear_op`, :mod:`~jax_oc128.nn.quant_gmm`) at the fewest rows on the weights it takes and splits K
for, else, for a large one, through the Pallas kernel (:func:`linear_pallas`,
:func:`~.grouped_matmul.gmm_pallas`); the rule: :data:`LINEAR_KERNEL_ROWS`. The rule and the twin is
:func:`~jax_oc128.nn.functional.linear_jnp`.
Under a mesh that splits the weights over ``"model"``, a named quantized weight runs its rule's split in a
``shard_map`` (:func:`tensor_parallel`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_oc128 import ops
from jax_oc128.nn import quant_gmm, sharding
from jax_oc128.nn.functional import linear_jnp, swiglu_gate
from jax_oc128.nn.grouped_matmul import (
    Blocks,
    Groups,
    block_rows_for,
    gather_rows_jnp,
    gmm_pallas,
    pallas_fits,
    per_platform,
)
from jax_oc128.nn.quant import QuantizedArray

#: when :func:`linear` runs a quantized weight through a kernel on CUDA: at most this many rows per group
#: (decode sizes, where reading the weight is the cost), through :func:`linear_op` where the op takes it at
#: up to ``LINEAR_OP_ROWS`` rows and splits K over several blocks (the weights whose outputs alone leave the
#: GPU's blocks idle), else through :func:`linear_pallas` for a weight of at least ``LINEAR_KERNEL_PARAMS``
#: parameters (a smaller one's Pallas kernel, one program per 32 outputs looping over all of K, waits on its
#: loads and is slower than XLA's: bench/RESULTS.md section 11); otherwise the weight dequantized whole and
#: XLA's matmul. The op's rows: one pass of its kernel; at 64 rows (four passes, the weights decoded in each)
#: and on weights it does not split, the Pallas kernel measured faster (section 37).
LINEAR_KERNEL_ROWS, LINEAR_OP_ROWS, LINEAR_KERNEL_PARAMS = 64, 16, 1 << 23
#: :func:`linear_pallas`'s tiling: the fastest of a sweep at 8 and 64 rows over V4-Flash's FP8 linears (the
#: expert tilings of :data:`DEFAULT_BLOCKS`, 128 columns a program, leave most SMs idle on 4096 outputs)
LINEAR_BLOCKS = Blocks(32, 256, 4, 3)


def linear_layout(groups: int, rows: int, block_rows: int | None = None) -> Groups:
    """The layout of a linear layer's ``rows`` x ``groups`` pairs (pair ``r * groups + g``: row r's group g,
    :func:`linear`'s ``x`` flattened): group g's rows in tiles of its own of ``block_rows`` rows (default
    :func:`~.grouped_matmul.block_rows_for`, the Pallas kernel's), ``tile_expert`` g. Static: built by numpy
    from the shapes."""
    block_rows = block_rows or block_rows_for(rows, 1)
    tiles = -(-rows // block_rows)
    pair_rows = (np.arange(groups) * tiles * block_rows + np.arange(rows)[:, None]).reshape(-1)
    row_pairs = np.full(groups * tiles * block_rows, groups * rows)
    row_pairs[pair_rows] = np.arange(groups * rows)
    tile_expert = np.repeat(np.arange(groups), tiles)
    return Groups(*(jnp.asarray(a, jnp.int32) for a in (pair_rows, row_pairs, tile_expert)), block_rows)


def _grouped_weights(weight, groups: int | None):
    """An ``[out, in]`` weight (float or quantized) as ``[groups, out / groups, in]`` (one group: None)."""
    return jax.tree.map(lambda a: a.reshape(groups or 1, -1, a.shape[-1]), weight)


def linear_pallas(x, weight, *, groups: int | None = None, blocks: Blocks | None = None, interpret=False):
    """:func:`~jax_oc128.nn.functional.linear_jnp` (shapes and ``groups`` the same) by :func:`gmm_pallas`:
    each group's weight one expert, on its rows (:func:`linear_layout`): a quantized weight's codes and
    scales read and dequantized in registers, never whole. ``blocks``: :func:`gmm_pallas`'s tiling (default
    :data:`LINEAR_BLOCKS`)."""
    weights = _grouped_weights(weight, groups)
    flat = x.reshape(-1, x.shape[-1]).astype(weights.dtype)  # the pairs, in order
    layout = linear_layout(weights.shape[0], flat.shape[0] // weights.shape[0])
    blocks = blocks or LINEAR_BLOCKS
    rows = gmm_pallas(gather_rows_jnp(flat, layout, 1), weights, layout, blocks=blocks, interpret=interpret)
    return rows[layout.rows].reshape(*x.shape[:-1], -1)


def linear_op(x, weight, *, groups: int | None = None):
    """:func:`~jax_oc128.nn.functional.linear_jnp` (shapes and ``groups`` the same) by the quantized grouped
    matmul op (:func:`~jax_oc128.nn.quant_gmm.quant_gmm`): each group's weight one expert, its rows one tile
    (:func:`linear_layout`, no padding row), the codes and scales read and dequantized in registers, never
    whole."""
    weights = _grouped_weights(weight, groups)
    count, width = weights.shape[0], x.shape[-1]
    rows = math.prod(x.shape[:-1]) // count
    by_group = x.reshape(rows, count, width).swapaxes(0, 1).reshape(count * rows, width)  # group g's rows
    layout = linear_layout(count, rows, block_rows=rows)
    out = quant_gmm.quant_gmm(by_group.astype(weights.dtype), weights, layout)
    return out.reshape(count, rows, -1).swapaxes(0, 1).reshape(*x.shape[:-1], -1)


def linear(x, weight, *, groups: int | None = None, name: tuple[str, ...] | None = None):
    """The model's linear layer, :func:`~jax_oc128.nn.functional.linear_jnp` (``x`` ``[..., in]`` by an
    ``[out, in]`` weight -> float32 ``[..., out]``; ``groups``: per group): a float weight by XLA's matmul; a
    quantized one (:class:`~jax_oc128.nn.quant.QuantizedArray`) on CUDA at up to
    :data:`LINEAR_KERNEL_ROWS` rows per group by :func:`linear_op` at up to ``LINEAR_OP_ROWS`` rows where
    the CUDA module has the op, it takes the weight (:func:`~jax_oc128.nn.quant_gmm.kernel_takes`: a bfloat16
    model's, e8m0 scales) and splits its K (:func:`~jax_oc128.nn.quant_gmm.splits`), else one of at least
    ``LINEAR_KERNEL_PARAMS`` parameters by :func:`linear_pallas` (either reads the codes once, 1 byte per FP8
    parameter; XLA dequantizes the weight whole first, writing and reading 2 bytes per parameter more),
    otherwise dequantized whole.

    ``name``: the weight's parameter path, as :data:`~jax_oc128.nn.sharding.PARAM_RULES` names it (e.g.
    ``("attn", "q_b_proj")``). In a trace whose mesh splits the weights over ``"model"`` (tensor parallel) a
    quantized weight runs as :func:`tensor_parallel` splits it by that rule, each device's part by the rule
    above; without a ``name``, or for a split it does not take, dequantized whole and partitioned by XLA (the
    kernel is not partitioned: its operands would be gathered whole onto every device)."""
    if isinstance(weight, QuantizedArray) and sharding.traced_model_devices() > 1:
        split = None if name is None else tensor_parallel(_linear_on_device, x, weight, groups, name)
        return linear_jnp(x, weight, groups=groups) if split is None else split
    return _linear_on_device(x, weight, groups=groups)


def _linear_on_device(x, weight, *, groups: int | None = None):
    """:func:`linear` of one device's weight: on CUDA for a quantized weight at decode sizes
    :func:`linear_op` where the op takes it and splits its K, else :func:`linear_pallas` for a large one
    (:data:`LINEAR_KERNEL_ROWS`); :func:`~jax_oc128.nn.functional.linear_jnp` otherwise."""
    rows = math.prod(x.shape[:-1]) // (groups or 1)
    if not isinstance(weight, QuantizedArray) or not 0 < rows <= LINEAR_KERNEL_ROWS:
        return linear_jnp(x, weight, groups=groups)
    weights = _grouped_weights(weight, groups)
    if (
        rows <= LINEAR_OP_ROWS
        and quant_gmm.TARGET in ops.native_targets("cuda")
        and quant_gmm.kernel_takes(weight.dtype, weights)
        and quant_gmm.splits(weights.fmt, *weights.shape[1:], weights.shape[0], False) > 1
    ):
        return per_platform(linear_op, linear_jnp, x, weight, groups=groups)
    if math.prod(weight.shape) >= LINEAR_KERNEL_PARAMS and pallas_fits(x, weights):
        return per_platform(linear_pallas, linear_jnp, x, weight, groups=groups)
    return linear_jnp(x, weight, groups=groups)


def tensor_parallel(local, x, weight, groups: int | None, name: tuple[str, ...]):
    """``local(x, weight, groups=groups)`` (a linear layer of one device, :func:`linear`'s arguments) with
    ``weight`` split over the trace's mesh axis ``"model"`` as :func:`~jax_oc128.nn.sharding.param_spec`
    splits the parameter ``name``: each device runs ``local`` on its own part in a ``shard_map``, so that no
    device reads or gathers another's part. A split of the outputs (rows of ``weight``; with ``groups``,
    whole groups, ``x`` ``[..., G, in]`` split alike) gives each device its columns of the result (its
    groups); a split of the inputs (columns, whole scale groups on each device; no ``groups``) gives partial
    products, summed over the axis (a psum). A weight the rule leaves whole runs whole on every device.
    Returns None for any other split (``local`` cannot take it)."""
    model, devices = sharding.MODEL, sharding.traced_model_devices()
    spec = sharding.param_spec(name, weight, jax.sharding.get_abstract_mesh())
    codes, scales = (tuple(s) + (None,) * (2 - len(s)) for s in (spec.codes, spec.scales))
    outputs_split = codes == (model, None) and scales[0] == model
    batch = (None,) * (x.ndim - 1)  # x's axes but its last
    if codes == (None, None):  # whole on every device
        x_spec, out_spec, reduce = P(), P(), False
    elif outputs_split and groups is None:
        x_spec, out_spec, reduce = P(), P(*batch, model), False
    elif outputs_split and groups % devices == 0:  # whole groups: x [..., G, in] -> [..., G, out / G]
        x_spec = out_spec = P(*batch[:-1], model, None)
        reduce, groups = False, groups // devices
    elif codes == (None, model) and scales[1] == model and groups is None:  # the inputs split
        x_spec, out_spec, reduce = P(*batch, model), P(), True
    else:
        return None

    def on_device(x, weight):
        out = local(x, weight, groups=groups)
        return jax.lax.psum(out, model) if reduce else out

    return jax.shard_map(
        on_device,
        in_specs=(x_spec, spec),
        out_specs=out_spec,
        axis_names={model},
        check_vma=False,
    )(x, weight)


def swiglu(x, gate, up, down, limit=None, *, matmul=linear, names=(None, None, None)):
    """The SwiGLU MLP ``down(silu(gate(x)) * up(x))`` with ``[out, in]`` weights
    (:func:`~jax_oc128.nn.functional.swiglu_gate`), each projection ``matmul(x, weight, name=...)``
    (:func:`linear`; :func:`~jax_oc128.nn.functional.linear_jnp`: the weights dequantized whole, the
    oracle's way); ``names``: the gate's, the up and the down projection's parameter paths (:func:`linear`'s
    ``name``: their tensor-parallel split)."""
    gate_name, up_name, down_name = names
    hidden = swiglu_gate(matmul(x, gate, name=gate_name), matmul(x, up, name=up_name), limit)
    return matmul(hidden, down, name=down_name)
