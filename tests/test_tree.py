"""Tree speculation's math (jax_oc128.tree): the static facts of hand-made trees, their constructors and
errors, drafting a tree level by level, greedy acceptance on hand-made verifies, and sampled acceptance
following the target's distribution (chi-square, as the chain's in test_decode.py)."""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sampled import (
    VOCAB,
    assert_first_two_follow,
    at_nodes,
    chi_square_holds,
    context_tables,
    draft_and_accept,
    sampling_rows,
    softmax64,
)

from jax_oc128.sampling import pick, tempered
from jax_oc128.tree import (
    DEFAULT_CHOICES,
    Tree,
    accept_greedy,
    accept_sampled,
    check_parents,
    draft_children,
    draft_tree,
)

# an EAGLE-style example: nodes 0 (root), 1 = [0], 2 = [1], 3 = [0, 0], 4 = [0, 1], 5 = [1, 0], 6 = [0, 0, 0]
EXAMPLE_CHOICES = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
EXAMPLE = (-1, 0, 0, 1, 1, 2, 3)


def test_facts_of_a_hand_made_tree():
    t = Tree(EXAMPLE)
    assert t.size == 7 and t.depth == 3
    assert t.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert t.ranks.tolist() == [0, 0, 1, 0, 1, 0, 0]
    assert t.children == ((1, 2), (3, 4), (5,), (6,), (), (), ())
    assert t.children_table.tolist() == [[1, 2], [3, 4], [5, -1], [6, -1], [-1, -1], [-1, -1], [-1, -1]]
    on_path = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 4], 5: [0, 2, 5], 6: [0, 1, 3, 6]}
    assert {k: np.flatnonzero(t.mask[k]).tolist() for k in range(7)} == on_path
    assert t.paths.tolist() == [p + [-1] * (4 - len(p)) for p in on_path.values()]
    assert t.levels == ((0,), (1, 2), (3, 4, 5), (6,))
    assert t.expanded == ((0,), (1, 2), (3,))
    assert t.widths == (2, 2, 1)
    with pytest.raises(ValueError):  # the facts are read-only
        t.depths[0] = 1


def test_facts_of_a_tree_not_in_depth_order():
    """Parents need only come first: node 3 (depth 1) after node 2 (depth 2)."""
    t = Tree((-1, 0, 1, 0))
    assert t.depths.tolist() == [0, 1, 2, 1] and t.ranks.tolist() == [0, 0, 0, 1]
    assert t.levels == ((0,), (1, 3), (2,)) and t.expanded == ((0,), (1,))
    assert t.paths.tolist() == [[0, -1, -1], [0, 1, -1], [0, 1, 2], [0, 3, -1]]


def test_chain():
    t = Tree.chain(5)
    assert t.parents == (-1, 0, 1, 2, 3) and t.depth == 4
    assert np.array_equal(t.mask, np.tri(5, dtype=bool))  # causal: the chain's verify
    assert t.depths.tolist() == list(range(5)) and t.widths == (1,) * 4
    assert Tree.chain(1).parents == (-1,) and Tree.chain(1).depth == 0
    assert t.is_chain and Tree.chain(1).is_chain and Tree((-1, 0, 1)).is_chain
    assert not Tree((-1, 0, 0)).is_chain and not Tree((-1, 0, 1, 0)).is_chain


def test_trees_compare_and_hash_by_parents():
    assert Tree((-1, 0, 1)) == Tree.chain(3) and hash(Tree((-1, 0, 1))) == hash(Tree.chain(3))
    assert Tree((-1, 0, 0)) != Tree.chain(3) and Tree.chain(3) != (-1, 0, 1)

    @functools.partial(jax.jit, static_argnums=0)
    def depth_sum(t, x):
        return x + t.depths.sum()

    assert int(depth_sum(Tree.chain(3), 1)) == 4 and int(depth_sum(Tree((-1, 0, 0)), 1)) == 3


