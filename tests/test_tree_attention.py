"""A tree verify through DeepSeek-V4 attention (sliding, HCA and CSA layers): every node's output is the
output of a chain verify along its path, a draft level by level gives what one call gives, and after
``keep_path`` (and, for the C128 state, the commit of the accepted node's bank) the next token sees what it
sees after the chain, with no trace of the rejected branches."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_fixtures import ATTENTION_MODEL as MODEL
from hf_fixtures import ATTENTION_RUNTIME as RUNTIME
from hf_fixtures import ATTENTION_X as X
from hf_fixtures import attention_layer

from jax_oc128.controller import OFFLINE, ForwardMode, backend_of
from jax_oc128.nn import DeepseekV4Attention, ForwardBatch, prepare_forward
from jax_oc128.nn.attention import CSA, HCA
from jax_oc128.tree import Tree

MAX_DRAFT = 8
VERIFY = ForwardMode.TARGET_VERIFY
BATCH = X.shape[0]
# trees of MAX_DRAFT nodes: EAGLE-style default, a bushy one, one not in depth order
TREES = [Tree.default(MAX_DRAFT), Tree((-1, 0, 0, 0, 1, 1, 2, 4)), Tree((-1, 0, 1, 0, 3, 2, 0, 6))]
# (layer, tokens before the verify): the sliding layer (window 16, full), the HCA layer with no block
# closing in the tree, and with a block closing at depth 1 (position 127: several nodes close it), a CSA layer
# (random weights; its windows of 4 close at depths 3 and 7, then at 1 and 5; top-8 of 25 windows)
LAYERS = [(0, 100), (1, 100), (1, 126), (CSA, 100), (CSA, 102)]
LAYER_IDS = ["sliding", "hca", "hca-closing", "csa", "csa-shifted"]
# outputs of a node and of the chain along its path differ only in how XLA orders the same float32 terms
# (the tree's keys hold masked extra keys, exact zeros, and the closed entry at another index)
TOL = dict(rtol=2e-6, atol=2e-6)


def assert_same_rows(actual, desired):
    """Window rows and C128 state kept from a tree against the chain's: bit for bit on a CPU; on a GPU a
    token's projections (its window row, its kv_score) come from a matmul of another shape (N tokens against
    the path's), which XLA's GEMMs may round differently (1 ulp on the H200), so there within TOL. The fold
    of a path against the chain's on the same inputs is bit-exact everywhere (tests/test_tree_ops.py)."""
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(actual, desired)
    else:
        np.testing.assert_allclose(actual, desired, **TOL)


def make_layer(index):
    """Layer ``index`` of the transformers fixture, or (``CSA``) a CSA layer of its shapes, random weights."""
    if index == CSA:
        config = dataclasses.replace(MODEL, index_n_heads=2, index_head_dim=16, index_topk=8).attention(
            CSA, RUNTIME
        )
        return DeepseekV4Attention(config, max_draft=MAX_DRAFT, rngs=nnx.Rngs(5))
    return attention_layer(index, max_draft=MAX_DRAFT)


@functools.partial(jax.jit, static_argnames=("graphdef", "mode", "tree", "nodes"))
def forward(graphdef, params, x, positions, caches, mode=ForwardMode.EXTEND, tree=None, nodes=None):
    """One forward of the layer, the controller's transition first (as a model runs it)."""
    attn = nnx.merge(graphdef, params)
    cache, compressed = caches
    forward_batch = ForwardBatch.create(positions, mode=mode, tree=tree, nodes=nodes)
    compressed = prepare_forward(compressed, forward_batch)
    y, cache, compressed = attn(x, cache, compressed, forward_batch)
    return y, (cache, compressed)


@pytest.fixture(scope="module", params=LAYERS, ids=LAYER_IDS)
def prefilled(request):
    """``(graphdef, params, caches, prefix)``: the layer after ``prefix`` tokens of X."""
    index, prefix = request.param
    attn = make_layer(index)
    graphdef, params = nnx.split(attn)
    positions = jnp.broadcast_to(jnp.arange(prefix, dtype=jnp.int32), (BATCH, prefix))
    caches = (attn.init_cache(BATCH), attn.init_compressed(BATCH))
    _, caches = forward(graphdef, params, X[:, :prefix], positions, caches)
    return graphdef, params, caches, prefix


