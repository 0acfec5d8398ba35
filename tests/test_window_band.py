"""The banded window attention (nn.attention._window_keys): a chain longer than a query block attends in
blocks over ``[T, R + window - 1 + block]`` keys, in a loop over groups of blocks (nn.attend.by_query_blocks);
its outputs and caches equal the dense ``[T, R + T]`` path's (the same code with one block of every key, its
twin here) and, at V4-Flash's shapes, a float64 oracle's (``oracle.window_attention``); its temporaries follow
the loop's group, not T."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import window_memory
from flax import nnx
from harness import run_layer_chunks
from models import MODEL_CONFIG, MODEL_RUNTIME
from oracle import rel_err, window_attention

from jax_oc128.nn import CSA, HCA, SLIDING, DeepseekV4Attention, ForwardBatch, attend
from jax_oc128.nn import attention as attention_module

CONFIG = dataclasses.replace(
    MODEL_CONFIG, index_n_heads=2, index_head_dim=16, index_topk=8, sliding_window=16
)
# float32 rounding: the banded softmax sums and contractions skip the masked keys the dense ones add as zeros
TOL = dict(rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("layer_type", [SLIDING, HCA, CSA])
def test_banded_equals_dense(layer_type, monkeypatch):
    """Chunks of 300 (three blocks, the last padded, in a loop of two groups of two blocks, the last group
    padded) and 140 tokens (the ring read by the first block; one group), row 1 7 tokens shorter in each: the
    outputs of the valid tokens and the caches equal the dense path's."""
    layer = DeepseekV4Attention(
        CONFIG.attention(layer_type, MODEL_RUNTIME), max_draft=MODEL_RUNTIME.max_draft, rngs=nnx.Rngs(4)
    )
    monkeypatch.setattr(attend, "LOOP_QUERIES", 256)
    banded, (banded_cache, _) = run_layer_chunks(layer, (300, 140))
    monkeypatch.setattr(attention_module, "QUERY_BLOCK", 1 << 30)  # the dense twin: [T, R + T]
    dense, (dense_cache, _) = run_layer_chunks(layer, (300, 140))
    for row in range(2):
        assert np.isfinite(banded[row]).all()
        np.testing.assert_allclose(banded[row], dense[row], **TOL, err_msg=f"row {row}")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), banded_cache, dense_cache)


def test_band_shapes():
    """A chain of 300 tokens: 3 blocks of 128 queries, each over the ring's R rows and window - 1 + 128 new
    keys; a chain of 128 tokens is one block of every key."""
    c = CONFIG.attention(SLIDING, MODEL_RUNTIME)
    ring = CONFIG.sliding_window + MODEL_RUNTIME.max_draft
    for tokens, shape in ((300, (3, 128, ring + 15 + 128)), (128, (1, 128, ring + 128))):
        fb = ForwardBatch.create(jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32), (1, tokens)))
        keys, visible = attention_module._window_keys(
            fb,
            jnp.zeros((1, ring, c.head_dim)),
            jnp.full((1, ring), -1),
            jnp.ones((1, tokens, c.head_dim)),
            16,
        )
        assert visible.shape[1:] == shape and keys.shape[1:3] == (shape[0], shape[2])
        # every query sees itself and the window - 1 tokens before it, nothing else
        assert (visible.sum(-1).reshape(-1)[:tokens] == np.minimum(np.arange(tokens) + 1, 16)).all()


# V4-Flash's attention: 64 heads x 512, window 128, a ring of window + max_draft 4 rows
HEADS, DIM, WINDOW, RING = 64, 512, 128, 132
# float32 against float64 (measured: up to 1.8e-6); one key too many or too few of 128 moves it by ~1e-2
FLOAT32_TOL = 1e-5


