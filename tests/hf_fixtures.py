"""The transformers fixtures the test files share (tests/fixtures) and checkpoints written from their
weights: tiny random DeepSeek-V4 models, their weights by transformers name and their logits
(:func:`fixture`), a sliding and an HCA attention layer and their outputs (:data:`ATTENTION_FIXTURE`),
checkpoint directories as ``load_pretrained`` reads them (:func:`write`), and the tiny checkpoint in
DeepSeek's released format whose transformers logits are :data:`QUANTIZED_FIXTURE`
(:func:`quantized_checkpoint`)."""

from __future__ import annotations

import functools
import hashlib
import json
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from jax_oc128 import pretrained, released
from jax_oc128.controller import ForwardMode
from jax_oc128.loading import names
from jax_oc128.nn import DeepseekV4Attention, ModelConfig, RuntimeConfig, SpeculativeModel
from jax_oc128.nn.functional import variable_at

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
HF_TOL = 1e-4  # the bar: fp32 relative error against transformers


# ---------------------------------------------------------------------------------------------------------
# The full decoder: tests/fixtures/v4_<name>.npz (scripts/make_v4_fixture.py)


@functools.cache
def fixture(name):
    """The fixture ``name`` (``small_window`` or ``large_window``), loaded once: the model's config.json
    (a dict), its weights by transformers name, and the rest of the file (``prompt`` and the logits)."""
    data = dict(np.load(FIXTURES / f"v4_{name}.npz"))
    meta = json.loads(bytes(data.pop("meta")).decode())
    weights = {k.removeprefix("weights/"): data.pop(k) for k in list(data) if k.startswith("weights/")}
    return meta["config"], weights, data


def positions(batch, start, stop):
    """Positions ``start .. stop - 1`` for every row, ``[batch, stop - start]`` int32."""
    return jnp.broadcast_to(jnp.arange(start, stop, dtype=jnp.int32), (batch, stop - start))


@functools.partial(jax.jit, static_argnames=("graphdef", "mode"), donate_argnames="cache")
def forward(graphdef, params, tokens, positions, cache, mode=ForwardMode.EXTEND):
    """One jitted forward of the target model ``nnx.merge(graphdef, params)``: its logits ``[batch, T,
    vocab]`` and the cache it returns (``cache`` donated)."""
    logits, _, cache = nnx.merge(graphdef, params)(tokens, positions, cache, mode=mode)
    return logits, cache


def prefill_logits(model, prompt):
    """The prompt logits ``[batch, length, vocab]`` of ``model`` (a :class:`SpeculativeModel`) for the
    token ids ``prompt`` ``[batch, length]``, from a fresh cache."""
    prompt = jnp.asarray(prompt)
    batch, length = prompt.shape
    graphdef, params = nnx.split(model.target)
    return forward(graphdef, params, prompt, positions(batch, 0, length), model.target.init_cache(batch))[0]


# ---------------------------------------------------------------------------------------------------------
# A sliding and an HCA attention layer: tests/fixtures/hf_deepseek_v4.npz (scripts/make_hf_fixture.py)

ATTENTION_FIXTURE = np.load(FIXTURES / "hf_deepseek_v4.npz")
ATTENTION_META = json.loads(bytes(ATTENTION_FIXTURE["meta"]).decode())
ATTENTION_MODEL = ModelConfig.from_hf(ATTENTION_META["config"])  # its layers' configs: .attention(layer_type)
ATTENTION_RUNTIME = RuntimeConfig(max_len=ATTENTION_META["config"]["max_position_embeddings"])
ATTENTION_X = jnp.asarray(ATTENTION_FIXTURE["x"])  # the layers' input [batch, tokens, hidden] float32


def attention_weights(index):
    """Layer ``index``'s projection weights by transformers name (its ``sinks`` not among them)."""
    prefix = f"layer{index}/"
    return {k.split("/", 1)[1]: v for k, v in ATTENTION_FIXTURE.items() if k.startswith(prefix) and "." in k}


