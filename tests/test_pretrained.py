"""``jax_oc128.load_pretrained`` on tiny DeepSeek-V4 checkpoints: transformers' own ``save_pretrained`` output
(tests/fixtures/v4_small_window_hf, scripts/make_v4_checkpoint.py) and checkpoints written here from the
parity fixtures' weights (one file with transformers' names; shards and an index with DeepSeek's names and an
MTP layer). Loaded models hold exactly the weights written, give transformers' logits, decode speculatively
with the checkpoint's MTP layer as the draft head (greedy output = plain greedy), and every bad checkpoint is
refused, naming what is wrong, before any tensor is placed."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from harness import first_difference
from hf_fixtures import (
    FIXTURES,
    HF_TOL,
    deepseek_named,
    fixture,
    prefill_logits,
    target_tensors,
    tensors_of,
    write,
)
from oracle import rel_err

from jax_oc128 import load_pretrained, pretrained
from jax_oc128.engine import Engine
from jax_oc128.loading import names
from jax_oc128.nn import SLIDING, ModelConfig, RuntimeConfig, SpeculativeModel, kv_cache

HF_CHECKPOINT = FIXTURES / "v4_small_window_hf"
LAYERS = 4  # the small-window fixture's decoder layers


def assert_same_parameters(model, expected: dict):
    got = tensors_of(model)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and np.array_equal(got[name], value), name


@pytest.fixture(scope="module")
def small_window_with_mtp():
    """The small-window fixture's model with a random MTP layer (a SpeculativeModel) and its tensors."""
    config, weights, _ = fixture("small_window")
    model = SpeculativeModel.from_hf(config, weights, rngs=nnx.Rngs(1), max_len=512, max_draft=4)
    return config, model, tensors_of(model)


def test_transformers_save_pretrained_loads():
    """transformers' own checkpoint (a mixture of its names and DeepSeek's, one tensor per expert, BF16
    storage): the from_hf model's parameters and transformers' prompt logits; no MTP layer in it, so the
    model has no draft head."""
    _, _, data = fixture("small_window")
    model = load_pretrained(HF_CHECKPOINT, dtype="float32", max_len=512)
    assert model.mtp is None and not model.config.mtp
    assert_same_parameters(model, target_tensors("small_window"))
    assert rel_err(prefill_logits(model, data["prompt"]), data["prefill_logits"]) < HF_TOL


@pytest.mark.parametrize("name", ["small_window", "large_window"])
def test_single_file_with_transformers_names(tmp_path, name):
    """One model.safetensors with transformers' state-dict names (the fixtures' float32 tensors): the
    fixture's logits, exactly the weights written."""
    config, weights, data = fixture(name)
    model = load_pretrained(write(tmp_path / name, config, weights), dtype="float32", max_len=512)
    assert model.config == ModelConfig.from_hf(config, mtp=False) and model.runtime == RuntimeConfig(
        max_len=512
    )
    assert_same_parameters(model, target_tensors(name))
    assert rel_err(prefill_logits(model, data["prompt"]), data["prefill_logits"]) < HF_TOL


def test_deepseek_config_fields(tmp_path):
    """A config.json with DeepSeek's fields instead of transformers' (``compress_ratios`` with the MTP
    layer's entry, ``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling``): the same model config as
    transformers makes of them (the fixture's config is transformers' conversion of these fields)."""
    config, weights, _ = fixture("small_window")
    theirs = {
        k: v for k, v in config.items() if k not in ("layer_types", "mlp_layer_types", "rope_parameters")
    }
    theirs |= {
        "compress_ratios": [0, 4, 128, 4, 0],
        "num_hash_layers": 2,
        "qk_rope_head_dim": 8,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4,
            "original_max_position_embeddings": 128,
            "beta_fast": 32,
        },
    }
    model = load_pretrained(write(tmp_path / "ckpt", theirs, weights), dtype="float32", max_len=512)
    assert model.config == ModelConfig.from_hf(config, mtp=False)
    theirs["compress_ratios"] = [0, 4, 128, 4, 128]
    with pytest.raises(
        NotImplementedError, match=r"config\.json: compress_ratios\[4\]: the MTP layer must be sliding"
    ):
        load_pretrained(write(tmp_path / "mtp-hca", theirs | {"num_nextn_predict_layers": 1}, weights))


