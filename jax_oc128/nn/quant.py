"""DeepSeek's quantized weight formats (the released DeepSeek-V4 checkpoints), kept quantized on the device.

* **FP8** (``quantization_config``: ``fmt`` e4m3, ``scale_fmt`` ue8m0, ``weight_block_size`` [128, 128]): a
  ``[out, in]`` weight of float8_e4m3fn codes and one scale per 128 x 128 block, ``[ceil(out / 128),
  ceil(in / 128)]`` (the blocks at the right and bottom edges partial); value = code * scale.
* **FP4** (``expert_dtype`` fp4, the routed experts): e2m1 codes packed two per byte along ``in`` (the low
  nibble the even element), stored ``[out, in / 2]``, and one scale per 1 x 32 group, ``[out, in / 32]``.
* A scale is an e8m0 exponent byte ``e`` (float8_e8m0fnu): 2^(e - 127); 255 is NaN. The FP8 experts of the
  Base checkpoints have float32 scales instead.

On the device a weight is a :class:`QuantizedArray`: its codes as stored (float8_e4m3fn, or the packed uint8
bytes) and its scales per row, ``[..., out, ceil(in / group)]`` (``group`` 128 for FP8: the 128 x 128 block
scales repeated over their block's rows, 1/128 byte per parameter; 32 for FP4), so that the rows of a stacked
or sliced weight (an expert's gate and up halves, a device's rows) carry their scales. :func:`dequantize`
gives its float matrix, exactly (an e4m3 or e2m1 code times a power of two is a float32 and a bfloat16
number, where normal); between calls the device holds the codes and scales only. Inside a jitted matmul
XLA writes the dequantized matrix to memory and reads it back (it does not fuse the decoding into its
matmul's operand); the kernels of :mod:`~jax_oc128.nn.grouped_matmul` read the codes and scales only.
:func:`check_scales` is the range of scales the loader accepts, e8m0 or float32 (every code's value a normal
finite float32).

:func:`quantize_fp8` and :func:`quantize_fp4` are DeepSeek's quantization (per block: amax, clamped below at
1e-4, over the format's largest value, rounded up to a power of two; codes rounded to nearest even), which
writes such checkpoints (``scripts/make_released_checkpoint.py``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

FP8, FP4 = "fp8", "fp4"
#: the side of an FP8 block and the width of an FP4 group, and so of a row's scale group on the device
GROUP = {FP8: 128, FP4: 32}
#: the largest magnitude of a code: e4m3 448, e2m1 6
LARGEST = {FP8: 448.0, FP4: 6.0}
#: the e8m0 exponents at which every code of the format is a normal finite float32: FP8's smallest code
#: 2^-9 times 2^(e - 127) >= 2^-126 and 448 * 2^(e - 127) finite; FP4's 0.5 and 6 the same
EXPONENTS = {FP8: (10, 246), FP4: (2, 252)}
#: DeepSeek's lower bound of a block's amax before its scale is taken
MIN_AMAX = 1e-4
E8M0_BIAS = 127


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=("codes", "scales"), meta_fields=("fmt", "dtype_name")
)
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """A quantized ``[..., out, in]`` weight (a pytree of its codes and scales, see the module).

    Attributes:
      codes: FP8: float8_e4m3fn ``[..., out, in]``; FP4: uint8 ``[..., out, in / 2]`` (two codes a byte,
        the low nibble the even element).
      scales: ``[..., out, ceil(in / GROUP[fmt])]``, uint8 e8m0 exponents or float32.
      fmt: :data:`FP8` or :data:`FP4` (static).
      dtype_name: the dtype of the dequantized matrix, ``"float32"`` or ``"bfloat16"`` (static): the model's.
    """

    codes: jax.Array
    scales: jax.Array
    fmt: str
    dtype_name: str

    @property
    def shape(self) -> tuple[int, ...]:
        """The float matrix's shape ``[..., out, in]``."""
        *lead, stored = self.codes.shape
        return (*lead, stored * 2 if self.fmt == FP4 else stored)

    @property
    def ndim(self) -> int:
        return len(self.codes.shape)

    @property
    def dtype(self):
        """The dtype of the dequantized matrix (what a matmul takes its other operand in)."""
        return jnp.dtype(self.dtype_name)

    def __getitem__(self, key) -> QuantizedArray:
        """``[...]`` itself (an ``nnx.Variable``'s value); an index of the leading axes (an expert, a range
        of rows: not the last axis) indexes the codes and their scales alike."""
        if key is Ellipsis:
            return self
        key = key if isinstance(key, tuple) else (key,)
        if len(key) >= self.ndim or any(k is Ellipsis or k is None for k in key):
            raise IndexError(f"a QuantizedArray is indexed on its leading axes only, got {key!r}")
        return dataclasses.replace(self, codes=self.codes[key], scales=self.scales[key])


