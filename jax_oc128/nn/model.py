"""The DeepSeek-V4 decoder (Flax NNX) and its config, with one compressed state per model.

:class:`DeepseekV4Model` is transformers' ``DeepseekV4ForCausalLM`` (5.24.0) when its :class:`ModelConfig`
says so (:meth:`ModelConfig.from_hf`, :meth:`DeepseekV4Model.from_hf`): embedding, blocks of attention
(sliding, CSA or HCA layers) and a mixture of experts (hash-routed or top-k routed), each sublayer inside
hyper-connections over ``hc_mult`` residual streams (:mod:`~jax_oc128.nn.hyper_connections`), the
streams' final collapse, norm and LM head. Without ``hc_mult`` and ``mlp_layer_types`` (the shipped
model, :meth:`ModelConfig.tiny`) it is a small look-alike: one residual stream, RMSNorm -> attention ->
residual and RMSNorm -> SwiGLU -> residual. Its cache (:class:`ModelCache`) holds a
window/entry cache per layer and one layer-stacked compressor state for all its C128 layers: the
controller's transition runs once per forward, each C128 layer writes its own layer of the state, and an
eager commit is one launch for all layers.

The released DeepSeek-V4 models' configs are :meth:`ModelConfig.deepseek_v4_flash` and
:meth:`ModelConfig.deepseek_v4_pro`. The draft heads and :class:`~jax_oc128.nn.SpeculativeModel` (the
target with its draft head) are in :mod:`~jax_oc128.nn.draft`.

Shapes: ``tokens`` ``[batch, T]`` int32, ``positions`` ``[batch, T]`` int32 (consecutive per row),
``lengths`` ``[batch]`` int32 (valid tokens per row, default all; rows of length 0 are untouched).
Activations and logits are float32; the matrices are stored in ``ModelConfig.dtype`` (float32 or bfloat16,
accumulated in float32: :mod:`~jax_oc128.nn.functional`), the caches as ``ModelConfig.kv_cache_dtype`` says
(by default in the model's dtype; :mod:`~jax_oc128.nn.kv_cache`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jax_oc128.checks import check_int
from jax_oc128.controller import ONLINE, Backend, ForwardMode
from jax_oc128.nn import moe, quant
from jax_oc128.nn.attention import (
    CSA,
    HCA,
    SLIDING,
    AttentionCache,
    AttentionConfig,
    DeepseekV4Attention,
    prepare_forward,
)
from jax_oc128.nn.csa import IndexerConfig
from jax_oc128.nn.functional import DTYPES, assign_weights, build_abstract, normal_param, ones_param, rms_norm
from jax_oc128.nn.grouped_matmul import linear, swiglu
from jax_oc128.nn.hyper_connections import HyperConnection, HyperHead
from jax_oc128.nn.kv_cache import CacheDtypes, check_kv_cache_dtype
from jax_oc128.nn.moe import HASH_MOE, MOE, MoE, MoEConfig, check_dispatch, check_expert_ids
from jax_oc128.nn.rope import RopeConfig
from jax_oc128.rules import MAX_DRAFT
from jax_oc128.tree import check_tree

#: the fields added with the full DeepSeek-V4 layout (its layout, the draft head's presence, the weights'
#: dtype) and since (the caches' storage): a checkpoint written before they existed has
#: :meth:`ModelConfig.tiny`'s values of them
V4_FIELDS = (
    "mlp_layer_types",
    "num_experts",
    "num_experts_per_tok",
    "routed_scaling_factor",
    "swiglu_limit",
    "moe_dispatch",
    "hc_mult",
    "hc_sinkhorn_iters",
    "hc_eps",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "compress_rope_factor",
    "compress_rope_original_max_position_embeddings",
    "mtp",
    "dtype",
    "kv_cache_dtype",
)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The decoder's static configuration (transformers' ``DeepseekV4Config`` fields, by
    :meth:`from_hf`). ``mlp_hidden`` is the dense MLP's width, or ``moe_intermediate_size`` (each
    expert's and the shared expert's) with ``mlp_layer_types``.

    Every field is given (no defaults): a config is the shipped model's (:meth:`tiny`), a released
    DeepSeek-V4's (:meth:`deepseek_v4_flash`, :meth:`deepseek_v4_pro`) or a checkpoint's (:meth:`from_hf`),
    each with the fields a caller replaces."""

    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    mlp_hidden: int
    rms_norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    max_len: int
    max_draft: int  # most tokens per verify (banks of the online C128 state)
    mlp_layer_types: tuple[str, ...] | None  # moe / hash_moe per layer; None: a dense SwiGLU MLP
    num_experts: int  # n_routed_experts
    num_experts_per_tok: int
    routed_scaling_factor: float
    swiglu_limit: float  # MoE layers only
    moe_dispatch: str  # the MoE layers' routed experts' computation (moe.DISPATCHES)
    hc_mult: int | None  # residual streams of the hyper-connections; None: one plain residual
    hc_sinkhorn_iters: int
    hc_eps: float
    index_n_heads: int  # CSA layers' lightning indexer
    index_head_dim: int
    index_topk: int
    compress_rope_factor: float | None  # YaRN on the compress RoPE (CSA and HCA layers)
    compress_rope_original_max_position_embeddings: int | None
    mtp: bool  # a draft head (False: plain decoding only)
    dtype: str  # the matrices' storage dtype, a name in functional.DTYPES
    kv_cache_dtype: str  # the caches' storage, a name in kv_cache.KV_CACHE_DTYPES ("auto": the model's dtype)

    def __post_init__(self):
        """Every field checked (a config read from a file is checked before any parameter is built): ints
        in [1, 2**31) (positions and token ids are int32), finite floats > 0, a non-empty tuple of
        supported layer types, a bool ``mtp``, a known ``dtype`` and ``kv_cache_dtype``, and the shapes'
        constraints."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            kind = field.type.removesuffix(" | None")
            if value is None and kind != field.type:
                continue
            if kind == "int":
                if not isinstance(value, int) or isinstance(value, bool):
                    raise TypeError(f"{field.name}: must be an int, got {value!r}")
                if not 1 <= value < 2**31:
                    raise ValueError(f"{field.name}: must be in [1, 2**31), got {value}")
            elif kind == "float":
                if not isinstance(value, int | float) or isinstance(value, bool):
                    raise TypeError(f"{field.name}: must be a number, got {value!r}")
                if not 0 < value < math.inf:
                    raise ValueError(f"{field.name}: must be finite and > 0, got {value}")
        if not isinstance(self.mtp, bool):
            raise TypeError(f"mtp: must be a bool, got {self.mtp!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        check_dispatch(self.moe_dispatch, "moe_dispatch")
        if not isinstance(self.layer_types, tuple) or not self.layer_types:
            raise TypeError(f"layer_types: must be a non-empty tuple, got {self.layer_types!r}")
        for i, layer_type in enumerate(self.layer_types):
            if layer_type not in (SLIDING, CSA, HCA):
                raise ValueError(
                    f"layer_types[{i}]: must be {SLIDING!r}, {CSA!r} or {HCA!r}, got {layer_type!r}"
                )
        if self.mlp_layer_types is not None:
            if not isinstance(self.mlp_layer_types, tuple) or len(self.mlp_layer_types) != len(
                self.layer_types
            ):
                raise TypeError(
                    f"mlp_layer_types: must be None or a tuple of {len(self.layer_types)} (one per layer), "
                    f"got {self.mlp_layer_types!r}"
                )
            for i, mlp_type in enumerate(self.mlp_layer_types):
                if mlp_type not in (MOE, HASH_MOE):
                    raise ValueError(
                        f"mlp_layer_types[{i}]: must be {MOE!r} or {HASH_MOE!r}, got {mlp_type!r}"
                    )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok: at most num_experts ({self.num_experts}), "
                f"got {self.num_experts_per_tok}"
            )
        if (self.compress_rope_factor is None) != (
            self.compress_rope_original_max_position_embeddings is None
        ):
            raise ValueError(
                "compress_rope_factor: YaRN needs it and compress_rope_original_max_position_embeddings, got "
                f"{self.compress_rope_factor!r} and {self.compress_rope_original_max_position_embeddings!r}"
            )
        if self.rope_dim % 2 or self.rope_dim > self.head_dim:
            raise ValueError(f"rope_dim: must be even and <= head_dim ({self.head_dim}), got {self.rope_dim}")
        if CSA in self.layer_types and self.rope_dim > self.index_head_dim:
            raise ValueError(
                f"rope_dim: must be <= index_head_dim ({self.index_head_dim}) with CSA layers, "
                f"got {self.rope_dim}"
            )
        fp4_group = quant.GROUP[quant.FP4]
        if (
            self.cache_dtypes.index_keys == quant.FP4
            and CSA in self.layer_types
            and self.index_head_dim % fp4_group
        ):
            raise ValueError(
                f"index_head_dim: must be a multiple of {fp4_group} with FP4 indexer keys "
                f"(kv_cache_dtype {self.kv_cache_dtype!r}), got {self.index_head_dim}"
            )
        if self.num_heads * self.head_dim % self.o_groups:
            raise ValueError(
                f"o_groups: must divide num_heads * head_dim ({self.num_heads * self.head_dim}), "
                f"got {self.o_groups}"
            )
        if self.max_draft > MAX_DRAFT:
            raise ValueError(f"max_draft: at most {MAX_DRAFT}, got {self.max_draft}")
        if self.compressed_layers and self.head_dim % 32:
            raise ValueError(f"head_dim: must be a multiple of 32 with C128 layers, got {self.head_dim}")

    @property
    def compressed_layers(self) -> int:
        """The number of C128 (HCA) layers: the layers of the model's compressor state."""
        return self.layer_types.count(HCA)

    @property
    def cache_dtypes(self) -> CacheDtypes:
        """How every layer's caches are stored: ``kv_cache_dtype`` resolved against ``dtype``
        (:meth:`~jax_oc128.nn.kv_cache.CacheDtypes.resolve`)."""
        return CacheDtypes.resolve(self.kv_cache_dtype, self.dtype)

    @property
    def hyper_connections(self) -> bool:
        """Whether the residual is ``hc_mult`` streams inside hyper-connections (else one plain residual)."""
        return self.hc_mult is not None

    @property
    def draft_hidden_size(self) -> int:
        """The width of the target's hidden state that the draft head takes: the residual streams, flattened
        (``hc_mult * hidden_size`` with hyper-connections, else ``hidden_size``)."""
        return (self.hc_mult or 1) * self.hidden_size

    @classmethod
    def tiny(cls, **fields) -> ModelConfig:
        """The small DeepSeek-V4 look-alike the package ships (``jax_oc128/assets/default_model.npz``,
        trained by ``scripts/train_default_model.py``): byte-level (vocabulary 256), hidden 128, 4 layers
        alternating sliding (window 32) and C128, 4 heads x 64 (RoPE on 16), q and o LoRA rank 64 in 2
        o-groups, a dense SwiGLU MLP of 256, one residual stream, an MTP draft head, float32. ``fields``
        replace any of its fields (a smaller or differently laid out variant)."""
        return cls(**(TINY | fields))

    @classmethod
    def deepseek_v4_flash(cls, *, num_layers: int | None = None, **fields) -> ModelConfig:
        """DeepSeek-V4-Flash (284B parameters, 13B active per token) as its released ``config.json`` has
        it (:data:`DEEPSEEK_V4_FLASH`): 43 layers (2 sliding, then CSA and HCA alternating, the last CSA),
        hidden 4096, 64 heads, q LoRA rank 1024, 8 o-groups, 256 routed experts of 2048 (routed scaling
        1.5), the CSA indexer's top 512.

        A slice of it (for one device): ``num_layers`` its first layers (None: all 43), each keeping its
        released attention and MLP type (the released pattern's prefix); ``fields`` replace any other
        field, e.g. ``num_experts`` (fewer routed experts; every MoE layer still routes
        ``num_experts_per_tok``, 6, of them), ``max_len`` (released: ``max_position_embeddings``, a million
        tokens), ``max_draft``, ``mtp``, ``dtype``."""
        return cls._released(DEEPSEEK_V4_FLASH, num_layers, fields)

    @classmethod
    def deepseek_v4_pro(cls, *, num_layers: int | None = None, **fields) -> ModelConfig:
        """DeepSeek-V4-Pro (1.6T parameters, 49B active per token) as its released ``config.json`` has it
        (:data:`DEEPSEEK_V4_PRO`): 61 layers (2 HCA, then CSA and HCA alternating, the last CSA), hidden
        7168, 128 heads, q LoRA rank 1536, 16 o-groups, 384 routed experts of 3072 (routed scaling 2.5),
        the CSA indexer's top 1024. ``num_layers``, ``fields``: a slice, as :meth:`deepseek_v4_flash`."""
        return cls._released(DEEPSEEK_V4_PRO, num_layers, fields)

    @classmethod
    def _released(cls, values: dict, num_layers: int | None, fields: dict) -> ModelConfig:
        """The config of a released model's ``values`` (every field): its first ``num_layers`` layers,
        ``fields`` replacing the other fields' values."""
        layers = len(values["layer_types"])
        num_layers = layers if num_layers is None else check_int("num_layers", num_layers, 1, layers)
        for name in ("layer_types", "mlp_layer_types"):
            if name in fields:
                raise TypeError(
                    f"{name}: set by num_layers (the released layers' prefix), not a field to give"
                )
        sliced = {name: values[name][:num_layers] for name in ("layer_types", "mlp_layer_types")}
        return cls(**(values | sliced | fields))

    def attention(self, layer_type: str) -> AttentionConfig:
        """The :class:`~jax_oc128.nn.AttentionConfig` of a layer of ``layer_type``."""
        if layer_type == SLIDING:
            rope = RopeConfig(self.rope_dim, self.rope_theta)
        else:  # YaRN's attention factor is 1 here, as transformers forces it for V4
            rope = RopeConfig(
                self.rope_dim,
                self.compress_rope_theta,
                self.compress_rope_factor,
                self.compress_rope_original_max_position_embeddings,
            )
        indexer = None
        if layer_type == CSA:
            indexer = IndexerConfig(self.index_n_heads, self.index_head_dim, self.index_topk)
        return AttentionConfig(
            layer_type=layer_type,
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            q_lora_rank=self.q_lora_rank,
            o_groups=self.o_groups,
            o_lora_rank=self.o_lora_rank,
            sliding_window=self.sliding_window,
            rms_norm_eps=self.rms_norm_eps,
            rope=rope,
            max_position_embeddings=self.max_len,
            indexer=indexer,
            dtype=self.dtype,
            cache_dtypes=self.cache_dtypes,
        )

    def moe(self, layer: int) -> MoEConfig | None:
        """The :class:`~jax_oc128.nn.moe.MoEConfig` of ``layer``'s MLP, None for the dense MLP."""
        if self.mlp_layer_types is None:
            return None
        return MoEConfig(
            hash_routed=self.mlp_layer_types[layer] == HASH_MOE,
            hidden_size=self.hidden_size,
            intermediate_size=self.mlp_hidden,
            num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            routed_scaling_factor=self.routed_scaling_factor,
            swiglu_limit=self.swiglu_limit,
            vocab_size=self.vocab_size,
            dtype=self.dtype,
            dispatch=self.moe_dispatch,
        )

    @classmethod
    def from_hf(
        cls,
        config: dict,
        *,
        max_len: int | None = None,
        max_draft: int = 8,
        mtp: bool = True,
        dtype: str = "float32",
        moe_dispatch: str = "grouped",
        kv_cache_dtype: str = "auto",
    ) -> ModelConfig:
        """From ``DeepseekV4Config.to_dict()`` (a Hugging Face ``config.json``); ``max_len`` (default
        ``max_position_embeddings``) bounds the sequences the caches hold; ``max_draft``, ``mtp``,
        ``dtype``, ``moe_dispatch`` and ``kv_cache_dtype`` are the fields of the same names. Raises
        ValueError naming a missing field, NotImplementedError for what transformers allows and this model
        does not have."""
        missing = sorted(HF_FIELDS - config.keys())
        if missing:
            raise ValueError(f"config: missing fields {missing}")
        for name, want in HF_FIXED.items():
            if config.get(name, want) != want:
                raise NotImplementedError(f"config: {name} must be {want!r}, got {config[name]!r}")
        main, compress = config["rope_parameters"]["main"], config["rope_parameters"]["compress"]
        head_dim = config["head_dim"]
        rope_dim = RopeConfig.from_hf(main, head_dim).dim
        main_rope = RopeConfig(rope_dim, float(config["rope_theta"]))
        compress_rope = RopeConfig.from_hf(compress, head_dim)
        if RopeConfig.from_hf(main, head_dim) != main_rope or compress_rope.dim != rope_dim:
            raise NotImplementedError(f"config: rope_parameters: unsupported {config['rope_parameters']!r}")
        model_config = cls(
            **{ours: config[theirs] for ours, theirs in HF_NAMES.items()},
            layer_types=tuple(config["layer_types"]),
            mlp_layer_types=tuple(config["mlp_layer_types"]),
            rope_dim=rope_dim,
            compress_rope_theta=compress_rope.theta,
            compress_rope_factor=compress_rope.factor,
            compress_rope_original_max_position_embeddings=compress_rope.original_max_position_embeddings,
            max_len=config["max_position_embeddings"] if max_len is None else max_len,
            max_draft=max_draft,
            mtp=mtp,
            dtype=dtype,
            moe_dispatch=moe_dispatch,
            kv_cache_dtype=kv_cache_dtype,
        )
        if model_config.attention(HCA).rope != compress_rope:
            raise NotImplementedError(f"config: rope_parameters['compress']: unsupported {compress!r}")
        return model_config


