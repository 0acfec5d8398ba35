"""The configs in the package: DeepSeek-V4-Flash and -Pro are their released config.json (as the loader reads
it), with the released models' parameter counts; their slices; the shipped model's config."""

from __future__ import annotations

import dataclasses
import math

import jax
import pytest
from flax import nnx

from jax_oc128 import checkpoint
from jax_oc128.loading.hf_config import from_deepseek
from jax_oc128.nn import (
    CSA,
    HCA,
    SLIDING,
    Block,
    DeepseekV4Model,
    ModelConfig,
    RuntimeConfig,
    SpeculativeModel,
    default_draft_head,
)
from jax_oc128.nn.moe import HASH_MOE, MOE

#: what DeepSeek-V4-Flash's and -Pro's released config.json share (DeepSeek's field names; the values from
#: the published files, /work/shared/notes/DEEPSEEK_V4_AT_SCALE.md). Their quantization_config (FP8/FP4) is
#: left out: the loader refuses it, a dequantized checkpoint has none.
RELEASED = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "o_lora_rank": 1024,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "num_hash_layers": 3,
    "scoring_func": "sqrtsoftplus",
    "swiglu_limit": 10.0,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "sliding_window": 128,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "num_nextn_predict_layers": 1,
}
FLASH_JSON = RELEASED | {
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "n_routed_experts": 256,
    "moe_intermediate_size": 2048,
    "routed_scaling_factor": 1.5,
    "index_topk": 512,
    # 44 entries: 2 sliding, 21 CSA, 20 HCA, and the MTP layer's (sliding)
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}
PRO_JSON = RELEASED | {
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "q_lora_rank": 1536,
    "o_groups": 16,
    "n_routed_experts": 384,
    "moe_intermediate_size": 3072,
    "routed_scaling_factor": 2.5,
    "index_topk": 1024,
    # 62 entries: 31 HCA, 30 CSA, and the MTP layer's (sliding)
    "compress_ratios": [128, 128] + [4, 128] * 29 + [4, 0],
}
PRESETS = {
    "flash": (ModelConfig.deepseek_v4_flash, FLASH_JSON),
    "pro": (ModelConfig.deepseek_v4_pro, PRO_JSON),
}
#: the released models' parameter counts as DeepSeek states them (total, active per token), each rounded:
#: the margin is half the last stated digit (284B and 13B to the billion; 1.6T to 0.1T and 49B to the billion)
STATED = {"flash": ((284e9, 0.5e9), (13e9, 0.5e9)), "pro": ((1.6e12, 0.05e12), (49e9, 0.5e9))}


@pytest.mark.parametrize("name", PRESETS)
def test_preset_is_the_released_config(name):
    """The preset equals what ModelConfig.from_hf makes of the released config.json (DeepSeek's fields
    converted as the loader converts them), and its layer counts are the released ones."""
    preset, released = PRESETS[name]
    config = preset()
    assert config == ModelConfig.from_hf(from_deepseek(released, 1))
    ratios = released["compress_ratios"][:-1]
    assert [config.layer_types.count(kind) for kind in (SLIDING, CSA, HCA)] == [
        ratios.count(r) for r in (0, 4, 128)
    ]
    assert config.mlp_layer_types == (HASH_MOE,) * 3 + (MOE,) * (len(ratios) - 3)
    assert default_draft_head(config) == "deepseek_v4_mtp"


def _sizes(module, num_experts: int) -> tuple[int, int]:
    """(parameters, routed experts' parameters: the ``[num_experts, ...]`` matrices) of ``module``."""
    shapes = [leaf.shape for leaf in jax.tree.leaves(nnx.state(module, nnx.Param))]
    experts = [shape for shape in shapes if len(shape) == 3 and shape[0] == num_experts]
    return sum(map(math.prod, shapes)), sum(map(math.prod, experts))


def target_parameters(config: ModelConfig) -> tuple[int, int]:
    """(total, active per token) parameters of the target model of ``config`` (the MTP layer, not counted in
    the released figures, left out), from the shapes (``nnx.eval_shape``): the model's own parameters once,
    then each layer's block, one block of each (attention, MLP) type traced. Active: all but the routed
    experts a token does not pick (``num_experts_per_tok`` of ``num_experts`` per MoE layer) and the
    embedding table (a token reads one row of it)."""
    one_layer = dataclasses.replace(
        config, layer_types=config.layer_types[:1], mlp_layer_types=config.mlp_layer_types[:1]
    )
    model = nnx.eval_shape(lambda: DeepseekV4Model(one_layer, rngs=nnx.Rngs(0)))
    (total, routed), (block, block_routed) = (_sizes(m, config.num_experts) for m in (model, model.blocks[0]))
    total, routed = total - block, routed - block_routed
    blocks = {}
    for layer, kinds in enumerate(zip(config.layer_types, config.mlp_layer_types, strict=True)):
        if kinds not in blocks:
            block = nnx.eval_shape(
                lambda layer=layer: Block(config, RuntimeConfig(), layer, rngs=nnx.Rngs(0))
            )
            blocks[kinds] = _sizes(block, config.num_experts)
        total, routed = total + blocks[kinds][0], routed + blocks[kinds][1]
    unpicked = routed * (1 - config.num_experts_per_tok / config.num_experts)
    return total, total - unpicked - math.prod(model.embed.shape)