def attention_layer(index, max_draft=4):
    """Layer ``index`` of the fixture with its weights."""
    weights = attention_weights(index) | {"sinks": ATTENTION_FIXTURE[f"layer{index}/sinks"]}
    config = ATTENTION_MODEL.attention(ATTENTION_MODEL.layer_types[index], ATTENTION_RUNTIME)
    return DeepseekV4Attention.from_hf(config, index, weights, max_draft=max_draft)


# ---------------------------------------------------------------------------------------------------------
# Checkpoints


def tensors_of(model: SpeculativeModel) -> dict[str, np.ndarray]:
    """Every parameter of ``model`` by its transformers-style name (what a checkpoint of it holds)."""
    paths = pretrained.parameter_paths(model)
    return {name: np.asarray(variable_at(model, path)[...]) for name, path in paths.items()}


def deepseek_named(tensors: dict, layers: int) -> dict[str, np.ndarray]:
    """``tensors`` (transformers-style names) under DeepSeek's names, the experts one tensor per expert and
    projection (w1 and w3 the halves of gate_up_proj, w2 down_proj)."""
    named = {}
    for param, value in tensors.items():
        if param.endswith("mlp.experts.gate_up_proj"):
            for expert, half in np.ndindex(value.shape[0], 2):
                name = pretrained.deepseek_name(pretrained.Part(param, expert, half), layers)
                named[name] = np.split(value[expert], 2)[half]
        elif param.endswith("mlp.experts.down_proj"):
            for expert in range(value.shape[0]):
                named[pretrained.deepseek_name(pretrained.Part(param, expert), layers)] = value[expert]
        else:
            named[pretrained.deepseek_name(pretrained.Part(param), layers)] = value
    return named


