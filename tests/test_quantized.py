"""DeepSeek's released FP8/FP4 format: dequantization against its formula (computed here in float64, bit
for bit), DeepSeek's quantization rules, and ``load_pretrained`` of a tiny checkpoint in the released format
(``jax_oc128.released``: DeepSeek's names, shards, config.json with ``quantization_config``) keeping its
weights quantized: its float32 logits equal transformers' on its dequantized weights
(tests/fixtures/v4_quantized.npz) and those of our float model of them over a prefill and 40 cached decode
steps, its MTP layer drafts and greedy speculative decoding equals plain greedy; every bad
quantized tensor or config is refused, naming it."""

from __future__ import annotations

import functools
import json
import pathlib
import re
import runpy

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from hf_fixtures import (
    QUANTIZED_FIXTURE,
    QUANTIZED_PROMPT,
    QUANTIZED_STEPS,
    checksum,
    dequantized_tensors,
    e2m1_codes,
    formula,
    quantized_checkpoint,
    quantized_config,
    write_dequantized,
)
from oracle import rel_err

from jax_oc128 import load_pretrained, pretrained, released
from jax_oc128.engine import Engine
from jax_oc128.loading import names
from jax_oc128.nn import ModelConfig, SpeculativeModel, moe, quant
from jax_oc128.nn.functional import variable_at
from jax_oc128.nn.quant import FP4, FP8, QuantizedArray

TOL = 1e-4  # float32 logits against transformers' and the float model's on the dequantized weights (the bar)
REFERENCE = dict(np.load(QUANTIZED_FIXTURE))  # transformers' logits (scripts/make_quantized_fixture.py)
PROMPT = REFERENCE["prompt"]  # [2, 64] int32


def device_dequantized(codes, scales, fmt, dtype="float32") -> np.ndarray:
    """``quant.dequantize`` of stored codes and scales (FP8 block scales made per row, as the loader does)."""
    scales = np.asarray(scales).view(np.uint8)
    if fmt == FP8:
        scales = quant.row_scales(scales, codes.shape[0])
    array = QuantizedArray(jnp.asarray(codes), jnp.asarray(scales), fmt, dtype)
    return np.asarray(jax.jit(quant.dequantize)(array))


def test_fp8_dequantization_is_the_formula():
    """Every e4m3 code (but NaN) in a [300, 260] weight (2 whole and 1 partial block each way) with the
    exponents at the ends of the accepted range among its 9 blocks: bit for bit the formula, in float32 and
    (exactly the same values) bfloat16."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 256, (300, 260), dtype=np.uint8)
    bits[:2, :128] = np.arange(256, dtype=np.uint8).reshape(2, 128)
    bits[(bits & 0x7F) == 0x7F] = 0x38  # NaN -> 1.0
    codes = bits.view(ml_dtypes.float8_e4m3fn)
    exponents = rng.integers(*quant.EXPONENTS[FP8], (3, 3), endpoint=True).astype(np.uint8)
    exponents[0, 0], exponents[2, 2], exponents[0, 2] = quant.EXPONENTS[FP8] + (127,)
    want = formula(codes.astype(np.float64), exponents, (128, 128))
    got = device_dequantized(codes, exponents, FP8)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.isfinite(got).all() and np.array_equal(
        got == 0, codes.astype(np.float32) == 0
    )  # nothing flushed
    as_bf16 = device_dequantized(codes, exponents, FP8, "bfloat16")
    assert np.array_equal(as_bf16.astype(np.float32), want)


def test_fp4_nibble_order_and_formula():
    """The low nibble is the even element: byte 0x21 holds 0.5 (code 1) then 1.0 (code 2); every byte's two
    codes, and a [6, 96] weight with 1 x 32 group scales at both ends of the range: the formula's bits."""
    array = QuantizedArray(
        jnp.asarray([[0x21, 0xF8]], jnp.uint8), jnp.full((1, 1), 127, jnp.uint8), FP4, "float32"
    )
    assert np.asarray(quant.dequantize(array)).tolist() == [[0.5, 1.0, -0.0, -6.0]]
    every = np.arange(256, dtype=np.uint8)
    assert np.array_equal(np.asarray(quant.e2m1_values(every)), e2m1_codes(every[None])[0])
    rng = np.random.default_rng(1)
    packed = rng.integers(0, 256, (6, 48), dtype=np.uint8)
    exponents = rng.integers(*quant.EXPONENTS[FP4], (6, 3), endpoint=True).astype(np.uint8)
    exponents[0, 0], exponents[5, 2] = quant.EXPONENTS[FP4]
    want = formula(e2m1_codes(packed), exponents, (1, 32))
    got = device_dequantized(packed, exponents, FP4)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_e8m0_edge_exponents():
    """e8m0 0 is 2^-127 (a float32 subnormal), 254 is 2^127, 255 NaN; the loader accepts the exponents at
    which every code is a normal finite float32 (FP8 [10, 246], FP4 [2, 252]) and refuses the others, naming
    the tensor: 255 (NaN), 0 (subnormal values, which XLA flushes to zero) and 254 (448 * 2^127 overflows)."""
    values = np.asarray(quant.scale_values(np.array([0, 1, 127, 254, 255], np.uint8)))
    assert values[:4].tolist() == [2.0**-127, 2.0**-126, 1.0, 2.0**127] and np.isnan(values[4])
    for fmt, (low, high) in quant.EXPONENTS.items():
        quant.check_scales(np.array([low, high], np.uint8), fmt, "t")
        assert np.isfinite(np.float32(quant.LARGEST[fmt]) * np.exp2(np.float32(high - 127)))
        assert np.exp2(np.float64(low - 127)) * (2.0**-9 if fmt == FP8 else 0.5) >= 2.0**-126
        for bad in (0, low - 1, high + 1, 254, 255):
            with pytest.raises(
                ValueError, match=rf"layers\.0\.w\.scale: scales must be in .*, got e8m0 exponent {bad}$"
            ):
                quant.check_scales(np.array([127, bad], np.uint8), fmt, "layers.0.w.scale")


