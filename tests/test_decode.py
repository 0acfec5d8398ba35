"""Speculative decoding end to end: greedy equals plain greedy, sampling follows the target, slots reuse
cleanly, and each step compiles once per (slots, N)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from harness import copy_tree, count_compiles

from jax_oc128.controller import OFFLINE, ONLINE
from jax_oc128.decode import Engine
from jax_oc128.nn import ModelConfig, SpeculativeModel

CONFIG = ModelConfig(
    vocab_size=64,
    hidden_size=64,
    head_dim=32,
    rope_dim=16,
    q_lora_rank=32,
    o_lora_rank=32,
    mlp_hidden=128,
    sliding_window=16,
    max_len=1024,
)
# prompt lengths crossing 128-blocks in prefill; 100 new tokens cross more during generation
PROMPT_LENGTHS = (120, 5, 200, 129, 60)


def make_model(backend, seed=0, config=CONFIG):
    return SpeculativeModel(config, backend=backend, rngs=nnx.Rngs(seed))


def prompts(vocab=CONFIG.vocab_size, lengths=PROMPT_LENGTHS):
    rng = np.random.default_rng(1)
    return [list(rng.integers(0, vocab, n)) for n in lengths]


@pytest.mark.parametrize("backend", [ONLINE, OFFLINE], ids=["online", "offline"])
def test_greedy_speculation_equals_plain_greedy(backend):
    """3 slots for 5 requests (slots are reused), N = 2, 4, 8: token for token the plain greedy output."""
    engine = Engine(make_model(backend), slots=3)
    plain = engine.generate(prompts(), 100)
    for n in (2, 4, 8):
        spec = engine.generate(prompts(), 100, num_tokens=n)
        assert spec.tokens == plain.tokens, f"N = {n}"
        assert spec.steps < plain.steps or n == 2  # drafts of a random head are rarely accepted, but some are


def test_backends_agree():
    online = Engine(make_model(ONLINE), slots=2).generate(prompts(), 40, num_tokens=4)
    offline = Engine(make_model(OFFLINE), slots=2).generate(prompts(), 40, num_tokens=4)
    assert online.tokens == offline.tokens


def test_reused_slot_carries_nothing_from_its_previous_owner():
    """One slot: request B after A gives what B gives alone in a fresh engine."""
    a, b = prompts(lengths=(250, 140))
    for n in (None, 4):
        together = Engine(make_model(ONLINE), slots=1).generate([a, b], 70, num_tokens=n)
        alone = Engine(make_model(ONLINE), slots=1).generate([b], 70, num_tokens=n)
        assert together.tokens[1] == alone.tokens[0]


def test_each_step_compiles_once_per_shape():
    engine = Engine(make_model(ONLINE), slots=5)  # a slot count no other test uses
    with count_compiles() as compiles:
        for seed in range(3):
            engine.generate(prompts(lengths=(30, 70, 90)), 20, num_tokens=4, seed=seed)
        assert compiles["_speculative_step"] == 1
        engine.generate(prompts(lengths=(30,)), 20, num_tokens=2)
        assert compiles["_speculative_step"] == 2


@pytest.mark.parametrize("n", [2, 4])
def test_speculative_sampling_follows_the_target(n):
    """Temperature 1: the first token of a speculative step is distributed as the target's softmax (chi-square
    over 4096 samples, p > 1e-3), though the draft head (random) proposes from another distribution."""
    config = ModelConfig(**{**CONFIG.__dict__, "vocab_size": 12})
    model = make_model(ONLINE, seed=3, config=config)
    engine = Engine(model, slots=512)
    prompt = prompts(vocab=12, lengths=(140,))[0]
    counts = np.zeros(12)
    prefilled = engine.prefill(engine.init_state(), dict.fromkeys(range(512), prompt), jax.random.key(0))
    first = int(prefilled.token[0])
    for seed in range(8):
        state = copy_tree(prefilled)
        _, tokens, _ = engine.step(state, jax.random.key(seed + 1), num_tokens=n, temperature=1.0)
        counts += np.bincount(np.asarray(tokens[:, 0]), minlength=12)
    sequence = jnp.asarray([[*prompt, first]], jnp.int32)
    logits, _, _ = model.target(sequence, jnp.arange(sequence.shape[1])[None], model.target.init_cache(1))
    expected = np.asarray(jax.nn.softmax(logits[0, -1])) * counts.sum()
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    # survival function of chi-square with 11 degrees of freedom at 31.3 is 1e-3
    assert chi2 < 31.3, (chi2, counts, expected)
    position = jnp.full((1, 1), sequence.shape[1] - 1, jnp.int32)
    hidden = jnp.zeros((1, 1, config.hidden_size))
    draft_logits, _, _ = model.mtp(sequence[:, -1:], hidden, position, model.mtp.init_cache(1))
    assert np.abs(np.asarray(jax.nn.softmax(draft_logits[0, 0])) - expected / counts.sum()).max() > 0.05


def test_bad_arguments_are_named():
    engine = Engine(make_model(ONLINE), slots=1)
    for kwargs, match in (
        (dict(num_tokens=1), "num_tokens"),
        (dict(num_tokens=CONFIG.max_draft + 1), "num_tokens"),
        (dict(temperature=-1.0), "temperature"),
    ):
        with pytest.raises(ValueError, match=match):
            engine.generate(prompts(lengths=(4,)), 3, **kwargs)
    with pytest.raises(ValueError, match=r"prompts\[1\]: length 0"):
        engine.generate([[1, 2], []], 3)
    with pytest.raises(ValueError, match=r"prompts\[0\]: token ids"):
        engine.generate([[1, CONFIG.vocab_size]], 3)
