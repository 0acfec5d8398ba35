"""A Hugging Face-format checkpoint's ``config.json`` as the transformers config
:meth:`~jax_oc128.nn.ModelConfig.from_hf` reads: transformers' ``DeepseekV4Config`` fields, or DeepSeek's own
(``compress_ratios``, ``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling``) converted, with the
runtime of its model (:class:`~jax_oc128.nn.RuntimeConfig`) and its registered model class:
:func:`read_config`.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import NamedTuple

from jax_oc128 import files
from jax_oc128.checks import check_int
from jax_oc128.loading.formats import read_quantization
from jax_oc128.nn import CSA, HCA, SLIDING, ModelConfig, RuntimeConfig
from jax_oc128.nn.moe import HASH_MOE, MOE
from jax_oc128.registry import model_class

CONFIG = "config.json"
#: the architecture of a config without ``architectures`` (DeepSeek's own ``config.json`` names none,
#: transformers' ``to_dict()`` of a config made in memory has None)
DEFAULT_ARCHITECTURE = "DeepseekV4ForCausalLM"
#: the largest config.json read, in bytes (DeepSeek-V4's is a few KiB)
MAX_CONFIG_BYTES = 1 << 20
#: DeepSeek's ``compress_ratios`` entries -> transformers' layer types
RATIO_LAYER_TYPES = {0: SLIDING, 4: CSA, 128: HCA}
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


class HFConfig(NamedTuple):
    """What a Hugging Face config says (:func:`model_config`)."""

    config: ModelConfig  # the architecture
    runtime: RuntimeConfig  # how the model runs (the caller's, max_len by default the config's)
    model_class: type  # the class registered as its ``architectures`` (registry.model_class)
    mtp_layers: int  # num_nextn_predict_layers (0 or 1)
    quantization: str | None  # read_quantization's


def read_config(file: pathlib.Path, **kwargs) -> HFConfig:
    """:func:`model_config` of ``config.json`` (``file``, read bounded: :data:`MAX_CONFIG_BYTES`)."""
    try:
        config = files.read_json(file, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        raise ValueError(f"path: {file.parent} has no {CONFIG} (not a Hugging Face checkpoint)") from None
    return model_config(config, file, **kwargs)


def model_config(config, where, *, dtype: str = "float32", max_len: int | None = None, **runtime) -> HFConfig:
    """The :class:`~jax_oc128.nn.ModelConfig` of a Hugging Face config (a dict: transformers' fields, or
    DeepSeek's converted, :func:`from_deepseek`) in ``dtype``, the :class:`~jax_oc128.nn.RuntimeConfig` of
    ``max_len`` (None: the config's ``max_position_embeddings``) and ``runtime`` (its other fields; each
    checked first, the error naming it), the model class of its ``architectures`` (absent, null or empty:
    :data:`DEFAULT_ARCHITECTURE`), its MTP layers and its quantization
    (:func:`~jax_oc128.loading.formats.read_quantization`). Each field it does not check itself is checked
    here: a ValueError (NotImplementedError for what the model has not) naming ``where`` (the file) and the
    field."""
    if not isinstance(config, dict):
        raise ValueError(f"{where}: must be a JSON object")
    given = RuntimeConfig(**runtime) if max_len is None else RuntimeConfig(max_len=max_len, **runtime)
    architectures = config.get("architectures") or [DEFAULT_ARCHITECTURE]
    if (
        not isinstance(architectures, list)
        or len(architectures) != 1
        or not isinstance(architectures[0], str)
    ):
        raise ValueError(f"{where}: architectures: must be a list of one name, got {architectures!r}")
    try:
        cls = model_class(architectures[0])
    except ValueError as error:
        raise ValueError(f"{where}: architectures: {error}") from None
    try:
        quantization = read_quantization(config)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    mtp_layers = config.get("num_nextn_predict_layers", 1)
    if not isinstance(mtp_layers, int) or isinstance(mtp_layers, bool) or mtp_layers < 0:
        raise ValueError(f"{where}: num_nextn_predict_layers: must be an int >= 0, got {mtp_layers!r}")
    if mtp_layers > 1:
        raise NotImplementedError(f"{where}: num_nextn_predict_layers: at most 1 MTP layer, got {mtp_layers}")
    try:
        config = from_deepseek(config, mtp_layers)
        if "rope_parameters" in config:
            check_rope_parameters(config["rope_parameters"])
        model = cls.config_from_hf(config, dtype=dtype)
        if max_len is None:
            given = dataclasses.replace(given, max_len=config["max_position_embeddings"])
        return HFConfig(model, model.check_runtime(given), cls, mtp_layers, quantization)
    except KeyError as error:
        raise ValueError(f"{where}: config: missing fields [{error.args[0]!r}]") from None
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: {error}") from None
    except NotImplementedError as error:
        raise NotImplementedError(f"{where}: {error}") from None


def _list_field(config: dict, name: str) -> list:
    """``config[name]``, which must be a JSON array (a KeyError where it is absent)."""
    value = config[name]
    if not isinstance(value, list):
        raise ValueError(f"{name}: must be a list, got {value!r}")
    return value


def from_deepseek(config: dict, mtp_layers: int) -> dict:
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


def check_rope_parameters(rope) -> None:
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
