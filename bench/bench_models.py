"""The models the decode benchmarks build (``bench_decode.py``; ``bench_moe.py``, ``bench_linear.py`` and
``sweep_gmm.py`` use :func:`random_quantized`), their weights and their prompts.

Configs (:data:`CONFIGS`, :func:`build_model`):

* ``shipped``: the model shipped in the package (``checkpoint.load``; 4 layers, 2 of them C128, byte-level).
  Prompts are slices of the demo's text, so that the drafts are accepted as in use.
* ``v4flash-attn``: the attention of DeepSeek-V4-Flash (``ModelConfig.deepseek_v4_flash``) at its shapes
  (hidden 4096, 64 heads x 512, q and o LoRA rank 1024, 8 o-groups, rope_dim 64 with the compress RoPE's YaRN,
  window 128) in 6 layers alternating sliding and C128, a dense SwiGLU MLP of 2048 and one residual stream
  (the small MTP head), float32, random weights (``nnx.Rngs(0)``, the same for both backends), ``max_len``
  4096 (``--max-len``; the 64-slot caches stay small), ``max_draft`` 4. The vocabulary is 4096, not V4's
  129280: the point is the attention and the C128 state, and a full-size LM head (2 GiB of float32, read at
  every step and every draft) would dominate the small-batch steps. Prompts are random token ids; the random
  MTP head's drafts are almost never accepted (mean accepted length about 1), which does not matter for the
  time per step.
* ``v4flash-slice``: DeepSeek-V4-Flash as released (``ModelConfig.deepseek_v4_flash``: its config.json), its
  first ``--layers`` (6: sliding, sliding, CSA, HCA, CSA, HCA; hash-routed MoE in the first 3, top-k in the
  others): hidden 4096, 64 heads x 512, q and o LoRA rank 1024, 8 o-groups, rope_dim 64 (compress RoPE YaRN
  x16 from 65536), window 128, the CSA indexer's 64 heads x 128 and top-512, MoE experts of 2048 with 6
  routed per token and a shared one, routed scaling 1.5, SwiGLU limit 10, hyper-connections of 4 streams
  with 20 Sinkhorn iterations, the vocabulary of 129280, and DeepSeek-V4's MTP layer as the draft head; but
  ``--experts`` (16; V4-Flash has 256) routed experts, run by the grouped dispatch (``MoEConfig.dispatch``'s
  default: each picked expert once). ``max_len`` 4096 (``--max-len``), ``max_draft`` 4; random prompts.
  ``--weights``:

  - ``bf16`` (default): the matrices bfloat16 (norms, hyper-connections and biases float32), random, made
    one at a time (each drawn in float32, stored in bfloat16; the constructor under ``jit`` would hold every
    float32 draw at once). 6 layers, 16 experts: 9.8 GB; 256 experts: 13.2 GB per layer, 15.3 GB for the
    MTP layer, embedding and LM head.
  - ``released``: DeepSeek's released precision, as ``load_pretrained`` holds a released checkpoint
    (:func:`released_model`): FP8 (e4m3 codes, e8m0 128 x 128 block scales kept per row) for the tensors the
    checkpoint stores FP8 (the attention's, the indexer's query and the shared experts' projections, the MTP
    layer's ``e_proj`` / ``h_proj``), FP4 (packed e2m1, e8m0 1 x 32 scales) for the routed experts, the rest
    as the bfloat16 model has it; the quantized weights made random in that form on the device, one tensor
    at a time. 256 experts: 3.6 GB per layer, 5.7 GB for the MTP layer, embedding and LM head.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from jax_oc128 import checkpoint, pretrained
from jax_oc128.controller import BACKENDS
from jax_oc128.nn import ModelConfig, RuntimeConfig, SpeculativeModel
from jax_oc128.nn.attention import HCA, SLIDING
from jax_oc128.nn.functional import build_abstract, variable_at
from jax_oc128.nn.quant import E8M0_BIAS, FP4, FP8, GROUP, QuantizedArray
from jax_oc128.state import nbytes

CONFIGS = ("shipped", "v4flash-attn", "v4flash-slice")
#: the runtime of the DeepSeek-V4-Flash configs: 4096 tokens, verifies of up to 4
RUNTIME = RuntimeConfig(max_len=4096, max_draft=4)
#: DeepSeek-V4-Flash's attention shapes in 6 layers (see the module doc)
V4FLASH_ATTN = dataclasses.replace(
    ModelConfig.deepseek_v4_flash(),
    vocab_size=4096,
    layer_types=(SLIDING, HCA) * 3,
    mlp_layer_types=None,
    hc_mult=None,
)


def slice_config(layers: int, experts: int) -> ModelConfig:
    """DeepSeek-V4-Flash's first ``layers`` layers with ``experts`` routed experts, in bfloat16 (see the
    module doc)."""
    return ModelConfig.deepseek_v4_flash(num_layers=layers, num_experts=experts, dtype="bfloat16")


#: the default slice: 6 layers, 16 experts
V4FLASH_SLICE = slice_config(6, 16)
#: ``--weights``: the slice's matrices in bfloat16, or in DeepSeek's released precision (see the module doc)
WEIGHTS = ("bf16", "released")
#: the e4m3 codes of random FP8 weights: a random sign and mantissa, exponent field 6 or 7 (values +-[0.5,
#: 1.875]: no NaN, no subnormal); FP4's random bytes are any two e2m1 codes
FP8_CODE_BITS = (0x8F, 0x30)  # (bits kept of a random byte, bits set)
#: the demo's prompts (byte-level text for the shipped model)
TEXT = (
    "Return a new list containing all items from the iterable in ascending order. A custom key function "
    "can be supplied to customize the sort order, and the reverse flag can be set to request the result in "
    "descending order. Open file and return a corresponding file object. If the file cannot be opened, an "
    "OSError is raised. This module provides access to some variables used or maintained by the interpreter "
    "and to functions that interact strongly with the interpreter. It is always available. Create a new "
    "thread "
)


def build_model(config: str, backend: str, weights: str = "bf16", slice_: ModelConfig = V4FLASH_SLICE):
    """The model of ``config`` with the C128 ``backend``; the slice's (``slice_``) in ``weights``
    (:data:`WEIGHTS`). Its runtime: :data:`RUNTIME` (the shipped model's: ``RuntimeConfig()``)."""
    if config == "shipped":
        return checkpoint.load(backend=BACKENDS[backend])[0]
    if config == "v4flash-attn":
        return SpeculativeModel(V4FLASH_ATTN, RUNTIME, backend=BACKENDS[backend], rngs=nnx.Rngs(0))
    if config == "v4flash-slice" and weights == "released":
        return released_model(slice_, backend)
    if config == "v4flash-slice":
        return SpeculativeModel(slice_, RUNTIME, backend=BACKENDS[backend], rngs=nnx.Rngs(0))
    raise ValueError(f"unknown config {config!r}")


def released_model(config: ModelConfig, backend: str, seed: int = 0) -> SpeculativeModel:
    """The model of ``config`` (with hyper-connections and MoE layers: a DeepSeek-V4) with its matrices in
    DeepSeek's released precision, as :func:`~jax_oc128.load_pretrained` holds a released checkpoint: the
    model built with shapes only, the quantized parameters (:func:`~jax_oc128.pretrained.released_formats`:
    the attention's, the indexer's query and the shared experts' projections and the MTP layer's ``e_proj``
    and ``h_proj`` FP8, the routed experts FP4) made :class:`~jax_oc128.nn.quant.QuantizedArray` s
    (:func:`~jax_oc128.pretrained.quantized_leaves`), each filled with random codes and scales on the device
    one tensor at a time (:func:`random_quantized`); every other parameter as the float model of ``config``
    has it (the constructor under ``jit`` returning those alone: the draws of the quantized ones are dead
    code, never computed)."""
    build = functools.partial(SpeculativeModel, config, RUNTIME, backend=BACKENDS[backend])
    model = build_abstract(lambda rngs: build(rngs=rngs))
    paths = pretrained.parameter_paths(model)
    formats = pretrained.released_formats(paths, FP4, optional=True)
    rest = {name: path for name, path in paths.items() if name not in formats}

    @jax.jit
    def rest_values():
        built = build(rngs=nnx.Rngs(seed))
        return {name: variable_at(built, path)[...] for name, path in rest.items()}

    for name, value in rest_values().items():
        variable_at(model, paths[name]).set_value(value)
    key = jax.random.key(seed)
    for i, (name, fmt) in enumerate(formats.items()):
        variable = variable_at(model, paths[name])
        want = pretrained.quantized_leaves(variable.get_value(), fmt, "F8_E8M0", config.dtype)
        value = random_quantized(jax.random.fold_in(key, i), fmt=fmt, shape=want.shape, dtype=config.dtype)
        if nbytes(value) != nbytes(want) or jax.tree.structure(value) != jax.tree.structure(want):
            raise AssertionError(f"{name}: the random {fmt} weight is not in the loader's layout")
        variable.set_value(value)
    return model


@functools.cache
def code_rms(fmt: str) -> float:
    """The root mean square of the values of :func:`random_quantized`'s codes of ``fmt`` (uniform over
    them)."""
    if fmt == FP4:
        values = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn)
    else:
        kept, set_ = FP8_CODE_BITS
        values = (np.arange(256) & kept | set_).astype(np.uint8).view(ml_dtypes.float8_e4m3fn)
    return float(np.sqrt(np.mean(values.astype(np.float64) ** 2)))