def test_shards_with_deepseek_names_and_mtp_decode_speculatively(tmp_path, small_window_with_mtp):
    """Three shards and an index, DeepSeek's names (``layers.{i}.attn.wq_a.weight``, per-expert tensors, the
    MTP layer as ``mtp.0.*``), BF16 and F32 storage: the same model, transformers' prompt logits; its MTP
    layer drafts in the engine and greedy speculative decoding (N = 2 and 4) gives the plain greedy tokens,
    whose first 40 are transformers'."""
    config, written, tensors = small_window_with_mtp
    _, _, data = fixture("small_window")
    directory = write(
        tmp_path / "ckpt", config | {"num_nextn_predict_layers": 1}, deepseek_named(tensors, 4), 3
    )
    model = load_pretrained(directory, dtype="float32", max_len=512, max_draft=4)
    assert model.config == written.config
    assert_same_parameters(model, tensors)
    assert rel_err(prefill_logits(model, data["prompt"]), data["prefill_logits"]) < HF_TOL
    engine = Engine(model, slots=2)
    prompts = [list(map(int, row)) for row in data["prompt"]]
    # stop_tokens=(): the config's EOS id (1) would end a row before the 40 tokens transformers gave
    plain = engine.generate(prompts, 50, stop_tokens=())
    assert [row[:40] for row in plain.tokens] == data["decode_tokens"].tolist()
    for n in (2, 4):
        assert engine.generate(prompts, 50, num_tokens=n, stop_tokens=()).tokens == plain.tokens, n


def copying_checkpoint() -> tuple[dict, SpeculativeModel]:
    """A tiny model (2 layers: sliding + top-k MoE, then HCA; hc_mult 2) whose MTP layer copies what its
    first layer predicts: the embedding's rows have RMS 1, the MTP layer's embedding projection is the
    identity and its hidden projection zero, its block, stream collapse and norm are the target's first
    block, collapse and norm; the second layer's outputs are scaled by 0.1. So the MTP layer drafts the
    target's prediction up to the second layer's small correction."""
    config, _, _ = fixture("small_window")
    config = config | {
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "heavily_compressed_attention"],
        "mlp_layer_types": ["moe", "moe"],
        "num_nextn_predict_layers": 1,
    }
    model = SpeculativeModel(
        ModelConfig.from_hf(config), RuntimeConfig(max_len=512, max_draft=4), rngs=nnx.Rngs(7)
    )
    embed = model.target.embed[...]
    model.target.embed[...] = embed / jnp.sqrt(jnp.mean(embed * embed, axis=-1, keepdims=True))
    second = model.target.blocks[1]
    for variable in (second.attn.o_b_proj, second.moe.experts_down, second.moe.shared_down):
        variable[...] = variable[...] * 0.1
    mtp = model.mtp
    mtp.embed_proj[...] = jnp.eye(config["hidden_size"])
    mtp.hidden_proj[...] = jnp.zeros_like(mtp.hidden_proj[...])
    nnx.update(mtp.block, nnx.state(model.target.blocks[0]))
    nnx.update(mtp.hc_head, nnx.state(model.target.hc_head))
    mtp.norm[...] = model.target.norm[...]
    return config, model


@pytest.fixture(scope="module")
def copying(tmp_path_factory):
    """:func:`copying_checkpoint` written with the MTP layer named the DeepSeek-V3 way
    (``model.layers.{num_hidden_layers}.*``): its directory, its tensors, and the float32 model loaded from
    it in a 2-slot engine."""
    config, written = copying_checkpoint()
    tensors = tensors_of(written)
    named = {n.replace("mtp.0.", "model.layers.2."): v for n, v in deepseek_named(tensors, 2).items()}
    directory = write(tmp_path_factory.mktemp("copying") / "ckpt", config, named)
    model = load_pretrained(directory, dtype="float32", max_len=512, max_draft=4)
    return directory, tensors, Engine(model, slots=2)


def test_mtp_layer_drafts_are_accepted(copying):
    """The copying MTP layer, named the DeepSeek-V3 way: exactly the weights written; its drafts are mostly
    accepted (mean accepted length well above 1 at N = 4) and greedy speculative decoding still gives the
    plain greedy tokens."""
    _, tensors, engine = copying
    assert_same_parameters(engine.model, tensors)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
    plain = engine.generate(prompts, 40, stop_tokens=())  # the full 40 (no stop at the config's EOS id)
    speculative = engine.generate(prompts, 40, num_tokens=4, stop_tokens=())
    assert speculative.tokens == plain.tokens
    assert speculative.mean_accepted > 2.5, speculative.mean_accepted