def test_from_choices():
    t = Tree.from_choices(EXAMPLE_CHOICES)
    assert t.parents == EXAMPLE
    assert Tree.from_choices(EXAMPLE_CHOICES[::-1]) == t  # numbered by depth then ranks, whatever the order
    assert Tree.from_choices(((0,), (0, 0))) == Tree.chain(3) and Tree.from_choices([]) == Tree.chain(1)
    # a node's rank is the last rank of its choice
    assert t.ranks[1:].tolist() == [c[-1] for c in sorted(EXAMPLE_CHOICES, key=lambda c: (len(c), c))]


def test_default_trees():
    """Tree.default(n) takes the most probable paths of depth <= 4 under the per-rank acceptance model of
    its docstring (recomputed here), and the expected accepted lengths it quotes hold."""
    probability = (0.7, 0.15, 0.05)
    paths = [p for d in range(1, 5) for p in np.ndindex(*(3,) * d)]
    # (rounded: equal products in another order differ in the last bit)
    best = sorted(paths, key=lambda p: (-round(math.prod(probability[r] for r in p), 12), len(p), p))[:15]
    assert tuple(best) == DEFAULT_CHOICES

    def expected(t):  # the root (always kept) + the probability of each draft's whole path
        return sum(
            math.prod(probability[t.ranks[j]] for j in t.paths[k, 1 : t.depths[k] + 1]) for k in range(t.size)
        )

    assert Tree.default(8).parents == (-1, 0, 0, 1, 1, 2, 3, 6)
    assert Tree.default(8).depth == Tree.default(16).depth == 4 and Tree.default(16).widths[0] == 3
    quoted = {Tree.default(8): 3.13, Tree.chain(8): 3.14, Tree.chain(5): 2.77, Tree.default(16): 3.61}
    quoted[Tree.chain(16)] = 3.32
    for t, length in quoted.items():
        assert round(expected(t), 2) == length, t
    assert Tree.default(1) == Tree.chain(1) and Tree.default(2) == Tree.chain(2)


@pytest.mark.parametrize(
    ("parents", "error", "message"),
    [
        ("-1,0", TypeError, "parents: must be a sequence of ints"),
        (5, TypeError, "parents: must be a sequence of ints"),
        ((), ValueError, "parents: must have 1 to 16"),
        ((-1, *range(16)), ValueError, "parents: must have 1 to 16"),
        ((-1, 0.0), TypeError, "parents: parents[1] must be an int"),
        ((-1, True), TypeError, "parents: parents[1] must be an int"),
        ((0, 0), ValueError, "parents: parents[0] must be -1"),
        ((-1, 1), ValueError, "parents: parents[1] must be in [0, 1)"),
        ((-1, 0, -1), ValueError, "parents: parents[2] must be in [0, 2)"),
        ((-1, 0, 3, 1), ValueError, "parents: parents[2] must be in [0, 2)"),
    ],
)
def test_bad_parents(parents, error, message):
    with pytest.raises(error, match="^" + re.escape(message)):
        Tree(parents)
    with pytest.raises(error, match="^" + re.escape(message.replace("parents", "tree"))):
        check_parents(parents, "tree")  # an op's tree= argument


@pytest.mark.parametrize(
    ("choices", "error", "message"),
    [
        ("0", TypeError, "choices: must be a sequence of paths"),
        ([0], TypeError, r"choices: choices\[0\] must be a sequence of ranks"),
        ([[0], []], ValueError, r"choices: choices\[1\] must be a non-empty path of ints >= 0"),
        ([[-1]], ValueError, r"choices: choices\[0\] must be a non-empty path"),
        ([[0.0]], ValueError, r"choices: choices\[0\] must be a non-empty path"),
        ([[0], [0]], ValueError, "choices: paths must be distinct"),
        ([[0], [0, 0, 0]], ValueError, r"choices: \[0, 0, 0\] has no parent \[0, 0\]"),
        ([[0], [2]], ValueError, r"choices: \[2\] has no previous sibling \[1\]"),
        ([[0], [0, 1]], ValueError, r"choices: \[0, 1\] has no previous sibling \[0, 0\]"),
        ([[i] for i in range(16)], ValueError, r"choices: at most 15 paths"),
    ],
)
def test_bad_choices(choices, error, message):
    with pytest.raises(error, match=f"^{message}"):
        Tree.from_choices(choices)


