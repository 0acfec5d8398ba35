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
:data:`~jax_oc128.nn.model.MTP_WEIGHT_NAMES`) and its decoder block's as a layer's. The embedding and LM
head are the target's. A checkpoint without MTP tensors loads for plain decoding
(``model.mtp`` None, ``config.mtp`` False).

Everything is checked before anything of the model's size is allocated or read: the config, then every
file's header (names, shapes, dtypes), then every tensor against the model of the config
(:func:`flax.nnx.eval_shape`): missing and unexpected tensors, shapes and dtypes, all problems in one
:class:`ValueError` that names each tensor; then the hash layers' token -> expert tables (small) are read
and their ids checked. Then the tensors are read one at a time (a shard is memory mapped), each cast to its
parameter's dtype and placed on the device, DeepSeek's per-expert tensors written into their stacked
parameter in place. Quantized checkpoints (FP8/FP4
tensors with scales, ``quantization_config``) are not supported: dequantize them first.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open

from jax_oc128.checks import check_int
from jax_oc128.controller import ONLINE, Backend
from jax_oc128.nn import CSA, HCA, SLIDING, ModelConfig, SpeculativeModel
from jax_oc128.nn.functional import DTYPES, variable_at
from jax_oc128.nn.moe import HASH_MOE, MOE, check_expert_ids
from jax_oc128.rules import MAX_DRAFT

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

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
EXPERT_NAME = re.compile(r"ffn\.experts\.(\d+)\.(w[123])\.weight")
LAYER_NAME = re.compile(r"(?:model\.)?(layers|mtp)\.(\d+)\.(.+)")
#: DeepSeek's ``compress_ratios`` entries -> transformers' layer types
RATIO_LAYER_TYPES = {0: SLIDING, 4: CSA, 128: HCA}
#: safetensors dtypes a floating / an integer parameter may be stored in (cast on load)
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
INT_DTYPES = {"I64", "I32", "I16", "I8", "U32", "U16", "U8"}


@dataclasses.dataclass(frozen=True)
class Part:
    """Where a stored tensor goes: the parameter ``param`` (its transformers-style name) whole
    (``expert`` None) or one expert's slice of it (DeepSeek's per-expert tensors): rows
    ``[half * n, (half + 1) * n)`` of ``param[expert]``, ``n`` half its rows (``half`` None: all)."""

    param: str
    expert: int | None = None
    half: int | None = None


