"""The engine's compiled steps do no work of ``max_len``'s size when their forwards are bounded (issue 40).

The decode dispatch: at ``max_len`` 2^20 (nothing allocated: lowered from the state's layout), bounded to 256
positions, no instruction of the optimized program other than those that name or update an array in place
has a dimension that follows ``max_len`` (``bench/hlo_shapes.py``), and its temporaries are those of the
same dispatch at ``max_len`` 1024. Dense float32 caches and paged FP8 caches (the FP8 indexer keys' RoPE
part has no channels: the paged read of such a leaf once raised a ZeroDivisionError). A paged CSA layer's
decode reads its picked entries where they are stored: no array of the slot's ``[batch, read, ...]``
entries exists in the program, fused or not (its indexer keys, all of which the indexer scores, are read in
order).

The prefill likewise: a new request's slot keeps the entries it held (no clear of ``max_len``'s entries),
and an engine whose every entry and indexer key is NaN gives the tokens of a clean one."""

from __future__ import annotations

import dataclasses
import functools

import hlo_shapes
import jax
import numpy as np
import pytest
from flax import nnx
from harness import poisoned_entries
from models import MODEL_CONFIG, MODEL_RUNTIME

from jax_oc128.engine import Engine, arguments
from jax_oc128.nn import CSA, HCA, SLIDING, SpeculativeModel

CONFIG = dataclasses.replace(
    MODEL_CONFIG, layer_types=(SLIDING, HCA, CSA), index_n_heads=2, index_head_dim=32, index_topk=4
)
MAX_LEN, SMALL_MAX_LEN, CONTEXT, PAGE, POOL = 1 << 20, 1024, 256, 128, 8


def layout_dims(engine: Engine) -> set[int]:
    """Every dimension of ``engine``'s decode state's arrays."""
    return {dim for leaf in jax.tree.leaves(engine._state_layout) for dim in leaf.shape}


def engine_at(max_len: int, kv_cache_dtype: str, pages) -> Engine:
    runtime = dataclasses.replace(MODEL_RUNTIME, max_len=max_len, kv_cache_dtype=kv_cache_dtype)
    model = SpeculativeModel(CONFIG, runtime, rngs=nnx.Rngs(0))
    return Engine(model, 2, steps_per_dispatch=4, pages=pages, page_size=PAGE)


@functools.cache
def decode_at(max_len: int, kv_cache_dtype: str, pages):
    """``(engine, its decode dispatch compiled for 4 plain steps bounded to CONTEXT positions)``."""
    engine = engine_at(max_len, kv_cache_dtype, pages)
    stops, waiting = arguments.stop_array(()), np.bool_(False)
    lowered = engine._decode.lower(engine.params, engine._state_layout, stops, waiting, 4, None, CONTEXT)
    return engine, lowered.compile()


@pytest.mark.parametrize(
    ("kv_cache_dtype", "pages"),
    [
        ("float32", None),
        ("fp8", POOL),
        pytest.param(
            "bfloat16",
            None,
            marks=pytest.mark.xfail(
                strict=True,
                reason="XLA's CPU scatters into a bfloat16 array in float32: the whole cache converted per "
                "step (docs/performance.md); XLA's GPU writes it in place",
            ),
        ),
    ],
    ids=["dense-float32", "paged-fp8", "dense-bfloat16"],
)
def test_decode_does_no_work_of_max_len(kv_cache_dtype, pages):
    (engine, large), (small_engine, small) = (
        decode_at(max_len, kv_cache_dtype, pages) for max_len in (MAX_LEN, SMALL_MAX_LEN)
    )
    # the dimensions that follow max_len: the state's at 2^20 that it does not have at 1024
    sizes = layout_dims(engine) - layout_dims(small_engine)
    assert (MAX_LEN // PAGE if pages else MAX_LEN // 4) in sizes, sizes  # the page table's / CSA entries'
    assert hlo_shapes.sized(large.as_text(), sizes) == []
    temp = [c.memory_analysis().temp_size_in_bytes for c in (large, small)]
    assert temp[0] == temp[1], temp


def test_paged_decode_reads_the_picked_entries_where_stored():
    engine, compiled = decode_at(MAX_LEN, "fp8", POOL)
    read, batch = CONTEXT // 4, engine.slots
    # the FP8 entries' leaves: non-RoPE channels (24, not the indexer keys' 32) and RoPE channels (8)
    widths = (CONFIG.head_dim - CONFIG.rope_dim, CONFIG.rope_dim)
    assert CONFIG.index_head_dim not in widths
    shapes = hlo_shapes.shapes(compiled.as_text())
    assert (batch, read, CONFIG.index_head_dim) in shapes  # the indexer keys, read in order: the check sees
    assert not {(batch, read, width) for width in widths} & shapes


def test_prefill_does_no_work_of_max_len():
    engines = [engine_at(max_len, "float32", None) for max_len in (MAX_LEN, SMALL_MAX_LEN)]
    sizes = layout_dims(engines[0]) - layout_dims(engines[1])
    large, small = (engine.lower_prefill(200).compile() for engine in engines)
    assert hlo_shapes.sized(large.as_text(), sizes) == []
    assert large.memory_analysis().temp_size_in_bytes == small.memory_analysis().temp_size_in_bytes


def test_entries_left_by_earlier_requests_are_not_read():
    engine = engine_at(SMALL_MAX_LEN, "float32", None)
    rng = np.random.default_rng(5)
    prompts = [list(rng.integers(0, CONFIG.vocab_size, n)) for n in (150, 40)]
    clean = engine.generate(prompts, 12).tokens
    engine._idle_state = poisoned_entries(engine._idle_state)  # the next call's state: every entry NaN
    assert engine.generate(prompts, 12).tokens == clean
