"""The engine's memory checks (:mod:`jax_oc128.engine.memory`): a decode state, or a dispatch's compiled
program, larger than the device's free memory is refused on the host, naming ``max_len`` (``pages`` for a
paged state) and the request, before it is allocated or dispatched; with enough memory the same call runs.
The CPU reports no memory: the tests patch :func:`~jax_oc128.engine.memory.free_bytes`, the one place the
engine reads it."""

from __future__ import annotations

import dataclasses

import jax
import pytest
from flax import nnx
from harness import count_compiles
from models import DECODE_CONFIG, DECODE_RUNTIME

from jax_oc128.checks import ArgumentError
from jax_oc128.engine import Engine, memory
from jax_oc128.nn import HCA, SLIDING, SpeculativeModel

CONFIG = dataclasses.replace(DECODE_CONFIG, layer_types=(SLIDING, HCA), num_heads=2)
RUNTIME = dataclasses.replace(DECODE_RUNTIME, max_len=512)
PROMPTS = ([1, 2, 3], [4] * 40)
PLENTY = 2**50  # bytes: everything fits


@pytest.fixture(scope="module")
def model():
    return SpeculativeModel(CONFIG, RUNTIME, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, slots=2, prompt_bucket=64, steps_per_dispatch=4)


@pytest.fixture
def free(monkeypatch):
    """Sets the free bytes every device reports: ``free(n)``."""

    def set_free(size: int) -> None:
        monkeypatch.setattr(memory, "free_bytes", lambda device: size)

    return set_free


def test_the_cpu_reports_no_memory():
    assert memory.free_bytes(jax.devices("cpu")[0]) is None


@pytest.mark.parametrize("pages", [None, 4], ids=["dense", "paged"])
def test_a_state_too_large_is_refused_before_it_is_allocated(model, free, pages):
    engine = Engine(model, slots=2, pages=pages)
    need = engine._state_bytes
    free(need - 1)
    with count_compiles() as compiles, pytest.raises(ArgumentError) as refused:
        engine.init_state()
    assert not compiles  # nothing compiled, so nothing dispatched or allocated
    argument = "max_len" if pages is None else "pages"
    assert refused.value.argument == argument
    assert str(refused.value).startswith(f"{argument}: the decode state")
    assert f"needs {need} bytes" in str(refused.value) and f"{need - 1} bytes" in str(refused.value)
    free(need)
    state = engine.init_state()
    assert sum(leaf.nbytes for leaf in jax.tree.leaves(state)) == need  # the bytes the check counted


def test_a_bucket_too_large_is_refused_before_its_dispatch(engine, free):
    free(PLENTY)
    state = engine.init_state()
    free(1000)
    with count_compiles() as compiles, pytest.raises(ArgumentError) as refused:
        engine.prefill(state, {0: PROMPTS[0], 1: PROMPTS[1]}, 3)
    assert list(compiles) == ["prefill"]  # the program measured
    message = str(refused.value)
    assert refused.value.argument == "max_len"
    assert "the prefill of slot 1's prompt (a context of 40 positions, context bucket 256)" in message
    assert "1000 bytes" in message
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))  # not donated: nothing ran
    free(PLENTY)
    with count_compiles() as compiles:
        state, output = engine.prefill(state, {0: PROMPTS[0], 1: PROMPTS[1]}, 3)
    assert not compiles  # the check compiled the dispatch's program: jit's own compilation, reused
    assert output.counts.tolist() == [[1, 1]]
    free(1000)
    with pytest.raises(ArgumentError, match=r"^max_len: decode\(context=100\) \(a context of 100 positions"):
        engine.decode(state, context=100)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))
    free(PLENTY)
    with count_compiles() as compiles:
        _, output = engine.decode(state, context=100)
    assert not compiles
    assert output.counts[0].tolist() == [1, 1]


def test_generate_names_the_request(engine, free):
    free(PLENTY)
    plain = engine.generate(PROMPTS, 5)
    # the prefill of these prompts fits (checked above); the speculative decode loop is a new program
    free(1000)
    with pytest.raises(ArgumentError) as refused:
        engine.generate(PROMPTS, 5, num_tokens=2)
    assert refused.value.argument == "max_len"
    # the longest request: 40 prompt tokens + 5 new + the N = 2 a speculative step may write
    expected = "max_len: the decode dispatch of request 1 (slot 1) (a context of 47 positions"
    assert str(refused.value).startswith(expected)
    free(PLENTY)  # the engine's state is intact: the same call runs, greedy tokens as plain decoding
    assert engine.generate(PROMPTS, 5, num_tokens=2).tokens == plain.tokens
