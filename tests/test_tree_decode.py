"""Tree speculation through the engine: greedy tree speculation equals plain greedy token for token (sliding,
HCA and CSA layers), sampled tree speculation follows the target, and the misuse of ``tree=`` is refused by
name."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from harness import count_compiles
from models import DECODE_CONFIG, DECODE_RUNTIME, prompts
from sampled import resampled

from jax_oc128.controller import OFFLINE, ONLINE
from jax_oc128.engine import Engine
from jax_oc128.nn import SpeculativeModel
from jax_oc128.nn.attention import CSA, HCA, SLIDING
from jax_oc128.tree import Tree

# sliding and HCA layers (the engine tests'), a small vocabulary, so that a random draft head's top-k children
# often hold the target's token and the paths are accepted deep
TREE_CONFIG = dataclasses.replace(DECODE_CONFIG, vocab_size=6)
TREES = [Tree.default(8), Tree((-1, 0, 0, 0, 1, 1, 2, 4)), Tree.chain(4)]


def make_model(seed=0, config=TREE_CONFIG, backend=ONLINE):
    return SpeculativeModel(config, DECODE_RUNTIME, backend=backend, rngs=nnx.Rngs(seed))


@pytest.fixture(scope="module")
def greedy():
    """``greedy(num_tokens, tree)``: ``generate(prompts, 60, ...)`` of one engine (3 slots for 5 requests:
    slots reused), each computed once for the module's tests."""
    engine = Engine(make_model(), slots=3, steps_per_dispatch=8)
    requests = prompts(vocab=TREE_CONFIG.vocab_size)
    return functools.cache(
        lambda num_tokens, tree: engine.generate(requests, 60, num_tokens=num_tokens, tree=tree)
    )


@pytest.mark.parametrize("tree", TREES, ids=str)
def test_greedy_tree_speculation_equals_plain_greedy(greedy, tree):
    """Token for token the plain greedy output, in fewer steps."""
    plain, spec = greedy(None, None), greedy(None, tree)
    assert spec.tokens == plain.tokens
    assert spec.steps < plain.steps  # some drafts were accepted


def test_greedy_tree_speculation_with_csa_layers_equals_plain_greedy():
    """CSA layers too (windows of 4 closing inside the tree, the indexer's top-4 of them)."""
    config = dataclasses.replace(
        TREE_CONFIG, layer_types=(SLIDING, CSA, HCA, CSA), index_n_heads=2, index_head_dim=16, index_topk=4
    )
    engine = Engine(make_model(config=config), slots=3, steps_per_dispatch=8)
    requests = prompts(vocab=TREE_CONFIG.vocab_size)
    plain = engine.generate(requests, 60)
    spec = engine.generate(requests, 60, tree=TREES[1])
    assert spec.tokens == plain.tokens
    assert spec.steps < plain.steps


def test_a_wider_tree_accepts_more_than_the_chain_of_its_width(greedy):
    chain, tree = greedy(8, None), greedy(None, TREES[1])
    assert tree.tokens == chain.tokens
    assert tree.mean_accepted > chain.mean_accepted, (tree.mean_accepted, chain.mean_accepted)


@pytest.fixture(scope="module")
def sampling():
    """The sampling tests' model (a vocabulary of 12) and its 512-slot engine."""
    model = make_model(seed=3, config=dataclasses.replace(TREE_CONFIG, vocab_size=12))
    return model, Engine(model, slots=512)


@pytest.mark.parametrize("tree", TREES[:2], ids=str)
def test_sampled_tree_speculation_follows_the_target(sampling, tree):
    """Temperature 1: the first token of a tree step is distributed as the target's softmax (chi-square over
    4096 samples, p > 1e-3), though the draft head (random) proposes from another distribution."""
    vocab = 12
    model, engine = sampling
    prompt = prompts(vocab=vocab, lengths=(140,))[0]
    counts = np.zeros(vocab)
    prefilled, _ = engine.prefill(engine.init_state(), dict.fromkeys(range(512), prompt), 10, tree=tree)
    first = int(prefilled.token[0])
    for seed in range(8):
        _, output = engine.decode(resampled(prefilled, seed + 1, 1.0), tree=tree, steps=1)
        counts += np.bincount(np.asarray(output.tokens[0, :, 0]), minlength=vocab)
    sequence = jnp.asarray([[*prompt, first]], jnp.int32)
    logits, _, _ = model.target(sequence, jnp.arange(sequence.shape[1])[None], model.target.init_cache(1))
    expected = np.asarray(jax.nn.softmax(logits[0, -1])) * counts.sum()
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    # survival function of chi-square with 11 degrees of freedom at 31.3 is 1e-3
    assert chi2 < 31.3, (chi2, counts, expected)


def test_tree_misuse():
    engine = Engine(make_model(), slots=1)
    prompt = prompts(vocab=TREE_CONFIG.vocab_size, lengths=(20,))
    with pytest.raises(ValueError, match=r"^tree: tree\[0\] must be -1"):
        engine.generate(prompt, 5, tree=(0, 0))
    with pytest.raises(TypeError, match=r"^tree: must be a sequence of ints"):
        engine.generate(prompt, 5, tree="(-1, 0)")
    with pytest.raises(ValueError, match=r"^tree: must have drafts"):
        engine.generate(prompt, 5, tree=(-1,))
    with pytest.raises(ValueError, match=r"^tree: at most max_draft = 8 nodes"):
        engine.generate(prompt, 5, tree=Tree.default(9))
    with pytest.raises(ValueError, match=r"^num_tokens: None or the tree's 8 nodes"):
        engine.generate(prompt, 5, num_tokens=4, tree=Tree.default(8))
    with count_compiles() as compiles, pytest.raises(ValueError, match=r"^tree: a node has 7 children, more"):
        engine.generate(prompt, 5, tree=(-1,) + (0,) * 7)  # 7 distinct tokens of 6
    assert not compiles
    offline = Engine(make_model(backend=OFFLINE), slots=1)
    with pytest.raises(NotImplementedError, match=r"^tree: this model verifies chains only"):
        offline.generate(prompt, 5, tree=(-1, 0, 0))
