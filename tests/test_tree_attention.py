"""A tree verify through DeepSeek-V4 attention (sliding layers): every node's output is the output of a chain
verify along its path, and after :meth:`AttentionCache.keep_path` the cache is the chain's, with no trace of
the rejected branches."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_nn import CONFIG, FIXTURE, VERIFY, X

from jax_oc128.controller import ForwardMode
from jax_oc128.nn import AttentionConfig, DeepseekV4Attention
from jax_oc128.tree import Tree

MAX_DRAFT = 8
PREFIX = 100  # tokens in the cache before the verify (the window, 16, is full)
# trees of MAX_DRAFT nodes: EAGLE-style default, a bushy one, one not in depth order, the chain
TREES = [Tree.default(MAX_DRAFT), Tree((-1, 0, 0, 0, 1, 1, 2, 4)), Tree((-1, 0, 1, 0, 3, 2, 0, 6))]
# outputs of a node and of the chain along its path differ only in how XLA sums the masked extra keys
# (exact zeros): the same float32 terms, reduced over arrays of different lengths
TOL = dict(rtol=2e-6, atol=2e-6)


def sliding_layer():
    weights = {k.split("/", 1)[1]: v for k, v in FIXTURE.items() if k.startswith("layer0/") and "." in k}
    weights |= {"sinks": FIXTURE["layer0/sinks"]}
    return DeepseekV4Attention.from_hf(CONFIG, 0, weights, max_draft=MAX_DRAFT)


@functools.partial(jax.jit, static_argnames=("graphdef", "mode", "tree", "nodes"))
def forward(graphdef, params, x, positions, cache, mode=ForwardMode.EXTEND, tree=None, nodes=None):
    y, cache, _ = nnx.merge(graphdef, params)(x, positions, cache, mode=mode, tree=tree, nodes=nodes)
    return y, cache


@pytest.fixture(scope="module")
def prefilled():
    attn = sliding_layer()
    graphdef, params = nnx.split(attn)
    batch = X.shape[0]
    positions = jnp.broadcast_to(jnp.arange(PREFIX, dtype=jnp.int32), (batch, PREFIX))
    _, cache = forward(graphdef, params, X[:, :PREFIX], positions, attn.init_cache(batch))
    return graphdef, params, cache


def tree_inputs(tree, seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(X.shape[0], tree.size, X.shape[2])).astype(np.float32))
    return x, PREFIX + jnp.broadcast_to(jnp.asarray(tree.depths), (X.shape[0], tree.size))


def chain(graphdef, params, cache, x):
    """A chain verify of ``x`` ``[batch, T, hidden]`` at PREFIX."""
    positions = PREFIX + jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape[:2])
    return forward(graphdef, params, x, positions, cache, mode=VERIFY)


@pytest.mark.parametrize("tree", TREES, ids=str)
def test_every_node_is_the_chain_along_its_path(prefilled, tree):
    graphdef, params, cache = prefilled
    x, positions = tree_inputs(tree, 1)
    y, _ = forward(graphdef, params, x, positions, cache, mode=VERIFY, tree=tree)
    for node in range(tree.size):
        path = tree.paths[node][: tree.depths[node] + 1]
        y_chain, _ = chain(graphdef, params, cache, x[:, path])
        np.testing.assert_allclose(y[:, node], y_chain[:, -1], **TOL, err_msg=f"node {node}")


@pytest.mark.parametrize("tree", TREES, ids=str)
def test_keep_path_leaves_the_chains_cache(prefilled, tree):
    graphdef, params, cache = prefilled
    x, positions = tree_inputs(tree, 2)
    deepest = int(np.argmax(tree.depths))
    for nodes in ([deepest, 0], [tree.size - 1, int(tree.parents[tree.size - 1])]):
        _, after = forward(graphdef, params, x, positions, cache, mode=VERIFY, tree=tree)
        after = after.keep_path(tree, positions[:, 0], jnp.asarray(nodes, jnp.int32))
        x_next = jnp.asarray(np.random.default_rng(3).normal(size=(X.shape[0], 1, X.shape[2])), jnp.float32)
        for row, node in enumerate(nodes):
            path = tree.paths[node][: tree.depths[node] + 1]
            _, chained = chain(graphdef, params, cache, x[:, path])
            kept = tree.depths[node] + 1
            # where the chain's verify wrote, the same rows and positions; the verify's other ring rows empty
            ring = (PREFIX + np.arange(tree.size)) % after.window.shape[1]
            np.testing.assert_array_equal(after.window_positions[row, ring[:kept]], PREFIX + np.arange(kept))
            np.testing.assert_array_equal(after.window[row, ring[:kept]], chained.window[row, ring[:kept]])
            assert np.all(np.asarray(after.window_positions[row, ring[kept:]]) == -1)
            untouched = np.setdiff1d(np.arange(after.window.shape[1]), ring)
            np.testing.assert_array_equal(after.window[row, untouched], cache.window[row, untouched])
            # the next token sees what it sees after the chain
            at = jnp.full((X.shape[0], 1), PREFIX + kept, jnp.int32)
            y_tree, _ = forward(graphdef, params, x_next, at, after, mode=ForwardMode.DECODE)
            y_chain, _ = forward(graphdef, params, x_next, at, chained, mode=ForwardMode.DECODE)
            np.testing.assert_allclose(y_tree[row], y_chain[row], **TOL)


def test_keep_path_of_no_node_leaves_the_row(prefilled):
    graphdef, params, cache = prefilled
    tree = TREES[0]
    x, positions = tree_inputs(tree, 4)
    _, after = forward(graphdef, params, x, positions, cache, mode=VERIFY, tree=tree)
    kept = after.keep_path(tree, positions[:, 0], jnp.asarray([-1, 3], jnp.int32))
    np.testing.assert_array_equal(kept.window[0], after.window[0])
    np.testing.assert_array_equal(kept.window_positions[0], after.window_positions[0])


def test_tree_misuse():
    attn = sliding_layer()
    x, positions = tree_inputs(TREES[0], 5)
    cache = attn.init_cache(X.shape[0])
    with pytest.raises(ValueError, match=r"^tree: only for a verify"):
        attn(x, positions, cache, tree=TREES[0])
    with pytest.raises(ValueError, match=r"^tree: 4 nodes for 8 tokens"):
        attn(x, positions, cache, mode=VERIFY, tree=Tree.chain(4))
    with pytest.raises(TypeError, match=r"^tree: a jax_oc128.tree.Tree"):
        attn(x, positions, cache, mode=VERIFY, tree=(-1, 0))
    hca = DeepseekV4Attention(AttentionConfig.from_hf(CONFIG, 1), max_draft=MAX_DRAFT, rngs=nnx.Rngs(0))
    with pytest.raises(NotImplementedError, match=r"^tree: heavily_compressed_attention"):
        hca(x, positions, hca.init_cache(X.shape[0]), mode=VERIFY, tree=TREES[0])


@pytest.mark.parametrize("tree", TREES, ids=str)
def test_a_tree_drafted_level_by_level_is_the_tree_verified_at_once(prefilled, tree):
    """The draft head's calls (one per level, each node seeing its ancestors' rows written by the calls
    before) give each node what one call of the whole tree gives it."""
    graphdef, params, cache = prefilled
    x, positions = tree_inputs(tree, 6)
    y_all, _ = forward(graphdef, params, x, positions, cache, mode=VERIFY, tree=tree)
    drafted = cache
    for level in tree.levels:
        y, drafted = forward(
            graphdef,
            params,
            x[:, list(level)],
            positions[:, list(level)],
            drafted,
            mode=ForwardMode.DRAFT_EXTEND,
            tree=tree,
            nodes=level,
        )
        np.testing.assert_allclose(y, y_all[:, list(level)], **TOL, err_msg=f"level {level}")


def test_keep_path_empties_a_path_node_not_written(prefilled):
    """A draft head writes only the nodes it expands: a kept leaf leaves its position empty."""
    graphdef, params, cache = prefilled
    tree = Tree((-1, 0, 1))
    x, positions = tree_inputs(tree, 7)
    _, drafted = forward(graphdef, params, x[:, :2], positions[:, :2], cache, mode=VERIFY, tree=Tree((-1, 0)))
    kept = drafted.keep_path(tree, positions[:, 0], jnp.asarray([2, 1], jnp.int32), written=(0, 1))
    ring = (PREFIX + np.arange(3)) % kept.window.shape[1]
    np.testing.assert_array_equal(kept.window_positions[:, ring], [[PREFIX, PREFIX + 1, -1]] * 2)
