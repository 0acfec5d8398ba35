"""DeepSeek-V4 attention (Flax NNX) against transformers' fixture, and its verify mode against decode."""

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

from jax_oc128.nn import AttentionConfig, DeepseekV4Attention

FIXTURE = np.load(pathlib.Path(__file__).parent / "fixtures" / "hf_deepseek_v4.npz")
META = json.loads(bytes(FIXTURE["meta"]).decode())
CONFIG = META["config"]
X = jnp.asarray(FIXTURE["x"])
BATCH, PROMPT = X.shape[:2]
HF_TOL = 1e-4  # the bar: fp32 relative error against transformers


def layer(index, backend="online"):
    weights = {
        k.split("/", 1)[1]: v for k, v in FIXTURE.items() if k.startswith(f"layer{index}/") and "." in k
    }
    weights |= {"sinks": FIXTURE[f"layer{index}/sinks"]}
    return DeepseekV4Attention.from_hf(CONFIG, index, weights, backend=backend, max_draft=4)


def positions(start, stop):
    return jnp.broadcast_to(jnp.arange(start, stop, dtype=jnp.int32), (BATCH, stop - start))


@functools.partial(jax.jit, static_argnames=("graphdef", "verify"), donate_argnames="cache")
def step(graphdef, params, x, pos, cache, lengths=None, verify=False):
    """One jitted call of the module with its cache donated."""
    return nnx.merge(graphdef, params)(x, pos, cache, lengths=lengths, verify=verify)


def run(attn, chunks):
    """Feed X in chunks through the jitted module, the cache donated; outputs concatenated."""
    graphdef, params = nnx.split(attn)
    cache, outputs, start = attn.init_cache(BATCH), [], 0
    for size in chunks:
        y, cache = step(graphdef, params, X[:, start : start + size], positions(start, start + size), cache)
        outputs.append(y)
        start += size
    return jnp.concatenate(outputs, axis=1), cache


CHUNKINGS = {
    "full": (PROMPT,),
    "chunked": tuple(META["chunks"]),
    "decoded": (META["decode_from"],) + (1,) * (PROMPT - META["decode_from"]),
}


@pytest.mark.parametrize("mode", ["full", "chunked", "decoded"])
@pytest.mark.parametrize(
    "index, backend",
    [(0, "online"), (1, "online"), (1, "offline")],
    ids=["sliding", "hca-online", "hca-offline"],
)
def test_matches_transformers(index, mode, backend):
    """Layer outputs and compressed entries (2 closed blocks) equal transformers' within 1e-4 (measured:
    about 5e-7)."""
    y, cache = run(layer(index, backend), CHUNKINGS[mode])
    assert rel_err(y, FIXTURE[f"layer{index}/{mode}"]) < HF_TOL
    if index == 1:
        hf_entries = FIXTURE["layer1/entries" if mode != "decoded" else "layer1/decode_entries"]
        assert rel_err(cache.entries[:, : hf_entries.shape[1]], hf_entries) < HF_TOL
        assert not np.any(np.asarray(cache.entries[:, hf_entries.shape[1] :])), (
            "no entry past the closed blocks"
        )


def test_online_and_offline_backends_agree():
    y_online, c_online = run(layer(1, "online"), CHUNKINGS["chunked"])
    y_offline, c_offline = run(layer(1, "offline"), CHUNKINGS["chunked"])
    assert rel_err(y_online, y_offline) < 1e-5
    assert rel_err(c_online.entries, c_offline.entries) < 1e-5


@pytest.mark.parametrize("backend", ["online", "offline"])
@pytest.mark.parametrize("start", [250, 126], ids=["open-block", "closes-mid-verify"])
def test_verify_equals_decoding_one_by_one(start, backend):
    """N = 4 tokens verified at once give the outputs of decoding them one by one, also when a block
    closes at the second token (the later drafts see its entry); after commit the cache goes on alike."""
    attn = layer(1, backend)
    graphdef, params = nnx.split(attn)
    _, cache = run(attn, (start,))
    _, cache_copy = run(attn, (start,))
    y_verify, cache = step(
        graphdef, params, X[:, start : start + 4], positions(start, start + 4), cache, verify=True
    )
    decoded = []
    for p in range(start, start + 4):
        y, cache_copy = step(graphdef, params, X[:, p : p + 1], positions(p, p + 1), cache_copy)
        decoded.append(y)
    assert rel_err(y_verify, jnp.concatenate(decoded, axis=1)) < 1e-5
    cache = attn.commit(cache, jnp.full((BATCH,), start, jnp.int32), jnp.full((BATCH,), 4, jnp.int32))
    nxt = start + 4
    y_after, _ = step(graphdef, params, X[:, nxt : nxt + 1], positions(nxt, nxt + 1), cache)
    y_ref, _ = step(graphdef, params, X[:, nxt : nxt + 1], positions(nxt, nxt + 1), cache_copy)
    assert rel_err(y_after, y_ref) < 1e-5


