"""The full DeepSeek-V4 decoder (every layer type, MoE, hyper-connections) against transformers 5.24.0:
tests/fixtures/v4_*.npz (scripts/make_v4_fixture.py, read by :func:`hf_fixtures.fixture`) hold tiny random
models' weights by transformers name, their prefill logits and the logits of 40 cached greedy decode steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_fixtures import HF_TOL, fixture, forward, positions
from oracle import rel_err

from jax_oc128 import checkpoint
from jax_oc128.controller import OFFLINE, ONLINE, ForwardMode
from jax_oc128.engine import Engine
from jax_oc128.nn import CSA, HCA, SLIDING, DeepseekV4Model, ModelConfig, SpeculativeModel

NAMES = ("small_window", "large_window")


def load(name, backend=ONLINE, **kwargs):
    config, weights, _ = fixture(name)
    return DeepseekV4Model.from_hf(config, weights, backend=backend, max_len=512, **kwargs)


def test_fixtures_cover_every_layer_and_mlp_type():
    configs = [ModelConfig.from_hf(fixture(name)[0]) for name in NAMES]
    assert {t for c in configs for t in c.layer_types} == {SLIDING, CSA, HCA}
    assert {t for c in configs for t in c.mlp_layer_types} == {"moe", "hash_moe"}
    assert {c.hc_mult for c in configs} == {2, 4}
    assert min(c.sliding_window for c in configs) < 128 < max(c.sliding_window for c in configs)
    prompt = fixture(NAMES[0])[2]["prompt"]
    assert all(c.index_topk < prompt.shape[1] // 4 for c in configs), "the indexer's top-k selects"


@pytest.mark.parametrize("backend", [ONLINE, OFFLINE], ids=["online", "offline"])
@pytest.mark.parametrize("name", NAMES)
def test_prefill_and_decode_match_transformers(name, backend):
    """The prompt's logits, then 40 decode steps fed transformers' greedy tokens, one at a time through the
    donated cache: relative error < 1e-4 each."""
    _, _, data = fixture(name)
    model = load(name, backend)
    graphdef, params = nnx.split(model)
    prompt = jnp.asarray(data["prompt"])
    batch, length = prompt.shape
    logits, cache = forward(graphdef, params, prompt, positions(batch, 0, length), model.init_cache(batch))
    assert rel_err(logits, data["prefill_logits"]) < HF_TOL
    decoded = []
    for i, token in enumerate(data["decode_tokens"].T):
        pos = positions(batch, length + i, length + i + 1)
        step, cache = forward(graphdef, params, jnp.asarray(token)[:, None], pos, cache, ForwardMode.DECODE)
        decoded.append(step[:, 0])
    assert rel_err(jnp.stack(decoded, axis=1), data["decode_logits"]) < HF_TOL


def test_chunked_prefill_matches_transformers():
    """The prompt in chunks of 97, 2, 1 and 120 tokens (windows and blocks split across calls) gives the
    same logits as transformers' single prefill."""
    _, _, data = fixture("small_window")
    model = load("small_window")
    graphdef, params = nnx.split(model)
    prompt = jnp.asarray(data["prompt"])
    batch = prompt.shape[0]
    cache, outputs, start = model.init_cache(batch), [], 0
    for size in (97, 2, 1, 120):
        pos = positions(batch, start, start + size)
        logits, cache = forward(graphdef, params, prompt[:, start : start + size], pos, cache)
        outputs.append(logits)
        start += size
    assert rel_err(jnp.concatenate(outputs, axis=1), data["prefill_logits"]) < HF_TOL


@pytest.mark.parametrize("eager", [True, False], ids=["eager-commit", "lazy-commit"])
@pytest.mark.parametrize("backend", [ONLINE, OFFLINE], ids=["online", "offline"])
@pytest.mark.parametrize("name", NAMES)
def test_verify_with_rejected_drafts_matches_transformers(name, backend, eager):
    """At position 253 verify 2 real tokens and 2 junk drafts (the junk closes a CSA window and a C128
    block at 255), keep 2 (an eager commit, or the next forward's lazy one), then verify the next 4 real
    tokens and decode one: every real token's logits are transformers' (the junk's rows, entries and banks
    are rewritten by position before any query reads them)."""
    _, _, data = fixture(name)
    model = load(name, backend, max_draft=4)
    graphdef, params = nnx.split(model)
    tokens = jnp.asarray(np.concatenate([data["prompt"], data["decode_tokens"]], axis=1))
    batch, length = data["prompt"].shape
    expected = data["decode_logits"]  # the logits of tokens[:, length + i] at position length + i
    start = 253
    _, cache = forward(
        graphdef, params, tokens[:, :start], positions(batch, 0, start), model.init_cache(batch)
    )
    junk = (tokens[:, start + 2 : start + 4] + 7) % data["prefill_logits"].shape[-1]
    drafts = jnp.concatenate([tokens[:, start : start + 2], junk], axis=1)
    verify = ForwardMode.TARGET_VERIFY
    logits, cache = forward(graphdef, params, drafts, positions(batch, start, start + 4), cache, verify)
    assert rel_err(logits[:, :2], expected[:, start - length : start - length + 2]) < HF_TOL
    if eager:
        cache = model.commit(cache, jnp.full((batch,), start, jnp.int32), jnp.full((batch,), 2, jnp.int32))
    start += 2
    for mode, width in ((verify, 4), (ForwardMode.DECODE, 1)):
        pos = positions(batch, start, start + width)
        logits, cache = forward(graphdef, params, tokens[:, start : start + width], pos, cache, mode)
        assert rel_err(logits, expected[:, start - length : start - length + width]) < HF_TOL
        start += width


