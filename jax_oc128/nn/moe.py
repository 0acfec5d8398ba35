"""DeepSeek-V4's mixture-of-experts MLP (transformers' ``DeepseekV4SparseMoeBlock``, 5.24.0).

Router scores are ``sqrt(softplus(x · W_gᵀ))`` per expert. A ``moe`` layer picks the top-k experts of
(scores + the selection-only ``e_score_correction_bias``); a ``hash_moe`` layer picks ``tid2eid[token]``, a
fixed table. The picked scores, normalised to sum to 1 and times ``routed_scaling_factor``, weight the picked
experts' SwiGLU outputs (gate and up clamped by ``swiglu_limit``); the shared expert, the same MLP unrouted,
is added. Activations and routing are float32; the router's and experts' weights are float32 or bfloat16
(:mod:`~jax_oc128.nn.functional`).

:meth:`MoE.route` gives each token's picked experts and their weights (``[..., k]``); a dispatch function,
chosen by :attr:`MoEConfig.dispatch` (:data:`DISPATCHES`), computes the weighted routed experts from them:
``dense`` runs every expert on every token and weights the unpicked ones 0 (the exact oracle, memory O(tokens
x experts)); ``grouped`` sorts the (token, expert) pairs by expert and runs each picked expert once on its
rows (:mod:`~jax_oc128.nn.grouped_matmul`: the Pallas kernel on CUDA, a jnp loop elsewhere; FP4 experts at
decode sizes on CUDA: the quantized grouped matmul op, :mod:`~jax_oc128.nn.quant_gmm`), then scatters the
outputs back weighted. ``grouped_jnp``, ``grouped_pallas``, ``grouped_ragged_dot`` and ``grouped_quant_op``
force one grouped matmul on every platform (the Pallas kernel in interpret mode off GPUs; XLA's ragged dot;
the op, quantized experts only: FP4 with e8m0 scales, FP8 with e8m0 or float32 ones).
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_oc128.nn import grouped_matmul, quant_gmm
from jax_oc128.nn.functional import FULL, linear_jnp, normal_param, param, zeros_param
from jax_oc128.nn.linear import linear, swiglu
from jax_oc128.nn.sharding import MODEL, traced_model_devices


class MlpType(enum.StrEnum):
    """A layer's MLP type (``ModelConfig.mlp_layer_types``); a member equals the string configs hold."""

    MOE = "moe"  # top-k routed
    HASH_MOE = "hash_moe"  # routed by a table of the token id