def tree_inputs(tree, prefix, seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(BATCH, tree.size, X.shape[2])).astype(np.float32))
    return x, prefix + jnp.broadcast_to(jnp.asarray(tree.depths), (BATCH, tree.size))


def chain(graphdef, params, caches, x, prefix):
    """A chain verify of ``x`` ``[batch, T, hidden]`` at ``prefix``."""
    positions = prefix + jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape[:2])
    return forward(graphdef, params, x, positions, caches, mode=VERIFY)


def commit(graphdef, params, caches, prefix, accept, banks=None):
    """The eager commit of every row's verify at ``prefix``: ``accept`` tokens (and ``banks``)."""
    cache, compressed = caches
    if compressed is None:
        return caches
    slots = jnp.arange(BATCH, dtype=jnp.int32)
    seq = jnp.full((BATCH,), prefix, jnp.int32)
    controller = backend_of(compressed).controller
    return cache, controller.commit(compressed, slots, seq, jnp.asarray(accept, jnp.int32), banks)


def path_of(tree, node):
    return list(tree.paths[node][: tree.depths[node] + 1])


@pytest.mark.parametrize("tree", TREES, ids=str)
def test_every_node_is_the_chain_along_its_path(prefilled, tree):
    graphdef, params, caches, prefix = prefilled
    x, positions = tree_inputs(tree, prefix, 1)
    y, _ = forward(graphdef, params, x, positions, caches, mode=VERIFY, tree=tree)
    for node in range(tree.size):
        y_chain, _ = chain(graphdef, params, caches, x[:, path_of(tree, node)], prefix)
        np.testing.assert_allclose(y[:, node], y_chain[:, -1], **TOL, err_msg=f"node {node}")


@pytest.mark.parametrize("tree", TREES, ids=str)
def test_keep_path_leaves_the_chains_caches(prefilled, tree):
    graphdef, params, caches, prefix = prefilled
    x, positions = tree_inputs(tree, prefix, 2)
    deepest = int(np.argmax(tree.depths))
    x_next = jnp.asarray(np.random.default_rng(3).normal(size=(BATCH, 1, X.shape[2])), jnp.float32)
    for nodes in ([deepest, 0], [tree.size - 1, int(tree.parents[tree.size - 1])], [1, 2]):
        _, (cache, compressed) = forward(graphdef, params, x, positions, caches, mode=VERIFY, tree=tree)
        nodes = jnp.asarray(nodes, jnp.int32)
        cache = cache.keep_path(tree, positions[:, 0], nodes)
        kept = jnp.asarray(tree.depths)[nodes] + 1
        after = commit(graphdef, params, (cache, compressed), prefix, kept, nodes + 1)
        for row, node in enumerate(np.asarray(nodes)):
            chained = chain(graphdef, params, caches, x[:, path_of(tree, node)], prefix)[1]
            chained = commit(graphdef, params, chained, prefix, [len(path_of(tree, node))] * BATCH)
            length = len(path_of(tree, node))
            # where the chain's verify wrote, the same rows and positions; the verify's other ring rows empty
            ring = (prefix + np.arange(tree.size)) % cache.window.shape[1]
            np.testing.assert_array_equal(
                after[0].window_positions[row, ring[:length]], prefix + np.arange(length)
            )
            assert_same_rows(after[0].window[row, ring[:length]], chained[0].window[row, ring[:length]])
            assert np.all(np.asarray(after[0].window_positions[row, ring[length:]]) == -1)
            untouched = np.setdiff1d(np.arange(cache.window.shape[1]), ring)
            np.testing.assert_array_equal(after[0].window[row, untouched], caches[0].window[row, untouched])
            np.testing.assert_allclose(after[0].entries[row], chained[0].entries[row], **TOL)
            np.testing.assert_allclose(after[0].index_keys[row], chained[0].index_keys[row], **TOL)
            if after[0].rows.shape[1]:  # a CSA layer's raw rows of the path, by position
                raw = (prefix + np.arange(length)) % after[0].rows.shape[1]
                assert_same_rows(after[0].rows[row, raw], chained[0].rows[row, raw])
            if after[1] is not None:  # the committed C128 state: the chain's
                assert_same_rows(after[1].banks[:, 0, row], chained[1].banks[:, 0, row])
            # the next token sees what it sees after the chain
            at = jnp.full((BATCH, 1), prefix + length, jnp.int32)
            y_tree, _ = forward(graphdef, params, x_next, at, after, mode=ForwardMode.DECODE)
            y_chain, _ = forward(graphdef, params, x_next, at, chained, mode=ForwardMode.DECODE)
            np.testing.assert_allclose(y_tree[row], y_chain[row], **TOL)


