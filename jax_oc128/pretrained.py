"""Loading a DeepSeek-V4 checkpoint in Hugging Face format: :func:`load_pretrained`.

A checkpoint is a directory with ``config.json`` (transformers' ``DeepseekV4Config`` fields, or DeepSeek's
own: ``compress_ratios``, ``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling``) and its tensors in
safetensors files: ``model.safetensors``, or shards listed by ``model.safetensors.index.json``. A tensor
may have transformers' state-dict name (``model.layers.0.self_attn.q_a_proj.weight``, the experts stacked
in ``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj``) or DeepSeek's (``layers.0.attn.wq_a.weight``,
one tensor per expert and projection: ``layers.0.ffn.experts.{e}.w1.weight``), with or without a ``model.``
prefix; the two may be mixed (transformers' ``save_pretrained`` writes such a mixture).

The MTP layer follows the decoder layers (at most one, as DeepSeek-V4 has): ``mtp.0.`` (DeepSeek's
checkpoints) or ``model.layers.{num_hidden_layers}.`` (the DeepSeek-V3 layout), its own tensors named as
DeepSeek names them (``enorm``, ``hnorm``, ``e_proj``, ``h_proj``, ``norm``, ``hc_head_fn/base/scale``:
:data:`~jax_oc128.nn.draft.MTP_WEIGHT_NAMES`) and its decoder block's as a layer's. The embedding and LM
head are the target's. A checkpoint without MTP tensors loads for plain decoding
(``model.mtp`` None, ``config.mtp`` False).

Everything is checked before anything of the model's size is allocated or read, and the checks' work is
bounded by the files' sizes, not by numbers in the config: only regular files are opened (symlinks
followed; a FIFO, a device or a socket is refused, never opened), ``config.json`` and the index are read up
to :data:`MAX_CONFIG_BYTES` and :data:`MAX_INDEX_BYTES`; then every file's header (names, shapes, dtypes);
then the config's layers and tensors are counted against the headers' tensors (each layer has tensors of its
own, each expert of a per-expert checkpoint its own), then every tensor is checked against the model of the
config (shapes only, not traced: ``functional.build_abstract``): missing and unexpected tensors, shapes and
dtypes, all problems in one :class:`ValueError` that names each tensor; then the hash layers' token ->
expert tables (small, any integer dtype) are read and their ids checked. Then the tensors are read one at a
time, memory mapped, each header checked again (a shard replaced since is refused, naming the tensor), and
placed straight into the parameter's final layout (:class:`_Shards`): on one device, or split over a mesh as
an :class:`~jax_oc128.engine.Engine` on it places it, each device given only its shard (read from the mapped
tensor), DeepSeek's per-expert tensors written into their expert's slice of the stacked parameter in place.

A quantized checkpoint (DeepSeek's released format: ``quantization_config`` and ``expert_dtype``,
:func:`read_quantization`) keeps its weights quantized on the device (:mod:`jax_oc128.nn.quant`): the FP8
linears (:data:`FP8_PARAMS`) and the routed experts (FP4, or FP8 in the Base checkpoints) become
:class:`~jax_oc128.nn.quant.QuantizedArray` parameters of their codes and per-row scales, each weight with its
``.scale`` tensor (checked with the others: present, of its shape and dtype, and each quantized weight of its
format's dtype and packed shape; a quantized tensor where the format has a float one is refused), each
scale's exponents checked when it is read (:func:`~jax_oc128.nn.quant.check_exponents`). The other
parameters load as from a float checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import math
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh
from safetensors import SafetensorError, safe_open

from jax_oc128 import files
from jax_oc128.checks import check_int
from jax_oc128.controller import ONLINE, Backend
from jax_oc128.nn import CSA, HCA, SLIDING, ModelConfig, SpeculativeModel, sharding
from jax_oc128.nn.functional import DTYPES, build_abstract, variable_at
from jax_oc128.nn.kv_cache import check_kv_cache_dtype
from jax_oc128.nn.moe import HASH_MOE, MOE, check_expert_ids
from jax_oc128.nn.quant import FP4, FP8, GROUP, QuantizedArray, check_exponents, row_scales
from jax_oc128.rules import MAX_DRAFT

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
#: the largest config.json read, in bytes (DeepSeek-V4's is a few KiB)
MAX_CONFIG_BYTES = 1 << 20
#: the largest index read, in bytes (DeepSeek-V3's, 91k tensors with their FP8 scales, is 8.9 MiB)
MAX_INDEX_BYTES = 64 << 20
#: the most tensor names one list of an error message shows (the others are counted)
MAX_LISTED = 20

#: DeepSeek's name of a top-level tensor -> transformers' (each also accepted under its own name)
DEEPSEEK_TOP_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
#: DeepSeek's name of a decoder layer's tensor (within ``layers.{i}.``) -> transformers' (within
#: ``model.layers.{i}.``); the experts' tensors are :data:`DEEPSEEK_EXPERT`
DEEPSEEK_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"hc_{hc}_{name}": f"{hc}_hc.{name}" for hc in ("attn", "ffn") for name in ("fn", "base", "scale")},
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.norm.weight": "self_attn.kv_norm.weight",  # as transformers' save_pretrained writes it
    "attn.attn_sink": "self_attn.sinks",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    **{
        f"attn.{ours}compressor.{name}": f"self_attn.compressor.{theirs}{hf}"
        for ours, theirs in (("", ""), ("indexer.", "indexer."))
        for name, hf in (
            ("wkv.weight", "kv_proj.weight"),
            ("wgate.weight", "gate_proj.weight"),
            ("ape", "position_bias"),
            ("norm.weight", "kv_norm.weight"),
        )
    },
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
#: DeepSeek's per-expert projection -> (transformers' stacked tensor, which half of its rows: w1 the gate's,
#: w3 the up projection's; None: all of them)
DEEPSEEK_EXPERT = {
    "w1": ("mlp.experts.gate_up_proj", 0),
    "w3": ("mlp.experts.gate_up_proj", 1),
    "w2": ("mlp.experts.down_proj", None),
}
# (indices of at most 9 digits: a name with a longer one is an unexpected tensor)
EXPERT_NAME = re.compile(r"ffn\.experts\.(\d{1,9})\.(w[123])\.weight")
LAYER_PARAM = re.compile(r"model\.layers\.\d+\.(.+)")
LAYER_NAME = re.compile(r"(?:model\.)?(layers|mtp)\.(\d{1,9})\.(.+)")
#: DeepSeek's ``compress_ratios`` entries -> transformers' layer types
RATIO_LAYER_TYPES = {0: SLIDING, 4: CSA, 128: HCA}
#: safetensors dtypes a floating / an integer parameter may be stored in (cast on load)
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
INT_DTYPES = {"I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8"}
#: the numpy dtype of each safetensors dtype read (a tensor is memory mapped as it is stored: little-endian)
NUMPY_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    **{
        f"{kind}{bits}": np.dtype(f"{kind.lower()}{bits // 8}")
        for kind in ("I", "U")
        for bits in (8, 16, 32, 64)
    },
}
#: DeepSeek's ``quantization_config`` as released, the only one read (each field checked)
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
    "activation_scheme": "dynamic",
}
#: ``expert_dtype`` -> the routed experts' format (absent: fp4, as the released V4 checkpoints)
EXPERT_DTYPES = {"fp4": FP4, "fp8": FP8}
#: the parameters (within ``model.layers.{i}.``) a quantized checkpoint stores in FP8: the attention's
#: projections, the indexer's query projection and the shared expert
FP8_PARAMS = (
    "self_attn.q_a_proj.weight",
    "self_attn.q_b_proj.weight",
    "self_attn.kv_proj.weight",
    "self_attn.o_a_proj.weight",
    "self_attn.o_b_proj.weight",
    "self_attn.compressor.indexer.q_b_proj.weight",
    "mlp.shared_experts.gate_proj.weight",
    "mlp.shared_experts.up_proj.weight",
    "mlp.shared_experts.down_proj.weight",
)
#: the MTP layer's projections: FP8 where stored so (F8_E4M3 with a scale), float otherwise
OPTIONAL_FP8_PARAMS = ("e_proj.weight", "h_proj.weight")
#: the routed experts' parameters, in the format of ``expert_dtype``
EXPERT_PARAMS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
#: a quantized weight's safetensors dtype, and its scale's (the Base checkpoints' FP8 experts: float32)
WEIGHT_DTYPE = {FP8: "F8_E4M3", FP4: "I8"}
SCALE_DTYPES = {FP8: ("F8_E8M0",), FP4: ("F8_E8M0",)}
EXPERT_SCALE_DTYPES = {FP8: ("F8_E8M0", "F32"), FP4: ("F8_E8M0",)}
SCALE = ".scale"
#: the fields of a RoPE's parameters (``rope_parameters['main']`` and ``['compress']``) that its
#: ``rope_type`` needs, and those that are numbers where given
ROPE_REQUIRED = {
    "default": ("rope_theta",),
    "yarn": ("rope_theta", "factor", "original_max_position_embeddings"),
}
ROPE_NUMBERS = (
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "partial_rotary_factor",
    "beta_fast",
    "beta_slow",
    "attention_factor",
)


@dataclasses.dataclass(frozen=True)
class Part:
    """Where a stored tensor goes: the parameter ``param`` (its transformers-style name) whole
    (``expert`` None) or one expert's slice of it (DeepSeek's per-expert tensors): rows
    ``[half * n, (half + 1) * n)`` of ``param[expert]``, ``n`` half its rows (``half`` None: all); ``scale``:
    the part's scale (a quantized checkpoint's ``.scale`` tensor), not its weight."""

    param: str
    expert: int | None = None
    half: int | None = None
    scale: bool = False


def load_pretrained(
    path,
    *,
    dtype=None,
    backend: Backend = ONLINE,
    max_len: int | None = None,
    max_draft: int = 8,
    mesh: Mesh | None = None,
    kv_cache_dtype: str = "auto",
) -> SpeculativeModel:
    """The DeepSeek-V4 model of the Hugging Face-format checkpoint directory ``path``, with its MTP layer
    as the draft head when the checkpoint has one (else ``model.mtp`` is None: plain decoding only).

    Args:
      path: the directory (``config.json`` and ``model.safetensors`` or ``model.safetensors.index.json``
        with its shards).
      dtype: the weights' dtype, ``"float32"`` or ``"bfloat16"`` (or the numpy/jax dtype); None: bfloat16
        on a GPU, float32 elsewhere. Norms, hyper-connections, sinks and biases stay float32 and the
        matmuls accumulate in float32 (:mod:`jax_oc128.nn.functional`).
      backend: the C128 compressor state (:data:`~jax_oc128.ONLINE` or :data:`~jax_oc128.OFFLINE`).
      max_len: the longest sequence the caches hold (default: ``max_position_embeddings``, a million
        tokens for DeepSeek-V4: pass less).
      max_draft: the most tokens a verify may take (N of speculative decoding).
      mesh: None (one device), or a :class:`jax.sharding.Mesh` of the axes ``("data", "model")``: each
        parameter is placed in the layout an :class:`~jax_oc128.engine.Engine` on ``mesh`` gives it
        (:func:`jax_oc128.nn.sharding.param_specs`: split over ``"model"``, replicated over ``"data"``),
        each device given only its shard, read from the memory-mapped tensor (:class:`_Shards`).
      kv_cache_dtype: how the caches are stored (``ModelConfig.kv_cache_dtype``,
        :mod:`jax_oc128.nn.kv_cache`): ``"auto"`` (the model's dtype), ``"float32"``, ``"bfloat16"``,
        ``"fp8"`` (DeepSeek's FP8 entries and indexer keys) or ``"fp8_fp4"`` (FP8 entries, FP4 indexer keys:
        DeepSeek's inference format).

    Raises ValueError (naming the file, and the field or every tensor at fault) for a directory that is
    not such a checkpoint or that does not fit its config, NotImplementedError for what the config asks
    and this model does not have; both before anything of the model's size is allocated.
    """
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"path: must be a str or os.PathLike (a directory), got {type(path).__name__}")
    directory = pathlib.Path(path)
    dtype = _check_dtype(dtype)
    if not isinstance(backend, Backend):
        raise TypeError(f"backend: must be a jax_oc128.Backend (ONLINE or OFFLINE), got {backend!r}")
    if max_len is not None:
        check_int("max_len", max_len, 1)  # (the config bounds it by 2**31)
    check_int("max_draft", max_draft, 1, MAX_DRAFT)
    check_kv_cache_dtype(kv_cache_dtype)
    mesh = None if mesh is None else sharding.check_mesh(mesh)
    config, mtp_layers, quantization = _read_config(directory / CONFIG)
    try:
        model_config = ModelConfig.from_hf(
            config, max_len=max_len, max_draft=max_draft, dtype=dtype, kv_cache_dtype=kv_cache_dtype
        )
    except (TypeError, ValueError) as error:  # what the file says (the arguments are checked above)
        raise ValueError(f"{directory / CONFIG}: {error}") from None
    except NotImplementedError as error:
        raise NotImplementedError(f"{directory / CONFIG}: {error}") from None
    headers = _read_headers(directory)
    layers = len(model_config.layer_types)
    if layers > len(headers):  # before the model is built (work linear in the layers)
        raise ValueError(
            f"{directory}: the config has {layers} layers, the checkpoint {len(headers)} tensors (each layer "
            "has tensors of its own)"
        )
    parts = {name: _part(name, layers) for name in headers}
    has_mtp = mtp_layers > 0 and any(
        part is not None and part.param.startswith(f"model.layers.{layers}.") for part in parts.values()
    )
    model_config = dataclasses.replace(model_config, mtp=has_mtp)
    model = build_abstract(lambda rngs: SpeculativeModel(model_config, backend=backend, rngs=rngs))
    params = parameter_paths(model)
    variables = {name: variable_at(model, path) for name, path in params.items()}
    abstract = {name: v.get_value() for name, v in variables.items()}
    formats = _formats(headers, parts, abstract, quantization)
    _check_tensors(directory, headers, parts, abstract, layers, formats)
    scale_dtypes = {parts[name].param: header[2] for name, header in headers.items() if parts[name].scale}
    for param, fmt in formats.items():  # the quantized parameters' leaves
        leaves = quantized_leaves(abstract[param], fmt, scale_dtypes[param], model_config.dtype)
        variables[param].set_value(leaves)
    placing = {name: _placing(params[name], variables[name].get_value(), mesh) for name in params}
    tables = {}  # the hash layers' (small): read once, checked, and placed as checked
    hashes = {n: h for n, h in headers.items() if jnp.issubdtype(abstract[parts[n].param].dtype, jnp.integer)}
    for file, names in _by_file(hashes).items():
        with _open_shard(file) as stored:
            for name in names:
                tables[name] = _read_tensor(stored, name, headers[name])
                check_expert_ids(tables[name], model_config.num_experts, f"{file}: tensor {name}")
    for file, names in _by_file(headers).items():
        with _open_shard(file) as stored:
            for name in names:
                value = tables[name] if name in tables else _read_tensor(stored, name, headers[name])
                part, fmt = parts[name], formats.get(parts[name].param)
                if part.scale:
                    rows = _part_shape(part, abstract[part.param].shape)[-2]
                    value = _scale_rows(value, fmt, rows, f"{file}: tensor {name}")
                elif fmt == FP4:
                    value = value.view(np.uint8)  # the packed codes' bytes
                _place(placing[part.param], part, value)
    for name, placed in placing.items():
        variables[name].set_value(jax.tree.map(_Shards.array, placed))
    return model


def _check_dtype(dtype) -> str:
    """``dtype`` as a name in :data:`~jax_oc128.nn.functional.DTYPES` (None: bfloat16 on a GPU)."""
    if dtype is None:
        return "bfloat16" if jax.default_backend() == "gpu" else "float32"
    try:
        name = np.dtype(dtype).name
    except TypeError:
        raise TypeError(f"dtype: must be None, 'float32' or 'bfloat16', got {dtype!r}") from None
    if name not in DTYPES:
        raise ValueError(f"dtype: must be None, 'float32' or 'bfloat16', got {dtype!r}")
    return name


def _read_config(file: pathlib.Path) -> tuple[dict, int, str | None]:
    """The transformers config of ``config.json`` (DeepSeek's fields converted), its MTP layers and its
    quantization (:func:`read_quantization`); each field :func:`ModelConfig.from_hf
    <jax_oc128.nn.ModelConfig.from_hf>` does not check itself is checked here (a ValueError naming the file
    and the field)."""
    try:
        config = files.read_json(file, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        raise ValueError(f"path: {file.parent} has no {CONFIG} (not a Hugging Face checkpoint)") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: must be a JSON object")
    try:
        quantization = read_quantization(config)
    except ValueError as error:
        raise ValueError(f"{file}: {error}") from None
    mtp_layers = config.get("num_nextn_predict_layers", 1)
    if not isinstance(mtp_layers, int) or isinstance(mtp_layers, bool) or mtp_layers < 0:
        raise ValueError(f"{file}: num_nextn_predict_layers: must be an int >= 0, got {mtp_layers!r}")
    if mtp_layers > 1:
        raise NotImplementedError(f"{file}: num_nextn_predict_layers: at most 1 MTP layer, got {mtp_layers}")
    try:
        config = _from_deepseek(config, mtp_layers)
        if "rope_parameters" in config:
            _check_rope_parameters(config["rope_parameters"])
        return config, mtp_layers, quantization
    except KeyError as error:
        raise ValueError(f"{file}: config: missing fields [{error.args[0]!r}]") from None
    except (TypeError, ValueError) as error:
        raise ValueError(f"{file}: {error}") from None
    except NotImplementedError as error:
        raise NotImplementedError(f"{file}: {error}") from None


def read_quantization(config: dict) -> str | None:
    """The routed experts' format (:data:`~jax_oc128.nn.quant.FP4` or ``FP8``) of a quantized checkpoint's
    config, None for a float checkpoint (no ``quantization_config``). A quantized one must be DeepSeek's
    released format: ``quantization_config`` :data:`QUANTIZATION_CONFIG` (FP8 e4m3 weights with ue8m0 scales
    of 128 x 128 blocks) and ``expert_dtype`` ``"fp4"`` (the default) or ``"fp8"``; a ValueError naming the
    field otherwise."""
    quantization = config.get("quantization_config")
    if quantization is None:
        if config.get("expert_dtype") is not None:
            raise ValueError("expert_dtype: given without a quantization_config")
        return None
    if not isinstance(quantization, dict):
        raise ValueError(f"quantization_config: must be an object, got {quantization!r}")
    for field, value in QUANTIZATION_CONFIG.items():
        if quantization.get(field) != value:
            raise ValueError(
                f"quantization_config[{field!r}]: must be {value!r} (DeepSeek's released format), got "
                f"{quantization.get(field)!r}"
            )
    expert_dtype = config.get("expert_dtype", "fp4")
    if expert_dtype not in EXPERT_DTYPES:
        raise ValueError(f"expert_dtype: must be one of {sorted(EXPERT_DTYPES)}, got {expert_dtype!r}")
    return EXPERT_DTYPES[expert_dtype]


def _list_field(config: dict, name: str) -> list:
    """``config[name]``, which must be a JSON array (a KeyError where it is absent)."""
    value = config[name]
    if not isinstance(value, list):
        raise ValueError(f"{name}: must be a list, got {value!r}")
    return value


def _from_deepseek(config: dict, mtp_layers: int) -> dict:
    """``config`` with transformers' ``layer_types``, ``mlp_layer_types`` and ``rope_parameters`` made from
    DeepSeek's fields where only those are given (as ``DeepseekV4Config`` converts them): the layer types
    of ``compress_ratios`` (0 sliding, 4 CSA, 128 HCA; the entries past the decoder layers are the MTP
    layers', which must be sliding here), ``num_hash_layers`` hash-routed layers first, and the RoPE of
    ``rope_theta``, ``compress_rope_theta``, ``qk_rope_head_dim`` and ``rope_scaling`` (YaRN on the
    compress RoPE, attention factor 1). ``num_hidden_layers`` must be the number of layer types (as
    transformers requires), checked before anything is made per layer."""
    config = dict(config)
    layers = check_int("num_hidden_layers", config["num_hidden_layers"], 1)
    source = (
        "layer_types" if "layer_types" in config or "compress_ratios" not in config else "compress_ratios"
    )
    if source == "compress_ratios":
        ratios = _list_field(config, "compress_ratios")
        for i, ratio in enumerate(ratios[: layers + mtp_layers]):
            if ratio not in RATIO_LAYER_TYPES:
                raise ValueError(f"compress_ratios[{i}]: must be 0, 4 or 128, got {ratio!r}")
            if i >= layers and ratio != 0:
                raise NotImplementedError(
                    f"compress_ratios[{i}]: the MTP layer must be sliding (0), got {ratio}"
                )
        config["layer_types"] = [RATIO_LAYER_TYPES[ratio] for ratio in ratios[:layers]]
    if len(_list_field(config, "layer_types")) != layers:
        raise ValueError(
            f"num_hidden_layers: must be the number of layers of {source} ({len(config['layer_types'])}), "
            f"got {layers}"
        )
    if "mlp_layer_types" not in config and "num_hash_layers" in config:
        hashed = check_int("num_hash_layers", config["num_hash_layers"], 0, layers, " = num_hidden_layers")
        config["mlp_layer_types"] = [HASH_MOE if i < hashed else MOE for i in range(layers)]
    _list_field(config, "mlp_layer_types")
    if "rope_parameters" not in config and "qk_rope_head_dim" in config:
        head_dim = check_int("head_dim", config["head_dim"], 1)
        factor = (
            check_int("qk_rope_head_dim", config["qk_rope_head_dim"], 0, head_dim, " = head_dim") / head_dim
        )
        main = {"rope_type": "default", "rope_theta": config["rope_theta"], "partial_rotary_factor": factor}
        compress = {"rope_type": "default"}
        scaling = config.get("rope_scaling") or {}
        if not isinstance(scaling, dict):
            raise ValueError(f"rope_scaling: must be an object or null, got {scaling!r}")
        if scaling:
            compress = {k: v for k, v in scaling.items() if k != "type"}
            compress |= {"rope_type": scaling.get("rope_type", scaling.get("type")), "attention_factor": 1.0}
        compress |= {"rope_theta": config["compress_rope_theta"], "partial_rotary_factor": factor}
        config["rope_parameters"] = {"main": main, "compress": compress}
    return config


def _check_rope_parameters(rope) -> None:
    """``rope_parameters``: an object with the ``main`` and ``compress`` RoPEs, each an object with the
    fields of :data:`ROPE_REQUIRED` its ``rope_type`` needs and numbers where :data:`ROPE_NUMBERS` has
    them (an unsupported ``rope_type`` is the config's NotImplementedError)."""
    if not isinstance(rope, dict):
        raise ValueError(f"rope_parameters: must be an object {{'main': ..., 'compress': ...}}, got {rope!r}")
    for kind in ("main", "compress"):
        params, where = rope.get(kind), f"rope_parameters[{kind!r}]"
        if not isinstance(params, dict):
            raise ValueError(f"{where}: must be an object, got {params!r}")
        for name in ROPE_REQUIRED.get(params.get("rope_type", "default"), ()):
            if params.get(name) is None:
                raise ValueError(f"{where}: missing field {name!r}")
        for name in ROPE_NUMBERS:
            value = params.get(name)
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if value is not None and not (number and math.isfinite(value)):
                raise ValueError(f"{where}[{name!r}]: must be a finite number, got {value!r}")


def _read_headers(directory: pathlib.Path) -> dict[str, tuple[pathlib.Path, tuple[int, ...], str]]:
    """Every tensor of the checkpoint: name -> (its file, shape, safetensors dtype), from the headers."""
    if (directory / SINGLE).exists():
        files = {directory / SINGLE: None}
    elif (directory / INDEX).exists():
        files = _read_index(directory)
    else:
        raise ValueError(f"path: {directory} has neither {SINGLE} nor {INDEX}")
    headers = {}
    for file, names in files.items():
        with _open_shard(file) as stored:
            held = set(stored.keys())
            for name in held if names is None else names:
                if name not in held:
                    raise ValueError(f"{directory / INDEX}: tensor {name}: not in {file.name}")
                view = stored.get_slice(name)
                headers[name] = file, tuple(view.get_shape()), view.get_dtype()
    return headers


@contextlib.contextmanager
def _open_shard(file: pathlib.Path):
    """``file`` opened by safetensors (memory mapped), a regular file; a ValueError naming it if it is not
    one or its header cannot be read."""
    try:
        files.regular_file(file)
        with safe_open(file, framework="numpy") as stored:
            yield stored
    except (OSError, SafetensorError) as error:
        raise ValueError(f"{file}: not a readable safetensors file ({error})") from None


def _read_tensor(stored, name: str, header: tuple) -> np.ndarray:
    """The tensor ``name`` of the open shard ``stored``, memory mapped (:data:`NUMPY_DTYPES`: nothing is read
    until it is indexed), whose header must still be ``header`` (file, shape, dtype) as it was when the
    headers were checked: a ValueError naming the tensor otherwise (the file replaced since)."""
    file, shape, dtype = header
    try:
        view = stored.get_slice(name)
        now = tuple(view.get_shape()), view.get_dtype()
    except SafetensorError as error:
        raise ValueError(f"{file}: tensor {name}: not readable ({error}; the file changed?)") from None
    if now != (shape, dtype):
        raise ValueError(
            f"{file}: tensor {name}: now shape {now[0]} and dtype {now[1]}, checked as {shape} and "
            f"{dtype} (the file changed while it was loaded)"
        )
    status = os.stat(file)
    start, offsets = _data_layout(file, status.st_mtime_ns, status.st_size)
    begin, end = offsets[name]
    numpy_dtype = np.dtype(NUMPY_DTYPES[dtype])
    if end - begin != math.prod(shape) * numpy_dtype.itemsize:
        raise ValueError(f"{file}: tensor {name}: {end - begin} bytes for shape {shape} of {dtype}")
    if begin == end:  # (np.memmap maps no empty range)
        return np.zeros(shape, numpy_dtype)
    data = np.memmap(file, dtype=np.uint8, mode="r", offset=start + begin, shape=(end - begin,))
    return data.view(numpy_dtype).reshape(shape)


@functools.lru_cache(maxsize=4)
def _data_layout(file: pathlib.Path, mtime_ns: int, size: int) -> tuple[int, dict[str, tuple[int, int]]]:
    """Where the tensors of the safetensors ``file`` lie (of this modification time and size): the data's
    first byte and each tensor's ``data_offsets`` from it (the header, which safetensors has read)."""
    with open(file, "rb") as stream:
        length = int.from_bytes(stream.read(8), "little")
        if not 0 < length <= size - 8:
            raise ValueError(f"{file}: not a readable safetensors file (header of {length} bytes)")
        header = json.loads(stream.read(length))
    offsets = {name: tuple(entry["data_offsets"]) for name, entry in header.items() if name != "__metadata__"}
    return 8 + length, offsets


def _read_index(directory: pathlib.Path) -> dict[pathlib.Path, list[str]]:
    """The shards of ``model.safetensors.index.json`` and the tensors each holds."""
    file = directory / INDEX
    index = files.read_json(file, MAX_INDEX_BYTES)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{file}: not an index (a JSON object with a weight_map object {{tensor: file}})")
    shards = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or pathlib.Path(shard).name != shard:
            raise ValueError(
                f"{file}: weight_map[{name!r}]: must be a file name in {directory}, got {shard!r}"
            )
        shards.setdefault(directory / shard, []).append(name)
    return shards


def _part(name: str, layers: int) -> Part | None:
    """Where the stored tensor ``name`` goes (see :class:`Part`), None for a name of neither naming. A
    quantized weight's scale is its name with ``.scale`` for ``.weight`` (DeepSeek's)."""
    if name.endswith(SCALE):
        weight = _part(name.removesuffix(SCALE) + ".weight", layers)
        if weight is not None and _layer_suffix(weight.param) in (*FP8_PARAMS, *OPTIONAL_FP8_PARAMS):
            return dataclasses.replace(weight, scale=True)
        if weight is not None and weight.expert is not None:  # an expert's (EXPERT_NAME)
            return dataclasses.replace(weight, scale=True)
    bare = name.removeprefix("model.")
    if bare in DEEPSEEK_TOP_NAMES:
        return Part(DEEPSEEK_TOP_NAMES[bare])
    if name in DEEPSEEK_TOP_NAMES.values():
        return Part(name)
    match = LAYER_NAME.fullmatch(name)
    if match is None:
        return None
    kind, index, suffix = match.groups()
    prefix = f"model.layers.{int(index) + (layers if kind == 'mtp' else 0)}."
    expert = EXPERT_NAME.fullmatch(suffix)
    if expert is not None:
        param, half = DEEPSEEK_EXPERT[expert.group(2)]
        return Part(prefix + param, int(expert.group(1)), half)
    return Part(prefix + DEEPSEEK_LAYER_NAMES.get(suffix, suffix))


def _layer_suffix(param: str) -> str | None:
    """The name of the parameter ``param`` within its layer (``model.layers.{i}.``), None for a top-level
    one."""
    match = LAYER_PARAM.fullmatch(param)
    return None if match is None else match.group(1)


def _formats(headers: dict, parts: dict, params: dict, experts: str | None) -> dict[str, str]:
    """The quantized parameters of a checkpoint and their formats (FP8 or FP4): none for a float checkpoint
    (``experts`` None), else :data:`FP8_PARAMS` in FP8, :data:`EXPERT_PARAMS` in ``experts``' format and
    :data:`OPTIONAL_FP8_PARAMS` in FP8 where stored as FP8 codes."""
    if experts is None:
        return {}
    formats = released_formats(params, experts)
    for name, part in parts.items():
        optional = part is not None and not part.scale and _layer_suffix(part.param) in OPTIONAL_FP8_PARAMS
        if optional and part.param in params and headers[name][2] == WEIGHT_DTYPE[FP8]:
            formats[part.param] = FP8
    return formats


def released_formats(params, experts: str, optional: bool = False) -> dict[str, str]:
    """The quantized parameters among ``params`` (transformers-style names, :func:`parameter_paths`) in
    DeepSeek's released format and their formats: :data:`FP8_PARAMS` FP8, :data:`EXPERT_PARAMS` ``experts``
    (FP4 or FP8), and with ``optional`` :data:`OPTIONAL_FP8_PARAMS` FP8 too (as the released checkpoints and
    :func:`jax_oc128.released.released_tensors` store them)."""
    formats = {}
    for param in params:
        suffix = _layer_suffix(param)
        if suffix in EXPERT_PARAMS:
            formats[param] = experts
        elif suffix in FP8_PARAMS or (optional and suffix in OPTIONAL_FP8_PARAMS):
            formats[param] = FP8
    return formats


def _stored_shape(fmt: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The stored shape of a quantized ``[..., out, in]`` weight: FP4 two codes a byte along ``in``."""
    return (*shape[:-1], shape[-1] // 2) if fmt == FP4 else shape


def _scale_shape(fmt: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The stored shape of the scale of a quantized ``[..., out, in]`` weight: FP8 one per 128 x 128 block,
    FP4 one per 1 x 32 group."""
    *lead, out, width = shape
    if fmt == FP8:
        return (*lead, -(-out // GROUP[FP8]), -(-width // GROUP[FP8]))
    return (*lead, out, width // GROUP[FP4])


def _scale_name(weight: str) -> str:
    """The name of the scale of the stored weight ``weight``."""
    return weight.removesuffix(".weight") + SCALE


def quantized_leaves(want, fmt: str, scale_dtype: str, dtype: str) -> QuantizedArray:
    """The abstract :class:`QuantizedArray` of a parameter of abstract value ``want`` ``[..., out, in]`` in
    ``fmt``, its scales stored as ``scale_dtype`` (F8_E8M0: uint8 exponents; F32: float32), dequantized to
    ``dtype``."""
    *lead, width = want.shape
    codes = (
        jax.ShapeDtypeStruct((*lead, width // 2), jnp.uint8)
        if fmt == FP4
        else jax.ShapeDtypeStruct(want.shape, jnp.float8_e4m3fn)
    )
    scales = jax.ShapeDtypeStruct(
        (*lead, -(-width // GROUP[fmt])), jnp.float32 if scale_dtype == "F32" else jnp.uint8
    )
    return QuantizedArray(codes, scales, fmt, dtype)


def _scale_rows(value: np.ndarray, fmt: str, rows: int, name: str) -> np.ndarray:
    """A read scale as the device keeps it: e8m0 exponents as uint8, their range checked
    (:func:`~jax_oc128.nn.quant.check_exponents`), float32 scales finite and > 0 (a ValueError naming the
    tensor, ``name``, otherwise); FP8 block scales repeated over their ``rows``."""
    if value.dtype == ml_dtypes.float8_e8m0fnu:
        value = value.view(np.uint8)
        check_exponents(value, fmt, name)
    elif not np.all(np.isfinite(value) & (value > 0)):
        raise ValueError(f"{name}: float32 scales must be finite and > 0")
    return row_scales(value, rows) if fmt == FP8 else value


def parameter_paths(model: SpeculativeModel) -> dict[str, tuple]:
    """Every parameter of ``model`` (what a checkpoint of its config holds) by its transformers-style name
    (the MTP layer's under ``model.layers.{num_hidden_layers}.``, its own tensors by DeepSeek's names) ->
    attribute path."""
    paths = {name: ("target", *path) for name, path in model.target.hf_weight_paths().items()}
    if model.mtp is not None:
        prefix = f"model.layers.{len(model.config.layer_types)}."
        paths |= {prefix + name: ("mtp", *path) for name, path in model.mtp.weight_paths().items()}
    return paths


def _part_shape(part: Part, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of ``part`` of a parameter of ``shape``."""
    if part.expert is None:
        return shape
    if part.half is None:
        return shape[1:]
    return (shape[1] // 2, *shape[2:])


def deepseek_name(part: Part, layers: int) -> str:
    """DeepSeek's name of ``part`` (for messages; ``{e}`` for every expert of a whole stacked parameter)."""
    top = {hf: theirs for theirs, hf in DEEPSEEK_TOP_NAMES.items()}
    if part.param in top:
        return top[part.param]
    layer, suffix = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", part.param).groups()
    prefix = f"mtp.{int(layer) - layers}." if int(layer) >= layers else f"layers.{layer}."
    projections = [w for w, (param, half) in DEEPSEEK_EXPERT.items() if suffix == param and half == part.half]
    if not projections:  # not an expert tensor (the first DeepSeek name of each, the checkpoints')
        theirs = {hf: name for name, hf in reversed(DEEPSEEK_LAYER_NAMES.items())}
        return prefix + theirs.get(suffix, suffix)
    expert = "{e}" if part.expert is None else part.expert
    return prefix + f"ffn.experts.{expert}.{projections[0]}.weight"


def _check_tensors(
    directory, headers: dict, parts: dict, params: dict, layers: int, formats: dict | None = None
) -> None:
    """Every parameter of ``params`` (name -> its abstract value) given exactly once (whole, or every
    expert's part), no other tensor, each of its shape and of a dtype of its kind; a quantized one's
    (``formats``: parameter -> FP8 or FP4, :func:`_formats`) each part in its format's dtype and stored
    shape, with its scale of the format's shape and dtype; raises one ValueError listing every problem
    (``layers``: the decoder layers, for DeepSeek's names of missing tensors)."""
    formats = formats or {}
    unexpected, problems, given, scales = [], [], {}, {}
    for name, part in parts.items():
        if part is None or part.param not in params or (part.scale and part.param not in formats):
            unexpected.append(name)  # (a scale of an unquantized weight too)
            continue
        want = params[part.param]
        if part.expert is not None and part.expert >= want.shape[0]:  # an expert the config has not
            unexpected.append(name)
            continue
        (scales if part.scale else given).setdefault(part.param, {}).setdefault(
            (part.expert, part.half), []
        ).append(name)
        _, shape, stored = headers[name]
        logical, fmt = _part_shape(part, want.shape), formats.get(part.param)
        if part.scale:
            _check_scale(
                problems, name, headers[name], fmt, logical, _layer_suffix(part.param) in EXPERT_PARAMS
            )
            continue
        if fmt is not None:
            _check_codes(problems, name, headers[name], fmt, logical)
            continue
        if shape != logical:
            problems.append(f"tensor {name}: shape {shape}, the config gives {logical}")
        kinds = INT_DTYPES if jnp.issubdtype(want.dtype, jnp.integer) else FLOAT_DTYPES
        if stored not in kinds:
            kind = "an integer" if kinds is INT_DTYPES else "a floating-point"
            note = ""
            if stored.startswith(("F8", "F6", "F4")) or (stored == "I8" and kinds is FLOAT_DTYPES):
                where = "the format stores this tensor unquantized" if formats else "no quantization_config"
                note = f" (quantized: {where})"
            problems.append(f"tensor {name}: dtype {stored}, expected {kind} dtype{note}")
    unscaled = []  # the quantized weights given without their scales
    for param, pieces in given.items():
        have = scales.get(param, {}) if param in formats else None
        if have is None:
            continue
        unscaled += [_scale_name(names[0]) for key, names in pieces.items() if key not in have]
        for key, names in have.items():
            if key not in pieces:
                problems.append(f"tensor {names[0]}: a scale without its weight")
            if len(names) > 1:
                problems.append(f"tensors {', '.join(sorted(names))}: the same scale twice")
        stored = {headers[name][2] for names in have.values() for name in names}
        if len(stored) > 1:
            problems.append(f"tensor {param}: scales of different dtypes ({', '.join(sorted(stored))})")
    if unscaled:
        problems.insert(0, f"missing scales ({len(unscaled)}): {_listed(sorted(unscaled), len(unscaled))}")
    missing, absent = [], 0  # the first MAX_LISTED names of the missing tensors, and how many are missing
    for param, want in params.items():
        pieces = given.get(param, {})
        for names in pieces.values():
            if len(names) > 1:
                problems.append(f"tensors {', '.join(sorted(names))}: the same parameter ({param}) twice")
        if (None, None) in pieces and len(pieces) > 1:
            problems.append(f"tensor {param}: given whole and per expert")
        halves = _halves(param)
        if not pieces:
            theirs = " and ".join(deepseek_name(Part(param, None, h), layers) for h in halves)
            missing += [f"{param} (DeepSeek: {theirs})"][: MAX_LISTED - len(missing)]
            absent += 1
        elif (
            None,
            None,
        ) not in pieces:  # counted, not listed: the config's experts are not bounded by the files
            absent += want.shape[0] * len(halves) - len(pieces)
            names = (
                deepseek_name(Part(param, expert, h), layers)
                for expert in range(want.shape[0])
                for h in halves
                if (expert, h) not in pieces
            )
            missing += itertools.islice(names, MAX_LISTED - len(missing))
    if absent:
        problems.insert(0, f"missing tensors ({absent}): {_listed(missing, absent)}")
    if unexpected:
        problems.insert(
            0, f"unexpected tensors ({len(unexpected)}): {_listed(sorted(unexpected), len(unexpected))}"
        )
    if problems:
        raise ValueError(f"{directory}: the checkpoint does not fit its config:\n  " + "\n  ".join(problems))


def _check_scale(problems: list, name: str, header: tuple, fmt: str, logical: tuple, expert: bool) -> None:
    """The scale ``name`` (``header``: file, shape, dtype) of a weight part of shape ``logical`` in
    ``fmt`` (``expert``: a routed expert's) has the format's shape and dtype; each problem appended."""
    _, shape, stored = header
    if shape != _scale_shape(fmt, logical):
        expected = _scale_shape(fmt, logical)
        problems.append(f"tensor {name}: shape {shape}, the config gives {expected} (the {fmt} scales)")
    allowed = (EXPERT_SCALE_DTYPES if expert else SCALE_DTYPES)[fmt]
    if stored not in allowed:
        problems.append(f"tensor {name}: dtype {stored}, expected {' or '.join(allowed)} ({fmt} scales)")


def _check_codes(problems: list, name: str, header: tuple, fmt: str, logical: tuple) -> None:
    """The quantized weight part ``name`` (``header``: file, shape, dtype) of shape ``logical`` in ``fmt``
    has the format's stored shape and dtype; each problem appended."""
    _, shape, stored = header
    if fmt == FP4 and logical[-1] % GROUP[FP4]:
        problems.append(f"tensor {name}: the config's {logical[-1]} columns are not FP4 groups of 32")
    elif shape != _stored_shape(fmt, logical):
        packed = ", two codes a byte" if fmt == FP4 else ""
        expected = _stored_shape(fmt, logical)
        problems.append(f"tensor {name}: shape {shape}, the config gives {expected} ({fmt}{packed})")
    if stored != WEIGHT_DTYPE[fmt]:
        problems.append(
            f"tensor {name}: dtype {stored}, expected {WEIGHT_DTYPE[fmt]} ({fmt}: quantization_config)"
        )


def _halves(param: str) -> tuple[int | None, ...]:
    """The halves of the stacked expert parameter ``param`` that DeepSeek stores as tensors of their own
    (gate_up_proj: w1 and w3), ``(None,)`` for one whole."""
    return (0, 1) if param.endswith(DEEPSEEK_EXPERT["w1"][0]) else (None,)


def _listed(names: list[str], count: int) -> str:
    """The first :data:`MAX_LISTED` of ``names``, ``count`` in all, for a message."""
    more = count - min(len(names), MAX_LISTED)
    return ", ".join(names[:MAX_LISTED]) + (f" and {more} more" if more else "")


def _by_file(headers: dict) -> dict[pathlib.Path, list[str]]:
    """The tensor names of each file, in file order."""
    files = {}
    for name, (file, _, _) in sorted(headers.items(), key=lambda item: str(item[1][0])):
        files.setdefault(file, []).append(name)
    return files


def _placing(path: tuple, value, mesh: Mesh | None):
    """The :class:`_Shards` of the parameter at ``path`` of abstract ``value`` (a :class:`QuantizedArray`:
    one of its codes' and of its scales'), split as the engine places it on ``mesh``
    (:func:`~jax_oc128.nn.sharding.param_spec`), or on the default device (``mesh`` None)."""
    if mesh is None:
        return jax.tree.map(lambda leaf: _Shards(leaf, None), value)
    specs = sharding.param_spec(tuple(str(step) for step in path), value, mesh)
    return jax.tree.map(_Shards, value, sharding.named(specs, mesh))


class _Shards:
    """An array of the abstract value ``abstract`` (shape and dtype) written part by part straight into its
    shards of ``placement`` (a sharding; None: the default device, uncommitted): each distinct shard's piece
    of a part is cut from the part once (from a memory-mapped tensor only that piece is read), cast to the
    dtype and put on each device holding that shard; a shard made of several parts (DeepSeek's per-expert
    tensors) is a zero buffer of the shard's shape on its device, the parts written into it in place. No
    device holds more than its shard, the host no more than one piece beyond what it has placed.
    """

    def __init__(self, abstract, placement: jax.sharding.Sharding | None):
        self.shape, self.dtype, self.placement = abstract.shape, abstract.dtype, placement
        whole = (slice(None),) * len(self.shape)
        indices = (
            {None: whole} if placement is None else placement.addressable_devices_indices_map(self.shape)
        )
        self.devices = {}  # each shard's bounds, per axis (start, stop) -> the devices holding it
        for device, index in indices.items():
            bounds = tuple(axis.indices(size)[:2] for axis, size in zip(index, self.shape, strict=True))
            self.devices.setdefault(bounds, []).append(device)
        self.buffers = {}  # device -> its shard as written so far

    def write(self, region: tuple[tuple[int, int], ...], value: np.ndarray) -> None:
        """Write ``value`` (a host array: a memory-mapped tensor, or one made from it) as ``region`` (per
        axis (start, stop)) of the array."""
        for bounds, devices in self.devices.items():
            overlap = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(region, bounds, strict=True))
            if any(start >= stop for start, stop in overlap):
                continue
            cut = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(overlap, region, strict=True))
            piece = np.array(value[cut], dtype=self.dtype)  # read, cast, owned
            starts = tuple(np.int32(lo - c) for (lo, _), (c, _) in zip(overlap, bounds, strict=True))
            for device in devices:
                if overlap == bounds:
                    self.buffers[device] = jax.device_put(piece, device)
                    continue
                if device not in self.buffers:
                    shape = tuple(stop - start for start, stop in bounds)
                    self.buffers[device] = jnp.zeros(shape, self.dtype, device=device)
                self.buffers[device] = _set_slice(self.buffers[device], piece, starts)

    def array(self) -> jax.Array:
        """The array of the parts written (every shard must be whole)."""
        if self.placement is None:
            return self.buffers[None]
        devices = self.placement.addressable_devices_indices_map(self.shape)
        return jax.make_array_from_single_device_arrays(
            self.shape, self.placement, [self.buffers[device] for device in devices]
        )


@functools.partial(jax.jit, donate_argnums=0)
def _set_slice(buffer, value, starts):
    """``buffer`` with ``value`` written at ``starts`` (one index per axis)."""
    return jax.lax.dynamic_update_slice(buffer, value, starts)


def _place(placing, part: Part, value: np.ndarray) -> None:
    """Write ``value`` into its ``part`` of the parameter being placed by ``placing`` (its :class:`_Shards`,
    or a :class:`QuantizedArray` of its codes' and its scales': ``part.scale`` picks)."""
    if isinstance(placing, QuantizedArray):
        placing = placing.scales if part.scale else placing.codes
    if part.expert is None:
        placing.write(tuple((0, size) for size in placing.shape), value)
        return
    rows = placing.shape[1] if part.half is None else placing.shape[1] // 2
    row = 0 if part.half is None else part.half * rows
    rest = tuple((0, size) for size in placing.shape[2:])
    placing.write(((part.expert, part.expert + 1), (row, row + rows), *rest), value[None])
