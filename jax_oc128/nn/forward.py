"""The forward record: what every layer of one forward reads, built once per forward and passed down.

:class:`ForwardBatch` (SGLang's name; tpu-inference calls it ``AttentionMetadata``) holds the forward's mode,
tree and nodes (static) and its positions, lengths and page table (device arrays). The model builds it
(:meth:`DeepseekV4Model.__call__ <jax_oc128.nn.DeepseekV4Model.__call__>`, a draft head its own) and hands
it to each block, each attention layer and each compressor. The layer-stacked C128 state is not in it: the
C128 layers update it, so it is threaded beside the record, through :func:`prepare_forward` (once, before
the layers) and each HCA layer. Its controller is found from its type
(:func:`~jax_oc128.controller.backend_of`): a layer takes no backend.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_oc128.controller import ForwardMode, State, backend_of
from jax_oc128.rules import batch_slots, context_bucket
from jax_oc128.tree import Tree

__all__ = ["ForwardBatch", "commit_verify", "context_bucket", "prepare_forward"]

#: the metadata of a field in the record's tree structure (hashed, known at trace time)
_STATIC = {"static": True}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardBatch:
    """One forward's record, a pytree (make it with :meth:`create`, which checks it).

    Attributes:
      positions: ``[batch, T]`` int32, each token's position (a chain's consecutive per row; a tree's the
        root's + the node's depth).
      lengths: ``[batch]`` int32, the valid tokens of each row; the rest is padding, and a row of length 0
        leaves every cache untouched (outputs of padding are meaningless). Batch row b is slot b of the
        C128 state.
      page_table: None (the dense layout), or ``[batch, max_pages]`` int32: the pages of the compressed
        layers' pools holding each row's entries (-1: none), :mod:`~jax_oc128.nn.kv_cache`.
      mode: static :class:`~jax_oc128.controller.ForwardMode`: EXTEND or DECODE fold the tokens into the
        caches; TARGET_VERIFY writes a verify's banks (1 <= T <= max_draft, rows of length T or 0);
        DRAFT_EXTEND is a draft head's (no C128 layer).
      tree: static :class:`~jax_oc128.tree.Tree` of a tree verify (TARGET_VERIFY) or of a level of a tree
        draft (DRAFT_EXTEND), None for a chain (a chain given as a tree runs as the chain: same positions).
      nodes: static, the tree's nodes the T tokens are: every node (a verify) or distinct nodes of one
        depth (a draft level); None for a chain.
      context: static, the forward's context bound: every row's position + its tokens is at most
        ``context`` (the host's promise, :func:`context_bucket`), so every cache read touches only the first
        ``context`` positions of each slot (:meth:`read_entries`); None: all ``max_len``. The window ring
        is bounded by the window already; writes are as without it.
    """

    positions: jax.Array
    lengths: jax.Array
    page_table: jax.Array | None = None
    mode: ForwardMode = dataclasses.field(default=ForwardMode.EXTEND, metadata=_STATIC)
    tree: Tree | None = dataclasses.field(default=None, metadata=_STATIC)
    nodes: tuple[int, ...] | None = dataclasses.field(default=None, metadata=_STATIC)
    context: int | None = dataclasses.field(default=None, metadata=_STATIC)

    @classmethod
    def create(
        cls,
        positions,
        *,
        lengths=None,
        mode: ForwardMode = ForwardMode.EXTEND,
        tree: Tree | None = None,
        nodes: tuple[int, ...] | None = None,
        page_table=None,
        context: int | None = None,
    ) -> ForwardBatch:
        """The record of a forward of the tokens at ``positions`` ``[batch, T]`` int32; ``lengths``
        ``[batch]`` int32 (default: all T). ``tree`` and ``nodes`` (default: every node) are checked
        against T and ``mode``; a chain (:attr:`Tree.is_chain <jax_oc128.tree.Tree.is_chain>`) is stored
        as None. ``context``: None or a positive int (see the class doc)."""
        if not isinstance(mode, ForwardMode):
            raise TypeError(f"mode: a jax_oc128.ForwardMode, got {mode!r}")
        if jnp.ndim(positions) != 2:
            raise ValueError(f"positions: [batch, T], got shape {jnp.shape(positions)}")
        if context is not None and (not isinstance(context, int) or isinstance(context, bool)):
            raise TypeError(f"context: None or a positive int (a static bound), got {type(context).__name__}")
        if context is not None and context < 1:
            raise ValueError(f"context: None or a positive int (a static bound), got {context}")
        batch, tokens = positions.shape
        if lengths is not None and jnp.shape(lengths) != (batch,):
            raise ValueError(f"lengths: [batch] = [{batch}], got shape {jnp.shape(lengths)}")
        lengths = jnp.full((batch,), tokens, jnp.int32) if lengths is None else lengths
        if tree is None:
            if nodes is not None:
                raise ValueError(f"nodes: only with a tree, got {nodes} and tree None")
        else:
            nodes = _check_tree_call(tree, nodes, tokens, mode)
            if tree.is_chain:  # the chain's kernels and masks: its nodes are consecutive positions
                tree, nodes = None, None
        return cls(positions, lengths, page_table, mode, tree, nodes, context)

    @property
    def slots(self):
        """``[batch]`` int32: each row's slot of the C128 state, -1 for rows of length 0
        (:func:`batch_slots`)."""
        return batch_slots(self.lengths)

    def read_entries(self, stored: int, rate: int) -> int:
        """How many of a slot's ``stored`` entries of ``rate`` tokens each (static) this forward reads: those
        a token below the context bound can see, ``context // rate``, at most ``stored``."""
        return stored if self.context is None else min(stored, self.context // rate)

    @property
    def base(self):
        """``[batch, 1]`` int32: the root's position (a chain's first token's, a tree's node 0's)."""
        if self.tree is None:
            return self.positions[:, :1]
        return self.positions[:, :1] - int(self.tree.depths[self.nodes[0]])

    @property
    def every_node(self) -> bool:
        """Whether the tokens are every node of the tree (a verify; True for a chain)."""
        return self.tree is None or self.nodes == tuple(range(self.tree.size))


def _check_tree_call(tree, nodes, tokens: int, mode: ForwardMode) -> tuple[int, ...]:
    """A tree call's ``tree`` and ``nodes`` (default: every node) checked against its ``tokens`` and
    ``mode``; returns the nodes."""
    if not isinstance(tree, Tree):
        raise TypeError(f"tree: a jax_oc128.tree.Tree or None, got {type(tree).__name__}")
    if mode not in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND):
        raise ValueError(f"tree: only for a verify or a draft (TARGET_VERIFY, DRAFT_EXTEND), got mode {mode}")
    nodes = tuple(range(tree.size)) if nodes is None else tuple(nodes)
    if len(nodes) != tokens:
        raise ValueError(f"tree: {len(nodes)} nodes for {tokens} tokens")
    depths = {int(tree.depths[n]) for n in nodes if 0 <= n < tree.size}
    if len(set(nodes)) != len(nodes) or (len(depths) != 1 and nodes != tuple(range(tree.size))):
        raise ValueError(f"nodes: all of the tree's nodes or distinct nodes of one depth, got {nodes}")
    return nodes


def prepare_forward(compressed: State | None, forward_batch: ForwardBatch) -> State | None:
    """The controller's once-per-forward transition of the layer-stacked C128 state before the forward of
    ``forward_batch``: commits what is pending for its rows (one launch for all layers), or for a verify
    hands it to each layer's verify kernel. None (no C128 layer) stays None."""
    if compressed is None:
        return None
    seq_lens = forward_batch.positions[:, 0]
    controller = backend_of(compressed).controller
    return controller.prepare_forward(compressed, forward_batch.mode, forward_batch.slots, seq_lens)


def commit_verify(compressed: State, seq_lens, accept_lens) -> State:
    """The eager commit after a verify forward at ``seq_lens`` ``[batch]`` int32: row b keeps
    ``accept_lens[b]`` tokens in slot b, every layer of ``compressed`` in one launch."""
    slots = jnp.arange(seq_lens.shape[0], dtype=jnp.int32)
    return backend_of(compressed).controller.commit(compressed, slots, seq_lens, accept_lens)