@functools.partial(jax.jit, static_argnames=("fmt", "shape", "dtype"))
def random_quantized(key, *, fmt: str, shape: tuple[int, ...], dtype: str) -> QuantizedArray:
    """A random ``[..., out, in]`` weight of ``shape`` in ``fmt`` as :class:`QuantizedArray` holds it (codes
    and per-row uint8 e8m0 scales; dequantized to ``dtype``), made in that form: random codes (FP8:
    :data:`FP8_CODE_BITS`; FP4: random bytes) and random scales (FP8 one per 128 x 128 block, repeated over
    its rows; FP4 one per 1 x 32 group), each the power of two at or just below the one that gives the
    values the standard deviation of the float model's init, ``1 / sqrt(in)``
    (:func:`~jax_oc128.nn.functional.normal_param`), or twice it: the values' standard deviation within a
    factor 2 of the init's."""
    *lead, out, width = shape
    code_key, scale_key = jax.random.split(key)
    exponent = E8M0_BIAS + math.floor(math.log2(width**-0.5 / code_rms(fmt)))
    if fmt == FP8:
        kept, set_ = FP8_CODE_BITS
        bits = jax.random.bits(code_key, tuple(shape), jnp.uint8) & kept | set_
        codes = jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn)
        blocks = (*lead, -(-out // GROUP[FP8]), -(-width // GROUP[FP8]))
    else:
        codes = jax.random.bits(code_key, (*lead, out, width // 2), jnp.uint8)
        blocks = (*lead, out, width // GROUP[FP4])
    scales = jax.random.randint(scale_key, blocks, exponent, exponent + 2).astype(jnp.uint8)
    if fmt == FP8:
        scales = jnp.repeat(scales, GROUP[FP8], axis=-2)[..., :out, :]
    return QuantizedArray(codes, scales, fmt, dtype)


def with_runtime(model: SpeculativeModel, backend: str, **changes) -> SpeculativeModel:
    """``model`` with the fields of its runtime that ``changes`` give (``max_len``, ``kv_cache_dtype``; None:
    as its runtime says): its parameters (not copied) in the module of that runtime."""
    changes = {k: v for k, v in changes.items() if v is not None and v != getattr(model.runtime, k)}
    if not changes:
        return model
    runtime = dataclasses.replace(model.runtime, **changes)
    abstract = build_abstract(
        lambda rngs: SpeculativeModel(model.config, runtime, backend=BACKENDS[backend], rngs=rngs)
    )
    return nnx.merge(nnx.graphdef(abstract), nnx.state(model))


def make_prompts(model_config: ModelConfig, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens: slices of :data:`TEXT` at different offsets for a byte-level
    model, else random token ids."""
    if model_config.vocab_size == 256:
        text = TEXT.encode("ascii")
        text = text * (length // len(text) + 2)
        return [list(text[(61 * i) % len(TEXT) :][:length]) for i in range(count)]
    rng = np.random.default_rng(seed)
    return [rng.integers(0, model_config.vocab_size, length).tolist() for _ in range(count)]
