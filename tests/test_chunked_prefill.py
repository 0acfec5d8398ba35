"""Chunked prefill (Engine(..., prefill_chunk=C)): the prompts fed C positions at a time in one lax.scan give
the single forward's decode state and its greedy tokens (dense and paged caches, online and offline C128
state; plain, chain and tree steps), and the prefill's LM head runs at each row's last token only."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import numpy as np
import pytest
from models import DECODE_CONFIG, make_model, prompts

from jax_oc128.controller import OFFLINE, ONLINE
from jax_oc128.engine import MAX_STOP_TOKENS, Engine, arguments, steps
from jax_oc128.engine.scheduler import on_gpu
from jax_oc128.nn import CSA, HCA, SLIDING
from jax_oc128.tree import Tree

# the engine tests' model with a CSA layer too (CSA windows of 4, C128 blocks, sliding windows of 16)
CONFIG = dataclasses.replace(DECODE_CONFIG, layer_types=(SLIDING, HCA, CSA), mlp_layer_types=None)
# chunks of 50 cut CSA windows and C128 blocks; a prompt ends inside the first chunk, one on a chunk's last
# position, one past a C128 block with a chunk's first position in its last sliding window (the MTP head's
# window entries there read the hidden state carried from the chunk before), one four chunks in (the bucket
# of 256 rounded up to 300: six chunks)
CHUNK = 50
LENGTHS = (5, 100, 160, 200)
SLOTS = len(LENGTHS)
NEW_TOKENS = 30
BACKENDS = [pytest.param(ONLINE, id="online"), pytest.param(OFFLINE, id="offline")]


@pytest.fixture(scope="module", params=BACKENDS)
def engines(request):
    """``(single, chunked, paged)``: engines of one model on the backend, the first prefilling in one
    forward, the others in chunks of :data:`CHUNK` (dense; paged caches of 8 pages of 128 tokens)."""
    model = make_model(request.param, config=CONFIG)
    options = dict(slots=SLOTS, steps_per_dispatch=8)
    return (
        Engine(model, **options),
        Engine(model, prefill_chunk=CHUNK, **options),
        Engine(model, prefill_chunk=CHUNK, pages=8, page_size=128, **options),
    )


def test_chunked_prefill_state_is_the_single_forwards(engines):
    """engine.prefill of three of four slots (one stays idle through every chunk): the first tokens are the
    single forward's, and every leaf of the decode state (the target's caches, the MTP head's cache, the
    hidden state at the last prompt token) equals it to float32 rounding."""
    single, chunked, _ = engines
    assignments = dict(zip((0, 1, 3), prompts(lengths=LENGTHS[1:]), strict=True))
    results = [engine.prefill(engine.init_state(), assignments, NEW_TOKENS) for engine in (single, chunked)]
    (expected, expected_out), (state, out) = results
    rows = list(assignments)  # an idle slot's output token is not output (its count is 0)
    assert np.asarray(out.tokens)[0, rows].tolist() == np.asarray(expected_out.tokens)[0, rows].tolist()
    assert np.asarray(out.counts).tolist() == np.asarray(expected_out.counts).tolist() == [[1, 1, 0, 1]]
    assert np.asarray(state.active).tolist() == [True, True, False, True]
    pairs = zip(jax.tree.leaves_with_path(state), jax.tree.leaves(expected), strict=True)
    for (path, leaf), want in pairs:
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf, want = jax.random.key_data(leaf), jax.random.key_data(want)
        np.testing.assert_allclose(
            np.asarray(leaf, np.float32),
            np.asarray(want, np.float32),
            rtol=1e-5,
            atol=1e-5,
            err_msg=jax.tree_util.keystr(path),
        )


def test_chunked_prefill_tokens_are_the_single_forwards(engines):
    """Greedy tokens after a chunked prefill, dense and paged, plain, chain (N = 4) and, on the online state,
    a tree of 8 nodes: those of the single-forward engine's plain steps, token for token."""
    single, chunked, paged = engines
    expected = single.generate(prompts(lengths=LENGTHS), NEW_TOKENS).tokens
    options = [dict(), dict(num_tokens=4)]
    if single.model.target.backend is ONLINE:
        options.append(dict(tree=Tree.default(8)))
    for engine in (chunked, paged):
        for option in options:
            assert engine.generate(prompts(lengths=LENGTHS), NEW_TOKENS, **option).tokens == expected, option


