"""DeepSeek-V4's mixture-of-experts MLP (transformers' ``DeepseekV4SparseMoeBlock``, 5.24.0).

Router scores are ``sqrt(softplus(x · W_gᵀ))`` per expert. A ``moe`` layer picks the top-k experts of
(scores + the selection-only ``e_score_correction_bias``); a ``hash_moe`` layer picks ``tid2eid[token]``, a
fixed table. The picked scores, normalised to sum to 1 and times ``routed_scaling_factor``, weight the picked
experts' SwiGLU outputs (gate and up clamped by ``swiglu_limit``); the shared expert, the same MLP unrouted,
is added. Activations and routing are float32; the router's and experts' weights are float32 or bfloat16
(:mod:`~jax_oc128.nn.functional`).

Every expert runs on every token and the unpicked ones get weight 0 (exact, and simple for these tiny
configs; a grouped dispatch is the later optimisation for real sizes).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_oc128.nn.functional import FULL, linear, normal_param, swiglu

MOE, HASH_MOE = "moe", "hash_moe"


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


class MoE(nnx.Module):
    """The routed experts, their router and the shared expert of one layer."""

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.router_weight = normal_param(rngs, c.num_experts, c.hidden_size, dtype=c.dtype)
        if c.hash_routed:
            self.tid2eid = nnx.Variable(
                jnp.arange(c.vocab_size * c.num_experts_per_tok, dtype=jnp.int32).reshape(c.vocab_size, -1)
                % c.num_experts
            )
        else:
            self.e_score_correction_bias = nnx.Param(jnp.zeros((c.num_experts,), jnp.float32))
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
        """``[batch, T, num_experts]``: each token's weight per expert (0 for the experts not picked)."""
        c = self.config
        scores = jnp.sqrt(jax.nn.softplus(linear(x, self.router_weight[...])))
        if c.hash_routed:
            picks = self.tid2eid[...][tokens]
        else:
            _, picks = jax.lax.top_k(scores + self.e_score_correction_bias[...], c.num_experts_per_tok)
        weights = jnp.take_along_axis(scores, picks, axis=-1)
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20) * c.routed_scaling_factor
        return jnp.einsum("btk,btke->bte", weights, jax.nn.one_hot(picks, c.num_experts), precision=FULL)

    def __call__(self, x, tokens):
        """``x`` ``[batch, T, hidden]`` float32 (the normed collapsed stream) and its ``tokens``
        ``[batch, T]`` int32 (for hash routing) -> ``[batch, T, hidden]``."""
        c, gate_up, i = self.config, self.experts_gate_up[...], self.config.intermediate_size
        every_expert = jax.vmap(swiglu, in_axes=(None, 0, 0, 0, None), out_axes=2)
        experts = every_expert(x, gate_up[:, :i], gate_up[:, i:], self.experts_down[...], c.swiglu_limit)
        routed = jnp.einsum("bte,bted->btd", self.route(x, tokens), experts, precision=FULL)
        shared = swiglu(x, self.shared_gate[...], self.shared_up[...], self.shared_down[...], c.swiglu_limit)
        return routed + shared


def check_expert_ids(table, num_experts: int, name: str) -> None:
    """A hash layer's token -> expert table (``tid2eid``, integers) holds expert ids in ``[0, num_experts)``
    only; a ValueError naming the tensor (``name``) otherwise."""
    table = np.asarray(table)
    if table.size and not (table.min() >= 0 and table.max() < num_experts):
        raise ValueError(f"{name}: expert ids must be in [0, {num_experts})")


# transformers state-dict name (within the layer's mlp) -> attribute
HF_WEIGHT_NAMES = {
    "gate.weight": "router_weight",
    "gate.e_score_correction_bias": "e_score_correction_bias",
    "gate.tid2eid": "tid2eid",
    "experts.gate_up_proj": "experts_gate_up",
    "experts.down_proj": "experts_down",
    "shared_experts.gate_proj.weight": "shared_gate",
    "shared_experts.up_proj.weight": "shared_up",
    "shared_experts.down_proj.weight": "shared_down",
}
