"""DeepSeek-V4 attention (Flax NNX) against transformers' fixture, and its verify mode against decode."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from harness import copy_tree
from hf_fixtures import ATTENTION_FIXTURE as FIXTURE
from hf_fixtures import ATTENTION_META as META
from hf_fixtures import ATTENTION_MODEL as MODEL
from hf_fixtures import ATTENTION_RUNTIME as RUNTIME
from hf_fixtures import ATTENTION_X as X
from hf_fixtures import HF_TOL, attention_layer, attention_weights
from oracle import rel_err

from jax_oc128.controller import OFFLINE, ONLINE, ForwardMode
from jax_oc128.nn import DeepseekV4Attention, ForwardBatch, commit_verify, prepare_forward

BATCH, PROMPT = X.shape[:2]
VERIFY = ForwardMode.TARGET_VERIFY


def positions(start, stop):
    return jnp.broadcast_to(jnp.arange(start, stop, dtype=jnp.int32), (BATCH, stop - start))


def init_caches(attn, backend=ONLINE):
    """The layer's own cache and a compressor state of its own on the C128 ``backend`` (None for a sliding
    layer)."""
    return attn.init_cache(BATCH), attn.init_compressed(BATCH, backend)


@functools.partial(jax.jit, static_argnames=("graphdef", "mode"), donate_argnames="caches")
def step(graphdef, params, x, pos, caches, lengths=None, mode=ForwardMode.EXTEND):
    """One jitted forward of the layer (the controller's transition first, as a model runs it) with its
    caches ``(cache, compressed)`` donated."""
    attn = nnx.merge(graphdef, params)
    cache, compressed = caches
    forward_batch = ForwardBatch.create(pos, lengths=lengths, mode=mode)
    compressed = prepare_forward(compressed, forward_batch)
    y, cache, compressed = attn(x, cache, compressed, forward_batch)
    return y, (cache, compressed)


def commit(caches, seq_len, accept):
    """The eager commit of every row's verify at ``seq_len``, keeping ``accept`` tokens."""
    cache, compressed = caches
    full = functools.partial(jnp.full, (BATCH,), dtype=jnp.int32)
    return cache, commit_verify(compressed, full(seq_len), full(accept))


def run(attn, chunks, backend=ONLINE):
    """Feed X in chunks through the jitted module (its C128 state on ``backend``), the cache donated;
    outputs concatenated."""
    graphdef, params = nnx.split(attn)
    cache, outputs, start = init_caches(attn, backend), [], 0
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
    [(0, ONLINE), (1, ONLINE), (1, OFFLINE)],
    ids=["sliding", "hca-online", "hca-offline"],
)
def test_matches_transformers(index, mode, backend):
    """Layer outputs and compressed entries (2 closed blocks) equal transformers' within 1e-4 (measured:
    about 5e-7)."""
    y, cache = run(attention_layer(index), CHUNKINGS[mode], backend)
    assert rel_err(y, FIXTURE[f"layer{index}/{mode}"]) < HF_TOL
    if index == 1:
        hf_entries = FIXTURE["layer1/entries" if mode != "decoded" else "layer1/decode_entries"]
        entries = cache[0].entries
        assert rel_err(entries[:, : hf_entries.shape[1]], hf_entries) < HF_TOL
        assert not np.any(np.asarray(entries[:, hf_entries.shape[1] :])), "no entry past the closed blocks"


def test_online_and_offline_backends_agree():
    y_online, c_online = run(attention_layer(1), CHUNKINGS["chunked"], ONLINE)
    y_offline, c_offline = run(attention_layer(1), CHUNKINGS["chunked"], OFFLINE)
    assert rel_err(y_online, y_offline) < 1e-5
    assert rel_err(c_online[0].entries, c_offline[0].entries) < 1e-5


@pytest.mark.parametrize("backend", [ONLINE, OFFLINE], ids=["online", "offline"])
@pytest.mark.parametrize("start", [250, 126], ids=["open-block", "closes-mid-verify"])
def test_verify_equals_decoding_one_by_one(start, backend):
    """N = 4 tokens verified at once give the outputs of decoding them one by one, also when a block
    closes at the second token (the later drafts see its entry); after commit the cache goes on alike."""
    attn = attention_layer(1)
    graphdef, params = nnx.split(attn)
    _, cache = run(attn, (start,), backend)
    _, cache_copy = run(attn, (start,), backend)
    y_verify, cache = step(
        graphdef, params, X[:, start : start + 4], positions(start, start + 4), cache, mode=VERIFY
    )
    decoded = []
    for p in range(start, start + 4):
        y, cache_copy = step(graphdef, params, X[:, p : p + 1], positions(p, p + 1), cache_copy)
        decoded.append(y)
    assert rel_err(y_verify, jnp.concatenate(decoded, axis=1)) < 1e-5
    cache = commit(cache, start, 4)
    nxt = start + 4
    y_after, _ = step(graphdef, params, X[:, nxt : nxt + 1], positions(nxt, nxt + 1), cache)
    y_ref, _ = step(graphdef, params, X[:, nxt : nxt + 1], positions(nxt, nxt + 1), cache_copy)
    assert rel_err(y_after, y_ref) < 1e-5


