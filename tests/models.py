"""The small random models the test files share and their prompts: the engine tests' model
(:data:`DECODE_CONFIG` running as :data:`DECODE_RUNTIME`, built by :func:`make_model`, fed :func:`prompts`)
and the forward tests' smaller one (:data:`MODEL_CONFIG`, :data:`MODEL_RUNTIME`). The transformers fixtures
are :mod:`hf_fixtures`."""

from __future__ import annotations

import numpy as np
from flax import nnx

from jax_oc128.nn import HCA, SLIDING, ModelConfig, RuntimeConfig, SpeculativeModel

# sliding and HCA layers of hidden 64, a vocabulary of 64: the engine tests' model
DECODE_CONFIG = ModelConfig.tiny(
    vocab_size=64,
    hidden_size=64,
    head_dim=32,
    rope_dim=16,
    q_lora_rank=32,
    o_lora_rank=32,
    mlp_hidden=128,
    sliding_window=16,
)
DECODE_RUNTIME = RuntimeConfig(max_len=1024)
# prompt lengths crossing 128-blocks in prefill; 100 new tokens cross more during generation
PROMPT_LENGTHS = (120, 5, 200, 129, 60)

# four layers of hidden 32, three of them HCA: the forward tests' model (short compilations)
MODEL_CONFIG = ModelConfig.tiny(
    vocab_size=32,
    hidden_size=32,
    layer_types=(HCA, SLIDING, HCA, HCA),
    num_heads=2,
    head_dim=32,
    rope_dim=8,
    q_lora_rank=16,
    o_lora_rank=16,
    mlp_hidden=32,
    sliding_window=8,
)
MODEL_RUNTIME = RuntimeConfig(max_len=512, max_draft=4)


def make_model(backend, seed=0, config=DECODE_CONFIG, runtime=DECODE_RUNTIME):
    """A :class:`SpeculativeModel` of ``config`` running as ``runtime`` on the C128 ``backend``, random
    weights from ``seed``."""
    return SpeculativeModel(config, runtime, backend=backend, rngs=nnx.Rngs(seed))


def prompts(vocab=DECODE_CONFIG.vocab_size, lengths=PROMPT_LENGTHS):
    """One random prompt (a list of token ids below ``vocab``) per length, the same on every call."""
    rng = np.random.default_rng(1)
    return [list(rng.integers(0, vocab, n)) for n in lengths]