def test_bfloat16_against_float32(copying):
    """The copying checkpoint (:func:`copying_checkpoint`) in bfloat16 and in float32 on the same prompts
    (the small-window fixture's first 100 tokens): prefill logits, greedy tokens and the MTP layer's accepted
    lengths. bfloat16 rounds each matmul's inputs to 8 significant bits: the logits are within 5% (2x the
    2.6% measured on the CPU; transformers' own bfloat16 forward of the small-window model is 16% from its
    float32 logits, the indexer's and routers' discrete picks flipping) and their argmax the same at 95% of
    the positions (99% measured), the greedy speculative tokens are the plain greedy tokens in bfloat16 too,
    and the drafts are accepted as often. Prints the numbers
    (``pytest -s``; bench/RESULTS.md records them)."""
    directory, _, float32 = copying
    prompts = fixture("small_window")[2]["prompt"][:, :100]
    bfloat16 = load_pretrained(directory, dtype="bfloat16", max_len=512, max_draft=4)
    report = {}
    for dtype, engine in (("float32", float32), ("bfloat16", Engine(bfloat16, slots=2))):
        model = engine.model
        requests = [list(map(int, row)) for row in prompts]
        plain = engine.generate(requests, 100, stop_tokens=())  # the full 100: no stop at the EOS id
        speculative = engine.generate(requests, 100, num_tokens=4, stop_tokens=())
        assert speculative.tokens == plain.tokens, dtype
        report[dtype] = prefill_logits(model, prompts), plain.tokens, speculative.mean_accepted
    (logits32, tokens32, accepted32), (logits16, tokens16, accepted16) = report.values()
    error = rel_err(logits16, logits32)
    argmax = float(jnp.mean(jnp.argmax(logits16, -1) == jnp.argmax(logits32, -1)))
    same = [first_difference(a, b) for a, b in zip(tokens32, tokens16, strict=True)]
    print(
        f"\nbfloat16 vs float32: prefill logits rel. error {error:.4f}, argmax agreement {argmax:.4f}; "
        f"greedy tokens equal up to {same} of 100; mean accepted length (N = 4) float32 "
        f"{accepted32:.3f}, bfloat16 {accepted16:.3f}"
    )
    assert error < 0.05 and argmax > 0.95
    assert accepted16 > 2.5 and accepted32 > 2.5


def test_without_mtp_layer_decodes_plainly_only():
    model = load_pretrained(HF_CHECKPOINT, max_len=512)
    engine = Engine(model, slots=1)
    with pytest.raises(ValueError, match="num_tokens: this model has no MTP head"):
        engine.generate([[1, 2, 3]], 4, num_tokens=2)
    with pytest.raises(ValueError, match="num_tokens: this model has no MTP head"):
        engine.prefill(engine.init_state(), {0: [1, 2, 3]}, 4, num_tokens=2)


def test_bfloat16_weights(tmp_path):
    """``dtype="bfloat16"``: the matrices in bfloat16 (the fixture's values exactly, they are bfloat16
    values), norms, hyper-connections, sinks, position biases and router biases in float32; the hash
    tables int32. The default is bfloat16 on a GPU, float32 elsewhere; a dtype that is neither is refused."""
    model = load_pretrained(HF_CHECKPOINT, dtype="bfloat16", max_len=512)
    assert model.config.dtype == "bfloat16"
    got, expected = (
        tensors_of(model),
        tensors_of(load_pretrained(HF_CHECKPOINT, dtype="float32", max_len=512)),
    )
    float32 = (
        "norm.weight",
        "hc_fn",
        "hc_base",
        "hc_scale",
        ".fn",
        ".base",
        ".scale",
        "sinks",
        "position_bias",
    )
    for name, value in expected.items():
        if value.dtype == np.int32:
            want = np.int32
        elif name.endswith((*float32, "e_score_correction_bias")):
            want = np.float32
        else:
            want = ml_dtypes.bfloat16
        assert got[name].dtype == want, name
        assert np.array_equal(got[name].astype(np.float32), value.astype(np.float32)), name
    default = load_pretrained(HF_CHECKPOINT).config.dtype
    assert default == ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    with pytest.raises(ValueError, match="dtype: must be None, 'float32' or 'bfloat16'"):
        load_pretrained(HF_CHECKPOINT, dtype="float16")
    with pytest.raises(TypeError, match="dtype: must be None"):
        load_pretrained(HF_CHECKPOINT, dtype=object())


