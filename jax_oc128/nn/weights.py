"""The DeepSeek-V4 model's parameters, each declared once (:class:`Weight`): its attribute path in its module,
its transformers state-dict name, DeepSeek's released name(s) and storage format, and its logical axes (how
it splits over a mesh). The loaders' names (:mod:`jax_oc128.loading.names`), the quantized formats
(:mod:`jax_oc128.loading.formats`) and the sharding rules (:data:`jax_oc128.nn.sharding.PARAM_RULES`, which
the call sites' ``name=("attn", "q_b_proj")`` of :func:`~jax_oc128.nn.linear.linear` index by the same
paths) are derived from these tables.

Three scopes: :data:`TOP`, the target model's own parameters (``DeepseekV4Model``); :data:`LAYER`, a decoder
layer's (``Block``, transformers' names within ``model.layers.{i}.``, DeepSeek's within ``layers.{i}.``);
:data:`MTP`, the MTP layer's own (``DeepseekV4MTP``, named as DeepSeek names them, within ``mtp.0.``; its
block's are :data:`LAYER`'s under ``block``). A parameter a module does not have (a sliding layer's
compressor, a hash layer's router bias) is skipped: :func:`present`.
"""

from __future__ import annotations

import dataclasses

from flax import nnx

#: how a released checkpoint stores a parameter: float (BF16 or F32), FP8 (e4m3 codes with 128 x 128 e8m0
#: block scales), the routed experts' format (``expert_dtype``: FP4 or FP8), FP8 where stored so
FLOAT, FP8, EXPERTS, OPTIONAL_FP8 = "float", "fp8", "experts", "optional fp8"
#: the logical axes a parameter may split along (:data:`jax_oc128.nn.sharding.LOGICAL_AXES` maps them onto
#: the mesh)
HEADS, GROUPS, MLP, EXPERT, VOCAB = "heads", "o_groups", "mlp", "experts", "vocab"


@dataclasses.dataclass(frozen=True)
class Weight:
    """One parameter. ``path``: its attribute path within its scope's module; ``hf``: transformers' name
    within the scope (None: none, the dense MLP's); ``deepseek``: DeepSeek's names within the scope, the
    first the one its checkpoints use, the others accepted too (the routed experts: the per-expert
    projections, ``ffn.experts.{e}.{w}.weight``, one per half of the stacked rows); ``stored``: its format in
    a released checkpoint; ``axes``: one logical axis (or None) per dimension, () for replicated."""

    path: tuple[str, ...]
    hf: str | None
    deepseek: tuple[str, ...] = ()
    stored: str = FLOAT
    axes: tuple[str | None, ...] = ()


def _compressor(attr: str, hf: str, deepseek: str, stored: str = FLOAT) -> Weight:
    return Weight(("attn", "compressor", attr), f"self_attn.compressor.{hf}", (f"attn.{deepseek}",), stored)


def _hc(kind: str) -> tuple[Weight, ...]:
    """A block's hyper-connection ``kind`` (attn or ffn) parameters."""
    return tuple(
        Weight((f"{kind}_hc", name), f"{kind}_hc.{name}", (f"hc_{kind}_{name}",))
        for name in ("fn", "base", "scale")
    )


