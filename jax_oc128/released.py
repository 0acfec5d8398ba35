"""Writing a checkpoint in DeepSeek's released DeepSeek-V4 format from a float model (the tests' and
``scripts/make_released_checkpoint.py``'s tiny checkpoints): :func:`released_tensors` and
:func:`write_released`.

The format is what :func:`~jax_oc128.load_pretrained` reads (:mod:`jax_oc128.pretrained`): DeepSeek's tensor
names (``layers.{i}.attn.wq_a.weight``, one tensor per expert and projection, the MTP layer under ``mtp.0.``),
the FP8 linears (:data:`~jax_oc128.loading.names.FP8_PARAMS` and the MTP layer's projections) as F8_E4M3 codes
with F8_E8M0 128 x 128 block scales, the routed experts as FP4 (I8, two codes a byte, F8_E8M0 1 x 32 scales)
or FP8, quantized by DeepSeek's rules (:func:`~jax_oc128.nn.quant.quantize_fp8`,
:func:`~jax_oc128.nn.quant.quantize_fp4`); the other matrices in BF16, the norms, hyper-connections, sinks,
position biases and router biases in F32, the hash tables in I64; ``config.json`` with DeepSeek's own
fields and the ``quantization_config`` and ``expert_dtype`` as released; shards and their index.
"""

from __future__ import annotations

import json
import pathlib

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from jax_oc128.loading import names
from jax_oc128.loading.formats import EXPERT_DTYPES, QUANTIZATION_CONFIG, released_formats
from jax_oc128.loading.hf_config import CONFIG, RATIO_LAYER_TYPES
from jax_oc128.loading.names import EXPERT_PARAMS, SCALE, Part, deepseek_name
from jax_oc128.loading.shards import INDEX
from jax_oc128.nn import SpeculativeModel
from jax_oc128.nn.functional import variable_at
from jax_oc128.nn.moe import HASH_MOE, MOE
from jax_oc128.nn.quant import FP8, quantize_fp4, quantize_fp8

#: the matrices stored in BF16 (within a layer, or top-level); every other float tensor is F32
BF16_SUFFIXES = (
    "embed_tokens.weight",
    "lm_head.weight",
    "proj.weight",  # compressors' kv_proj and gate_proj, the indexer's weights_proj (not its q_b_proj: FP8)
    "mlp.gate.weight",
)


def _stored_float(param: str, value: np.ndarray) -> np.ndarray:
    """A float tensor as DeepSeek stores it: the matrices of :data:`BF16_SUFFIXES` in bfloat16, the hash
    tables in int64, the rest in float32."""
    if np.issubdtype(value.dtype, np.integer):
        return value.astype(np.int64)
    if param.endswith(BF16_SUFFIXES):
        return value.astype(ml_dtypes.bfloat16)
    return value.astype(np.float32)


def _quantized(fmt: str, name: str, value: np.ndarray) -> dict[str, np.ndarray]:
    """The weight ``name`` (float ``[out, in]``) in ``fmt``: its codes and its scale."""
    codes, scales = (quantize_fp8 if fmt == FP8 else quantize_fp4)(np.asarray(value, np.float32))
    return {name: codes, names.scale_name(name): scales}


def released_tensors(model: SpeculativeModel, expert_dtype: str = "fp4") -> dict[str, np.ndarray]:
    """Every tensor of ``model`` (float32 or bfloat16 weights) in the released format, by DeepSeek's names
    (see the module; ``expert_dtype``: the routed experts' ``"fp4"`` or ``"fp8"``)."""
    paths = names.parameter_paths(model)
    formats = released_formats(paths, EXPERT_DTYPES[expert_dtype], optional=True)
    layers = len(model.config.layer_types)
    tensors = {}
    for param, path in paths.items():
        value = np.asarray(variable_at(model, path)[...])
        fmt = formats.get(param)
        if fmt is None:
            tensors[deepseek_name(Part(param), layers)] = _stored_float(param, value)
            continue
        if names.layer_suffix(param) in EXPERT_PARAMS:
            halves = names.halves(param)
            for expert in range(value.shape[0]):
                pieces = np.split(value[expert], len(halves))
                for half, piece in zip(halves, pieces, strict=True):
                    name = deepseek_name(Part(param, expert, half), layers)
                    tensors |= _quantized(fmt, name, piece)
        else:
            tensors |= _quantized(fmt, deepseek_name(Part(param), layers), value)
    return tensors


