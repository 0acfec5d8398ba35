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
:data:`~jax_oc128.nn.weights.MTP`) and its decoder block's as a layer's. The embedding and LM
head are the target's. A checkpoint without MTP tensors loads for plain decoding
(``model.mtp`` None, ``config.mtp`` False).

Everything is checked before anything of the model's size is allocated or read, and the checks' work is
bounded by the files' sizes, not by numbers in the config: only regular files are opened (symlinks
followed; a FIFO, a device or a socket is refused, never waited on), ``config.json`` and the index are read
up to :data:`~jax_oc128.loading.hf_config.MAX_CONFIG_BYTES` and
:data:`~jax_oc128.loading.shards.MAX_INDEX_BYTES`; then every file's header (names, shapes, dtypes, byte
ranges: :class:`~jax_oc128.loading.shards.Shard`); then the config's layers and tensors are counted against
the headers' tensors (each layer has tensors of its own, each expert of a per-expert checkpoint its own),
then every tensor is checked against the model of the config (shapes only, not traced:
``functional.build_abstract``; :func:`~jax_oc128.loading.checker.check_tensors`): missing and unexpected
tensors, shapes and dtypes, all problems in one :class:`ValueError` that names each tensor; then the hash
layers' token -> expert tables (small, any integer dtype) are read and their ids checked. Then the tensors
are read one at a time, memory mapped from the descriptor each shard was opened and checked on, each header
checked again (a shard replaced since is refused, naming the tensor), and placed straight into the
parameter's final layout (:class:`~jax_oc128.loading.placement.Shards`): on one device, or split over a mesh
as an :class:`~jax_oc128.engine.Engine` on it places it, each device given only its shard (read from the
mapped tensor), DeepSeek's per-expert tensors written into their expert's slice of the stacked parameter in
place.