@pytest.mark.parametrize("fmt", [FP8, FP4])
def test_quantization_follows_deepseeks_rules(fmt):
    """Each block's scale is its amax (at least 1e-4) over the largest code, rounded up to a power of two;
    the codes are the values over it rounded to nearest (within half a code step); an all-zero block gets
    2^ceil(log2(1e-4 / largest)); quantizing the dequantized weight gives the same values."""
    rng = np.random.default_rng(2)
    w = (rng.normal(size=(200, 160)) * np.exp2(rng.integers(-8, 8, (200, 1)))).astype(np.float32)
    w[:, :32] = 0.0
    quantize, block = (quant.quantize_fp8, (128, 128)) if fmt == FP8 else (quant.quantize_fp4, (1, 32))
    codes, scales = quantize(w)
    exponents = scales.view(np.uint8)
    values = codes.astype(np.float64) if fmt == FP8 else e2m1_codes(codes.view(np.uint8))
    rows, cols = -(-200 // block[0]), -(-160 // block[1])
    padded = np.zeros((rows * block[0], cols * block[1]))
    padded[:200, :160] = np.abs(w)
    amax = np.maximum(padded.reshape(rows, block[0], cols, block[1]).max(axis=(1, 3)), 1e-4)
    assert np.array_equal(exponents, np.ceil(np.log2(amax / quant.LARGEST[fmt])) + 127)
    scale = np.exp2(np.repeat(np.repeat(exponents - 127.0, block[0], 0), block[1], 1)[:200, :160])
    assert np.abs(values).max() <= quant.LARGEST[fmt]
    step = 2.0 ** np.floor(np.log2(np.maximum(np.abs(w / scale), 2.0**-6 if fmt == FP8 else 1.0)))
    assert np.all(np.abs(values - w / scale) <= step / (16 if fmt == FP8 else 4))  # half a code step
    dequantized = formula(values, exponents, block)
    again = quantize(dequantized)
    again_values = again[0].astype(np.float64) if fmt == FP8 else e2m1_codes(again[0].view(np.uint8))
    assert np.array_equal(formula(again_values, again[1].view(np.uint8), block), dequantized)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The tiny random DeepSeek-V4 with an MTP layer in the released format
    (:func:`hf_fixtures.quantized_checkpoint`; 3 shards, FP4 experts, ``expert_dtype`` absent: the default),
    its released tensors, and the float checkpoint of its dequantized weights."""
    config, tensors = quantized_checkpoint()
    root = tmp_path_factory.mktemp("released")
    directory = released.write_released(root / "released", config, tensors, shards=3)
    floats = write_dequantized(root / "float", config, dequantized_tensors(tensors))
    return directory, tensors, floats


# compiled quickly (the models this file compares are all compiled alike)
QUICK = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@functools.partial(jax.jit, static_argnames="graphdef", donate_argnames="cache", compiler_options=QUICK)
def forward(graphdef, params, tokens, positions, cache):
    logits, _, cache = nnx.merge(graphdef, params)(tokens, positions, cache)
    return logits, cache


def prefill_and_decode(model, prompt, steps: int) -> np.ndarray:
    """The logits of a prefill of ``prompt`` and ``steps`` cached greedy decode steps, ``[batch, T + steps,
    vocab]``."""
    graphdef, params = nnx.split(model.target)
    batch, length = prompt.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    logits, cache = forward(graphdef, params, jnp.asarray(prompt), positions, model.target.init_cache(batch))
    out = [logits]
    for step in range(steps):
        token = jnp.argmax(out[-1][:, -1:], axis=-1).astype(jnp.int32)
        position = jnp.full((batch, 1), length + step, jnp.int32)
        logits, cache = forward(graphdef, params, token, position, cache)
        out.append(logits)
    return np.concatenate([np.asarray(x) for x in out], axis=1)


def parameter_bytes(model) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(model)))


@pytest.fixture(scope="module")
def load(checkpoints):
    """``load(kind, dtype)``: the released checkpoint (``kind`` "released") or its dequantized float one
    ("float") loaded with ``dtype``, once per module."""
    directory, _, floats = checkpoints
    paths = {"released": directory, "float": floats}
    return functools.cache(
        lambda kind, dtype: load_pretrained(paths[kind], dtype=dtype, max_len=512, max_draft=4)
    )


@pytest.fixture(scope="module")
def float32_logits(load):
    """The float32 logits ``[2, 64 + 40, vocab]`` of the quantized model and of the dequantized float model
    over a prefill of :data:`PROMPT` (64 tokens) and 40 cached greedy decode steps."""
    return tuple(
        prefill_and_decode(load(kind, "float32"), PROMPT, QUANTIZED_STEPS) for kind in ("released", "float")
    )


def test_quantized_checkpoint_matches_float_model(load, float32_logits):
    """The released checkpoint loads with its weights quantized (FP8 codes and uint8 scales for the linears,
    packed FP4 for the experts, the MTP layer's too, float for the rest) and with dtype float32 gives the
    logits of the float model of its dequantized weights, < 1e-4 relative over a prefill and 40 cached decode
    steps; bfloat16's agreement is printed (and bounded as the float checkpoints' is, 5%)."""
    model, reference = load("released", "float32"), load("float", "float32")
    block = model.target.blocks[1]
    for weight, fmt in (
        (block.attn.q_b_proj, FP8),
        (block.moe.shared_down, FP8),
        (block.moe.experts_down, FP4),
    ):
        assert isinstance(weight[...], QuantizedArray) and weight[...].fmt == fmt
    assert weight[...].codes.dtype == jnp.uint8 and block.attn.q_b_proj[...].codes.dtype == jnp.float8_e4m3fn
    assert isinstance(model.mtp.embed_proj[...], QuantizedArray)
    assert not isinstance(block.moe.router_weight[...], QuantizedArray)
    quantized, full = parameter_bytes(model), parameter_bytes(reference)
    got, want = float32_logits
    error = rel_err(got, want)
    got16, want16 = (prefill_and_decode(load(kind, "bfloat16"), PROMPT, 0) for kind in ("released", "float"))
    error16, against32 = rel_err(got16, want16), rel_err(got16, want[:, :QUANTIZED_PROMPT])
    print(
        f"\nquantized vs dequantized float model: float32 logits rel. error {error:.2e} (prefill, 40 steps); "
        f"bfloat16 {error16:.2e} (prefill), bfloat16 vs float32 {against32:.4f}; parameter bytes {quantized} "
        f"vs {full} float32"
    )
    assert error < TOL
    assert error16 < TOL
    assert quantized < full / 2


def test_quantized_checkpoint_matches_transformers(checkpoints, float32_logits):
    """With dtype float32 the quantized checkpoint's logits are transformers' (``DeepseekV4ForCausalLM`` on
    its dequantized weights, :data:`REFERENCE`), < 1e-4 relative over the prefill and over 40 cached greedy
    decode steps, with the same greedy tokens; the fixture was made from these very weights (their
    checksum)."""
    _, tensors, _ = checkpoints
    meta = json.loads(bytes(REFERENCE["meta"]).decode())
    assert checksum(dequantized_tensors(tensors)) == meta["checksum"], (
        "the released checkpoint's dequantized weights are not those of tests/fixtures/v4_quantized.npz: "
        "rerun scripts/make_quantized_fixture.py"
    )
    got, _ = float32_logits
    prefill, decode = got[:, :QUANTIZED_PROMPT], got[:, QUANTIZED_PROMPT:]
    tokens = np.argmax(got[:, QUANTIZED_PROMPT - 1 : -1], axis=-1)
    errors = rel_err(prefill, REFERENCE["prefill_logits"]), rel_err(decode, REFERENCE["decode_logits"])
    print(
        f"\nquantized vs transformers on the dequantized weights: float32 logits rel. error {errors[0]:.2e} "
        f"(prefill), {errors[1]:.2e} (40 decode steps)"
    )
    assert np.array_equal(tokens, REFERENCE["decode_tokens"])
    assert max(errors) < TOL


def test_mtp_drafts_from_the_quantized_checkpoint(load, float32_logits):
    """The quantized checkpoint's MTP layer is the engine's draft head: greedy speculative decoding (N = 2)
    gives the plain greedy tokens, which are the dequantized float model's (its greedy decode steps of
    :func:`float32_logits`, from the same prompts)."""
    prompts = PROMPT.tolist()
    engine = Engine(load("released", "float32"), slots=2)
    plain = engine.generate(prompts, 24, stop_tokens=())  # the full 24 (no stop at the config's EOS id)
    speculative = engine.generate(prompts, 24, num_tokens=2, stop_tokens=())
    print(f"\nquantized MTP drafts: mean accepted length {speculative.mean_accepted:.3f} (N = 2)")
    assert speculative.tokens == plain.tokens
    assert speculative.mean_accepted >= 1.0
    _, want = float32_logits
    greedy = np.argmax(want[:, QUANTIZED_PROMPT - 1 : QUANTIZED_PROMPT - 1 + 24], axis=-1)
    assert plain.tokens == greedy.tolist()


def base_checkpoint(tensors: dict) -> dict[str, np.ndarray]:
    """The released checkpoint's ``tensors`` as a Base checkpoint stores them: its experts FP8 with float32
    block scales (the same values re-quantized)."""
    base = {}
    for name, value in tensors.items():
        match = names.EXPERT_NAME.search(name.removesuffix(pretrained.SCALE) + ".weight")
        if match is None:
            base[name] = value
        elif name.endswith(".weight"):
            floats = dequantized_tensors(
                {name: value, names.scale_name(name): tensors[names.scale_name(name)]}
            )
            codes, scales = quant.quantize_fp8(floats[name])
            base[name] = codes
            base[names.scale_name(name)] = np.exp2(scales.view(np.uint8) - 127.0).astype(np.float32)
    return base


def test_fp8_experts_with_float32_scales(tmp_path, checkpoints):
    """``expert_dtype: fp8`` (the Base checkpoints): FP8 experts with float32 block scales load as FP8
    QuantizedArrays whose dequantized experts are the formula's."""
    base = base_checkpoint(checkpoints[1])
    directory = released.write_released(
        tmp_path / "base", released.released_config(quantized_config(), "fp8"), base
    )
    model = load_pretrained(directory, dtype="float32", max_len=512, max_draft=4)
    experts = model.target.blocks[2].moe.experts_down[...]
    assert experts.fmt == FP8 and experts.scales.dtype == jnp.float32
    for expert in range(experts.shape[0]):
        name = f"layers.2.ffn.experts.{expert}.w2"
        scale = np.log2(base[name + ".scale"]).astype(np.int64) + 127
        want = formula(base[name + ".weight"].astype(np.float64), scale, (128, 128))
        assert np.array_equal(np.asarray(quant.dequantize(experts[expert])), want)