def test_prefill_computes_the_logits_of_each_rows_last_token_only():
    """The traced prefill of a bucket of 300 positions, chunked (one scan of 6 chunks, bounded by context
    buckets: one scan per bucket) or one forward: the LM head runs at each row's last token only, so the
    compiled prefill has its logits ``[slots, vocab]`` and no array of a chunk's (``[slots, 50, vocab]``) or
    the whole prompt's; a vocabulary of 96, no other dimension's size."""
    vocab = 96
    engine = Engine(make_model(ONLINE, config=dataclasses.replace(CONFIG, vocab_size=vocab)), slots=SLOTS)
    state = engine.init_state()
    width = 6 * CHUNK
    tokens, starts = np.zeros((SLOTS, width), np.int32), np.zeros(SLOTS, np.int32)
    args = [tokens, starts, np.full(SLOTS, width, np.int32), np.ones(SLOTS, np.int32)]
    stops = np.full(MAX_STOP_TOKENS, -1, np.int32)

    def traced(chunk, floor=None):
        prefill = functools.partial(steps.prefill, engine.model, chunk=chunk, floor=floor)
        return jax.make_jaxpr(prefill)(state, *args, state.sampling, stops).jaxpr

    def scans(jaxpr):
        return [eqn.params["length"] for eqn in jaxpr.eqns if eqn.primitive.name == "scan"]

    def by_token_logits(chunk):
        """The ``[slots, n, vocab]`` arrays of the compiled prefill (the draft head's logits, traced and
        unused, are gone: what runs is what counts), and whether it has the ``[slots, vocab]`` logits."""
        prefill = jax.jit(functools.partial(steps.prefill, engine.model, chunk=chunk))
        hlo = prefill.lower(state, *args, state.sampling, stops).compile().as_text()
        return set(re.findall(rf"\[{SLOTS},\d+,{vocab}\]", hlo)), f"[{SLOTS},{vocab}]" in hlo

    assert scans(traced(CHUNK)) == [6]
    # bounded by context buckets from 128: the chunks ending at 50, 100 | 150 .. 250 | 300, one scan each
    assert scans(traced(CHUNK, floor=128)) == [2, 3, 1]
    assert by_token_logits(CHUNK) == by_token_logits(None) == (set(), True)


def test_the_engine_chooses_the_chunk(monkeypatch):
    """``prefill_chunk="auto"`` (the default): on a GPU 2048, less where a device's slots times it would pass
    16384 positions (the largest power of two within them); None on a CPU. Padded prompts of at most the chunk
    are one forward (chunk None dispatched), longer ones whole chunks."""
    assert arguments.GPU_PREFILL_CHUNK == 2048 and arguments.GPU_PREFILL_POSITIONS == 16384
    chunks = {1: 2048, 8: 2048, 9: 1024, 24: 512, 64: 256, 16384: 1, 20000: 1}  # by a device's slots
    for device_slots, chunk in chunks.items():
        assert arguments.check_prefill_chunk("auto", True, device_slots) == chunk, device_slots
    assert arguments.check_prefill_chunk("auto", False, 64) is None
    assert arguments.check_prefill_chunk(4096, True, 64) == 4096  # a given chunk is kept
    with pytest.raises(TypeError, match="prefill_chunk: must be an int"):
        arguments.check_prefill_chunk("always", True, 8)
    model = make_model(ONLINE, config=CONFIG)
    auto = arguments.check_prefill_chunk("auto", on_gpu(None), SLOTS)
    assert Engine(model, slots=SLOTS).prefill_chunk == auto
    engine = Engine(model, slots=SLOTS, prompt_bucket=32, prefill_chunk=CHUNK)
    calls = []
    monkeypatch.setattr(engine, "_prefill", lambda *args: calls.append(args))
    for length in (20, 40):
        engine.prefill(engine.init_state(), {0: prompts(lengths=(length,))[0]}, 3)
    assert [(args[2].shape[1], args[-2]) for args in calls] == [(32, None), (100, CHUNK)]


def test_lower_prefill_is_the_prefill_dispatched(monkeypatch):
    """Engine.lower_prefill(P), from the shapes alone: the lowering of what engine.prefill dispatches for a
    prompt of P tokens (its arguments recorded), of one forward and of chunks; a bad P is refused by name."""
    engine = Engine(make_model(ONLINE, config=CONFIG), slots=SLOTS, prompt_bucket=32, prefill_chunk=CHUNK)
    calls = []
    with monkeypatch.context() as patch:
        patch.setattr(engine, "_prefill", lambda *args: calls.append(args))
        for length in (20, 40):
            engine.prefill(engine.init_state(), {1: prompts(lengths=(length,))[0]}, 3)
    for length, args in zip((20, 40), calls, strict=True):
        assert engine.lower_prefill(length).as_text() == engine._prefill.lower(*args).as_text()
    assert engine.lower_prefill(20).as_text() != engine.lower_prefill(40).as_text()
    for bad, error in ((0, ValueError), (engine.model.max_len - 1, ValueError), (20.0, TypeError)):
        with pytest.raises(error, match=r"^prompt_len: "):
            engine.lower_prefill(bad)