MOE, HASH_MOE = MlpType.MOE, MlpType.HASH_MOE


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Static configuration of one MoE layer (the fields of transformers' ``DeepseekV4Config``)."""

    hash_routed: bool
    hidden_size: int
    intermediate_size: int  # moe_intermediate_size: each routed expert's and the shared expert's
    num_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    swiglu_limit: float
    vocab_size: int
    dtype: str = "float32"  # the router's and experts' weights'
    dispatch: str = "grouped"  # the routed experts' computation, a name in DISPATCHES

    def __post_init__(self):
        check_dispatch(self.dispatch, "dispatch")


#: the shared expert's gate, up and down projections' parameter paths (their tensor-parallel split)
SHARED_EXPERT_NAMES = (("moe", "shared_gate"), ("moe", "shared_up"), ("moe", "shared_down"))


class MoE(nnx.Module):
    """The routed experts, their router and the shared expert of one layer."""

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.router_weight = normal_param(rngs, c.num_experts, c.hidden_size, dtype=c.dtype)
        if c.hash_routed:
            shape = (c.vocab_size, c.num_experts_per_tok)
            self.tid2eid = param(
                shape,
                jnp.int32,
                lambda: jnp.arange(np.prod(shape), dtype=jnp.int32).reshape(shape) % c.num_experts,
                kind=nnx.Variable,
            )
        else:
            self.e_score_correction_bias = zeros_param(c.num_experts)
        self.experts_gate_up = normal_param(
            rngs, c.num_experts, 2 * c.intermediate_size, c.hidden_size, dtype=c.dtype
        )
        self.experts_down = normal_param(
            rngs, c.num_experts, c.hidden_size, c.intermediate_size, dtype=c.dtype
        )
        self.shared_gate = normal_param(rngs, c.intermediate_size, c.hidden_size, dtype=c.dtype)
        self.shared_up = normal_param(rngs, c.intermediate_size, c.hidden_size, dtype=c.dtype)
        self.shared_down = normal_param(rngs, c.hidden_size, c.intermediate_size, dtype=c.dtype)

    def route(self, x, tokens):
        """``x`` ``[..., hidden]`` float32 and its ``tokens`` ``[...]`` int32 -> ``(expert_ids, weights)``,
        int32 and float32 ``[..., k]``: each token's picked experts and their weights (the picked scores
        normalised to sum to 1, times ``routed_scaling_factor``)."""
        c = self.config
        scores = jnp.sqrt(jax.nn.softplus(linear(x, self.router_weight[...])))
        if c.hash_routed:
            picks = self.tid2eid[...][tokens]
        else:
            _, picks = jax.lax.top_k(scores + self.e_score_correction_bias[...], c.num_experts_per_tok)
        weights = jnp.take_along_axis(scores, picks, axis=-1)
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20) * c.routed_scaling_factor
        return picks.astype(jnp.int32), weights

    def __call__(self, x, tokens):
        """``x`` ``[batch, T, hidden]`` float32 (the normed collapsed stream) and its ``tokens``
        ``[batch, T]`` int32 (for hash routing) -> ``[batch, T, hidden]``."""
        c = self.config
        with jax.named_scope("route"):
            expert_ids, weights = self.route(x, tokens)
        experts = (self.experts_gate_up[...], self.experts_down[...])
        with jax.named_scope("routed_experts"):
            routed = DISPATCHES[c.dispatch](x, expert_ids, weights, *experts, c.swiglu_limit)
        with jax.named_scope("shared_expert"):
            projections = (self.shared_gate[...], self.shared_up[...], self.shared_down[...])
            shared = swiglu(x, *projections, c.swiglu_limit, names=SHARED_EXPERT_NAMES)
        return routed + shared


def dense(x, expert_ids, weights, gate_up, down, limit):
    """The routed experts' weighted sum by running every expert on every token (unpicked ones weighted 0).

    Args:
      x: float32 ``[..., hidden]``; expert_ids: int32 ``[..., k]``; weights: float32 ``[..., k]``.
      gate_up: ``[experts, 2 * intermediate, hidden]``; down: ``[experts, hidden, intermediate]`` (float32
        or bfloat16, or quantized: :class:`~jax_oc128.nn.quant.QuantizedArray`, each expert dequantized where
        its matmul reads it; ``[out, in]`` per expert); limit: the SwiGLU limit.
    Returns: float32 ``[..., hidden]``.
    """
    i = down.shape[2]
    expert = functools.partial(swiglu, matmul=linear_jnp)  # the oracle: each weight dequantized whole
    every_expert = jax.vmap(expert, in_axes=(None, 0, 0, 0, None), out_axes=-2)
    experts = every_expert(x, gate_up[:, :i], gate_up[:, i:], down, limit)  # [..., experts, hidden]
    mask = jnp.einsum(
        "...k,...ke->...e", weights, jax.nn.one_hot(expert_ids, gate_up.shape[0]), precision=FULL
    )
    return jnp.einsum("...e,...ed->...d", mask, experts, precision=FULL)