BAD_TENSORS = {
    "missing": (
        lambda t: t.pop("model.layers.1.self_attn.compressor.indexer.q_b_proj.weight"),
        r"missing tensors \(1\): model\.layers\.1\.self_attn\.compressor\.indexer\.q_b_proj\.weight "
        r"\(DeepSeek: layers\.1\.attn\.indexer\.wq_b\.weight\)",
    ),
    "unexpected": (
        lambda t: t.update({"model.layers.0.mlp.gate.bias": np.zeros(4, np.float32)}),
        r"unexpected tensors \(1\): model\.layers\.0\.mlp\.gate\.bias",
    ),
    "misshaped": (
        lambda t: t.update({"model.hc_head.hc_fn": np.zeros((2, 63), np.float32)}),
        r"tensor model\.hc_head\.hc_fn: shape \(2, 63\), the config gives \(2, 64\)",
    ),
    "float-table": (
        lambda t: t.update({"model.layers.0.mlp.gate.tid2eid": np.zeros((64, 2), np.float32)}),
        r"tensor model\.layers\.0\.mlp\.gate\.tid2eid: dtype BF16, expected an integer dtype",
    ),
    "integer-weight": (
        lambda t: t.update({"lm_head.weight": np.zeros((64, 32), np.int32)}),
        r"tensor lm_head\.weight: dtype I32, expected a floating-point dtype",
    ),
    "twice": (
        lambda t: t.update({"layers.0.attn.kv_norm.weight": t["model.layers.0.self_attn.kv_norm.weight"]}),
        r"tensors layers\.0\.attn\.kv_norm\.weight, model\.layers\.0\.self_attn\.kv_norm\.weight: the same "
        r"parameter \(model\.layers\.0\.self_attn\.kv_norm\.weight\) twice",
    ),
    "expert-ids": (
        lambda t: t.update({"model.layers.1.mlp.gate.tid2eid": np.full((64, 2), 4, np.int64)}),
        r"model\.safetensors: tensor model\.layers\.1\.mlp\.gate\.tid2eid: expert ids must be in \[0, 4\)",
    ),
    "mtp-not-in-config": (
        lambda t: t.update({"mtp.0.enorm.weight": np.ones(32, np.float32)}),
        r"unexpected tensors \(1\): mtp\.0\.enorm\.weight",
    ),
}

BAD_CONFIGS = {
    "missing-field": ({"hc_mult": None}, ValueError, r"config\.json: config: missing fields \['hc_mult'\]"),
    "layer-type": (
        {"layer_types": ["sliding_attention"] * 3 + ["full_attention"]},
        ValueError,
        r"config\.json: layer_types\[3\]: must be",
    ),
    "mlp-type": (
        {"mlp_layer_types": ["moe", "dense", "moe", "moe"]},
        ValueError,
        r"mlp_layer_types\[1\]: must be",
    ),
    "quantized": (  # not DeepSeek's released format (tests/test_quantized.py loads that)
        {"quantization_config": {"quant_method": "fp8"}},
        ValueError,
        r"config\.json: quantization_config\['fmt'\]: must be 'e4m3' \(DeepSeek's released format\)",
    ),
    "unknown-architecture": (
        {"architectures": ["LlamaForCausalLM"]},
        ValueError,
        r"config\.json: architectures: architecture: unknown 'LlamaForCausalLM'; registered: "
        r".*DeepseekV4ForCausalLM",
    ),
    "two-architectures": (
        {"architectures": ["DeepseekV4ForCausalLM", "X"]},
        ValueError,
        r"config\.json: architectures: must be a list of one name, got \['DeepseekV4ForCausalLM', 'X'\]",
    ),
    "two-mtp-layers": (
        {"num_nextn_predict_layers": 2},
        NotImplementedError,
        r"num_nextn_predict_layers: at most 1 MTP layer, got 2",
    ),
    "huge": (
        # an embedding of 2**30 x 2**14 float32 (64 TiB): refused from the headers, nothing allocated
        {"vocab_size": 2**30, "hidden_size": 2**14},
        ValueError,
        r"tensor model\.embed_tokens\.weight: shape \(64, 32\), the config gives \(1073741824, 16384\)",
    ),
}