def matrix(weight):
    """``weight`` as a float matrix: a :class:`QuantizedArray` dequantized (:func:`dequantize`), an array
    itself."""
    return dequantize(weight) if isinstance(weight, QuantizedArray) else weight


def dequantize(weight: QuantizedArray) -> jax.Array:
    """The float ``[..., out, in]`` matrix of ``weight``, in its ``dtype``: each code's value times its row
    group's scale, computed in float32 (exact where the result is a normal float32 number; XLA flushes
    subnormals to zero) and cast (exact for bfloat16 too: the values have at most 3 significant bits)."""
    values = weight.codes.astype(jnp.float32) if weight.fmt == FP8 else e2m1_values(weight.codes)
    scales = scale_values(weight.scales)
    scales = jnp.repeat(scales, GROUP[weight.fmt], axis=-1)[..., : values.shape[-1]]
    return (values * scales).astype(weight.dtype)


def e2m1_values(packed) -> jax.Array:
    """float32 ``[..., 2n]`` of the e2m1 codes packed in uint8 ``[..., n]`` (element ``2j`` the low nibble
    of byte ``j``, :func:`nibbles`), each decoded by :func:`e2m1_code_values`."""
    packed = jnp.asarray(packed)
    codes = jnp.stack(nibbles(packed), axis=-1).reshape(*packed.shape[:-1], -1)
    return e2m1_code_values(codes)


def nibbles(packed) -> tuple[jax.Array, jax.Array]:
    """The e2m1 codes (uint32, 0..15) of packed bytes (uint8, any shape): ``(low, high)``, the low nibbles
    the even elements, the high nibbles the odd ones."""
    packed = jnp.asarray(packed).astype(jnp.uint32)
    return packed & 0xF, packed >> 4


def e2m1_code_values(codes) -> jax.Array:
    """float32 values of e2m1 codes (uint32, 0..15, any shape; elementwise, so a kernel decodes with it
    too): sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6
    and 8..15 their negatives. Built as float32 bits (exact)."""
    sign, exponent, mantissa = codes >> 3, (codes >> 1) & 3, codes & 1
    normal = ((exponent + 126) << 23) | (mantissa << 22)
    bits = (sign << 31) | jnp.where(exponent > 0, normal, mantissa * (126 << 23))  # subnormal: 0 or 0.5
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


#: the magnitudes halfway between consecutive e2m1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6), each with whether a
#: magnitude exactly there rounds up (to the even code above it) or down (to the even code below)
E2M1_MIDPOINTS = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)


def e2m1_codes(values) -> jax.Array:
    """The e2m1 codes (uint32, 0..15) of float32 ``values`` (any shape), rounded to the nearest e2m1 value,
    ties to the even code, magnitudes past 6 to 6 (ml_dtypes' ``float4_e2m1fn`` rounding; the inverse of
    :func:`e2m1_code_values` on its values). Elementwise comparisons, so any backend computes it."""
    values = jnp.asarray(values, jnp.float32)
    magnitude = jnp.abs(values)
    code = sum(
        ((magnitude >= mid) if up else (magnitude > mid)).astype(jnp.uint32) for mid, up in E2M1_MIDPOINTS
    )
    return code | (jnp.signbit(values).astype(jnp.uint32) << 3)


def pack_nibbles(codes) -> jax.Array:
    """uint8 ``[..., n]`` of e2m1 codes ``[..., 2n]`` (uint32, 0..15): two a byte, the even element the low
    nibble (the inverse of :func:`nibbles`)."""
    codes = jnp.asarray(codes, jnp.uint32)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(jnp.uint8)


def scale_values(scales) -> jax.Array:
    """float32 values of ``scales`` (any shape; elementwise, so a kernel takes them with it too): uint8 e8m0
    exponents ``e`` -> 2^(e - 127) (0: 2^-127, a subnormal; 255: NaN), built as float32 bits; float32
    scales as they are."""
    scales = jnp.asarray(scales)
    if scales.dtype == jnp.float32:
        return scales
    e = scales.astype(jnp.uint32)
    bits = jnp.where(e == 0, 1 << 22, jnp.where(e == 255, 0x7FC00000, e << 23))
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint32), jnp.float32)