A quantized checkpoint (DeepSeek's released format: ``quantization_config`` and ``expert_dtype``,
:func:`read_quantization`) keeps its weights quantized on the device (:mod:`jax_oc128.nn.quant`): the FP8
linears (:data:`~jax_oc128.loading.names.FP8_PARAMS`) and the routed experts (FP4, or FP8 in the Base
checkpoints) become
:class:`~jax_oc128.nn.quant.QuantizedArray` parameters of their codes and per-row scales, each weight with its
``.scale`` tensor (checked with the others: present, of its shape and dtype, and each quantized weight of its
format's dtype and packed shape; a quantized tensor where the format has a float one is refused), each
scale's range checked when it is read (:func:`~jax_oc128.nn.quant.check_scales`). The other
parameters load as from a float checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jax_oc128 import files
from jax_oc128.checks import check_token_ids, shown
from jax_oc128.controller import ONLINE, Backend
from jax_oc128.loading.checker import check_tensors
from jax_oc128.loading.formats import (
    EXPERT_DTYPES,
    QUANTIZATION_CONFIG,
    checkpoint_formats,
    quantized_leaves,
    read_quantization,
    released_formats,
    scale_rows,
)
from jax_oc128.loading.hf_config import CONFIG, MAX_CONFIG_BYTES, RATIO_LAYER_TYPES, HFConfig, read_config
from jax_oc128.loading.hf_config import model_config as model_config_of
from jax_oc128.loading.names import (
    FP8_PARAMS,
    LAYER_NAME,
    SCALE,
    Part,
    deepseek_name,
    parameter_paths,
    part,
    part_shape,
)
from jax_oc128.loading.placement import Shards, place, placing
from jax_oc128.loading.shards import INDEX, NUMPY_DTYPES, SINGLE, Shard, by_file, read_headers
from jax_oc128.nn import SpeculativeModel, sharding
from jax_oc128.nn.functional import DTYPES, build_abstract, variable_at
from jax_oc128.nn.moe import check_expert_ids
from jax_oc128.nn.quant import FP4
from jax_oc128.text import GENERATION_CONFIG, MAX_TEXT_BYTES

__all__ = [
    "CONFIG",
    "EXPERT_DTYPES",
    "FP8_PARAMS",
    "INDEX",
    "QUANTIZATION_CONFIG",
    "RATIO_LAYER_TYPES",
    "SCALE",
    "SINGLE",
    "Part",
    "deepseek_name",
    "load_pretrained",
    "parameter_paths",
    "read_quantization",
    "released_formats",
]


def load_pretrained(
    path,
    *,
    dtype=None,
    backend: Backend = ONLINE,
    max_len: int | None = None,
    max_draft: int = 8,
    mesh: Mesh | None = None,
    kv_cache_dtype: str = "auto",
    attention_impl: str = "jnp",
) -> SpeculativeModel:
    """The model of the Hugging Face-format checkpoint directory ``path``, of the class registered as its
    ``config.json``'s ``architectures`` (:func:`~jax_oc128.registry.model_class`; DeepSeek-V4's:
    :class:`~jax_oc128.nn.SpeculativeModel`), with its MTP layer as the draft head when the checkpoint has
    one (else ``model.mtp`` is None: plain decoding only), and
    its EOS token ids as ``model.eos_token_ids`` (:func:`eos_token_ids`: where ``Engine.generate`` stops by
    default).

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
        each device given only its shard, read from the memory-mapped tensor.
      kv_cache_dtype: how the caches are stored (``RuntimeConfig.kv_cache_dtype``,
        :mod:`jax_oc128.nn.kv_cache`): ``"auto"`` (the model's dtype), ``"float32"``, ``"bfloat16"``,
        ``"fp8"`` (DeepSeek's FP8 entries and indexer keys) or ``"fp8_fp4"`` (FP8 entries, FP4 indexer keys:
        DeepSeek's inference format).
      attention_impl: the attention math (``RuntimeConfig.attention_impl``, :mod:`jax_oc128.nn.attend`):
        ``"jnp"`` (the oracle), ``"kernel"`` (the attention op: the CUDA kernel on a GPU) or ``"auto"`` (the
        kernel where the default backend is a GPU with the CUDA module built).

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
    mesh = None if mesh is None else sharding.check_mesh(mesh)
    hf = read_config(
        directory / CONFIG,
        dtype=dtype,
        max_len=max_len,
        max_draft=max_draft,
        kv_cache_dtype=kv_cache_dtype,
        attention_impl=attention_impl,
    )
    model = _load(hf, backend, directory, read_headers(directory), Shard, mesh)
    model.eos_token_ids = eos_token_ids(directory, hf.config.vocab_size)
    return model


def eos_token_ids(directory: pathlib.Path, vocab_size: int) -> tuple[int, ...]:
    """A checkpoint's EOS token ids: ``eos_token_id`` (an int or a list of ints in [0, ``vocab_size``)) of
    its ``generation_config.json`` if that file sets it, else of its ``config.json``; () if neither does.
    ValueError naming the file and the field for another value."""
    for name, limit in ((GENERATION_CONFIG, MAX_TEXT_BYTES), (CONFIG, MAX_CONFIG_BYTES)):
        try:
            config = files.read_json(directory / name, limit)
        except FileNotFoundError:
            continue
        if isinstance(config, dict) and config.get("eos_token_id") is not None:
            return check_token_ids(config["eos_token_id"], vocab_size, f"{directory / name}: eos_token_id")
    return ()


def load_weights(config: dict, weights: dict, *, backend: Backend = ONLINE, **kwargs) -> SpeculativeModel:
    """The model of a Hugging Face ``config`` (a dict: ``DeepseekV4Config.to_dict()``, or DeepSeek's fields)
    and its ``weights`` in memory (name -> array; transformers' or DeepSeek's names, as a checkpoint's), by
    the pipeline of :func:`load_pretrained`: the config converted, every tensor checked against the config's
    model (one ValueError naming each missing, unexpected, misshaped or mistyped tensor, each error naming
    ``weights``), then placed. The MTP layer is loaded where its tensors are given (``model.mtp`` None
    otherwise), the config's ``eos_token_id`` as ``model.eos_token_ids``; ``kwargs``: ``dtype`` and the
    :class:`~jax_oc128.nn.RuntimeConfig` fields (``max_len``, default the config's
    ``max_position_embeddings``, ``max_draft``, ...) of :func:`~jax_oc128.loading.hf_config.model_config`."""
    headers, opener = _in_memory(weights)
    hf = model_config_of(config, "config", **kwargs)
    model = _load(hf, backend, WEIGHTS, headers, opener)
    if config.get("eos_token_id") is not None:
        where = "config: eos_token_id"
        model.eos_token_ids = check_token_ids(config["eos_token_id"], hf.config.vocab_size, where)
    return model


def load_part(module, paths: dict[str, tuple], weights: dict, prefix: str, layers: int) -> None:
    """Set the parameters of ``module``, a part of a model (``paths``: each of its parameters' full
    transformers-style name, ``model.layers.{i}.self_attn.sinks``, -> its attribute path in ``module``), from
    ``weights`` (name -> array: a full name of either naming as it is, any other within ``prefix``), by the
    pipeline of :func:`load_weights`: every tensor checked first (one ValueError naming ``weights`` and each
    missing, unexpected, misshaped or mistyped tensor; ``layers``: the model's decoder layers, for
    DeepSeek's names), then placed."""
    headers, opener = _in_memory(weights)
    full = {name: name if LAYER_NAME.fullmatch(name) else prefix + name for name in headers}
    parts = {name: part(full[name], layers) for name in headers}
    _place(module, paths, WEIGHTS, headers, parts, opener, layers)


#: the "file" of tensors given in memory (:func:`load_weights`), for messages
WEIGHTS = "weights"


#: numpy dtype -> its safetensors name
SAFETENSORS_DTYPES = {np.dtype(dtype): name for name, dtype in NUMPY_DTYPES.items()} | {
    np.dtype(bool): "BOOL"
}


class _InMemory:
    """Tensors given in memory, read as a shard's (:class:`~jax_oc128.loading.shards.Shard`)."""

    def __init__(self, arrays: dict):
        self.arrays = arrays

    def __enter__(self):
        return self

    def __exit__(self, *_):
        pass

    def read(self, name: str, shape, dtype) -> np.ndarray:
        return self.arrays[name]


def _in_memory(weights: dict):
    """The headers (name -> (file, shape, safetensors dtype)) and the opener of tensors given in memory
    (``weights``: name -> array)."""
    if not isinstance(weights, dict):
        raise TypeError(f"weights: must be a dict of name -> array, got {type(weights).__name__}")
    arrays = {name: np.asarray(value) for name, value in weights.items()}
    headers = {name: (WEIGHTS, value.shape, _dtype_name(value.dtype)) for name, value in arrays.items()}
    return headers, lambda _: _InMemory(arrays)


def _dtype_name(dtype: np.dtype) -> str:
    """The safetensors name of a numpy dtype (else its own name, which the checker refuses)."""
    return SAFETENSORS_DTYPES.get(np.dtype(dtype), np.dtype(dtype).name)


def _load(hf: HFConfig, backend, where, headers, opener, mesh=None) -> SpeculativeModel:
    """The model of ``hf`` (:func:`read_config`) with the tensors of ``headers`` (name -> (file, shape,
    safetensors dtype)) read by ``opener(file)`` (a context manager with ``read(name, shape, dtype)``),
    ``where`` naming them in messages: built with shapes only, then :func:`_place`."""
    model_config = hf.config
    layers = len(model_config.layer_types)
    if layers > len(headers):  # before the model is built (work linear in the layers)
        raise ValueError(
            f"{where}: the config has {layers} layers, the checkpoint {len(headers)} tensors (each layer "
            "has tensors of its own)"
        )
    parts = {name: part(name, layers) for name in headers}
    has_mtp = hf.mtp_layers > 0 and any(
        piece is not None and piece.param.startswith(f"model.layers.{layers}.") for piece in parts.values()
    )
    model_config = dataclasses.replace(model_config, mtp=has_mtp)
    model = build_abstract(lambda rngs: hf.model_class(model_config, hf.runtime, backend=backend, rngs=rngs))
    _place(model, parameter_paths(model), where, headers, parts, opener, layers, hf.quantization, mesh)
    return model


def _place(module, params, where, headers, parts, opener, layers, quantization=None, mesh=None) -> None:
    """The pipeline's checks and placement: every parameter of ``module`` (``params``: its
    transformers-style name -> attribute path) set from the tensors of ``headers`` (each going where
    ``parts`` says, :func:`~jax_oc128.loading.names.part`), after all of them are checked
    (:func:`~jax_oc128.loading.checker.check_tensors`, and the hash layers' tables), kept quantized in
    ``quantization``'s format (:func:`read_quantization`; None: a float checkpoint), placed on ``mesh``."""
    variables = {name: variable_at(module, path) for name, path in params.items()}
    abstract = {name: v.get_value() for name, v in variables.items()}
    formats = checkpoint_formats(headers, parts, abstract, quantization)
    check_tensors(where, headers, parts, abstract, layers, formats)
    scale_dtypes = {parts[name].param: header[2] for name, header in headers.items() if parts[name].scale}
    for param, fmt in formats.items():  # the quantized parameters' leaves
        want = abstract[param]
        variables[param].set_value(quantized_leaves(want, fmt, scale_dtypes[param], want.dtype.name))
    placed = {name: placing(params[name], variables[name].get_value(), mesh) for name in params}
    tables = {}  # the hash layers' (small): read once, checked, and placed as checked
    hashes = {n: h for n, h in headers.items() if jnp.issubdtype(abstract[parts[n].param].dtype, jnp.integer)}
    for file, names in by_file(hashes).items():
        with opener(file) as shard:
            for name in names:
                tables[name] = shard.read(name, *headers[name][1:])
                moe = variable_at(module, params[parts[name].param][:-1])  # the table's layer
                check_expert_ids(tables[name], moe.config.num_experts, f"{file}: tensor {shown(name)}")
    for file, names in by_file(headers).items():
        with opener(file) as shard:
            for name in names:
                value = tables[name] if name in tables else shard.read(name, *headers[name][1:])
                piece, fmt = parts[name], formats.get(parts[name].param)
                if piece.scale:
                    rows = part_shape(piece, abstract[piece.param].shape)[-2]
                    value = scale_rows(value, fmt, rows, f"{file}: tensor {shown(name)}")
                elif fmt == FP4:
                    value = value.view(np.uint8)  # the packed codes' bytes
                place(placed[piece.param], piece, value)
    for name, shards in placed.items():
        variables[name].set_value(jax.tree.map(Shards.array, shards))


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
