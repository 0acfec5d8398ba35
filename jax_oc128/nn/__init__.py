"""Flax NNX modules: DeepSeek-V4 attention (:mod:`~jax_oc128.nn.attention`) with the HCA compressor
(:mod:`~jax_oc128.nn.hca`) and the CSA compressor and indexer (:mod:`~jax_oc128.nn.csa`), RoPE
(:mod:`~jax_oc128.nn.rope`), hyper-connections (:mod:`~jax_oc128.nn.hyper_connections`), the mixture of
experts (:mod:`~jax_oc128.nn.moe`, its kernel :mod:`~jax_oc128.nn.grouped_matmul`), the linear layers
(:mod:`~jax_oc128.nn.linear`), the decoder (:mod:`~jax_oc128.nn.model`), its config
(:mod:`~jax_oc128.nn.config`) and its forward record (:mod:`~jax_oc128.nn.forward`), the draft heads and
the speculative model (:mod:`~jax_oc128.nn.draft`)."""

from jax_oc128.nn.attention import (
    CSA,
    HCA,
    SLIDING,
    AttentionCache,
    AttentionConfig,
    DeepseekV4Attention,
    LayerType,
)
from jax_oc128.nn.config import ModelConfig, RuntimeConfig
from jax_oc128.nn.csa import CSACompressor
from jax_oc128.nn.draft import DeepseekV4MTP, DraftHead, MTPHead, SpeculativeModel, default_draft_head
from jax_oc128.nn.forward import ForwardBatch, batch_slots, commit_verify, context_bucket, prepare_forward
from jax_oc128.nn.hca import HCACompressor
from jax_oc128.nn.hyper_connections import HyperConnection, HyperHead
from jax_oc128.nn.model import Block, DeepseekV4Model, ModelCache
from jax_oc128.nn.moe import MlpType, MoE
from jax_oc128.nn.rope import RopeConfig

__all__ = [
    "CSA",
    "HCA",
    "SLIDING",
    "AttentionCache",
    "AttentionConfig",
    "Block",
    "CSACompressor",
    "DeepseekV4Attention",
    "DeepseekV4MTP",
    "DeepseekV4Model",
    "DraftHead",
    "ForwardBatch",
    "HCACompressor",
    "HyperConnection",
    "HyperHead",
    "LayerType",
    "MTPHead",
    "MlpType",
    "MoE",
    "ModelCache",
    "ModelConfig",
    "RopeConfig",
    "RuntimeConfig",
    "SpeculativeModel",
    "batch_slots",
    "commit_verify",
    "context_bucket",
    "default_draft_head",
    "prepare_forward",
]