@pytest.mark.parametrize(
    ("size", "error"), [(0, ValueError), (17, ValueError), (2.0, TypeError), (True, TypeError)]
)
def test_bad_sizes(size, error):
    for make in (Tree.chain, Tree.default):
        with pytest.raises(error, match=r"^size: "):
            make(size)


def test_draft_children_greedy_is_the_top_k():
    logits = jax.random.normal(jax.random.key(0), (2, 3, 10))
    picks = draft_children(logits, 4)
    assert picks.dtype == jnp.int32 and picks.shape == (2, 3, 4)
    assert np.array_equal(picks, np.argsort(-np.asarray(logits), axis=-1)[..., :4])


def test_draft_children_samples_without_replacement():
    """Two draws: distinct, the pair (x, y) distributed as q(x) q(y) / (1 - q(x)) (chi-square over 30000
    rows, 20 cells), q = softmax(logits / 0.7)."""
    logits = jnp.asarray([1.0, 0.2, -0.5, 0.7, 0.0])
    rows = 30000
    wide = jnp.broadcast_to(logits, (rows, 1, 5))
    picks = np.asarray(draft_children(wide, 2, jax.random.key(1), sampling_rows(rows, 0.7)))
    q = softmax64(logits, 0.7)
    pairs = q[:, None] * q[None, :] / (1 - q[:, None])
    np.fill_diagonal(pairs, 0)
    counts = np.zeros((5, 5))
    np.add.at(counts, (picks[:, 0, 0], picks[:, 0, 1]), 1)
    ok, detail = chi_square_holds(counts, pairs)
    assert ok, detail


@pytest.mark.parametrize("temperature", [1e-10, 1e-40])
def test_sampling_at_a_vanishing_temperature_is_greedy_under_jit(temperature):
    """At 1e-10 and 1e-40 the tempered logits are finite, 0 at the argmax (no NaN: scaling before
    subtracting the maximum overflowed under jit); a sample (the engine's pick) is the argmax, a draft of two
    children the top 2."""
    key = jax.random.key(0)
    logits = jax.random.normal(jax.random.key(1), (64, 1, 32)) * 4
    order = np.argsort(-np.asarray(logits), axis=-1)
    sampling = sampling_rows(64, temperature)
    assert not np.any(sampling.greedy)  # sampled, not taken as greedy
    scaled = np.asarray(jax.jit(tempered)(logits, sampling.temperature))
    assert np.isfinite(scaled).all() and np.all(scaled <= 0)
    assert np.array_equal(np.take_along_axis(scaled, order[..., :1], -1), np.zeros((64, 1, 1)))
    assert np.array_equal(jax.jit(pick)(logits[:, 0], key, sampling), order[:, 0, 0])
    drafts = jax.jit(draft_children, static_argnums=1)(logits, 2, key, sampling)
    assert np.array_equal(drafts, order[..., :2])


def test_draft_children_bad_arguments():
    with pytest.raises(ValueError, match=r"^width: must be in \[1, 10\]"):
        draft_children(jnp.zeros((1, 1, 10)), 11)
    with pytest.raises(ValueError, match=r"^key: a PRNG key is needed to sample"):
        draft_children(jnp.zeros((1, 1, 10)), 2, None, sampling_rows(1, 1.0))