@pytest.mark.parametrize("value", [1e-42, 3e38, 2.0**-118, 0.0, -1.0, np.nan, np.inf])
def test_float32_scales_out_of_range_are_refused(tmp_path, checkpoints, value):
    """A float32 expert scale that is subnormal (1e-42: the expert's weights flushed to zero), huge (3e38:
    inf weights, NaN logits), just below the e8m0 path's range, zero, negative, NaN or infinite: refused by
    the e8m0 scales' rule (quant.check_scales), naming the tensor (before: only > 0 and finite were
    checked)."""
    base = base_checkpoint(checkpoints[1])
    name = "layers.2.ffn.experts.1.w2.scale"
    base[name] = base[name].copy()
    base[name][0, 0] = value
    directory = released.write_released(
        tmp_path / "base", released.released_config(quantized_config(), "fp8"), base
    )
    with pytest.raises(
        ValueError, match=rf"tensor {re.escape(name)}: scales must be in \[2\^-117, 2\^119\] for fp8"
    ):
        load_pretrained(directory, dtype="float32", max_len=512, max_draft=4)


BAD_CONFIGS = {
    "fmt": ({"fmt": "e5m2"}, r"quantization_config\['fmt'\]: must be 'e4m3'"),
    "scale_fmt": ({"scale_fmt": "fp32"}, r"quantization_config\['scale_fmt'\]: must be 'ue8m0'"),
    "block": (
        {"weight_block_size": [64, 128]},
        r"quantization_config\['weight_block_size'\]: must be \[128, 128\]",
    ),
    "method": ({"quant_method": "awq"}, r"quantization_config\['quant_method'\]: must be 'fp8'"),
    "expert_dtype": ({"expert_dtype": "int4"}, r"expert_dtype: must be one of \['fp4', 'fp8'\], got 'int4'"),
}


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_bad_quantization_configs_are_named(tmp_path, checkpoints, nothing_placed, case):
    """An unknown fmt, scale_fmt, block size, method or expert_dtype: a ValueError naming config.json's field,
    before any tensor is read."""
    directory, _, _ = checkpoints
    change, match = BAD_CONFIGS[case]
    config = json.loads((directory / pretrained.CONFIG).read_text())
    if case == "expert_dtype":
        config |= change
    else:
        config["quantization_config"] = config["quantization_config"] | change
    bad = tmp_path / "bad"
    bad.mkdir()
    for file in directory.iterdir():
        (bad / file.name).symlink_to(file)
    (bad / pretrained.CONFIG).unlink()
    (bad / pretrained.CONFIG).write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: " + match):
        load_pretrained(bad, max_len=512)