@pytest.mark.parametrize("case", BAD_TENSORS)
def test_bad_tensors_are_named(tmp_path, nothing_placed, case):
    change, match = BAD_TENSORS[case]
    config, weights, _ = fixture("small_window")
    tensors = dict(weights)
    change(tensors)
    with pytest.raises(ValueError, match=match):
        load_pretrained(write(tmp_path / "ckpt", config, tensors), max_len=512)


def test_every_problem_in_one_error(tmp_path, nothing_placed, small_window_with_mtp):
    """DeepSeek's names in shards: a missing expert part, a missing MTP tensor, two unexpected tensors and a
    misshaped one, all in one error."""
    config, _, tensors = small_window_with_mtp
    named = deepseek_named(tensors, LAYERS)
    del named["layers.2.ffn.experts.3.w3.weight"], named["mtp.0.hnorm.weight"]
    named |= {
        "layers.2.ffn.experts.4.w1.weight": named["layers.2.ffn.experts.0.w1.weight"],
        "extra": np.ones(1),
    }
    named["mtp.0.e_proj.weight"] = np.zeros((32, 31), np.float32)
    directory = write(tmp_path / "ckpt", config | {"num_nextn_predict_layers": 1}, named, 2)
    with pytest.raises(ValueError) as error:
        load_pretrained(directory, max_len=512)
    lines = str(error.value).splitlines()
    assert lines[0] == f"{directory}: the checkpoint does not fit its config:"
    assert lines[1:] == [
        "  unexpected tensors (2): extra, layers.2.ffn.experts.4.w1.weight",
        "  missing tensors (2): layers.2.ffn.experts.3.w3.weight, "
        "model.layers.4.hnorm.weight (DeepSeek: mtp.0.hnorm.weight)",
        "  tensor mtp.0.e_proj.weight: shape (32, 31), the config gives (32, 32)",
    ]


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_bad_configs_are_named(tmp_path, nothing_placed, case):
    change, error, match = BAD_CONFIGS[case]
    config, weights, _ = fixture("small_window")
    config = {k: v for k, v in {**config, **change}.items() if v is not None}
    with pytest.raises(error, match=match):
        load_pretrained(write(tmp_path / "ckpt", config, weights), max_len=512)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"path": 3}, TypeError, "path: must be a str or os.PathLike"),
        ({"backend": "online"}, TypeError, "backend: must be a jax_oc128.Backend"),
        ({"max_len": 0}, ValueError, r"max_len: must be in \[1, 2147483647\], got 0"),
        ({"max_draft": 17}, ValueError, r"max_draft: must be in \[1, 16\]"),
        ({"max_draft": 2.0}, TypeError, "max_draft: must be an int"),
        ({"kv_cache_dtype": "float16"}, ValueError, r"kv_cache_dtype: must be one of \['auto'"),
        # the fixture's indexer keys have 16 channels, less than one FP4 group
        ({"kv_cache_dtype": "fp8_fp4"}, ValueError, "config.json: index_head_dim: must be a multiple of 32"),
        ({"attention_impl": "flash"}, ValueError, r"attention_impl: must be one of \('jnp'"),
    ],
)
def test_bad_arguments_are_named(nothing_placed, kwargs, error, match):
    with pytest.raises(error, match=match):
        load_pretrained(**{"path": HF_CHECKPOINT, **kwargs})


def test_kv_cache_dtype_picks_the_caches():
    """``load_pretrained(kv_cache_dtype=...)`` is the model's cache format: FP8 entries in every compressed
    layer of the checkpoint's model; ``attention_impl`` is every layer's attention math."""
    model = load_pretrained(HF_CHECKPOINT, max_len=512, kv_cache_dtype="fp8", attention_impl="kernel")
    assert model.runtime.kv_cache_dtype == "fp8"
    assert {block.attn.attention_impl for block in model.target.blocks} == {"kernel"}
    cache = jax.eval_shape(lambda: model.target.init_cache(1))
    compressed = [
        layer for layer, kind in zip(cache.layers, model.config.layer_types, strict=True) if kind != SLIDING
    ]
    assert compressed and all(isinstance(layer.entries, kv_cache.FP8Entries) for layer in compressed)