def write(directory: pathlib.Path, config: dict, tensors: dict, shards: int = 1) -> pathlib.Path:
    """A checkpoint: ``config.json`` and ``tensors`` in ``model.safetensors`` or, with ``shards`` > 1, that
    many files and an index. Floating tensors whose values are bfloat16 values are stored as BF16."""
    directory.mkdir(parents=True)
    (directory / pretrained.CONFIG).write_text(json.dumps(config))

    def stored(value):
        value = np.ascontiguousarray(value)
        as_bf16 = value.astype(ml_dtypes.bfloat16)
        exact = value.dtype == np.float32 and np.array_equal(as_bf16.astype(np.float32), value)
        return as_bf16 if exact else value

    if shards == 1:
        save_file({name: stored(value) for name, value in tensors.items()}, directory / pretrained.SINGLE)
        return directory
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {name: files[i % shards] for i, name in enumerate(sorted(tensors))}
    for file in files:
        save_file({n: stored(v) for n, v in tensors.items() if weight_map[n] == file}, directory / file)
    (directory / pretrained.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def target_tensors(name: str) -> dict[str, np.ndarray]:
    """The tensors of the fixture's model (no MTP layer) as :meth:`DeepseekV4Model.from_hf` loads them."""
    config, weights, _ = fixture(name)
    model = SpeculativeModel.from_hf(config, weights, rngs=nnx.Rngs(0))
    return {name: value for name, value in tensors_of(model).items() if name in weights}


# ---------------------------------------------------------------------------------------------------------
# The released format: tests/fixtures/v4_quantized.npz (scripts/make_quantized_fixture.py)

#: transformers' float32 logits of :func:`quantized_checkpoint`'s dequantized weights over a prefill of
#: ``prompt`` [2, 64] (``prefill_logits``) and 40 cached greedy decode steps (``decode_tokens``,
#: ``decode_logits``); its ``meta`` holds the :func:`checksum` of those weights
QUANTIZED_FIXTURE = FIXTURES / "v4_quantized.npz"
QUANTIZED_PROMPT, QUANTIZED_STEPS = 64, 40


def quantized_config() -> dict:
    """The small-window fixture's config in its first 3 layers (sliding, CSA, HCA; hash routing in the first
    two) with 32-wide experts (FP4 groups of 32), a q_lora_rank of 136 (partial 128 x 128 blocks both ways)
    and one MTP layer."""
    config, _, _ = fixture("small_window")
    return config | {
        "num_hidden_layers": 3,
        "layer_types": config["layer_types"][:3],
        "mlp_layer_types": config["mlp_layer_types"][:3],
        "moe_intermediate_size": 32,
        "q_lora_rank": 136,
        "num_nextn_predict_layers": 1,
    }


def quantized_checkpoint() -> tuple[dict, dict[str, np.ndarray]]:
    """A tiny random DeepSeek-V4 with an MTP layer (:func:`quantized_config`, seeded) in the released format:
    its ``config.json`` (``expert_dtype`` absent: FP4 experts, the default) and its tensors by DeepSeek's
    names (:func:`jax_oc128.released.released_tensors`)."""
    config = quantized_config()
    # drawn on the CPU: a GPU's random normals may round otherwise (the fixture's checksum is of these bytes)
    with jax.default_device(jax.devices("cpu")[0]):
        model = SpeculativeModel(
            ModelConfig.from_hf(config), RuntimeConfig(max_len=512, max_draft=4), rngs=nnx.Rngs(3)
        )
    return released.released_config(config, expert_dtype=None), released.released_tensors(model)


def write_dequantized(directory: pathlib.Path, config: dict, floats: dict[str, np.ndarray]) -> pathlib.Path:
    """The float checkpoint of a released one: ``config`` (:func:`quantized_checkpoint`'s) without its
    ``quantization_config`` and ``floats`` (its dequantized tensors, DeepSeek's names) in one file."""
    directory.mkdir(parents=True)
    float_config = {k: v for k, v in config.items() if k != "quantization_config"}
    (directory / pretrained.CONFIG).write_text(json.dumps(float_config))
    save_file({name: np.ascontiguousarray(v) for name, v in floats.items()}, directory / pretrained.SINGLE)
    return directory


def checksum(floats: dict[str, np.ndarray]) -> str:
    """The sha256 of ``floats``' names, dtypes, shapes and bytes (a checkpoint's identity)."""
    digest = hashlib.sha256()
    for name in sorted(floats):
        value = np.ascontiguousarray(floats[name])
        digest.update(f"{name} {value.dtype} {value.shape}\n".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


#: the e2m1 codes' values 0..7 (8..15: their negatives)
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def formula(codes: np.ndarray, exponents: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """The released format's value of float ``codes`` ``[out, in]`` with e8m0 ``exponents`` per ``block``
    (rows, columns): code * 2^(e - 127), in float64, rounded once to float32."""
    per_element = np.repeat(np.repeat(exponents.astype(np.int64), block[0], 0), block[1], 1)
    return (codes * np.exp2(per_element[: codes.shape[0], : codes.shape[1]] - 127.0)).astype(np.float32)


def e2m1_codes(packed: np.ndarray) -> np.ndarray:
    """float64 values of the e2m1 codes packed in ``packed`` ``[out, in / 2]`` (element 2j the low nibble)."""
    table = np.array(E2M1 + [-v for v in E2M1])
    nibbles = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    return table[nibbles]


def dequantized_tensors(tensors: dict) -> dict[str, np.ndarray]:
    """The float checkpoint of a released one: every quantized weight as the formula's float32 values
    (its scale dropped), every other tensor as stored."""
    floats = {}
    for name, value in tensors.items():
        scale = tensors.get(names.scale_name(name)) if name.endswith(".weight") else None
        if scale is None:
            if not name.endswith(pretrained.SCALE):
                floats[name] = value
        elif value.dtype == ml_dtypes.float8_e4m3fn:
            floats[name] = formula(value.astype(np.float64), scale.view(np.uint8), (128, 128))
        else:
            floats[name] = formula(e2m1_codes(value.view(np.uint8)), scale.view(np.uint8), (1, 32))
    return floats