def test_draft_tree_greedy():
    """Each draft is the rank-th best token of the draft head at its parent; the head reads each level once,
    with the tokens of the levels drafted so far (deeper ones 0), and its carry threads through."""
    t = Tree(EXAMPLE)
    tables = context_tables(np.random.default_rng(0), t.depth)
    root = jnp.asarray([3, 1], jnp.int32)

    def draft_fn(carry, tokens, level):
        assert not np.asarray(tokens[:, t.depths > level]).any()
        return at_nodes(tables, t, tokens, t.expanded[level]), [*carry, level]

    tokens, draft_logits, levels = draft_tree(t, root, draft_fn, [])
    assert levels == [0, 1, 2] and tokens.dtype == jnp.int32 and tokens.shape == (2, 7)
    assert np.array_equal(tokens[:, 0], root)
    for k in range(1, t.size):
        parent = at_nodes(tables, t, tokens, [t.parents[k]])[:, 0]
        assert np.array_equal(tokens[:, k], np.argsort(-np.asarray(parent), axis=-1)[:, t.ranks[k]]), k
    expanded = [k for nodes in t.expanded for k in nodes]
    assert np.array_equal(draft_logits[:, expanded], at_nodes(tables, t, tokens, expanded))
    assert not np.asarray(draft_logits[:, [k for k in range(t.size) if k not in expanded]]).any()


def test_draft_tree_bad_arguments():
    def draft_fn(carry, tokens, level):
        return jnp.zeros((2, 2, VOCAB)), carry  # two nodes where the root alone is read

    root = jnp.zeros(2, jnp.int32)
    with pytest.raises(ValueError, match=r"^draft_fn: at level 0 must give logits \[2, 1, V\]"):
        draft_tree(Tree(EXAMPLE), root, draft_fn, None)
    with pytest.raises(ValueError, match=r"^tree: must have drafts"):
        draft_tree(Tree.chain(1), root, draft_fn, None)
    with pytest.raises(TypeError, match=r"^tree: must be a Tree"):
        draft_tree(EXAMPLE, root, draft_fn, None)


def one_hot_logits(argmaxes, vocab=8):
    """Target logits ``[bs, N, V]`` whose argmax at node k is ``argmaxes[..., k]``."""
    return jnp.where(jnp.arange(vocab) == jnp.asarray(argmaxes)[..., None], 1.0, 0.0)


def test_greedy_acceptance_on_hand_made_verifies():
    """The EXAMPLE tree, the target's argmax (1, 3, 4, 6, 7, 2, 0) at nodes 0..6, one verify per row."""
    argmax = [1, 3, 4, 6, 7, 2, 0]
    tokens = jnp.asarray(
        [
            [5, 1, 2, 3, 0, 0, 6],  # full depth: 1, 3, 6 accepted (2, 4 not, 5 under 2)
            [5, 2, 0, 3, 3, 4, 6],  # nothing accepted: the bonus alone
            [5, 1, 1, 3, 3, 4, 1],  # siblings repeat a token: 3, 4 and 5 accepted at depth 2, 3 kept
            [5, 1, 1, 0, 0, 4, 6],  # the deeper branch under the second child; 6 agrees but 3 did not
        ],
        jnp.int32,
    )
    got = accept_greedy(Tree(EXAMPLE), one_hot_logits([argmax] * 4), tokens)
    assert got.node.tolist() == [6, 0, 3, 5]
    assert got.length.tolist() == [4, 1, 3, 3]
    assert got.path.tolist() == [[0, 1, 3, 6], [0, -1, -1, -1], [0, 1, 3, -1], [0, 2, 5, -1]]
    assert got.emitted.tolist() == [[1, 3, 6, 0], [1, 0, 0, 0], [1, 3, 6, 0], [1, 4, 2, 0]]
    assert got.bonus.tolist() == [0, 1, 6, 2]
    assert all(x.dtype == jnp.int32 for x in jax.tree.leaves(got))


def reference_greedy(t, target_logits, tokens):
    """accept_greedy by a walk in numpy: (node, emitted) per row."""
    target = np.argmax(target_logits, axis=-1)
    nodes, emitted = [], []
    for row, argmax in zip(np.asarray(tokens), target, strict=True):
        accepted = [0]
        for k in range(1, t.size):
            if t.parents[k] in accepted and row[k] == argmax[t.parents[k]]:
                accepted.append(k)
        node = max(accepted, key=lambda k: (t.depths[k], -k))
        path = t.paths[node, 1 : t.depths[node] + 1]
        nodes.append(node)
        emitted.append([*row[path], argmax[node]] + [0] * (t.depth - len(path)))
    return nodes, emitted