@jax.jit
def model_window(q, ring, window_positions, kv, positions, lengths, sinks):
    """The model's window attention (the jnp path): its keys by block (``_window_keys``) and the queries by
    group (``attend.by_query_blocks``), as ``DeepseekV4Attention`` runs them."""
    fb = ForwardBatch.create(positions, lengths=lengths)
    keys, visible = attention_module._window_keys(fb, ring, window_positions, kv, WINDOW)

    def queries(keys, visible, q):
        return attend.attend(q, keys, visible, None, None, sinks, DIM**-0.5, impl="jnp", entries_prefix=True)

    return attend.by_query_blocks(queries, keys, visible, (q,), q.shape[1])


def ring_of(history, first, drafts):
    """The ring after a row's calls up to ``first``: ``(rows [R, D], positions [R])``, the positions before
    ``first`` it still holds, then ``drafts`` rejected drafts at ``first``, ``first + 1``, ... (rows the
    window no longer needs); every row that no query may read (drafts, empty rows) NaN."""
    rows, positions = np.full((RING, DIM), np.nan, np.float32), np.full(RING, -1, np.int32)
    for p in range(max(0, first - RING + drafts), first):
        rows[p % RING], positions[p % RING] = history[p], p
    positions[(first + np.arange(drafts)) % RING] = first + np.arange(drafts)
    return rows, positions


@pytest.mark.parametrize("tokens", [530, 4])
def test_window_attention_equals_float64(tokens):
    """V4-Flash's shapes, two rows: one at position 300 after 3 rejected drafts (its ring full), one at 50
    (its ring mostly empty); row 1 shorter. A chain of 530 (5 blocks, the last padded, in 2 groups of 4
    blocks, the last padded) or a verify of 4: the valid queries' outputs equal the float64 oracle's (each
    query over its 128 positions back and the sink), with the ring's unseen rows and the queries past each
    row's length NaN, and the new keys past it junk."""
    rng = np.random.default_rng(11)
    firsts, lengths = (300, 50), (tokens, tokens - tokens // 4)
    q = rng.standard_normal((2, tokens, HEADS, DIM)).astype(np.float32)
    kv = rng.standard_normal((2, tokens, DIM)).astype(np.float32)  # past each length: junk
    sinks = rng.standard_normal(HEADS).astype(np.float32)
    histories, rings = [], []
    for row, (first, length) in enumerate(zip(firsts, lengths, strict=True)):
        history = rng.standard_normal((first + tokens, DIM)).astype(np.float32)
        kv[row, :length] = history[first : first + length]
        q[row, length:] = np.nan
        histories.append(history)
        rings.append(ring_of(history, first, drafts=3 if first >= RING else 0))
    positions = np.asarray(firsts, np.int32)[:, None] + np.arange(tokens, dtype=np.int32)
    out = model_window(
        q,
        np.stack([r for r, _ in rings]),
        np.stack([p for _, p in rings]),
        kv,
        positions,
        np.asarray(lengths, np.int32),
        sinks,
    )
    for row, (first, length) in enumerate(zip(firsts, lengths, strict=True)):
        got = np.asarray(out[row, :length])
        assert np.isfinite(got).all(), f"row {row}"
        ref = window_attention(q[row, :length], histories[row], first, sinks, DIM**-0.5, WINDOW)
        assert rel_err(got, ref) < FLOAT32_TOL, f"row {row}"


def test_window_memory_follows_the_loop(capsys):
    """bench/window_memory.py (V4-Flash's sliding layer, compiled from shapes): a chunk of 8192 needs under 2
    GiB of temporaries (the issue's bound; 2.9 GiB before the loop over query groups) and under 1.5x those of
    a chunk of 2048: only the chunk's activations of the hidden size grow with it, not the queries' logits."""
    window_memory.main(["--chunks", "2048", "8192"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    assert [row[0] for row in rows] == ["| 2048", "| 8192"]
    small, large = (float(row[1].rstrip(" |")) for row in rows)
    assert 0 < small < large < min(2048, 1.5 * small)