#: ModelConfig field -> the transformers config field it is (the others :meth:`ModelConfig.from_hf` derives)
HF_NAMES = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_heads": "num_attention_heads",
    "head_dim": "head_dim",
    "q_lora_rank": "q_lora_rank",
    "o_groups": "o_groups",
    "o_lora_rank": "o_lora_rank",
    "sliding_window": "sliding_window",
    "mlp_hidden": "moe_intermediate_size",
    "rms_norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "num_experts": "n_routed_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "routed_scaling_factor": "routed_scaling_factor",
    "swiglu_limit": "swiglu_limit",
    "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
}
#: the transformers config fields :meth:`ModelConfig.from_hf` reads
HF_FIELDS = frozenset(HF_NAMES.values()) | {
    "layer_types",
    "mlp_layer_types",
    "rope_parameters",
    "max_position_embeddings",
}
#: transformers config fields whose other values this model does not implement (absent: the default)
HF_FIXED = {
    "num_key_value_heads": 1,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "compress_rates": {CSA: 4, HCA: 128},
}

#: :meth:`ModelConfig.tiny`: the shipped model's fields
TINY = dict(
    vocab_size=256,
    hidden_size=128,
    layer_types=(SLIDING, HCA, SLIDING, HCA),
    num_heads=4,
    head_dim=64,
    rope_dim=16,
    q_lora_rank=64,
    o_groups=2,
    o_lora_rank=64,
    sliding_window=32,
    mlp_hidden=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    max_len=4096,
    max_draft=8,
    mlp_layer_types=None,
    num_experts=4,
    num_experts_per_tok=2,
    routed_scaling_factor=1.5,
    swiglu_limit=10.0,
    moe_dispatch="grouped",
    hc_mult=None,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    index_n_heads=16,
    index_head_dim=32,
    index_topk=16,
    compress_rope_factor=None,
    compress_rope_original_max_position_embeddings=None,
    mtp=True,
    dtype="float32",
    kv_cache_dtype="auto",
)
#: what DeepSeek-V4-Flash's and -Pro's released ``config.json`` share, as ModelConfig fields (``max_len``
#: their ``max_position_embeddings``; ``max_draft``, ``mtp`` and ``dtype`` as :meth:`ModelConfig.from_hf`
#: sets them by default: one MTP layer, ``num_nextn_predict_layers`` 1)
DEEPSEEK_V4 = dict(
    vocab_size=129280,
    head_dim=512,
    rope_dim=64,
    o_lora_rank=1024,
    sliding_window=128,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    max_len=1048576,
    max_draft=8,
    num_experts_per_tok=6,
    swiglu_limit=10.0,
    moe_dispatch="grouped",
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    index_n_heads=64,
    index_head_dim=128,
    compress_rope_factor=16.0,
    compress_rope_original_max_position_embeddings=65536,
    mtp=True,
    dtype="float32",
    kv_cache_dtype="auto",
)
#: DeepSeek-V4-Flash's released ``config.json`` as ModelConfig fields (:meth:`ModelConfig.deepseek_v4_flash`):
#: ``compress_ratios`` 0, 0, then 4 and 128 alternating, ending 4; ``num_hash_layers`` 3
DEEPSEEK_V4_FLASH = DEEPSEEK_V4 | dict(
    hidden_size=4096,
    layer_types=(SLIDING,) * 2 + (CSA, HCA) * 20 + (CSA,),
    mlp_layer_types=(HASH_MOE,) * 3 + (MOE,) * 40,
    num_heads=64,
    q_lora_rank=1024,
    o_groups=8,
    num_experts=256,
    mlp_hidden=2048,
    routed_scaling_factor=1.5,
    index_topk=512,
)
#: DeepSeek-V4-Pro's released ``config.json`` as ModelConfig fields (:meth:`ModelConfig.deepseek_v4_pro`):
#: ``compress_ratios`` 128, 128, then 4 and 128 alternating, ending 4; ``num_hash_layers`` 3
DEEPSEEK_V4_PRO = DEEPSEEK_V4 | dict(
    hidden_size=7168,
    layer_types=(HCA,) * 2 + (CSA, HCA) * 29 + (CSA,),
    mlp_layer_types=(HASH_MOE,) * 3 + (MOE,) * 58,
    num_heads=128,
    q_lora_rank=1536,
    o_groups=16,
    num_experts=384,
    mlp_hidden=3072,
    routed_scaling_factor=2.5,
    index_topk=1024,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelCache:
    """The target model's cache for a batch (slot = batch row), a pytree.

    Attributes:
      layers: one :class:`~jax_oc128.nn.AttentionCache` per layer (window ring; entries of C128 layers).
      compressed: the C128 compressor state of all C128 layers, layer-stacked
        (:class:`~jax_oc128.CompressState` or :class:`~jax_oc128.OfflineState` with ``compressed_layers``
        layers), or None for a model without C128 layers.
      page_table: None (the dense layout: every slot holds ``max_len`` tokens of entries), or ``[batch,
        max_pages]`` int32: paged, the pages of every compressed layer's pool holding slot b's tokens
        ``[k * page_size, (k + 1) * page_size)`` at ``page_table[b, k]`` (-1: none), one table for all
        layers (:mod:`~jax_oc128.nn.kv_cache`); set by the host between forwards.
    """

    layers: tuple[AttentionCache, ...]
    compressed: object
    page_table: jax.Array | None = None

    @classmethod
    def create(
        cls, config: ModelConfig, backend: Backend, batch: int, pages: int | None = None, page_size: int = 0
    ) -> ModelCache:
        """An empty cache of a model of ``config`` with the C128 ``backend`` for ``batch`` rows (slots):
        each layer's :meth:`~jax_oc128.nn.AttentionCache.create` up to ``max_len`` tokens, and the C128 state
        (float32); nothing but the config is read. With ``pages``: paged, a pool of ``pages`` pages of
        ``page_size`` tokens (a multiple of 128 dividing ``max_len``) per compressed layer and a page table
        of ``max_len // page_size`` pages per slot, none assigned."""
        compressed = None
        if config.compressed_layers:
            compressed = backend.create(config.compressed_layers, batch, config.head_dim, config.max_draft)
        layers = tuple(
            AttentionCache.create(
                config.attention(t), config.max_draft, batch, config.max_len, pages, page_size
            )
            for t in config.layer_types
        )
        if pages is None:
            return cls(layers, compressed)
        return cls(layers, compressed, jnp.full((batch, config.max_len // page_size), -1, jnp.int32))

    def clear(self, rows) -> ModelCache:
        """Empty ``rows`` ([n] int32, -1 ignored) for new sequences, in every layer and the compressor (a
        paged cache's pages are not cleared, nor its page table: the host's)."""
        paged = self.page_table is not None
        return ModelCache(
            tuple(layer.clear(rows, paged) for layer in self.layers),
            None if self.compressed is None else self.compressed.alloc(rows),
            self.page_table,
        )


class Block(nnx.Module):
    """One decoder layer of ``config``: RMSNorm -> attention, RMSNorm -> MLP (dense SwiGLU or MoE), each
    added to the residual, or with ``hc_mult`` inside its hyper-connection over the residual streams.

    Args:
      config: the model's config; layer: the layer's index in it.
      backend: the C128 compressor backend; compress_layer: the layer's index among the HCA layers.
    """

    def __init__(
        self, config: ModelConfig, layer: int, backend: Backend, compress_layer: int, *, rngs: nnx.Rngs
    ):
        self.eps = config.rms_norm_eps
        self.attn_norm = ones_param(config.hidden_size)
        self.attn = DeepseekV4Attention(
            config.attention(config.layer_types[layer]),
            backend=backend,
            max_draft=config.max_draft,
            compress_layer=compress_layer,
            rngs=rngs,
        )
        self.mlp_norm = ones_param(config.hidden_size)
        moe_config = config.moe(layer)
        if moe_config is None:
            self.gate = normal_param(rngs, config.mlp_hidden, config.hidden_size, dtype=config.dtype)
            self.up = normal_param(rngs, config.mlp_hidden, config.hidden_size, dtype=config.dtype)
            self.down = normal_param(rngs, config.hidden_size, config.mlp_hidden, dtype=config.dtype)
        else:
            self.moe = MoE(moe_config, rngs=rngs)
        if config.hyper_connections:
            hc = (config.hc_mult, config.hidden_size, config.hc_sinkhorn_iters, config.hc_eps, self.eps)
            self.attn_hc = HyperConnection(*hc, rngs=rngs)
            self.ffn_hc = HyperConnection(*hc, rngs=rngs)

    def __call__(
        self, h, tokens, positions, cache, compressed, lengths, mode, tree=None, nodes=None, page_table=None
    ):
        """``h`` the residual ``[batch, T, hidden]`` (or the streams ``[batch, T, hc_mult, hidden]``) of
        ``tokens`` ``[batch, T]`` -> ``(h, cache, compressed)``; ``tree``, ``nodes``: a tree verify or draft;
        ``page_table``: the model's (:class:`~jax_oc128.nn.DeepseekV4Attention`)."""

        def attention(x):
            nonlocal cache, compressed
            with jax.named_scope("attention"):
                y, cache, compressed = self.attn(
                    rms_norm(x, self.attn_norm[...], self.eps),
                    positions,
                    cache,
                    compressed,
                    lengths=lengths,
                    mode=mode,
                    tree=tree,
                    nodes=nodes,
                    page_table=page_table,
                )
            return y

        h = self._residual(getattr(self, "attn_hc", None), h, attention)
        h = self._residual(getattr(self, "ffn_hc", None), h, lambda x: self._mlp(x, tokens))
        return h, cache, compressed

    @staticmethod
    def _residual(hc, h, sublayer):
        """``h + sublayer(h)``, or with a hyper-connection ``hc`` its collapse, sublayer and expansion."""
        if hc is None:
            return h + sublayer(h)
        with jax.named_scope("hyper_connection"):
            post, comb, collapsed = hc(h)
        output = sublayer(collapsed)
        with jax.named_scope("hyper_connection"):
            return hc.expand(post, comb, output, h)

    def _mlp(self, h, tokens):
        with jax.named_scope("mlp"):
            x = rms_norm(h, self.mlp_norm[...], self.eps)
            if hasattr(self, "moe"):
                return self.moe(x, tokens)
            return swiglu(x, self.gate[...], self.up[...], self.down[...])

    def hf_weight_paths(self) -> dict[str, tuple]:
        """transformers state-dict name (within ``model.layers.{i}.``) -> attribute path of this block."""
        paths = {"input_layernorm.weight": ("attn_norm",), "post_attention_layernorm.weight": ("mlp_norm",)}
        paths |= {f"self_attn.{name}": ("attn", *path) for name, path in self.attn.hf_weight_paths().items()}
        if hasattr(self, "moe"):
            paths |= {
                f"mlp.{name}": ("moe", attr)
                for name, attr in moe.HF_WEIGHT_NAMES.items()
                if hasattr(self.moe, attr)
            }
        else:
            raise NotImplementedError(
                "a dense MLP layer has no transformers counterpart (DeepSeek-V4 layers are MoE)"
            )
        if hasattr(self, "attn_hc"):
            paths |= {
                f"{hc}.{name}": (hc, name) for hc in ("attn_hc", "ffn_hc") for name in ("fn", "base", "scale")
            }
        return paths


def flatten_streams(streams):
    """The residual streams ``[batch, T, hc_mult, hidden]`` as one hidden state ``[batch, T, hc_mult *
    hidden]`` (what the target hands the draft head)."""
    return streams.reshape(*streams.shape[:-2], -1)


def output_logits(hidden, norm, lm_head, eps):
    """The final RMSNorm and the LM head: ``[..., hidden]`` -> ``[..., vocab]``."""
    with jax.named_scope("lm_head"):
        return linear(rms_norm(hidden, norm, eps), lm_head)


class DeepseekV4Model(nnx.Module):
    """The target model; ``backend`` selects the C128 compressor state (online banks or offline rows)."""

    def __init__(self, config: ModelConfig, *, backend: Backend = ONLINE, rngs: nnx.Rngs):
        self.config, self.backend = config, backend
        self.embed = normal_param(rngs, config.vocab_size, config.hidden_size, scale=0.5, dtype=config.dtype)
        # each layer's index among the C128 layers (the layers before it of type HCA)
        compress_layers = itertools.accumulate((t == HCA for t in config.layer_types[:-1]), initial=0)
        self.blocks = nnx.List(
            [Block(config, layer, backend, index, rngs=rngs) for layer, index in enumerate(compress_layers)]
        )
        if config.hyper_connections:
            self.hc_head = HyperHead(
                config.hc_mult, config.hidden_size, config.hc_eps, config.rms_norm_eps, rngs=rngs
            )
        self.norm = ones_param(config.hidden_size)
        self.lm_head = normal_param(rngs, config.vocab_size, config.hidden_size, dtype=config.dtype)

    @classmethod
    def from_hf(cls, config: dict, weights: dict, *, backend: Backend = ONLINE, **kwargs) -> DeepseekV4Model:
        """The model of a transformers ``DeepseekV4ForCausalLM``: its ``config`` (``to_dict()``) and its
        ``weights``, the full state dict (name -> numpy array; ``mtp.*`` tensors, which transformers drops,
        are not expected). Every tensor is checked (missing, unexpected, shape, integer or floating) before
        any is set, each error naming it; ``kwargs``: ``max_len``, ``max_draft``, ``dtype`` of
        :meth:`ModelConfig.from_hf`."""
        model_config = ModelConfig.from_hf(config, **kwargs)
        model = build_abstract(lambda rngs: cls(model_config, backend=backend, rngs=rngs))
        paths = model.hf_weight_paths()
        graphdef, abstract = nnx.split(model)
        model = nnx.merge(graphdef, jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), abstract))
        assign_weights(model, paths, weights)
        for i, block in enumerate(model.blocks):
            table = getattr(getattr(block, "moe", None), "tid2eid", None)
            if table is not None:
                name = f"model.layers.{i}.mlp.gate.tid2eid"
                check_expert_ids(table[...], model_config.num_experts, f"weights[{name!r}]")
        return model

    def hf_weight_paths(self) -> dict[str, tuple]:
        """transformers state-dict name -> attribute path of this model (its config must have MoE layers and
        hyper-connections, as every DeepSeek-V4 has)."""
        if not hasattr(self, "hc_head"):
            raise NotImplementedError("a model without hyper-connections has no transformers counterpart")
        paths = {
            "model.embed_tokens.weight": ("embed",),
            "lm_head.weight": ("lm_head",),
            "model.norm.weight": ("norm",),
            "model.hc_head.hc_fn": ("hc_head", "fn"),
            "model.hc_head.hc_base": ("hc_head", "base"),
            "model.hc_head.hc_scale": ("hc_head", "scale"),
        }
        for i, block in enumerate(self.blocks):
            paths |= {
                f"model.layers.{i}.{name}": ("blocks", i, *path)
                for name, path in block.hf_weight_paths().items()
            }
        return paths

    def init_cache(self, batch: int, pages: int | None = None, page_size: int = 0) -> ModelCache:
        """An empty cache for ``batch`` rows (slots), paged with ``pages`` pages of ``page_size`` tokens:
        :meth:`ModelCache.create`."""
        return ModelCache.create(self.config, self.backend, batch, pages, page_size)

    def logits(self, hidden):
        """``[..., hidden]`` -> ``[..., vocab]`` (final norm and LM head)."""
        return output_logits(hidden, self.norm[...], self.lm_head[...], self.config.rms_norm_eps)

    def __call__(
        self, tokens, positions, cache: ModelCache, *, lengths=None, mode=ForwardMode.EXTEND, tree=None
    ):
        """A forward of ``mode`` (static :class:`~jax_oc128.controller.ForwardMode`: EXTEND or DECODE fold
        the tokens into the caches; TARGET_VERIFY writes a verify's banks, kept by :meth:`commit` or
        committed lazily by the rows' next forward; with ``tree``, a static :class:`~jax_oc128.tree.Tree`,
        the tokens are its nodes at ``positions`` = the root's + depth, then :meth:`keep_path`; a chain
        runs as ``tree=None``). Returns
        ``(logits [batch, T, vocab], hidden [batch, T, draft_hidden_size], cache)``; ``hidden`` is what the
        draft head takes, the last block's output (with hyper-connections its residual streams, flattened,
        before their final collapse)."""
        lengths = jnp.full(tokens.shape[:1], tokens.shape[1], jnp.int32) if lengths is None else lengths
        compressed = prepare_forward(self.backend, cache.compressed, mode, positions, lengths)
        h = self.embed[...][tokens].astype(jnp.float32)
        if self.config.hyper_connections:
            h = jnp.broadcast_to(h[..., None, :], (*h.shape[:-1], self.config.hc_mult, h.shape[-1]))
        layers = []
        for block, layer in zip(self.blocks, cache.layers, strict=True):
            h, layer, compressed = block(
                h, tokens, positions, layer, compressed, lengths, mode, tree, page_table=cache.page_table
            )
            layers.append(layer)
        cache = ModelCache(tuple(layers), compressed, cache.page_table)
        if self.config.hyper_connections:
            return self.logits(self.hc_head(h)), flatten_streams(h), cache
        return self.logits(h), h, cache

    def keep_path(self, cache: ModelCache, tree, first_positions, nodes) -> ModelCache:
        """After a verify of ``tree`` at ``first_positions`` ``[batch]`` (the root's positions), keep each
        row's path to ``nodes`` ``[batch]`` (-1: the row is left as it is) in every layer's cache
        (:meth:`~jax_oc128.nn.AttentionCache.keep_path`) and commit it in the C128 state: the node's bank,
        ``depths[node] + 1`` tokens (one launch for all layers). A chain (:attr:`Tree.is_chain`) keeps its
        path as the chain does: its caches are returned as they are, the verify pending for the rows' next
        forward to commit."""
        if check_tree(tree).is_chain:
            return cache
        layers = tuple(
            layer.keep_path(tree, first_positions, nodes, page_table=cache.page_table)
            for layer in cache.layers
        )
        cache = dataclasses.replace(cache, layers=layers)
        if cache.compressed is None:
            return cache
        slots = jnp.where(nodes >= 0, jnp.arange(nodes.shape[0], dtype=jnp.int32), -1)
        accept = jnp.asarray(tree.depths)[jnp.maximum(nodes, 0)] + 1
        compressed = self.backend.controller.commit(
            cache.compressed, slots, first_positions, accept, accept_banks=nodes + 1
        )
        return dataclasses.replace(cache, compressed=compressed)

    def commit(self, cache: ModelCache, seq_lens, accept_lens) -> ModelCache:
        """Keep ``accept_lens`` ``[batch]`` tokens of the verify forward at ``seq_lens`` ``[batch]`` (the
        eager commit): one launch for all C128 layers."""
        if cache.compressed is None:
            return cache
        slots = jnp.arange(seq_lens.shape[0], dtype=jnp.int32)
        compressed = self.backend.controller.commit(cache.compressed, slots, seq_lens, accept_lens)
        return dataclasses.replace(cache, compressed=compressed)