def check_scales(scales: np.ndarray, fmt: str, name: str) -> None:
    """The scales of a tensor of format ``fmt``, e8m0 exponents (uint8) or float32 values (the Base
    checkpoints' FP8 experts), lie in ``[2^(low - 127), 2^(high - 127)]`` for ``(low, high)`` =
    :data:`EXPONENTS` ``[fmt]``: one rule for both, where every code's value is a normal finite float32; a
    ValueError naming the tensor (``name``) otherwise (e8m0 255 and a float32 NaN are out; DeepSeek's
    quantization writes none outside, :data:`MIN_AMAX`)."""
    low, high = EXPONENTS[fmt]
    if not scales.size:
        return
    if scales.dtype == np.uint8:
        inside = (scales >= low) & (scales <= high)
    else:
        inside = (scales >= np.ldexp(1.0, low - E8M0_BIAS)) & (scales <= np.ldexp(1.0, high - E8M0_BIAS))
    if not np.all(inside):
        bad = scales.reshape(-1)[np.argmin(inside.reshape(-1))]
        got = f"e8m0 exponent {bad}" if scales.dtype == np.uint8 else f"{float(bad)!r}"
        raise ValueError(
            f"{name}: scales must be in [2^{low - E8M0_BIAS}, 2^{high - E8M0_BIAS}] for {fmt} (e8m0 "
            f"exponents [{low}, {high}]: every value a normal finite float32), got {got}"
        )


def row_scales(block_scales: np.ndarray, rows: int) -> np.ndarray:
    """The per-row scales ``[..., rows, ceil(in / 128)]`` of FP8 block scales ``[..., ceil(rows / 128),
    ceil(in / 128)]``: each block's scale repeated over its 128 rows (the last block's over its remaining
    rows)."""
    return np.repeat(block_scales, GROUP[FP8], axis=-2)[..., :rows, :]


def _exponents(amax: np.ndarray, largest: float) -> np.ndarray:
    """e8m0 exponents (uint8) of DeepSeek's scales: 2^ceil(log2(max(amax, 1e-4) / largest)), exactly."""
    mantissa, exponent = np.frexp(np.maximum(amax.astype(np.float64), MIN_AMAX) / largest)
    return (exponent - (mantissa == 0.5) + E8M0_BIAS).astype(np.uint8)  # frexp: mantissa in [0.5, 1)


def _scaled(w: np.ndarray, exponents: np.ndarray) -> np.ndarray:
    """``w`` divided by the scales of ``exponents`` (broadcast), exactly (powers of two, in float64)."""
    return w.astype(np.float64) * np.ldexp(1.0, E8M0_BIAS - exponents.astype(np.int64))


def quantize_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek's FP8 quantization of a float ``[out, in]`` weight: (float8_e4m3fn codes ``[out, in]``,
    float8_e8m0fnu scales ``[ceil(out / 128), ceil(in / 128)]``), each block's amax at most 448 codes."""
    out, width = w.shape
    block = GROUP[FP8]
    rows, cols = -(-out // block), -(-width // block)
    padded = np.zeros((rows * block, cols * block), np.float64)
    padded[:out, :width] = w
    amax = np.abs(padded.reshape(rows, block, cols, block)).max(axis=(1, 3))
    exponents = _exponents(amax, LARGEST[FP8])
    per_element = np.repeat(np.repeat(exponents, block, 0), block, 1)[:out, :width]
    codes = _scaled(w, per_element).astype(ml_dtypes.float8_e4m3fn)
    return codes, exponents.view(ml_dtypes.float8_e8m0fnu)


def quantize_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek's FP4 quantization of a float ``[out, in]`` weight (``in`` a multiple of 32): (int8 packed
    codes ``[out, in / 2]``, float8_e8m0fnu scales ``[out, in / 32]``), each group's amax at most 6."""
    out, width = w.shape
    group = GROUP[FP4]
    if width % group:
        raise ValueError(f"w: FP4 needs a multiple of {group} columns, got shape {w.shape}")
    exponents = _exponents(np.abs(w.reshape(out, width // group, group)).max(axis=2), LARGEST[FP4])
    codes = _scaled(w, np.repeat(exponents, group, axis=1)).astype(ml_dtypes.float4_e2m1fn)
    nibbles = codes.view(np.uint8) & 0xF
    packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    return packed.view(np.int8), exponents.view(ml_dtypes.float8_e8m0fnu)