def test_keep_path_of_no_node_leaves_the_row(prefilled):
    graphdef, params, caches, prefix = prefilled
    tree = TREES[0]
    x, positions = tree_inputs(tree, prefix, 4)
    _, (after, _) = forward(graphdef, params, x, positions, caches, mode=VERIFY, tree=tree)
    kept = after.keep_path(tree, positions[:, 0], jnp.asarray([-1, 3], jnp.int32))
    for name in ("window", "window_positions", "entries"):
        np.testing.assert_array_equal(getattr(kept, name)[0], getattr(after, name)[0], err_msg=name)


@pytest.mark.parametrize("tree", TREES, ids=str)
def test_a_tree_drafted_level_by_level_is_the_tree_verified_at_once(tree):
    """The draft head's calls (one per level, each node seeing its ancestors' rows written by the calls
    before) give each node what one call of the whole tree gives it (sliding layers: the draft heads')."""
    attn = make_layer(0)
    graphdef, params = nnx.split(attn)
    positions = jnp.broadcast_to(jnp.arange(100, dtype=jnp.int32), (BATCH, 100))
    _, caches = forward(graphdef, params, X[:, :100], positions, (attn.init_cache(BATCH), None))
    x, positions = tree_inputs(tree, 100, 6)
    y_all, _ = forward(graphdef, params, x, positions, caches, mode=VERIFY, tree=tree)
    drafted = caches
    for level in tree.levels:
        index = list(level)
        y, drafted = forward(
            graphdef,
            params,
            x[:, index],
            positions[:, index],
            drafted,
            mode=ForwardMode.DRAFT_EXTEND,
            tree=tree,
            nodes=level,
        )
        np.testing.assert_allclose(y, y_all[:, index], **TOL, err_msg=f"level {level}")


def test_keep_path_empties_a_path_node_not_written():
    """A draft head writes only the nodes it expands: a kept leaf leaves its position empty."""
    attn = make_layer(0)
    graphdef, params = nnx.split(attn)
    tree = Tree((-1, 0, 1, 0))  # not a chain: a chain keeps its path as it is
    x, positions = tree_inputs(tree, 100, 7)
    caches = (attn.init_cache(BATCH), None)
    _, (drafted, _) = forward(
        graphdef, params, x[:, :2], positions[:, :2], caches, mode=VERIFY, tree=Tree((-1, 0))
    )
    kept = drafted.keep_path(tree, positions[:, 0], jnp.asarray([2, 1], jnp.int32), written=(0, 1))
    ring = (100 + np.arange(3)) % kept.window.shape[1]
    np.testing.assert_array_equal(kept.window_positions[:, ring], [[100, 101, -1]] * 2)


def test_a_chain_drafted_as_a_tree_is_the_chain():
    """The draft head's levels of ``Tree.chain(N)`` (one node each) run the chain's calls: the same outputs
    and caches, bit for bit, and keep_path leaves the cache as it is."""
    attn = make_layer(0)
    graphdef, params = nnx.split(attn)
    positions = jnp.broadcast_to(jnp.arange(100, dtype=jnp.int32), (BATCH, 100))
    _, caches = forward(graphdef, params, X[:, :100], positions, (attn.init_cache(BATCH), None))
    tree = Tree.chain(4)
    x, positions = tree_inputs(tree, 100, 8)
    as_tree = as_chain = caches
    for level in tree.levels:
        mode, index = ForwardMode.DRAFT_EXTEND, list(level)
        y_tree, as_tree = forward(
            graphdef, params, x[:, index], positions[:, index], as_tree, mode=mode, tree=tree, nodes=level
        )
        y_chain, as_chain = forward(graphdef, params, x[:, index], positions[:, index], as_chain, mode=mode)
        np.testing.assert_array_equal(y_tree, y_chain, err_msg=f"level {level}")
        jax.tree.map(np.testing.assert_array_equal, as_tree, as_chain)
    kept = as_tree[0].keep_path(tree, positions[:, 0], jnp.asarray([2, -1], jnp.int32))
    jax.tree.map(np.testing.assert_array_equal, kept, as_chain[0])