@pytest.mark.parametrize("parents", [EXAMPLE, Tree.default(16).parents, (-1, 0, 1, 0, 3, 1, 2, 0, 4, 4)])
def test_greedy_acceptance_matches_a_walk(parents):
    """Random verifies over 3 tokens (most drafts agree somewhere, siblings sometimes repeat a token)."""
    t = Tree(parents)
    key_logits, key_tokens = jax.random.split(jax.random.key(len(parents)))
    logits = jax.random.normal(key_logits, (64, t.size, 3))
    tokens = jax.random.randint(key_tokens, (64, t.size), 0, 3, jnp.int32)
    got = accept_greedy(t, logits, tokens)
    nodes, emitted = reference_greedy(t, logits, tokens)
    assert got.node.tolist() == nodes and got.emitted.tolist() == emitted
    assert np.array_equal(got.length, t.depths[nodes] + 1) and np.array_equal(got.path, t.paths[nodes])
    assert len(set(nodes)) > 3  # the cases vary


def test_greedy_acceptance_of_the_chain_is_the_chains_rule():
    """Tree.chain(N): the longest run of drafts equal to the target's argmax before them (the engine's
    chain rule), then the argmax after the run."""
    n = 5
    key_logits, key_tokens = jax.random.split(jax.random.key(7))
    logits = jax.random.normal(key_logits, (128, n, 2))
    tokens = jax.random.randint(key_tokens, (128, n), 0, 2, jnp.int32)
    got = accept_greedy(Tree.chain(n), logits, tokens)
    target = np.argmax(np.asarray(logits), axis=-1)
    agree = np.asarray(tokens)[:, 1:] == target[:, :-1]
    run = np.where(agree.all(axis=1), n - 1, np.argmin(agree, axis=1))
    assert got.node.tolist() == run.tolist()
    assert got.bonus.tolist() == target[np.arange(128), run].tolist()
    assert sorted(set(run.tolist())) == list(range(n))


@pytest.mark.parametrize(
    ("target_logits", "tokens", "error", "message"),
    [
        ((2, 6, 8), (2, 7), ValueError, r"target_logits: must be \[bs, 7, V\]"),
        ((2, 7), (2, 7), ValueError, r"target_logits: must be \[bs, 7, V\]"),
        ((2, 7, 8), (3, 7), ValueError, r"tokens: must be \[2, 7\]"),
    ],
)
def test_acceptance_bad_shapes(target_logits, tokens, error, message):
    target_logits, tokens = jnp.zeros(target_logits), jnp.zeros(tokens, jnp.int32)
    with pytest.raises(error, match=f"^{message}"):
        accept_greedy(Tree(EXAMPLE), target_logits, tokens)
    with pytest.raises(error, match=f"^{message}"):
        accept_sampled(
            Tree(EXAMPLE), target_logits, target_logits, tokens, jax.random.key(0), sampling_rows(2, 1.0)
        )


def test_sampled_acceptance_bad_arguments():
    logits, tokens = jnp.zeros((2, 7, 8)), jnp.zeros((2, 7), jnp.int32)
    with pytest.raises(ValueError, match=r"^draft_logits: must be \[2, 7, 8\]"):
        accept_sampled(
            Tree(EXAMPLE), logits, logits[..., :4], tokens, jax.random.key(0), sampling_rows(2, 1.0)
        )
    with pytest.raises(TypeError, match=r"^tree: must be a Tree"):
        accept_greedy(EXAMPLE, logits, tokens)


