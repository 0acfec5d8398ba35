"""64-bit mode (``JAX_ENABLE_X64=1``): loading and generation run, and give the tokens of the default 32-bit
mode."""

from __future__ import annotations

import dataclasses

import jax
import pytest
from flax import nnx
from models import MODEL_CONFIG, MODEL_RUNTIME

from jax_oc128 import checkpoint
from jax_oc128.engine import Engine
from jax_oc128.nn import HCA, SLIDING, SpeculativeModel

# the forward tests' small model (short compilations), one sliding and one C128 layer, a vocabulary of 64
CONFIG = dataclasses.replace(MODEL_CONFIG, vocab_size=64, layer_types=(SLIDING, HCA))
PROMPTS = [[(7 * i) % 64 for i in range(150)], [5, 9, 1]]  # the first crosses a 128-token block


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_x64_mode_generates_the_same_tokens(tmp_path, temperature):
    """Speculative steps of N = 3 (2 slots, 3 steps per dispatch): before, 64-bit integer sums and argmaxes
    broke the decode loop's carry (int32 -> int64), and the sampled acceptance drew float64 uniforms."""
    path = tmp_path / "model.npz"
    checkpoint.save(SpeculativeModel(CONFIG, MODEL_RUNTIME, rngs=nnx.Rngs(0)), path)

    def generate():
        model, _ = checkpoint.load(path)  # in the mode: a user sets it for the whole program
        engine = Engine(model, slots=2, steps_per_dispatch=3)
        return engine.generate(PROMPTS, 12, num_tokens=3, temperature=temperature, seed=5)

    expected = generate()
    with jax.enable_x64(True):
        got = generate()
    assert got.tokens == expected.tokens
    assert (got.steps, got.dispatches) == (expected.steps, expected.dispatches)