def test_tree_misuse():
    x, positions = tree_inputs(TREES[0], 100, 5)
    with pytest.raises(ValueError, match=r"^tree: only for a verify"):
        ForwardBatch.create(positions, tree=TREES[0])
    with pytest.raises(ValueError, match=r"^tree: 4 nodes for 8 tokens"):
        ForwardBatch.create(positions, mode=VERIFY, tree=Tree.chain(4))
    with pytest.raises(TypeError, match=r"^tree: a jax_oc128.tree.Tree"):
        ForwardBatch.create(positions, mode=VERIFY, tree=(-1, 0))
    with pytest.raises(ValueError, match=r"^nodes: all of the tree's nodes or distinct nodes of one depth"):
        ForwardBatch.create(positions[:, :2], mode=VERIFY, tree=TREES[0], nodes=(0, 1))
    with pytest.raises(TypeError, match=r"^mode: a jax_oc128.ForwardMode"):
        ForwardBatch.create(positions, mode="verify")
    with pytest.raises(ValueError, match=r"^nodes: only with a tree"):
        ForwardBatch.create(positions, mode=VERIFY, nodes=tuple(range(8)))
    with pytest.raises(ValueError, match=r"^positions: \[batch, T\], got shape \(8,\)"):
        ForwardBatch.create(positions[0])
    with pytest.raises(ValueError, match=r"^lengths: \[batch\] = \[2\], got shape \(3,\)"):
        ForwardBatch.create(positions, lengths=jnp.ones(3, jnp.int32))
    hca = DeepseekV4Attention(MODEL.attention(HCA, RUNTIME), max_draft=MAX_DRAFT, rngs=nnx.Rngs(0))
    level = ForwardBatch.create(positions[:, :2], mode=VERIFY, tree=TREES[0], nodes=(1, 2))
    with pytest.raises(
        ValueError, match=r"^nodes: an heavily_compressed_attention layer verifies every node"
    ):
        hca(x[:, :2], hca.init_cache(BATCH), hca.init_compressed(BATCH), level)
    with pytest.raises(ValueError, match=r"^compressed: an HCA layer needs the C128 state"):
        hca(x, hca.init_cache(BATCH), None, ForwardBatch.create(positions, mode=VERIFY, tree=TREES[0]))
    with pytest.raises(ValueError, match=r"^tree: the offline C128 state verifies chains only"):
        hca(
            x,
            hca.init_cache(BATCH),
            hca.init_compressed(BATCH, OFFLINE),
            ForwardBatch.create(positions, mode=VERIFY, tree=TREES[0]),
        )


def test_the_forward_record():
    """The record is a pytree of its arrays (mode, tree and nodes are its static structure); a chain given as
    a tree is stored as the chain; ``base`` is the root's position, for a draft level too."""
    _, positions = tree_inputs(TREES[0], 100, 5)
    verify = ForwardBatch.create(positions, mode=VERIFY, tree=TREES[0])
    assert verify.nodes == tuple(range(MAX_DRAFT)) and verify.every_node
    assert len(jax.tree.leaves(verify)) == 2  # positions, lengths (no page table)
    assert jax.tree.structure(verify) != jax.tree.structure(ForwardBatch.create(positions, mode=VERIFY))
    np.testing.assert_array_equal(verify.base, positions[:, :1])
    chain = ForwardBatch.create(positions[:, :4], mode=VERIFY, tree=Tree.chain(4))
    assert chain.tree is None and chain.nodes is None
    level = ForwardBatch.create(positions[:, 1:3], mode=ForwardMode.DRAFT_EXTEND, tree=TREES[0], nodes=(1, 2))
    np.testing.assert_array_equal(level.base, jnp.full((BATCH, 1), 100))
    assert not level.every_node
