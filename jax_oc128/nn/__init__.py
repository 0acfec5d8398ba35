"""Flax NNX modules: DeepSeek-V4 attention (:mod:`~jax_oc128.nn.attention`), RoPE
(:mod:`~jax_oc128.nn.rope`), the decoder with its MTP draft head (:mod:`~jax_oc128.nn.model`)."""

from jax_oc128.nn.attention import (
    CSA,
    HCA,
    HF_WEIGHT_NAMES,
    SLIDING,
    AttentionCache,
    AttentionConfig,
    DeepseekV4Attention,
    batch_slots,
    prepare_forward,
)
from jax_oc128.nn.model import (
    Block,
    DeepseekV4Model,
    ModelCache,
    ModelConfig,
    MTPHead,
    SpeculativeModel,
)
from jax_oc128.nn.rope import RopeConfig

__all__ = [
    "CSA",
    "HCA",
    "HF_WEIGHT_NAMES",
    "SLIDING",
    "AttentionCache",
    "AttentionConfig",
    "Block",
    "DeepseekV4Attention",
    "DeepseekV4Model",
    "MTPHead",
    "ModelCache",
    "ModelConfig",
    "RopeConfig",
    "SpeculativeModel",
    "batch_slots",
    "prepare_forward",
]