def grouped(x, expert_ids, weights, gate_up, down, limit, *, matmul=grouped_matmul.gmm):
    """:func:`dense`'s result from the picked experts only: the (token, expert) pairs laid out by expert
    (:func:`~jax_oc128.nn.grouped_matmul.group_pairs`), each tile's expert's gate/up and down projections
    applied to its rows by ``matmul`` (a grouped matmul of :mod:`~jax_oc128.nn.grouped_matmul`, the gate/up
    projection gated in it), each pair's output gathered back and the token's k outputs summed weighted (a
    pair whose id is not in ``[0, experts)`` adds 0: another device's, :func:`expert_parallel`). Arguments and
    result as :func:`dense`."""
    *lead, hidden = x.shape
    k = expert_ids.shape[-1]
    groups = grouped_matmul.group_pairs(expert_ids, gate_up.shape[0], weights=gate_up)
    # each row its pair's token (a gather: XLA's scatter of whole rows is several times slower), 0 for padding
    token_x = x.reshape(-1, hidden).astype(gate_up.dtype)
    rows = grouped_matmul.gather_rows(token_x, groups, k)  # [rows, hidden]
    gated = matmul(rows, gate_up, groups, gated=True, limit=limit)  # [rows, intermediate]
    out = matmul(gated, down, groups).at[groups.rows].get(mode="fill", fill_value=0)  # 0: no expert here
    pair_out = out.reshape(*lead, k, hidden)
    return jnp.einsum("...k,...kd->...d", weights, pair_out, precision=FULL)


def expert_parallel(x, expert_ids, weights, gate_up, down, limit, *, local=grouped):
    """``local``'s result with the experts split over the mesh axis ``"model"``: each device runs ``local``
    on its own experts (the pairs of other devices' experts add 0 there) and the outputs are summed over the
    axis (a psum), so no device reads another's experts. Without a ``"model"`` axis of more than one device
    in the mesh of the trace (the engine's mesh), or one that does not divide the experts, ``local`` itself.
    Arguments and result as :func:`dense`."""
    devices = traced_model_devices()
    if devices == 1 or gate_up.shape[0] % devices:
        return local(x, expert_ids, weights, gate_up, down, limit)

    def on_device(x, expert_ids, weights, gate_up, down):
        first = jax.lax.axis_index(MODEL) * gate_up.shape[0]  # the device's first expert
        return jax.lax.psum(local(x, expert_ids - first, weights, gate_up, down, limit), MODEL)

    split = P(MODEL)
    return jax.shard_map(
        on_device,
        in_specs=(P(), P(), P(), split, split),
        out_specs=P(),
        axis_names={MODEL},
        check_vma=False,
    )(x, expert_ids, weights, gate_up, down)


def _grouped_by(matmul):
    """The grouped dispatch of ``matmul`` (a grouped matmul), split over the mesh's experts."""
    return functools.partial(expert_parallel, local=functools.partial(grouped, matmul=matmul))


#: the dispatch functions by name (:attr:`MoEConfig.dispatch`)
DISPATCHES = {
    "dense": dense,
    "grouped": _grouped_by(quant_gmm.gmm),
    "grouped_jnp": _grouped_by(grouped_matmul.gmm_jnp),
    "grouped_pallas": _grouped_by(grouped_matmul.gmm_pallas_anywhere),
    "grouped_ragged_dot": _grouped_by(grouped_matmul.gmm_ragged_dot),
    "grouped_quant_op": _grouped_by(quant_gmm.quant_gmm),
}


def check_dispatch(dispatch, name: str) -> None:
    """``dispatch`` is a name in :data:`DISPATCHES`; a ValueError naming the argument (``name``) otherwise."""
    if dispatch not in DISPATCHES:
        raise ValueError(f"{name}: must be one of {sorted(DISPATCHES)}, got {dispatch!r}")


def check_expert_ids(table, num_experts: int, name: str) -> None:
    """A hash layer's token -> expert table (``tid2eid``, integers) holds expert ids in ``[0, num_experts)``
    only; a ValueError naming the tensor (``name``) otherwise."""
    table = np.asarray(table)
    if table.size and not (table.min() >= 0 and table.max() < num_experts):
        raise ValueError(f"{name}: expert ids must be in [0, {num_experts})")