def test_cache_is_donated_under_jit():
    attn = attention_layer(1)
    graphdef, params = nnx.split(attn)
    cache = init_caches(attn)
    _, new_cache = step(graphdef, params, X[:, :5], positions(0, 5), cache)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(cache))
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(new_cache))


def test_bad_weights_are_named_together(nothing_placed):
    """A layer's weights go through load_pretrained's checker: a missing, a misshapen and an unexpected
    tensor (another layer's) named in one error, before anything is placed."""
    weights = attention_weights(1)
    width = weights["q_a_norm.weight"].shape[0]
    weights["q_a_norm.weight"] = weights["q_a_norm.weight"][:-1]
    weights["model.layers.0.self_attn.sinks"] = FIXTURE["layer1/sinks"]
    with pytest.raises(ValueError) as error:
        DeepseekV4Attention.from_hf(MODEL.attention(MODEL.layer_types[1], RUNTIME), 1, weights)
    assert str(error.value).splitlines() == [
        "weights: the checkpoint does not fit its config:",
        "  unexpected tensors (1): model.layers.0.self_attn.sinks",
        "  missing tensors (1): model.layers.1.self_attn.sinks (DeepSeek: layers.1.attn.attn_sink)",
        f"  tensor q_a_norm.weight: shape ({width - 1},), the config gives ({width},)",
    ]


def test_weights_named_in_full_load_the_same():
    """Names with the layer's prefix, or DeepSeek's, load the parameters the bare names load."""
    weights = attention_weights(1) | {"sinks": FIXTURE["layer1/sinks"]}
    full = {f"model.layers.1.self_attn.{name}": value for name, value in weights.items()}
    full["layers.1.attn.wq_a.weight"] = full.pop("model.layers.1.self_attn.q_a_proj.weight")
    config = MODEL.attention(MODEL.layer_types[1], RUNTIME)
    loaded = DeepseekV4Attention.from_hf(config, 1, full, max_draft=4)
    bare = attention_layer(1)
    assert np.array_equal(loaded.q_a_proj[...], weights["q_a_proj.weight"])
    assert jax.tree.all(jax.tree.map(np.array_equal, nnx.state(loaded), nnx.state(bare)))


def test_ragged_rows():
    """Rows of different lengths in one call (the rest padding), then only one row goes on: each row sees
    exactly its own tokens (compared with transformers' unpadded run)."""
    attn = attention_layer(1)
    graphdef, params = nnx.split(attn)
    lengths = jnp.asarray([PROMPT, 200], jnp.int32)
    y, cache = step(graphdef, params, X, positions(0, PROMPT), init_caches(attn), lengths)
    expected = FIXTURE["layer1/full"]
    assert rel_err(y[0], expected[0]) < HF_TOL and rel_err(y[1, :200], expected[1, :200]) < HF_TOL
    for p in range(200, 210):  # row 1 decodes on; row 0 is padding (length 0) at its own position
        pos = jnp.asarray([[PROMPT], [p]], jnp.int32)
        x = jnp.stack([X[0, :1], X[1, p : p + 1]])
        y, cache = step(graphdef, params, x, pos, cache, jnp.asarray([0, 1], jnp.int32))
        assert rel_err(y[1], expected[1, p : p + 1]) < HF_TOL


@pytest.mark.parametrize("backend", [ONLINE, OFFLINE], ids=["online", "offline"])
@pytest.mark.parametrize("start", [250, 126], ids=["open-block", "closes-mid-verify"])
def test_rejected_drafts_leave_no_trace(start, backend):
    """Verify 4 tokens whose last two are junk, keep 2 (eager commit), and go on: the outputs equal those of
    a cache that only ever saw the 2 kept tokens (window rows, entries and compressor state of the junk are
    all overwritten or invisible)."""
    attn = attention_layer(1)
    graphdef, params = nnx.split(attn)
    _, cache = run(attn, (start,), backend)
    _, clean = run(attn, (start + 2,), backend)
    junk = jnp.asarray(np.random.default_rng(0).normal(size=(BATCH, 2, X.shape[2])), jnp.float32)
    drafts = jnp.concatenate([X[:, start : start + 2], junk], axis=1)
    _, cache = step(graphdef, params, drafts, positions(start, start + 4), cache, mode=VERIFY)
    cache = commit(cache, start, 2)
    nxt = start + 2
    for mode, width in ((VERIFY, 4), (ForwardMode.DECODE, 1)):  # the next verify, and a decode
        x, pos = X[:, nxt : nxt + width], positions(nxt, nxt + width)
        y, _ = step(graphdef, params, x, pos, copy_tree(cache), mode=mode)
        y_ref, _ = step(graphdef, params, x, pos, copy_tree(clean), mode=mode)
        assert rel_err(y, y_ref) < 1e-5