def test_bad_quantized_tensors_in_one_error(tmp_path, checkpoints, nothing_placed):
    """Every problem of a released checkpoint in one ValueError naming each tensor, before any is placed: a
    scale of the wrong shape, one of the wrong dtype, a missing scale (of a linear and of an expert), FP4
    codes of the wrong dtype and of an unpacked shape, a scale of a weight the format has unquantized, and
    quantized tensors where the format has float ones (the router, the embedding)."""
    _, tensors, _ = checkpoints
    config = quantized_config()
    bad = dict(tensors)
    bad["layers.0.attn.wq_a.scale"] = bad["layers.0.attn.wq_a.scale"][:1]
    bad["layers.1.attn.wq_b.scale"] = np.ones((1, 2), np.float32)
    del bad["layers.1.attn.wo_b.scale"], bad["layers.2.ffn.experts.1.w2.scale"]
    bad["layers.0.ffn.experts.0.w1.weight"] = bad["layers.0.ffn.experts.0.w1.weight"].view(np.uint8)
    bad["layers.0.ffn.experts.1.w3.weight"] = np.zeros((32, 32), ml_dtypes.float8_e4m3fn)
    bad["layers.0.ffn.gate.weight"] = np.zeros((4, 32), np.int8)
    bad["embed.weight"], _ = quant.quantize_fp8(tensors["embed.weight"].astype(np.float32))
    bad["layers.0.ffn.gate.scale"] = np.ones((1, 1), ml_dtypes.float8_e8m0fnu)
    directory = released.write_released(tmp_path / "bad", released.released_config(config), bad)
    with pytest.raises(ValueError) as raised:
        load_pretrained(directory, max_len=512, max_draft=4)
    message = str(raised.value)
    for problem in (
        r"missing scales \(2\): layers\.1\.attn\.wo_b\.scale, layers\.2\.ffn\.experts\.1\.w2\.scale",
        r"unexpected tensors \(1\): layers\.0\.ffn\.gate\.scale",
        r"tensor layers\.0\.attn\.wq_a\.scale: shape \(1, 1\), the config gives \(2, 1\) \(the fp8 scales\)",
        r"tensor layers\.1\.attn\.wq_b\.scale: dtype F32, expected F8_E8M0 \(fp8 scales\)",
        r"tensor layers\.0\.ffn\.experts\.0\.w1\.weight: dtype U8, expected I8 \(fp4: quantization_config\)",
        r"tensor layers\.0\.ffn\.experts\.1\.w3\.weight: shape \(32, 32\), the config gives \(32, 16\) \(fp4",
        r"tensor layers\.0\.ffn\.experts\.1\.w3\.weight: dtype F8_E4M3, expected I8",
        r"tensor layers\.0\.ffn\.gate\.weight: dtype I8, expected a floating-point dtype \(quantized: the",
        r"tensor embed\.weight: dtype F8_E4M3, expected a floating-point dtype \(quantized: the format",
    ):
        assert re.search(problem, message), (problem, message)