@pytest.mark.parametrize("temperature", [0.001, 1e-10, 1e-40])
@pytest.mark.parametrize("parents", [EXAMPLE, Tree.default(16).parents])
def test_sampled_acceptance_at_a_vanishing_temperature_is_greedy(parents, temperature):
    """Greedy drafting (the top-k: Gumbel-top-k's limit at temperature 0) and target logits a permutation
    of 0..V-1 at every node: at temperature 0.001 and below the target's softmax is exactly one-hot in
    float32 and each draft the most probable token left to its draw, so the sampled walk accepts exactly
    the drafts equal to the target's argmax: the greedy walk's path and bonus (at 1e-10 and 1e-40 no NaN
    either: softmax(logits / T) once overflowed under jit)."""
    t, rows, vocab = Tree(parents), 256, 4
    keys = jax.random.split(jax.random.key(3), 3)
    order = jax.vmap(lambda k: jax.random.permutation(k, vocab))(jax.random.split(keys[0], rows * t.size))
    target_logits = order.reshape(rows, t.size, vocab).astype(jnp.float32)
    draft_logits = jax.random.normal(keys[1], (rows, t.size, vocab))

    @jax.jit
    def both(target_logits, draft_logits, key):
        def draft_fn(carry, tokens, level):
            return draft_logits[:, t.expanded[level]], carry

        tokens, logits, _ = draft_tree(t, jnp.zeros(rows, jnp.int32), draft_fn, None)
        greedy = accept_greedy(t, target_logits, tokens)
        return greedy, accept_sampled(t, target_logits, logits, tokens, key, sampling_rows(rows, temperature))

    greedy, sampled = both(target_logits, draft_logits, keys[2])
    for name, want in vars(greedy).items():
        assert np.array_equal(getattr(sampled, name), want), name
    assert len(set(greedy.node.tolist())) > 3  # the cases vary


WIDE = Tree.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 2]])
#: draft tables per case: close to the target's, independent of it, overlapping it on 2 of its 4
#: tokens, or disjoint from it (and of 2 tokens: a third child is a draw from nothing)
DRAFT_CASES = {
    "close": lambda rng, target: [t + 0.5 * rng.normal(size=t.shape).astype(np.float32) for t in target],
    "other": lambda rng, target: context_tables(rng, len(target) - 1),
    "partial": lambda rng, target: context_tables(rng, len(target) - 1, support=[2, 3, 4, 5]),
    "disjoint": lambda rng, target: context_tables(rng, len(target) - 1, support=[4, 5]),
}
TARGET_SUPPORT = {"close": None, "other": None, "partial": [0, 1, 2, 3], "disjoint": [0, 1, 2, 3]}
ROWS = 30000
TEMPERATURE = 0.8


@pytest.mark.parametrize(
    ("t", "case"),
    [
        (WIDE, "close"),
        (WIDE, "partial"),
        (WIDE, "disjoint"),
        (Tree.default(8), "other"),
        (Tree.chain(3), "other"),
    ],
    ids=["wide-close", "wide-partial", "wide-disjoint", "default8-other", "chain3-other"],
)
def test_sampled_acceptance_follows_the_target(t, case):
    """30000 speculative steps of toy context models (logits a table of the drafts before): the first new
    token is distributed as the target's softmax at the root, and the first two as the target's joint law
    p(x) p(y | x) (a step that emitted one token takes its second from the target after it, as the next
    step's first token would): chi-square, p > 1e-3, whatever the draft's distribution."""
    rng = np.random.default_rng(sorted(DRAFT_CASES).index(case) + 10 * t.size)
    target = context_tables(rng, t.depth, TARGET_SUPPORT[case])
    draft = DRAFT_CASES[case](rng, target)
    got = draft_and_accept(t, target, draft, jax.random.key(t.size), sampling_rows(ROWS, TEMPERATURE))
    assert_first_two_follow(got, [softmax64(table, TEMPERATURE) for table in target[:2]], rng)
    length = np.asarray(got.length)
    if case != "disjoint":  # drafts were accepted, beyond the first level too
        assert (length >= 3).mean() > 0.02, np.bincount(length)
