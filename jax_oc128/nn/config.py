"""The decoder's static configuration: its architecture, :class:`ModelConfig` (its fields and their checks,
the released DeepSeek-V4 models' presets (:meth:`ModelConfig.deepseek_v4_flash`,
:meth:`ModelConfig.deepseek_v4_pro`), the byte-level model's (:meth:`ModelConfig.tiny`) and the conversion
of a transformers ``DeepseekV4Config`` (:meth:`ModelConfig.from_hf`)), and how a model of it runs,
:class:`RuntimeConfig` (the caches' bounds and storage, the MoE's computation), given at construction."""

from __future__ import annotations

import dataclasses
import math

from jax_oc128.checks import check_int
from jax_oc128.nn import attend, quant
from jax_oc128.nn.attention import CSA, HCA, SLIDING, AttentionConfig, LayerType
from jax_oc128.nn.csa import IndexerConfig
from jax_oc128.nn.functional import DTYPES
from jax_oc128.nn.kv_cache import CacheDtypes, check_kv_cache_dtype
from jax_oc128.nn.moe import HASH_MOE, MOE, MoEConfig, check_dispatch
from jax_oc128.nn.rope import RopeConfig
from jax_oc128.rules import MAX_DRAFT


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """How a model runs, apart from its architecture (:class:`ModelConfig`): given to the model at
    construction (``SpeculativeModel(config, runtime, ...)``), which exposes ``max_len`` and ``max_draft``.
    Each field is checked, the error naming it.

    Attributes:
      max_len: the longest sequence the caches hold, in tokens, in [1, 2**31) (default 4096, the shipped
        model's).
      max_draft: the most tokens a verify takes (banks of the online C128 state), in [1,
        :data:`~jax_oc128.rules.MAX_DRAFT`] (default 8).
      kv_cache_dtype: the caches' storage, a name in :data:`~jax_oc128.nn.kv_cache.KV_CACHE_DTYPES` (default
        ``"auto"``: the model's dtype).
      moe_dispatch: the MoE layers' routed experts' computation, a name in
        :data:`~jax_oc128.nn.moe.DISPATCHES` (default ``"grouped"``).
      attention_impl: the attention math (:mod:`~jax_oc128.nn.attend`): ``"jnp"`` (default: the oracle),
        ``"kernel"`` (the attention op) or ``"auto"`` (the kernel on a GPU with the CUDA module built).
    """

    max_len: int = 4096
    max_draft: int = 8
    kv_cache_dtype: str = "auto"
    moe_dispatch: str = "grouped"
    attention_impl: str = "jnp"

    def __post_init__(self):
        check_int("max_len", self.max_len, 1, 2**31 - 1)
        check_int("max_draft", self.max_draft, 1, MAX_DRAFT)
        check_kv_cache_dtype(self.kv_cache_dtype)
        check_dispatch(self.moe_dispatch, "moe_dispatch")
        attend.check_impl(self.attention_impl)

    def cache_dtypes(self, dtype: str) -> CacheDtypes:
        """How every layer's caches are stored in a model of ``dtype``: ``kv_cache_dtype`` resolved
        (:meth:`~jax_oc128.nn.kv_cache.CacheDtypes.resolve`)."""
        return CacheDtypes.resolve(self.kv_cache_dtype, dtype)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The decoder's static configuration (transformers' ``DeepseekV4Config`` fields, by
    :meth:`from_hf`). ``mlp_hidden`` is the dense MLP's width, or ``moe_intermediate_size`` (each
    expert's and the shared expert's) with ``mlp_layer_types``.

    Every field is given (no defaults): a config is the byte-level model's (:meth:`tiny`), a released
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
    mlp_layer_types: tuple[str, ...] | None  # moe / hash_moe per layer; None: a dense SwiGLU MLP
    num_experts: int  # n_routed_experts
    num_experts_per_tok: int
    routed_scaling_factor: float
    swiglu_limit: float  # MoE layers only
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

    def __post_init__(self):
        """Every field checked (a config read from a file is checked before any parameter is built): ints
        in [1, 2**31) (positions and token ids are int32), finite floats > 0, a non-empty tuple of
        supported layer types, a bool ``mtp``, a known ``dtype``, and the shapes' constraints."""
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
        if not isinstance(self.layer_types, tuple) or not self.layer_types:
            raise TypeError(f"layer_types: must be a non-empty tuple, got {self.layer_types!r}")
        for i, layer_type in enumerate(self.layer_types):
            if layer_type not in (SLIDING, CSA, HCA):
                raise ValueError(
                    f"layer_types[{i}]: must be {SLIDING.value!r}, {CSA.value!r} or {HCA.value!r}, "
                    f"got {layer_type!r}"
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
                        f"mlp_layer_types[{i}]: must be {MOE.value!r} or {HASH_MOE.value!r}, got {mlp_type!r}"
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
        if self.num_heads * self.head_dim % self.o_groups:
            raise ValueError(
                f"o_groups: must divide num_heads * head_dim ({self.num_heads * self.head_dim}), "
                f"got {self.o_groups}"
            )
        if self.compressed_layers and self.head_dim % 32:
            raise ValueError(f"head_dim: must be a multiple of 32 with C128 layers, got {self.head_dim}")

    @property
    def compressed_layers(self) -> int:
        """The number of C128 (HCA) layers: the layers of the model's compressor state."""
        return self.layer_types.count(HCA)

    def check_runtime(self, runtime: RuntimeConfig) -> RuntimeConfig:
        """``runtime`` (a :class:`RuntimeConfig`) if a model of this config can run with it: FP4 indexer keys
        (``kv_cache_dtype`` ``"fp8_fp4"``) need CSA layers' ``index_head_dim`` a multiple of the FP4 group;
        TypeError or ValueError naming the argument otherwise."""
        if not isinstance(runtime, RuntimeConfig):
            raise TypeError(f"runtime: must be a jax_oc128.nn.RuntimeConfig, got {runtime!r}")
        fp4_group = quant.GROUP[quant.FP4]
        if (
            runtime.cache_dtypes(self.dtype).index_keys == quant.FP4
            and CSA in self.layer_types
            and self.index_head_dim % fp4_group
        ):
            raise ValueError(
                f"index_head_dim: must be a multiple of {fp4_group} with FP4 indexer keys "
                f"(kv_cache_dtype {runtime.kv_cache_dtype!r}), got {self.index_head_dim}"
            )
        return runtime

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
        """The small byte-level DeepSeek-V4 look-alike the tests run
        (:data:`~jax_oc128.checkpoint.DEFAULT_MODEL`, trained by ``scripts/train_default_model.py``):
        vocabulary 256, hidden 128, 4 layers alternating sliding (window 32) and C128, 4 heads x 64 (RoPE
        on 16), q and o LoRA rank 64 in 2 o-groups, a dense SwiGLU MLP of 256, one residual stream, an MTP
        draft head, float32. ``fields`` replace any of its fields (a smaller or differently laid out
        variant)."""
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
        ``num_experts_per_tok``, 6, of them), ``mtp``, ``dtype``."""
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

    def attention(self, layer_type: str, runtime: RuntimeConfig | None = None) -> AttentionConfig:
        """The :class:`~jax_oc128.nn.AttentionConfig` of a layer of ``layer_type`` (a
        :class:`~jax_oc128.nn.LayerType` or its string) running as ``runtime`` says (None: the defaults,
        ``RuntimeConfig()``): its ``max_position_embeddings`` the runtime's ``max_len``, its caches' storage
        the runtime's."""
        runtime = self.check_runtime(RuntimeConfig() if runtime is None else runtime)
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
            layer_type=LayerType(layer_type),
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            q_lora_rank=self.q_lora_rank,
            o_groups=self.o_groups,
            o_lora_rank=self.o_lora_rank,
            sliding_window=self.sliding_window,
            rms_norm_eps=self.rms_norm_eps,
            rope=rope,
            max_position_embeddings=runtime.max_len,
            indexer=indexer,
            dtype=self.dtype,
            cache_dtypes=runtime.cache_dtypes(self.dtype),
        )

    def moe(self, layer: int, runtime: RuntimeConfig | None = None) -> MoEConfig | None:
        """The :class:`~jax_oc128.nn.moe.MoEConfig` of ``layer``'s MLP (its dispatch ``runtime``'s
        ``moe_dispatch``; None: the default's), None for the dense MLP."""
        if self.mlp_layer_types is None:
            return None
        runtime = self.check_runtime(RuntimeConfig() if runtime is None else runtime)
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
            dispatch=runtime.moe_dispatch,
        )

    @classmethod
    def from_hf(cls, config: dict, *, mtp: bool = True, dtype: str = "float32") -> ModelConfig:
        """From ``DeepseekV4Config.to_dict()`` (a Hugging Face ``config.json``; its
        ``max_position_embeddings`` is a runtime bound, the default ``max_len`` of
        :func:`~jax_oc128.loading.hf_config.model_config`); ``mtp`` and ``dtype``
        are the fields of the same names. Raises ValueError naming a missing field, NotImplementedError for
        what transformers allows and this model does not have."""
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
            mtp=mtp,
            dtype=dtype,
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
    "compress_rates": {CSA.value: 4, HCA.value: 128},
}

#: :meth:`ModelConfig.tiny`: the byte-level model's fields
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
    mlp_layer_types=None,
    num_experts=4,
    num_experts_per_tok=2,
    routed_scaling_factor=1.5,
    swiglu_limit=10.0,
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
)
#: what DeepSeek-V4-Flash's and -Pro's released ``config.json`` share, as ModelConfig fields (``mtp`` and
#: ``dtype`` as :meth:`ModelConfig.from_hf` sets them by default: one MTP layer, ``num_nextn_predict_layers``
#: 1; their ``max_position_embeddings``, a million, is a runtime bound: ``RuntimeConfig.max_len``)
DEEPSEEK_V4 = dict(
    vocab_size=129280,
    head_dim=512,
    rope_dim=64,
    o_lora_rank=1024,
    sliding_window=128,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    num_experts_per_tok=6,
    swiglu_limit=10.0,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    index_n_heads=64,
    index_head_dim=128,
    compress_rope_factor=16.0,
    compress_rope_original_max_position_embeddings=65536,
    mtp=True,
    dtype="float32",
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