def released_config(config: dict, expert_dtype: str | None = "fp4") -> dict:
    """A transformers ``DeepseekV4Config`` dict (``layer_types``, ``mlp_layer_types``, ``rope_parameters``)
    as DeepSeek's released ``config.json`` has it: ``compress_ratios`` (the MTP layer's 0 last),
    ``num_hash_layers`` (the hash layers must come first), ``qk_rope_head_dim``, ``rope_scaling`` (the
    compress RoPE's YaRN), one MTP layer, ``quantization_config`` and ``expert_dtype`` (None: the field
    absent)."""
    ratios = {kind: ratio for ratio, kind in RATIO_LAYER_TYPES.items()}
    mlp = config["mlp_layer_types"]
    hashed = sum(kind == HASH_MOE for kind in mlp)
    if list(mlp) != [HASH_MOE] * hashed + [MOE] * (len(mlp) - hashed):
        raise ValueError(f"config: DeepSeek's num_hash_layers needs the hash layers first, got {mlp}")
    main, compress = config["rope_parameters"]["main"], config["rope_parameters"]["compress"]
    released = {
        k: v for k, v in config.items() if k not in ("layer_types", "mlp_layer_types", "rope_parameters")
    }
    released |= {
        "compress_ratios": [ratios[kind] for kind in config["layer_types"]] + [0],
        "num_hash_layers": hashed,
        "qk_rope_head_dim": round(config["head_dim"] * main["partial_rotary_factor"]),
        "rope_theta": main["rope_theta"],
        "compress_rope_theta": compress["rope_theta"],
        "num_nextn_predict_layers": 1,
        "quantization_config": dict(QUANTIZATION_CONFIG),
    }
    if compress.get("rope_type") == "yarn":
        scaling = {k: v for k, v in compress.items() if k not in ("rope_theta", "partial_rotary_factor")}
        released["rope_scaling"] = {k: v for k, v in scaling.items() if k != "attention_factor"} | {
            "type": "yarn"
        }
    if expert_dtype is not None:
        released["expert_dtype"] = expert_dtype
    return released


def write_released(directory, config: dict, tensors: dict[str, np.ndarray], shards: int = 2) -> pathlib.Path:
    """Write ``config`` (:func:`released_config`) as ``config.json`` and ``tensors``
    (:func:`released_tensors`) into ``shards`` safetensors files with ``model.safetensors.index.json`` (a
    weight and its scale in the same shard, as DeepSeek's are) under ``directory`` (made; must not exist)."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True)
    (directory / CONFIG).write_text(json.dumps(config, indent=2))
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weights = sorted(name for name in tensors if not name.endswith(SCALE) or _weight_of(name) not in tensors)
    weight_map = {}
    for i, name in enumerate(weights):
        weight_map[name] = files[i % shards]
        scale = names.scale_name(name)
        if scale in tensors:
            weight_map[scale] = files[i % shards]
    for file in files:
        save_file(
            {n: np.ascontiguousarray(v) for n, v in tensors.items() if weight_map[n] == file},
            directory / file,
        )
    index = {"metadata": {"total_size": sum(v.nbytes for v in tensors.values())}, "weight_map": weight_map}
    (directory / INDEX).write_text(json.dumps(index, indent=2))
    return directory


def _weight_of(scale: str) -> str:
    """The weight a ``.scale`` tensor's name belongs to."""
    return scale.removesuffix(SCALE) + ".weight"