def test_scale_exponents_out_of_range_are_named(tmp_path, checkpoints):
    """An e8m0 exponent of 255 (NaN) in a scale: a ValueError naming the tensor when it is read."""
    _, tensors, _ = checkpoints
    config = quantized_config()
    bad = dict(tensors)
    scale = bad["layers.2.ffn.experts.3.w1.scale"].view(np.uint8).copy()
    scale[0, 0] = 255
    bad["layers.2.ffn.experts.3.w1.scale"] = scale.view(ml_dtypes.float8_e8m0fnu)
    directory = released.write_released(tmp_path / "nan", released.released_config(config), bad)
    with pytest.raises(
        ValueError,
        match=r"tensor layers\.2\.ffn\.experts\.3\.w1\.scale: scales must be in .*, got e8m0 exponent 255$",
    ):
        load_pretrained(directory, max_len=512, max_draft=4)


@pytest.mark.parametrize("fmt", [FP4, FP8])
@pytest.mark.parametrize("dispatch", ["dense", "grouped_jnp", "grouped_ragged_dot"])
def test_expert_dispatch_takes_quantized_experts(fmt, dispatch):
    """Each expert dispatch on quantized experts (4 experts, 32 x 64) gives its result on the dequantized
    experts, float32 to rounding."""
    rng = np.random.default_rng(4)
    quantize = quant.quantize_fp8 if fmt == FP8 else quant.quantize_fp4

    def experts(out, width):
        pieces = [quantize(rng.normal(size=(out, width)).astype(np.float32)) for _ in range(4)]
        codes = np.stack([c.view(np.uint8) if fmt == FP4 else c for c, _ in pieces])
        scales = np.stack([s.view(np.uint8) for _, s in pieces])
        scales = quant.row_scales(scales, out) if fmt == FP8 else scales
        return QuantizedArray(jnp.asarray(codes), jnp.asarray(scales), fmt, "float32")

    gate_up, down = experts(64, 32), experts(32, 32)
    x = jnp.asarray(rng.normal(size=(2, 5, 32)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 4, (2, 5, 2)), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(2, 5, 2)), jnp.float32)
    run = jax.jit(moe.DISPATCHES[dispatch], static_argnums=5)
    got = run(x, ids, weights, gate_up, down, 10.0)
    want = run(x, ids, weights, quant.dequantize(gate_up), quant.dequantize(down), 10.0)
    assert rel_err(got, want) < 1e-6