def test_bad_directories_are_named(tmp_path, nothing_placed):
    config, weights, _ = fixture("small_window")
    with pytest.raises(ValueError, match=r"path: .* has no config\.json"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"path: .* has neither model\.safetensors nor model\.safetensors\.index"
    ):
        load_pretrained(tmp_path)
    directory = write(tmp_path / "sharded", config, dict(weights), 2)
    index = json.loads((directory / pretrained.INDEX).read_text())
    index["weight_map"]["model.norm.weight"] = index["weight_map"]["lm_head.weight"]  # the other shard
    (directory / pretrained.INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"index\.json: tensor model\.norm\.weight: not in model-0000"):
        load_pretrained(directory)


@pytest.mark.parametrize(
    "name, part",
    [
        ("embed.weight", ("model.embed_tokens.weight", None, None)),
        ("head.weight", ("lm_head.weight", None, None)),
        ("hc_head_scale", ("model.hc_head.hc_scale", None, None)),
        (
            "layers.5.attn.indexer.compressor.ape",
            ("model.layers.5.self_attn.compressor.indexer.position_bias", None, None),
        ),
        ("layers.0.ffn.experts.17.w3.weight", ("model.layers.0.mlp.experts.gate_up_proj", 17, 1)),
        ("model.layers.3.ffn.experts.2.w2.weight", ("model.layers.3.mlp.experts.down_proj", 2, None)),
        ("mtp.0.attn.attn_sink", (f"model.layers.{LAYERS}.self_attn.sinks", None, None)),
        ("mtp.0.hc_head_fn", (f"model.layers.{LAYERS}.hc_head_fn", None, None)),
        ("mtp.0.ffn.gate.bias", (f"model.layers.{LAYERS}.mlp.gate.e_score_correction_bias", None, None)),
        (
            "model.layers.1.self_attn.q_a_proj.weight",
            ("model.layers.1.self_attn.q_a_proj.weight", None, None),
        ),
    ],
)
def test_deepseek_names(name, part):
    """Names as DeepSeek-V4-Flash's checkpoint has them (and a transformers one) resolve to the parameter."""
    assert names.part(name, LAYERS) == pretrained.Part(*part)


def test_a_loaded_model_stops_at_its_eos_by_default(tmp_path):
    """A loaded checkpoint's EOS ids are ``model.eos_token_ids``: config.json's ``eos_token_id`` (1), or
    generation_config.json's where it sets one; ``Engine.generate`` ends each row at the first of them unless
    given ``stop_tokens`` (``()``: none): the full decode cut after its first EOS. A bad ``eos_token_id`` is
    refused naming the file and the field."""
    assert load_pretrained(HF_CHECKPOINT, dtype="float32", max_len=512).eos_token_ids == (1,)
    directory = tmp_path / "ckpt"
    directory.mkdir()
    for file in HF_CHECKPOINT.iterdir():
        (directory / file.name).symlink_to(file)
    prompts = [list(map(int, row[:20])) for row in fixture("small_window")[2]["prompt"]]
    (directory / "generation_config.json").write_text('{"eos_token_id": 1}')
    full = Engine(load_pretrained(directory, dtype="float32", max_len=512), slots=2).generate(
        prompts, 30, stop_tokens=()
    )
    eos = full.tokens[0][4]  # a token of the first row, made an EOS id
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 1]}))
    model = load_pretrained(directory, dtype="float32", max_len=512)
    assert model.eos_token_ids == (eos, 1)
    got = Engine(model, slots=2).generate(prompts, 30).tokens
    for row, want in zip(got, full.tokens, strict=True):
        cut = next((i + 1 for i, token in enumerate(want) if token in (eos, 1)), len(want))
        assert row == want[:cut]
    assert len(got[0]) <= 5
    (directory / "generation_config.json").write_text('{"eos_token_id": [1, "x"]}')
    with pytest.raises(ValueError, match=r"generation_config\.json: eos_token_id: must be a token id in"):
        load_pretrained(directory, dtype="float32", max_len=512)
