"""The full DeepSeek-V4 decoder (every layer type, MoE, hyper-connections) against transformers 5.24.0:
tests/fixtures/v4_*.npz (scripts/make_v4_fixture.py) hold tiny random models' weights by transformers name,
their prefill logits and the logits of 40 cached greedy decode steps."""

from __future__ import annotations

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from oracle import rel_err

from jax_oc128.controller import OFFLINE, ONLINE, ForwardMode
from jax_oc128.nn import CSA, HCA, SLIDING, DeepseekV4Model, ModelConfig

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
NAMES = ("small_window", "large_window")
HF_TOL = 1e-4  # the bar: fp32 relative error against transformers


@functools.cache
def fixture(name):
    data = dict(np.load(FIXTURES / f"v4_{name}.npz"))
    meta = json.loads(bytes(data.pop("meta")).decode())
    weights = {k.removeprefix("weights/"): data.pop(k) for k in list(data) if k.startswith("weights/")}
    return meta["config"], weights, data


def load(name, backend=ONLINE, **kwargs):
    config, weights, _ = fixture(name)
    return DeepseekV4Model.from_hf(config, weights, backend=backend, max_len=512, **kwargs)


@functools.partial(jax.jit, static_argnames=("graphdef", "mode"), donate_argnames="cache")
def forward(graphdef, params, tokens, positions, cache, mode=ForwardMode.EXTEND):
    logits, _, cache = nnx.merge(graphdef, params)(tokens, positions, cache, mode=mode)
    return logits, cache


def positions(batch, start, stop):
    return jnp.broadcast_to(jnp.arange(start, stop, dtype=jnp.int32), (batch, stop - start))


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