def test_cache_is_donated_under_jit():
    attn = layer(1)
    graphdef, params = nnx.split(attn)
    cache = attn.init_cache(BATCH)
    _, new_cache = step(graphdef, params, X[:, :5], positions(0, 5), cache)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(cache))
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(new_cache))


def test_compressed_sparse_attention_is_not_supported_yet():
    config = dict(CONFIG, layer_types=["compressed_sparse_attention", "heavily_compressed_attention"])
    with pytest.raises(NotImplementedError, match="compressed_sparse_attention"):
        AttentionConfig.from_hf(config, 0)


def test_missing_weight_is_named():
    weights = {k.split("/", 1)[1]: v for k, v in FIXTURE.items() if k.startswith("layer1/") and "." in k}
    with pytest.raises(KeyError, match="sinks"):
        DeepseekV4Attention.from_hf(CONFIG, 1, weights)


def test_ragged_rows():
    """Rows of different lengths in one call (the rest padding), then only one row goes on: each row sees
    exactly its own tokens (compared with transformers' unpadded run)."""
    attn = layer(1)
    graphdef, params = nnx.split(attn)
    lengths = jnp.asarray([PROMPT, 200], jnp.int32)
    y, cache = step(graphdef, params, X, positions(0, PROMPT), attn.init_cache(BATCH), lengths)
    expected = FIXTURE["layer1/full"]
    assert rel_err(y[0], expected[0]) < HF_TOL and rel_err(y[1, :200], expected[1, :200]) < HF_TOL
    for p in range(200, 210):  # row 1 decodes on; row 0 is padding (length 0) at its own position
        pos = jnp.asarray([[PROMPT], [p]], jnp.int32)
        x = jnp.stack([X[0, :1], X[1, p : p + 1]])
        y, cache = step(graphdef, params, x, pos, cache, jnp.asarray([0, 1], jnp.int32))
        assert rel_err(y[1], expected[1, p : p + 1]) < HF_TOL


@pytest.mark.parametrize("backend", ["online", "offline"])
@pytest.mark.parametrize("start", [250, 126], ids=["open-block", "closes-mid-verify"])
def test_rejected_drafts_leave_no_trace(start, backend):
    """Verify 4 tokens whose last two are junk, keep 2 (eager commit), and go on: the outputs equal those of
    a cache that only ever saw the 2 kept tokens (window rows, entries and compressor state of the junk are
    all overwritten or invisible)."""
    attn = layer(1, backend)
    graphdef, params = nnx.split(attn)
    _, cache = run(attn, (start,))
    _, clean = run(attn, (start + 2,))
    junk = jnp.asarray(np.random.default_rng(0).normal(size=(BATCH, 2, X.shape[2])), jnp.float32)
    drafts = jnp.concatenate([X[:, start : start + 2], junk], axis=1)
    _, cache = step(graphdef, params, drafts, positions(start, start + 4), cache, verify=True)
    cache = attn.commit(cache, jnp.full((BATCH,), start, jnp.int32), jnp.full((BATCH,), 2, jnp.int32))
    nxt = start + 2
    for verify in (True, False):  # the next verify, and a decode, from the same point
        width = 4 if verify else 1
        x, pos = X[:, nxt : nxt + width], positions(nxt, nxt + width)
        y, _ = step(graphdef, params, x, pos, _copy(cache), verify=verify)
        y_ref, _ = step(graphdef, params, x, pos, _copy(clean), verify=verify)
        assert rel_err(y, y_ref) < 1e-5


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)
