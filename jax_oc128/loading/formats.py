"""DeepSeek's released quantized format as a checkpoint stores it (``quantization_config`` and
``expert_dtype``): which parameters are quantized, in which format (:mod:`jax_oc128.nn.quant`), and the
stored shapes and dtypes of their codes and scales.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jax_oc128.loading.names import EXPERT_PARAMS, FP8_PARAMS, OPTIONAL_FP8_PARAMS, layer_suffix
from jax_oc128.nn.quant import FP4, FP8, GROUP, QuantizedArray, check_scales, row_scales

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
#: a quantized weight's safetensors dtype, and its scale's (the Base checkpoints' FP8 experts: float32)
WEIGHT_DTYPE = {FP8: "F8_E4M3", FP4: "I8"}
SCALE_DTYPES = {FP8: ("F8_E8M0",), FP4: ("F8_E8M0",)}
EXPERT_SCALE_DTYPES = {FP8: ("F8_E8M0", "F32"), FP4: ("F8_E8M0",)}


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


def checkpoint_formats(headers: dict, parts: dict, params: dict, experts: str | None) -> dict[str, str]:
    """The quantized parameters of a checkpoint and their formats (FP8 or FP4): none for a float checkpoint
    (``experts`` None), else :data:`FP8_PARAMS` in FP8, :data:`EXPERT_PARAMS` in ``experts``' format and
    :data:`OPTIONAL_FP8_PARAMS` in FP8 where stored as FP8 codes."""
    if experts is None:
        return {}
    formats = released_formats(params, experts)
    for name, part in parts.items():
        optional = part is not None and not part.scale and layer_suffix(part.param) in OPTIONAL_FP8_PARAMS
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
        suffix = layer_suffix(param)
        if suffix in EXPERT_PARAMS:
            formats[param] = experts
        elif suffix in FP8_PARAMS or (optional and suffix in OPTIONAL_FP8_PARAMS):
            formats[param] = FP8
    return formats


def stored_shape(fmt: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The stored shape of a quantized ``[..., out, in]`` weight: FP4 two codes a byte along ``in``."""
    return (*shape[:-1], shape[-1] // 2) if fmt == FP4 else shape


def scale_shape(fmt: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The stored shape of the scale of a quantized ``[..., out, in]`` weight: FP8 one per 128 x 128 block,
    FP4 one per 1 x 32 group."""
    *lead, out, width = shape
    if fmt == FP8:
        return (*lead, -(-out // GROUP[FP8]), -(-width // GROUP[FP8]))
    return (*lead, out, width // GROUP[FP4])


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


def scale_rows(value: np.ndarray, fmt: str, rows: int, name: str) -> np.ndarray:
    """A read scale as the device keeps it: e8m0 exponents as uint8, or float32, in the range of
    :func:`~jax_oc128.nn.quant.check_scales` (a ValueError naming the tensor, ``name``, otherwise); FP8
    block scales repeated over their ``rows``."""
    if value.dtype == ml_dtypes.float8_e8m0fnu:
        value = value.view(np.uint8)
    check_scales(value, fmt, name)
    return row_scales(value, rows) if fmt == FP8 else value
