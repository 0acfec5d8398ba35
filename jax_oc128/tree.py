"""Tree speculation's pure math: a static draft-tree shape, drafting a tree level by level, and accepting a
path of it (greedy, or by multi-draft speculative sampling that keeps the target's distribution).

**Nodes and verify tokens.** A tree of N nodes is the N tokens of one verify, node k being verify token k
(the ops' ``verify(..., tree=parents)``: bank k + 1 holds the state after the path from the root to node
k). In the engine's speculative step (:func:`jax_oc128.engine.steps.speculative_step`, which drafts,
verifies and accepts every tree, the chain included, by this module's rules), **node 0 is the root: the
newest token** (the last step's bonus token, already output, always kept); nodes 1 .. N-1 are drafts,
each a child of its parent in the token stream: node k sits at position ``position + depths[k]``. The
chain of N is the tree ``(-1, 0, 1, ..., N - 2)``.

After a verify, a row keeps the path from the root to one accepted node ``a``: ``depths[a] + 1`` tokens
(the commit's ``accept_lens``; its bank is ``a + 1``), and outputs the path's drafts followed by the bonus
token (the target's token after ``a``): ``depths[a] + 1`` new tokens, as the chain's ``accepted + 1``.

**Drafting.** The draft head runs once per level: at level d it reads the tokens of the depth-d nodes that
have children (:attr:`Tree.expanded`) and gives their next-token logits; each such node's children are the
top-k tokens of its logits (greedy) or k draws without replacement from the row's sampled distribution
(:mod:`jax_oc128.sampling`: tempered, truncated by top-k and top-p) in draw order (Gumbel-top-k), a node's
rank-r child taking the r-th. Siblings are therefore distinct tokens.

**Acceptance.** Greedy: a draft is accepted when its parent is and it is the target's argmax at its
parent; the row keeps the deepest accepted node. Sampled: recursive rejection sampling over a node's
children in draw order (SpecInfer's multi-step speculative sampling, with Sequoia's update of the draft
distribution for draws without replacement): child x_i is accepted with probability min(1, r(x_i) /
q_i(x_i)), r the target's distribution at the node (at first); on rejection r <- normalize(max(r - q_i,
0)) and q_{i+1} = q_i without x_i, renormalised; the walk descends into the accepted child, and where
every child is rejected (or at a leaf) the bonus token is drawn from r. Each emitted token then follows
the target's distribution exactly. With top-k or top-p, r and q are the target's and the draft's
distributions truncated by the same rule (:func:`~jax_oc128.sampling.log_probs`), so the tokens follow the
target's truncated distribution exactly: the proof only needs the drafts drawn from the q used here.
Each row has its own parameters (:class:`~jax_oc128.sampling.Sampling`; greedy rows by the greedy rule).

Every function is jit-friendly: the tree is static (a hashable :class:`Tree`, its facts numpy arrays
computed once), loops over levels and siblings are unrolled. Arrays are batch-first (``bs`` rows).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_oc128.checks import check_int, is_int
from jax_oc128.rules import MAX_DRAFT
from jax_oc128.sampling import Sampling, log_probs, softmax

#: the default trees' nodes after the root, best first, as sibling ranks along each path (see
#: :meth:`Tree.default`): the 15 most probable paths of depth <= 4 when a rank-r draft is the target's
#: token with probability (0.7, 0.15, 0.05)[r], independently per level (ties: shorter, then smaller ranks)
DEFAULT_CHOICES = (
    (0,),
    (0, 0),
    (0, 0, 0),
    (0, 0, 0, 0),
    (1,),
    (0, 1),
    (1, 0),
    (0, 0, 1),
    (0, 1, 0),
    (1, 0, 0),
    (0, 0, 0, 1),
    (0, 0, 1, 0),
    (0, 1, 0, 0),
    (1, 0, 0, 0),
    (2,),
)


def check_parents(parents, name: str = "parents") -> tuple[int, ...]:
    """A tree's parents checked (the one rule, for :class:`Tree` and an op's ``tree=``): a sequence of 1 to
    MAX_DRAFT ints (bools refused), ``parents[0] == -1``, ``0 <= parents[k] < k``. Errors name ``name``.
    Returns them as a tuple of ints."""
    if isinstance(parents, str | bytes) or not isinstance(parents, Sequence):
        raise TypeError(f"{name}: must be a sequence of ints, got {type(parents).__name__}")
    if not 1 <= len(parents) <= MAX_DRAFT:
        raise ValueError(f"{name}: must have 1 to {MAX_DRAFT} (MAX_DRAFT) nodes, got {len(parents)}")
    for k, parent in enumerate(parents):
        if not is_int(parent):
            raise TypeError(f"{name}: {name}[{k}] must be an int, got {parent!r}")
    if parents[0] != -1:
        raise ValueError(f"{name}: {name}[0] must be -1 (node 0 is the root), got {parents[0]}")
    for k, parent in enumerate(parents[1:], 1):
        if not 0 <= parent < k:
            raise ValueError(f"{name}: {name}[{k}] must be in [0, {k}) (a node before it), got {parent}")
    return tuple(map(int, parents))


def _frozen(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


class Tree:
    """A static draft-tree shape of N nodes (1 <= N <= MAX_DRAFT = 16), given by its parents: node 0 is
    the root (``parents[0] == -1``), every other node's parent comes before it (``0 <= parents[k] < k``).
    Hashable and compared by its parents (a static argument of jitted functions).

    Attributes (numpy, read-only, computed once):
      parents: tuple of N ints.
      size: N.
      depths: ``[N]`` int32, the node's depth (root 0): its position offset in the verify.
      depth: the deepest node's depth (N - 1 for the chain).
      ranks: ``[N]`` int32, the node's rank among its siblings (0 for the first child of its parent in
        index order; the root 0): the rank of its token in its parent's draft.
      children: per node, the tuple of its children in index (= rank) order.
      children_table: ``[N, W]`` int32, the same padded with -1 (W the most children of a node, >= 1).
      mask: ``[N, N]`` bool, ``mask[i, j]``: node j is on the path from the root to node i (an
        ancestor of i, or i): node i attends to node j in a verify.
      paths: ``[N, depth + 1]`` int32, ``paths[k, :depths[k] + 1]`` the nodes from the root to k, then -1.
      levels: per depth d in 0 .. depth, the tuple of the nodes at depth d.
      expanded: per depth d in 0 .. depth - 1, the tuple of the nodes at depth d that have children (in
        index order): the nodes the draft head reads at level d.
      widths: per depth d in 0 .. depth - 1, the most children of a node at depth d.
    """

    def __init__(self, parents: Sequence[int]):
        self.parents = check_parents(parents)
        n = self.size = len(self.parents)
        children = [[] for _ in range(n)]
        depths, ranks = np.zeros(n, np.int32), np.zeros(n, np.int32)
        mask = np.eye(n, dtype=bool)
        for k, parent in enumerate(self.parents[1:], 1):
            ranks[k] = len(children[parent])
            children[parent].append(k)
            depths[k] = depths[parent] + 1
            mask[k] |= mask[parent]
        self.children = tuple(map(tuple, children))
        self.depths, self.ranks, self.mask = map(_frozen, (depths, ranks, mask))
        self.depth = int(depths.max())
        width = max(1, *map(len, children))
        table = np.full((n, width), -1, np.int32)
        paths = np.full((n, self.depth + 1), -1, np.int32)
        for k in range(n):
            table[k, : len(children[k])] = children[k]
            path = np.flatnonzero(mask[k])  # ancestors come before their descendants: root to k
            paths[k, : len(path)] = path
        self.children_table, self.paths = _frozen(table), _frozen(paths)
        self.levels = tuple(tuple(np.flatnonzero(depths == d).tolist()) for d in range(self.depth + 1))
        self.expanded = tuple(tuple(k for k in level if children[k]) for level in self.levels[:-1])
        self.widths = tuple(max(len(children[k]) for k in nodes) for nodes in self.expanded)

    @classmethod
    def chain(cls, size: int) -> Tree:
        """The chain of ``size`` nodes (an int in [1, 16]): the root and ``size - 1`` drafts in a row."""
        size = check_int("size", size, 1, MAX_DRAFT, " = MAX_DRAFT")
        return cls((-1, *range(size - 1)))

    @classmethod
    def from_choices(cls, choices: Sequence[Sequence[int]]) -> Tree:
        """The tree of EAGLE/Medusa-style ``choices``: the nodes after the root, each given by the sibling
        ranks along its path (``[0]``: the root's top draft, ``[1, 0]``: the top draft after its second),
        at most 15 distinct non-empty paths of ints >= 0, each path's parent and its previous sibling
        present (``[0, 1]`` needs ``[0]`` and ``[0, 0]``: a node's children are its draft's top-k or first
        k draws). Nodes are numbered by depth, then by ranks: the root 0, then the choices sorted by
        (length, ranks)."""
        if isinstance(choices, str | bytes) or not isinstance(choices, Sequence):
            raise TypeError(f"choices: must be a sequence of paths, got {type(choices).__name__}")
        paths = []
        for i, path in enumerate(choices):
            if isinstance(path, str | bytes) or not isinstance(path, Sequence):
                raise TypeError(f"choices: choices[{i}] must be a sequence of ranks, got {path!r}")
            if not path or not all(is_int(r) and r >= 0 for r in path):
                raise ValueError(f"choices: choices[{i}] must be a non-empty path of ints >= 0, got {path!r}")
            paths.append(tuple(map(int, path)))
        if len(set(paths)) != len(paths):
            raise ValueError(f"choices: paths must be distinct, got {list(choices)!r}")
        if len(paths) >= MAX_DRAFT:
            raise ValueError(f"choices: at most {MAX_DRAFT - 1} paths (MAX_DRAFT - 1), got {len(paths)}")
        present = set(paths)
        for path in paths:
            parent, rank = path[:-1], path[-1]
            if parent and parent not in present:
                raise ValueError(f"choices: {list(path)} has no parent {list(parent)}")
            if rank and (*parent, rank - 1) not in present:
                raise ValueError(f"choices: {list(path)} has no previous sibling {[*parent, rank - 1]}")
        paths.sort(key=lambda path: (len(path), path))
        index = {path: k for k, path in enumerate(paths, 1)}
        return cls((-1, *(index.get(path[:-1], 0) for path in paths)))

    @classmethod
    def default(cls, size: int) -> Tree:
        """The default tree of ``size`` nodes (an int in [1, 16]): the root and the first ``size - 1`` of
        :data:`DEFAULT_CHOICES`.

        Why this tree: with a rank-r draft the target's token with a probability that depends on r alone
        (Sequoia's positional acceptance model), a tree's expected accepted length is 1 + the sum over
        its drafts of the probability that the whole path to the draft is the target's, so the best tree
        of a given size takes the most probable paths. With probabilities 0.7, 0.15, 0.05 for ranks 0,
        1, 2 (DeepSeek's MTP keeps its top-1 draft 85-90% of the time at the first level and less deeper,
        SPEC.md 4; lower ranks are far behind) those are the top-1 chain and its first alternatives. The
        depth is capped at 4 because every level is one sequential run of the draft head while width is
        nearly free in the verify: under that model 8 nodes (depth 4) expect 3.13 tokens a step, about as
        many as the chain of 8 (3.14, depth 7) and more than the chain of 5 (2.77) that drafts as many
        levels; 16 nodes (depth 4, three children at the root) expect 3.61, the chain of 16 (depth 15)
        3.32. (EAGLE's default tree has 60+ nodes, past our 16 banks.)"""
        size = check_int("size", size, 1, MAX_DRAFT, " = MAX_DRAFT")
        return cls.from_choices(DEFAULT_CHOICES[: size - 1])

    @property
    def is_chain(self) -> bool:
        """Whether this is :meth:`chain` of its size (every node the child of the one before it): the tree
        the model verifies and drafts with the chain's kernels and masks (its nodes at consecutive
        positions)."""
        return self.depth == self.size - 1

    def __eq__(self, other):
        return isinstance(other, Tree) and other.parents == self.parents

    def __hash__(self):
        return hash(self.parents)

    def __repr__(self):
        return f"Tree({self.parents})"


def check_tree(tree) -> Tree:
    """``tree`` a :class:`Tree` (TypeError otherwise, naming ``tree``)."""
    if not isinstance(tree, Tree):
        raise TypeError(f"tree: must be a Tree, got {type(tree).__name__}")
    return tree


def draft_children(logits, width: int, key=None, sampling: Sampling | None = None):
    """Each node's ``width`` children tokens from its draft ``logits`` ``[bs, n, V]`` (any float dtype):
    the top-``width`` tokens, best first (``sampling`` None, or a greedy row of it), or ``width`` draws
    without replacement from the row's distribution (:func:`~jax_oc128.sampling.log_probs`), in draw order
    (Gumbel-top-k with ``key``). Returns ``[bs, n, width]`` int32, distinct tokens per node (``width`` <=
    V)."""
    if not 1 <= width <= logits.shape[-1]:
        raise ValueError(f"width: must be in [1, {logits.shape[-1]}] (the vocabulary), got {width}")
    if sampling is not None and key is None:
        raise ValueError("key: a PRNG key is needed to sample (sampling given)")
    scores = logits.astype(jnp.float32)
    if sampling is not None:  # the draws only when a row samples

        def drawn():
            gumbel = jax.random.gumbel(key, scores.shape, jnp.float32)
            return jnp.where(sampling.greedy[:, None, None], scores, log_probs(scores, sampling) + gumbel)

        scores = jax.lax.cond(jnp.all(sampling.greedy), lambda: scores, drawn)
    if width == 1:  # the same token (of ties, the first), without top_k's sort (a chain drafts this way)
        return jnp.argmax(scores, axis=-1, keepdims=True).astype(jnp.int32)
    return jax.lax.top_k(scores, width)[1].astype(jnp.int32)


def draft_tree(tree: Tree, root, draft_fn: Callable, carry, key=None, sampling: Sampling | None = None):
    """Drafts ``tree`` level by level from the root tokens ``root`` ``[bs]`` int32 (the newest tokens).

    ``draft_fn(carry, tokens, level) -> (logits, carry)`` runs the draft head once per level 0 ..
    ``tree.depth - 1`` (a static, unrolled loop): ``tokens`` ``[bs, N]`` int32 holds the nodes of depth <=
    ``level`` (deeper nodes 0), ``logits`` ``[bs, len(tree.expanded[level]), V]`` are the next-token
    logits at the nodes ``tree.expanded[level]``, and ``carry`` is anything the head threads through the
    levels (e.g. its cache and hidden states). The children of each such node are then drafted by
    :func:`draft_children` (``key`` split per level; ``sampling`` None: greedy).

    With the MTP head, ``carry`` can hold its cache and ``[bs, N, H]`` hidden states by node: at level d
    the head reads the tokens ``tokens[:, expanded[d]]`` at positions ``position + d``, each with the
    target's hidden state (the root, level 0) or the head's own output at its parent (``hidden[:,
    parents[k]]``, stored there at level d - 1), and stores its outputs at ``hidden[:, expanded[d]]``;
    each node attends to the committed tokens and to its ancestors (``tree.mask``), not to its siblings.

    Returns ``(tokens, draft_logits, carry)``: ``tokens`` ``[bs, N]`` int32 (node 0 the root),
    ``draft_logits`` ``[bs, N, V]`` float32 each node's draft logits (zeros at the leaves: what
    :func:`accept_sampled` reads), and the last carry."""
    if check_tree(tree).size < 2:
        raise ValueError(f"tree: must have drafts (at least 2 nodes), got {tree}")
    bs = root.shape[0]
    tokens = jnp.zeros((bs, tree.size), jnp.int32).at[:, 0].set(root.astype(jnp.int32))
    draft_logits = None
    keys = [None] * tree.depth if sampling is None else jax.random.split(key, tree.depth)
    for level, nodes in enumerate(tree.expanded):
        logits, carry = draft_fn(carry, tokens, level)
        if logits.ndim != 3 or logits.shape[:2] != (bs, len(nodes)):
            raise ValueError(
                f"draft_fn: at level {level} must give logits [{bs}, {len(nodes)}, V] (the nodes "
                f"{nodes}), got {list(logits.shape)}"
            )
        if draft_logits is None:
            draft_logits = jnp.zeros((bs, tree.size, logits.shape[-1]), jnp.float32)
        draft_logits = draft_logits.at[:, nodes].set(logits.astype(jnp.float32))
        picks = draft_children(logits, tree.widths[level], keys[level], sampling)  # [bs, n, width]
        slot = {node: i for i, node in enumerate(nodes)}
        kids = list(tree.levels[level + 1])
        rows = picks[:, [slot[tree.parents[k]] for k in kids], [int(tree.ranks[k]) for k in kids]]
        tokens = tokens.at[:, kids].set(rows)
    return tokens, draft_logits, carry


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Acceptance:
    """One verify's accepted path per row (device arrays; D = ``tree.depth``).

    Attributes:
      node: ``[bs]`` int32, the accepted node (the commit's bank is ``node + 1``).
      length: ``[bs]`` int32, tokens kept, ``depths[node] + 1`` (the commit's ``accept_lens``; new tokens
        output).
      path: ``[bs, D + 1]`` int32, the nodes from the root to ``node`` (``path[:, 0] == 0``), then -1.
      emitted: ``[bs, D + 1]`` int32, the new tokens: the drafts on the path (nodes ``path[:, 1:length]``)
        then the bonus token, then 0 (the chain's step output).
      bonus: ``[bs]`` int32, the token after ``node`` (the next step's root).
    """

    node: jax.Array
    length: jax.Array
    path: jax.Array
    emitted: jax.Array
    bonus: jax.Array


def _acceptance(tree: Tree, tokens, node, bonus) -> Acceptance:
    """The :class:`Acceptance` of the accepted ``node`` ``[bs]`` and ``bonus`` ``[bs]`` of ``tokens``."""
    path = jnp.asarray(tree.paths)[node]  # [bs, D + 1]
    length = jnp.asarray(tree.depths)[node] + 1
    drafts = jnp.take_along_axis(tokens, jnp.maximum(path[:, 1:], 0), axis=1)
    emitted = jnp.concatenate([jnp.where(path[:, 1:] >= 0, drafts, 0), jnp.zeros_like(drafts[:, :1])], 1)
    emitted = emitted.at[jnp.arange(node.shape[0]), length - 1].set(bonus)
    return Acceptance(node, length, path, emitted, bonus)


def _check_verify(tree: Tree, target_logits, tokens):
    """``target_logits`` ``[bs, N, V]`` and ``tokens`` ``[bs, N]`` of ``tree`` (N = ``tree.size``)."""
    check_tree(tree)
    if target_logits.ndim != 3 or target_logits.shape[1] != tree.size:
        raise ValueError(f"target_logits: must be [bs, {tree.size}, V], got {list(target_logits.shape)}")
    if tokens.shape != target_logits.shape[:2]:
        raise ValueError(f"tokens: must be {list(target_logits.shape[:2])}, got {list(tokens.shape)}")


def accept_greedy(tree: Tree, target_logits, tokens) -> Acceptance:
    """Greedy acceptance of a verify of ``tree``: ``target_logits`` ``[bs, N, V]`` (any float dtype) the
    target's logits at every node, ``tokens`` ``[bs, N]`` int32 the nodes' tokens (node 0 the root).

    A draft is accepted when its parent is (the root always is) and its token is the target's argmax at
    the parent; the row keeps the deepest accepted node (of equally deep ones, the lowest index: only
    when siblings repeat a token, which drafting never does), and the bonus token is the target's argmax
    there. The chain of N gives the chain's greedy rule."""
    _check_verify(tree, target_logits, tokens)
    target = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [bs, N]
    parents = np.maximum(np.asarray(tree.parents), 0)
    agree = (tokens == target[:, parents]).at[:, 0].set(True)
    accepted = jnp.all(agree[:, None, :] | ~tree.mask[None], axis=-1)  # the whole path agrees
    node = jnp.argmax(jnp.where(accepted, tree.depths, -1), axis=1).astype(jnp.int32)
    bonus = jnp.take_along_axis(target, node[:, None], axis=1)[:, 0]
    return _acceptance(tree, tokens, node, bonus)


def accept_sampled(tree: Tree, target_logits, draft_logits, tokens, key, sampling: Sampling) -> Acceptance:
    """Sampled acceptance of a verify of ``tree``: ``target_logits`` ``[bs, N, V]`` the target's logits at
    every node, ``draft_logits`` ``[bs, N, V]`` the draft head's at every node with children (other rows
    unread), ``tokens`` ``[bs, N]`` int32 the nodes' tokens, each node's children drawn without replacement
    from the draft's distribution at it in rank order (:func:`draft_tree` with the same ``sampling``);
    ``key`` the acceptance's PRNG key; ``sampling`` each row's parameters (its greedy rows are sampled at
    :data:`~jax_oc128.sampling.MIN_TEMPERATURE`: :func:`accept` takes their greedy acceptance).

    From the root down (one unrolled pass per level), at the row's node: r and q the target's and the
    draft's distributions there, both tempered and truncated by the row's top-k and top-p
    (:func:`~jax_oc128.sampling.log_probs`); child i (in rank order) is accepted with probability min(1,
    r(x_i) / q(x_i)) (never when q(x_i) = 0: a draw from nothing left, with more children than tokens of
    nonzero probability), else r <- normalize(max(r - q, 0)) (r kept if that is all zero) and q <- q
    without x_i, renormalised. The row descends into the first accepted child; where none is (or at a
    leaf), the bonus token is drawn from r. Then every emitted token follows the target's truncated
    distribution at its context: each step of the walk is speculative sampling from r with the proposal
    q_i, whose residual is the next step's r."""
    _check_verify(tree, target_logits, tokens)
    if draft_logits.shape != target_logits.shape:
        raise ValueError(
            f"draft_logits: must be {list(target_logits.shape)} like target_logits, "
            f"got {list(draft_logits.shape)}"
        )
    bs, _, vocab = target_logits.shape
    rows = jnp.arange(bs)
    vocab_ids = jnp.arange(vocab)
    children = jnp.asarray(tree.children_table)
    target, draft = log_probs(target_logits, sampling), log_probs(draft_logits, sampling)
    accept_key, bonus_key = jax.random.split(key)
    u = jax.random.uniform(accept_key, (bs, tree.depth, tree.children_table.shape[1]), jnp.float32)
    node = jnp.zeros(bs, jnp.int32)
    done = jnp.zeros(bs, bool)
    residual = jnp.zeros((bs, vocab), jnp.float32)
    for level, width in enumerate(tree.widths):
        r = softmax(target[rows, node])
        q_logits = draft[rows, node]
        kids = children[node]  # [bs, W], -1 past the node's children
        drafts = jnp.take_along_axis(tokens, jnp.maximum(kids, 0), axis=1)
        chosen = jnp.full(bs, -1, jnp.int32)
        for i in range(width):
            x = drafts[:, i]
            q = softmax(q_logits)
            q_x, r_x = q[rows, x], r[rows, x]
            live = (kids[:, i] >= 0) & (chosen < 0) & ~done
            keep = live & (q_x > 0) & (u[:, level, i] * q_x < r_x)  # u < r/q without dividing
            chosen = jnp.where(keep, kids[:, i], chosen)
            rejected = (live & ~keep)[:, None]
            left = jnp.maximum(r - q, 0.0)
            total = jnp.sum(left, axis=-1, keepdims=True)
            r = jnp.where(rejected & (total > 0), left / jnp.where(total > 0, total, 1.0), r)
            q_logits = jnp.where(rejected & (vocab_ids == x[:, None]), -jnp.inf, q_logits)
        stops = ~done & (chosen < 0)
        residual = jnp.where(stops[:, None], r, residual)
        done = done | stops
        node = jnp.where(chosen >= 0, chosen, node)
    at_leaf = softmax(target[rows, node])
    residual = jnp.where(done[:, None], residual, at_leaf)
    bonus = jax.random.categorical(bonus_key, jnp.log(residual)).astype(jnp.int32)
    return _acceptance(tree, tokens, node, bonus)


def accept(tree: Tree, target_logits, draft_logits, tokens, key, sampling: Sampling) -> Acceptance:
    """Each row's acceptance by its ``sampling``: :func:`accept_greedy` for its greedy rows,
    :func:`accept_sampled` for the others (run only when a row samples); arguments as theirs."""
    greedy = accept_greedy(tree, target_logits, tokens)
    sampled = jax.lax.cond(
        jnp.all(sampling.greedy),
        lambda: greedy,
        lambda: accept_sampled(tree, target_logits, draft_logits, tokens, key, sampling),
    )
    rows = sampling.greedy
    return jax.tree.map(
        lambda g, s: jnp.where(rows.reshape((-1,) + (1,) * (g.ndim - 1)), g, s), greedy, sampled
    )