def test_speculative_greedy_equals_plain_greedy():
    """The engine on the small-window model (CSA, HCA, MoE, hyper-connections) with a random MTP head:
    speculative greedy (N = 4, lazy commits; and a draft tree of 4 nodes) gives the plain greedy tokens,
    whose first 40 on the fixture's prompts are transformers' greedy tokens. (The random head's drafts are
    all rejected here; partly accepted verifies are the test above.)"""
    config, weights, data = fixture("small_window")
    model = SpeculativeModel.from_hf(config, weights, rngs=nnx.Rngs(0), max_len=512, max_draft=4)
    engine = Engine(model, slots=2)
    prompts = [list(map(int, row)) for row in data["prompt"]]
    plain = engine.generate(prompts, 60)
    assert [row[:40] for row in plain.tokens] == data["decode_tokens"].tolist()
    assert engine.generate(prompts, 60, num_tokens=4).tokens == plain.tokens
    assert engine.generate(prompts, 60, tree=(-1, 0, 0, 1)).tokens == plain.tokens


@pytest.mark.parametrize(
    "change, error, match",
    [
        (
            lambda w: w.pop("model.layers.1.self_attn.compressor.indexer.q_b_proj.weight"),
            ValueError,
            r"missing tensors \(1\): model\.layers\.1\.self_attn\.compressor\.indexer\.q_b_proj\.weight",
        ),
        (
            lambda w: w.update({"model.layers.0.mlp.gate.bias": np.zeros(4)}),
            ValueError,
            r"unexpected tensors \(1\): model\.layers\.0\.mlp\.gate\.bias",
        ),
        (
            lambda w: w.update({"model.hc_head.hc_fn": np.zeros((2, 63), np.float32)}),
            ValueError,
            r"tensor model\.hc_head\.hc_fn: shape \(2, 63\), the config gives \(2, 64\)",
        ),
        (
            lambda w: w.update({"model.layers.0.mlp.gate.tid2eid": np.zeros((64, 2), np.float32)}),
            ValueError,
            r"tensor model\.layers\.0\.mlp\.gate\.tid2eid: dtype F32, expected an integer dtype",
        ),
        (
            lambda w: w.update({"model.layers.1.mlp.gate.tid2eid": np.full((64, 2), 4)}),
            ValueError,
            r"weights: tensor model\.layers\.1\.mlp\.gate\.tid2eid: expert ids must be in \[0, 4\)",
        ),
    ],
    ids=["missing", "unexpected", "shape", "dtype", "expert-id"],
)
def test_bad_weights_are_named(change, error, match):
    config, weights, _ = fixture("small_window")
    weights = dict(weights)
    change(weights)
    with pytest.raises(error, match=match):
        DeepseekV4Model.from_hf(config, weights)


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"hc_mult": None}, ValueError, r"config: missing fields \['hc_mult'\]"),
        ({"scoring_func": "softmax"}, NotImplementedError, "config: scoring_func must be 'sqrtsoftplus'"),
        (
            {"mlp_layer_types": ["moe", "dense_mlp", "moe", "moe"]},
            ValueError,
            r"mlp_layer_types\[1\]: must be",
        ),
        (
            {"layer_types": ["sliding_attention"] * 3 + ["full_attention"]},
            ValueError,
            r"layer_types\[3\]: must be",
        ),
        (
            {"compress_rates": {CSA: 8, HCA: 128}},
            NotImplementedError,
            r"config: compress_rates must be \{'compressed_sparse_attention': 4, ",
        ),
    ],
    ids=["missing", "unsupported", "mlp-type", "layer-type", "compress-rate"],
)
def test_bad_configs_are_named(change, error, match):
    config = {k: v for k, v in {**fixture("small_window")[0], **change}.items() if v is not None}
    with pytest.raises(error, match=match):
        ModelConfig.from_hf(config)


def test_checkpoint_round_trip(tmp_path):
    """A model loaded from transformers' weights saves to this package's checkpoint format and loads back
    with the same config (tuples, None fields) and parameters (the int32 hash tables included)."""
    config, weights, _ = fixture("small_window")
    model = SpeculativeModel.from_hf(config, weights, rngs=nnx.Rngs(0), max_len=512)
    checkpoint.save(model, tmp_path / "v4.npz")
    loaded, _ = checkpoint.load(tmp_path / "v4.npz")
    assert loaded.config == model.config
    for (path, want), (_, got) in zip(
        jax.tree_util.tree_leaves_with_path(nnx.state(model)),
        jax.tree_util.tree_leaves_with_path(nnx.state(loaded)),
        strict=True,
    ):
        assert got.dtype == want.dtype and np.array_equal(got, want), jax.tree_util.keystr(path)