def test_bench_released_weights():
    """bench/bench_decode.py's ``--weights released`` (bench/bench_models.py): every parameter the released
    format quantizes is a QuantizedArray in the loader's layout, made in that form, its values finite and of
    the float init's size (std 1 / sqrt(in) within the scales' factor 2, and the sample's noise); every other
    parameter is the float model's; a plain step of one token reads the target whole and top-k experts of
    each of its MoE layers (bench/step_floor.py)."""
    bench_dir = pathlib.Path(__file__).parents[1] / "bench"
    models, floor = (runpy.run_path(str(bench_dir / name)) for name in ("bench_models.py", "step_floor.py"))
    config = ModelConfig.from_hf(quantized_config(), dtype="bfloat16")
    model = models["released_model"](config, "online")
    float_model = SpeculativeModel(config, rngs=nnx.Rngs(0))
    paths = pretrained.parameter_paths(model)
    formats = pretrained.released_formats(paths, FP4, optional=True)
    assert set(formats.values()) == {FP4, FP8}
    for name, path in paths.items():
        value, want = variable_at(model, path)[...], variable_at(float_model, path)[...]
        if name not in formats:
            np.testing.assert_array_equal(np.asarray(value), np.asarray(want), err_msg=name)
            continue
        assert isinstance(value, QuantizedArray) and value.fmt == formats[name], name
        weights = np.asarray(quant.dequantize(value), np.float32)
        assert weights.shape == want.shape and np.all(np.isfinite(weights)), name
        assert 0.45 < weights.std() * np.sqrt(weights.shape[-1]) < 2.2, name
    reads = floor["weight_reads"](model)
    top_k = config.num_experts_per_tok
    experts = sum(top_k * one for owner, _, one in reads.moe if owner == "target")
    assert floor["step_read_bytes"](reads, {}, 1, top_k) == pytest.approx(reads.target + experts)