#: the target model's own parameters (transformers' names, DeepSeek's top-level ones)
TOP = (
    Weight(("embed",), "model.embed_tokens.weight", ("embed.weight",)),
    Weight(("lm_head",), "lm_head.weight", ("head.weight",), axes=(VOCAB, None)),
    Weight(("norm",), "model.norm.weight", ("norm.weight",)),
    *(
        Weight(("hc_head", name), f"model.hc_head.hc_{name}", (f"hc_head_{name}",))
        for name in ("fn", "base", "scale")
    ),
)
#: a decoder layer's parameters
LAYER = (
    Weight(("attn_norm",), "input_layernorm.weight", ("attn_norm.weight",)),
    Weight(("mlp_norm",), "post_attention_layernorm.weight", ("ffn_norm.weight",)),
    *_hc("attn"),
    *_hc("ffn"),
    Weight(("attn", "q_a_proj"), "self_attn.q_a_proj.weight", ("attn.wq_a.weight",), FP8),
    Weight(("attn", "q_a_norm"), "self_attn.q_a_norm.weight", ("attn.q_norm.weight",)),
    Weight(("attn", "q_b_proj"), "self_attn.q_b_proj.weight", ("attn.wq_b.weight",), FP8, (HEADS, None)),
    Weight(("attn", "kv_proj"), "self_attn.kv_proj.weight", ("attn.wkv.weight",), FP8),
    # (attn.norm.weight: as transformers' save_pretrained writes it)
    Weight(("attn", "kv_norm"), "self_attn.kv_norm.weight", ("attn.kv_norm.weight", "attn.norm.weight")),
    Weight(("attn", "o_a_proj"), "self_attn.o_a_proj.weight", ("attn.wo_a.weight",), FP8, (GROUPS, None)),
    Weight(("attn", "o_b_proj"), "self_attn.o_b_proj.weight", ("attn.wo_b.weight",), FP8, (None, GROUPS)),
    Weight(("attn", "sinks"), "self_attn.sinks", ("attn.attn_sink",), axes=(HEADS,)),
    _compressor("kv_proj", "kv_proj.weight", "compressor.wkv.weight"),
    _compressor("gate_proj", "gate_proj.weight", "compressor.wgate.weight"),
    _compressor("ape", "position_bias", "compressor.ape"),
    _compressor("kv_norm", "kv_norm.weight", "compressor.norm.weight"),
    _compressor("indexer_kv_proj", "indexer.kv_proj.weight", "indexer.compressor.wkv.weight"),
    _compressor("indexer_gate_proj", "indexer.gate_proj.weight", "indexer.compressor.wgate.weight"),
    _compressor("indexer_ape", "indexer.position_bias", "indexer.compressor.ape"),
    _compressor("indexer_kv_norm", "indexer.kv_norm.weight", "indexer.compressor.norm.weight"),
    _compressor("indexer_q_b_proj", "indexer.q_b_proj.weight", "indexer.wq_b.weight", FP8),
    _compressor("indexer_weights_proj", "indexer.scorer.weights_proj.weight", "indexer.weights_proj.weight"),
    Weight(("moe", "router_weight"), "mlp.gate.weight", ("ffn.gate.weight",)),
    Weight(("moe", "e_score_correction_bias"), "mlp.gate.e_score_correction_bias", ("ffn.gate.bias",)),
    Weight(("moe", "tid2eid"), "mlp.gate.tid2eid", ("ffn.gate.tid2eid",)),
    Weight(
        ("moe", "experts_gate_up"), "mlp.experts.gate_up_proj", ("w1", "w3"), EXPERTS, (EXPERT, None, None)
    ),
    Weight(("moe", "experts_down"), "mlp.experts.down_proj", ("w2",), EXPERTS, (EXPERT, None, None)),
    Weight(
        ("moe", "shared_gate"),
        "mlp.shared_experts.gate_proj.weight",
        ("ffn.shared_experts.w1.weight",),
        FP8,
        (MLP, None),
    ),
    Weight(
        ("moe", "shared_up"),
        "mlp.shared_experts.up_proj.weight",
        ("ffn.shared_experts.w3.weight",),
        FP8,
        (MLP, None),
    ),
    Weight(
        ("moe", "shared_down"),
        "mlp.shared_experts.down_proj.weight",
        ("ffn.shared_experts.w2.weight",),
        FP8,
        (None, MLP),
    ),
    # the dense SwiGLU MLP (not DeepSeek-V4's: no checkpoint names)
    Weight(("gate",), None, axes=(MLP, None)),
    Weight(("up",), None, axes=(MLP, None)),
    Weight(("down",), None, axes=(None, MLP)),
)
#: the MTP layer's own parameters (DeepSeek's names for both namings)
MTP = (
    Weight(("embed_norm",), "enorm.weight", ("enorm.weight",)),
    Weight(("hidden_norm",), "hnorm.weight", ("hnorm.weight",)),
    Weight(("embed_proj",), "e_proj.weight", ("e_proj.weight",), OPTIONAL_FP8),
    Weight(("hidden_proj",), "h_proj.weight", ("h_proj.weight",), OPTIONAL_FP8),
    Weight(("norm",), "norm.weight", ("norm.weight",)),
    *(Weight(("hc_head", name), f"hc_head_{name}", (f"hc_head_{name}",)) for name in ("fn", "base", "scale")),
)
#: the routed experts' stacked parameters
EXPERT_WEIGHTS = tuple(weight for weight in LAYER if weight.stored == EXPERTS)


def present(module: nnx.Module, weights: tuple[Weight, ...]) -> tuple[Weight, ...]:
    """The ``weights`` ``module`` has (each attribute of the path present)."""

    def has(path):
        node = module
        for step in path:
            if not hasattr(node, step):
                return False
            node = getattr(node, step)
        return True

    return tuple(weight for weight in weights if has(weight.path))


def hf_paths(
    module: nnx.Module, weights: tuple[Weight, ...], within: tuple[str, ...] = ()
) -> dict[str, tuple]:
    """transformers' name -> attribute path of each of ``weights`` that ``module`` has (``within``: only
    those under that path, ``module`` being the module there, e.g. ``("attn",)`` for an attention layer);
    NotImplementedError for a parameter without a transformers name (a dense MLP: DeepSeek-V4's layers are
    MoE)."""
    inner = tuple(
        dataclasses.replace(weight, path=weight.path[len(within) :])
        for weight in weights
        if weight.path[: len(within)] == within
    )
    found = present(module, inner)
    unnamed = [".".join(weight.path) for weight in found if weight.hf is None]
    if unnamed:
        raise NotImplementedError(
            f"{', '.join(unnamed)}: no transformers counterpart (DeepSeek-V4 layers are MoE)"
        )
    return {weight.hf: weight.path for weight in found}