def load_pretrained(
    path, *, dtype=None, backend: Backend = ONLINE, max_len: int | None = None, max_draft: int = 8
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
    config, mtp_layers = _read_config(directory / CONFIG)
    try:
        model_config = ModelConfig.from_hf(config, max_len=max_len, max_draft=max_draft, dtype=dtype)
    except (TypeError, ValueError, NotImplementedError) as error:
        raise type(error)(f"{directory / CONFIG}: {error}") from None
    headers = _read_headers(directory)
    layers = len(model_config.layer_types)
    parts = {name: _part(name, layers) for name in headers}
    has_mtp = mtp_layers > 0 and any(
        part is not None and part.param.startswith(f"model.layers.{layers}.") for part in parts.values()
    )
    model_config = dataclasses.replace(model_config, mtp=has_mtp)
    model = nnx.eval_shape(lambda: SpeculativeModel(model_config, backend=backend, rngs=nnx.Rngs(0)))
    params = parameter_paths(model)
    variables = {name: variable_at(model, path) for name, path in params.items()}
    _check_tensors(directory, headers, parts, {name: v.get_value() for name, v in variables.items()}, layers)
    tables = [name for name in headers if headers[name][2] in INT_DTYPES]  # the hash layers' (small)
    for file, names in _by_file({name: headers[name] for name in tables}).items():
        with safe_open(file, framework="numpy") as stored:
            for name in names:
                check_expert_ids(stored.get_tensor(name), model_config.num_experts, f"{file}: tensor {name}")
    for file, names in _by_file(headers).items():
        with safe_open(file, framework="numpy") as stored:
            for name in names:
                _place(variables[parts[name].param], parts[name], stored.get_tensor(name))
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


def _read_config(file: pathlib.Path) -> tuple[dict, int]:
    """The transformers config of ``config.json`` (DeepSeek's fields converted) and its MTP layers."""
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise ValueError(f"path: {file.parent} has no {CONFIG} (not a Hugging Face checkpoint)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{file}: not a readable JSON file ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: must be a JSON object")
    if config.get("quantization_config") is not None:
        raise NotImplementedError(
            f"{file}: quantization_config: quantized checkpoints (FP8/FP4) are not supported; dequantize "
            "the weights (to bfloat16 or float32) first"
        )
    mtp_layers = config.get("num_nextn_predict_layers", 1)
    if not isinstance(mtp_layers, int) or isinstance(mtp_layers, bool) or mtp_layers < 0:
        raise ValueError(f"{file}: num_nextn_predict_layers: must be an int >= 0, got {mtp_layers!r}")
    if mtp_layers > 1:
        raise NotImplementedError(f"{file}: num_nextn_predict_layers: at most 1 MTP layer, got {mtp_layers}")
    try:
        return _from_deepseek(config, mtp_layers), mtp_layers
    except KeyError as error:
        raise ValueError(f"{file}: config: missing fields [{error.args[0]!r}]") from None
    except (TypeError, ValueError, NotImplementedError) as error:
        raise type(error)(f"{file}: {error}") from None


def _from_deepseek(config: dict, mtp_layers: int) -> dict:
    """``config`` with transformers' ``layer_types``, ``mlp_layer_types`` and ``rope_parameters`` made from
    DeepSeek's fields where only those are given (as ``DeepseekV4Config`` converts them): the layer types
    of ``compress_ratios`` (0 sliding, 4 CSA, 128 HCA; the entries past the decoder layers are the MTP
    layers', which must be sliding here), ``num_hash_layers`` hash-routed layers first, and the RoPE of
    ``rope_theta``, ``compress_rope_theta``, ``qk_rope_head_dim`` and ``rope_scaling`` (YaRN on the
    compress RoPE, attention factor 1)."""
    config = dict(config)
    if "layer_types" not in config and "compress_ratios" in config:
        layers, ratios = config["num_hidden_layers"], config["compress_ratios"]
        for i, ratio in enumerate(ratios[: layers + mtp_layers]):
            if ratio not in RATIO_LAYER_TYPES:
                raise ValueError(f"compress_ratios[{i}]: must be 0, 4 or 128, got {ratio!r}")
            if i >= layers and ratio != 0:
                raise NotImplementedError(
                    f"compress_ratios[{i}]: the MTP layer must be sliding (0), got {ratio}"
                )
        config["layer_types"] = [RATIO_LAYER_TYPES[ratio] for ratio in ratios[:layers]]
    if "mlp_layer_types" not in config and "num_hash_layers" in config:
        layers, hashed = config["num_hidden_layers"], config["num_hash_layers"]
        config["mlp_layer_types"] = [HASH_MOE if i < hashed else MOE for i in range(layers)]
    if "rope_parameters" not in config and "qk_rope_head_dim" in config:
        factor = config["qk_rope_head_dim"] / config["head_dim"]
        main = {"rope_type": "default", "rope_theta": config["rope_theta"], "partial_rotary_factor": factor}
        compress = {"rope_type": "default"}
        scaling = config.get("rope_scaling") or {}
        if scaling:
            compress = {k: v for k, v in scaling.items() if k != "type"}
            compress |= {"rope_type": scaling.get("rope_type", scaling.get("type")), "attention_factor": 1.0}
        compress |= {"rope_theta": config["compress_rope_theta"], "partial_rotary_factor": factor}
        config["rope_parameters"] = {"main": main, "compress": compress}
    return config


def _read_headers(directory: pathlib.Path) -> dict[str, tuple[pathlib.Path, tuple[int, ...], str]]:
    """Every tensor of the checkpoint: name -> (its file, shape, safetensors dtype), from the headers."""
    if (directory / SINGLE).is_file():
        files = {directory / SINGLE: None}
    elif (directory / INDEX).is_file():
        files = _read_index(directory)
    else:
        raise ValueError(f"path: {directory} has neither {SINGLE} nor {INDEX}")
    headers = {}
    for file, names in files.items():
        try:
            with safe_open(file, framework="numpy") as stored:
                held = set(stored.keys())
                for name in held if names is None else names:
                    if name not in held:
                        raise ValueError(f"{directory / INDEX}: tensor {name}: not in {file.name}")
                    view = stored.get_slice(name)
                    headers[name] = file, tuple(view.get_shape()), view.get_dtype()
        except (OSError, SafetensorError) as error:
            raise ValueError(f"{file}: not a readable safetensors file ({error})") from None
    return headers


def _read_index(directory: pathlib.Path) -> dict[pathlib.Path, list[str]]:
    """The shards of ``model.safetensors.index.json`` and the tensors each holds."""
    file = directory / INDEX
    try:
        weight_map = json.loads(file.read_text())["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{file}: not an index (a JSON object with a weight_map) ({error})") from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{file}: weight_map: must be an object {{tensor: file}}")
    shards = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or pathlib.Path(shard).name != shard:
            raise ValueError(
                f"{file}: weight_map[{name!r}]: must be a file name in {directory}, got {shard!r}"
            )
        shards.setdefault(directory / shard, []).append(name)
    return shards


def _part(name: str, layers: int) -> Part | None:
    """Where the stored tensor ``name`` goes (see :class:`Part`), None for a name of neither naming."""
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


def _check_tensors(directory, headers: dict, parts: dict, params: dict, layers: int) -> None:
    """Every parameter of ``params`` (name -> its abstract value) given exactly once (whole, or every
    expert's part), no other tensor, each of its shape and of a dtype of its kind; raises one ValueError
    listing every problem (``layers``: the decoder layers, for DeepSeek's names of missing tensors)."""
    unexpected, problems, given = [], [], {}
    for name, part in parts.items():
        if part is None or part.param not in params:
            unexpected.append(name)
            continue
        want = params[part.param]
        if part.expert is not None and part.expert >= want.shape[0]:  # an expert the config has not
            unexpected.append(name)
            continue
        given.setdefault(part.param, {}).setdefault((part.expert, part.half), []).append(name)
        _, shape, stored = headers[name]
        if shape != _part_shape(part, want.shape):
            problems.append(f"tensor {name}: shape {shape}, the config gives {_part_shape(part, want.shape)}")
        kinds = INT_DTYPES if jnp.issubdtype(want.dtype, jnp.integer) else FLOAT_DTYPES
        if stored not in kinds:
            kind = "an integer" if kinds is INT_DTYPES else "a floating-point"
            note = " (quantized tensors are not supported)" if stored.startswith(("F8", "F6", "F4")) else ""
            problems.append(f"tensor {name}: dtype {stored}, expected {kind} dtype{note}")
    missing = []
    for param, want in params.items():
        pieces = given.get(param, {})
        for names in pieces.values():
            if len(names) > 1:
                problems.append(f"tensors {', '.join(sorted(names))}: the same parameter ({param}) twice")
        if (None, None) in pieces and len(pieces) > 1:
            problems.append(f"tensor {param}: given whole and per expert")
        halves = (0, 1) if param.endswith(DEEPSEEK_EXPERT["w1"][0]) else (None,)  # DeepSeek's w1 and w3
        if not pieces:
            theirs = " and ".join(deepseek_name(Part(param, None, h), layers) for h in halves)
            missing.append(f"{param} (DeepSeek: {theirs})")
        elif (None, None) not in pieces:
            for expert in range(want.shape[0]):
                missing += [
                    deepseek_name(Part(param, expert, h), layers) for h in halves if (expert, h) not in pieces
                ]
    if missing:
        problems.insert(0, f"missing tensors ({len(missing)}): {', '.join(missing)}")
    if unexpected:
        problems.insert(0, f"unexpected tensors ({len(unexpected)}): {', '.join(sorted(unexpected))}")
    if problems:
        raise ValueError(f"{directory}: the checkpoint does not fit its config:\n  " + "\n  ".join(problems))


def _by_file(headers: dict) -> dict[pathlib.Path, list[str]]:
    """The tensor names of each file, in file order."""
    files = {}
    for name, (file, _, _) in sorted(headers.items(), key=lambda item: str(item[1][0])):
        files.setdefault(file, []).append(name)
    return files


@functools.partial(jax.jit, donate_argnums=0)
def _set_slice(param, value, expert, row):
    """``param`` with ``value`` written at ``param[expert, row:row + len(value)]``."""
    return jax.lax.dynamic_update_slice(param, value[None].astype(param.dtype), (expert, row, 0))


def _place(variable: nnx.Variable, part: Part, value: np.ndarray) -> None:
    """Write ``value`` into its ``part`` of ``variable``, cast to the variable's dtype."""
    current = variable.get_value()
    value = value.astype(current.dtype)
    if part.expert is None:
        variable.set_value(jax.device_put(value))
        return
    if isinstance(current, jax.ShapeDtypeStruct):
        current = jnp.zeros(current.shape, current.dtype)
    row = 0 if part.half is None else part.half * (current.shape[1] // 2)
    variable.set_value(_set_slice(current, value, part.expert, row))