@pytest.mark.parametrize("name", PRESETS)
def test_parameter_counts_are_the_released_models(name):
    total, active = target_parameters(PRESETS[name][0]())
    (stated_total, total_margin), (stated_active, active_margin) = STATED[name]
    assert abs(total - stated_total) <= total_margin, total
    assert abs(active - stated_active) <= active_margin, active


def test_slices():
    """A slice keeps the released layers' prefix and every other released value but those given."""
    full = ModelConfig.deepseek_v4_flash()
    sliced = ModelConfig.deepseek_v4_flash(num_layers=6, num_experts=16, dtype="bfloat16")
    assert sliced.layer_types == (SLIDING, SLIDING, CSA, HCA, CSA, HCA) == full.layer_types[:6]
    assert sliced.mlp_layer_types == (HASH_MOE,) * 3 + (MOE,) * 3
    assert sliced == dataclasses.replace(
        full,
        layer_types=full.layer_types[:6],
        mlp_layer_types=full.mlp_layer_types[:6],
        num_experts=16,
        dtype="bfloat16",
    )
    assert ModelConfig.deepseek_v4_pro(num_layers=3).layer_types == (HCA, HCA, CSA)
    for bad, error in ((0, ValueError), (44, ValueError), (True, TypeError), (6.0, TypeError)):
        with pytest.raises(error, match=r"^num_layers: "):
            ModelConfig.deepseek_v4_flash(num_layers=bad)
    with pytest.raises(TypeError, match=r"^layer_types: set by num_layers"):
        ModelConfig.deepseek_v4_flash(layer_types=(SLIDING,))
    with pytest.raises(ValueError, match=r"^num_experts_per_tok: at most num_experts \(4\)"):
        ModelConfig.deepseek_v4_flash(num_experts=4)  # every MoE layer still routes 6


def test_tiny_is_the_shipped_model():
    """The shipped model's config is ModelConfig.tiny(), the one way to it (the config has no defaults)."""
    assert checkpoint.load()[0].config == ModelConfig.tiny()
    assert ModelConfig.tiny(vocab_size=32, mtp=False) == dataclasses.replace(
        ModelConfig.tiny(), vocab_size=32, mtp=False
    )
    with pytest.raises(TypeError):
        ModelConfig()


@pytest.mark.parametrize(
    "field, bad, error, match",
    [
        ("max_len", 0, ValueError, r"^max_len: must be in \[1, 2147483647\], got 0"),
        ("max_len", 2**31, ValueError, r"^max_len: must be in \[1, 2147483647\]"),
        ("max_draft", 17, ValueError, r"^max_draft: must be in \[1, 16\], got 17"),
        ("max_draft", 2.0, TypeError, "^max_draft: must be an int"),
        ("kv_cache_dtype", "float16", ValueError, "^kv_cache_dtype: must be one of"),
        ("moe_dispatch", "sparse", ValueError, "^moe_dispatch: must be one of"),
    ],
)
def test_runtime_fields_are_checked(field, bad, error, match):
    """Each RuntimeConfig field is checked, the error naming it; none is an architecture field."""
    with pytest.raises(error, match=match):
        RuntimeConfig(**{field: bad})
    with pytest.raises(TypeError, match=field):
        ModelConfig.tiny(**{field: getattr(RuntimeConfig(), field)})


def test_runtime_is_given_to_the_model():
    """The shipped model runs as RuntimeConfig()'s defaults (4096 tokens, 8 drafts, caches in its dtype,
    grouped experts); a model exposes its runtime's bounds; a runtime that is not a RuntimeConfig, or one
    beside a given target, is refused naming it."""
    assert RuntimeConfig() == RuntimeConfig(4096, 8, "auto", "grouped")
    model = checkpoint.load(runtime=RuntimeConfig(max_len=512, max_draft=4))[0]
    assert (model.runtime, model.max_len, model.max_draft) == (RuntimeConfig(512, 4), 512, 4)
    assert model.target.runtime is model.runtime and model.mtp.block.attn.max_draft == 4
    with pytest.raises(TypeError, match=r"^runtime: must be a jax_oc128.nn.RuntimeConfig, got \{'max_len'"):
        nnx.eval_shape(lambda: DeepseekV4Model(ModelConfig.tiny(), {"max_len": 512}, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"^runtime: None with a given target"):
        SpeculativeModel(model.config, RuntimeConfig(), rngs=nnx.Rngs(0), target=model.target)
