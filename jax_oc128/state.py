"""The compressed-state pytrees: the online state (banks + pending table) and the offline baseline (raw
rows, with the pooling that reads them).

Both are registered dataclasses whose leaves are device arrays and whose layout is derived from the
arrays' shapes, so they pass through ``jax.jit`` (donated) and ``jax.tree`` untouched. Both are
layer-stacked: one state holds every C128 layer of a model, addressed by the layer's index among them.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jax_oc128 import ops
from jax_oc128.reference import pool
from jax_oc128.rules import BLOCK, drop_index, valid_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CompressState:
    """Online C128 state of every slot of every C128 layer.

    Attributes:
      banks: ``[layers, 1 + max_draft, slots, 3, head_dim]`` float32 or bfloat16: ``[max | sum | mean]``
        per slot per bank; bank 0 is committed, banks ``1..max_draft`` hold the prefixes of the slot's
        last verify whose banks were written in every layer.
      pending: ``[slots]`` int32: the slot's sequence length at that verify while its acceptance is not
        committed, -1 when nothing is pending.
      pending_tokens: ``[slots]`` int32: N, the tokens that verify folded into banks ``1..N`` (a commit
        keeps at most N of them); meaningful where ``pending >= 0``.
      to_commit: ``[slots]`` int32: for the slots of a begun verify forward, the ``pending`` length that
        each layer's write_prefix commits before folding, -1 for none (nothing pending, or the forward's
        lengths do not fit it); set by ``prepare_forward``, cleared when the slot's pending verify is
        committed or replaced.
      to_commit_banks: ``[slots]`` int32: the bank that commit keeps (the chain: its accept; after a tree
        verify, the accepted node k's bank k + 1); meaningful where ``to_commit >= 0``.
      verify_rows: ``[slots]`` int32: for the slots of a begun verify forward, the forward's row that
        verifies the slot, -1 for none (see :func:`~jax_oc128.controller.verifying_slots`).

    The controller's rules (:class:`~jax_oc128.controller.Controller`) keep ``pending`` for a slot until
    it is committed (eagerly, or lazily by the slot's next forward), replaced by a verify whose banks
    were written in every layer, or the slot is freed.
    """

    banks: jax.Array
    pending: jax.Array
    pending_tokens: jax.Array
    to_commit: jax.Array
    to_commit_banks: jax.Array
    verify_rows: jax.Array

    @classmethod
    def create(
        cls, layers: int, slots: int, head_dim: int, max_draft: int, dtype=jnp.float32
    ) -> CompressState:
        """A zeroed state with nothing pending; every leaf is its own buffer, so the pytree can be donated."""
        banks = ops.init_state(layers, slots, head_dim, max_draft, dtype)
        table = functools.partial(jnp.full, (slots,), dtype=jnp.int32)
        return cls(
            banks,
            pending=table(-1),
            pending_tokens=table(0),
            to_commit=table(-1),
            to_commit_banks=table(0),
            verify_rows=table(-1),
        )

    layers = property(lambda self: self.banks.shape[0])
    max_draft = property(lambda self: self.banks.shape[1] - 1)
    slots = property(lambda self: self.banks.shape[2])
    head_dim = property(lambda self: self.banks.shape[4])
    dtype = property(lambda self: self.banks.dtype)

    def state_bytes(self) -> int:
        """Device bytes of this state, all slots (also for a ``jax.eval_shape`` of it)."""
        return nbytes(self)

    def replace(self, **fields) -> CompressState:
        return dataclasses.replace(self, **fields)

    def alloc(self, slots) -> CompressState:
        """Give ``slots`` ([n] int32, -1 ignored) to new requests: their rows are cleared in every bank and
        layer and nothing is pending for them."""
        cleared = self.banks.at[:, :, drop_index(slots, self.slots)].set(0, mode="drop")
        return self.free(slots).replace(banks=cleared)

    def free(self, slots) -> CompressState:
        """Release ``slots``: whatever is pending or begun for them is dropped (their rows are cleared on
        reuse)."""
        index = drop_index(slots, self.slots)
        return self.replace(
            pending=self.pending.at[index].set(-1, mode="drop"),
            to_commit=self.to_commit.at[index].set(-1, mode="drop"),
            verify_rows=self.verify_rows.at[index].set(-1, mode="drop"),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OfflineState:
    """Offline C128 state, the baseline: raw rows of the open block per slot, addressed by position.

    Attributes:
      rows: ``[layers, slots, 128 + max_draft, 2 * head_dim]``: ``[kv | score]`` (score without ape) of
        position p in row ``p % (128 + max_draft)``: the open block plus a verify's drafts fit without
        overlap, so rejected drafts are simply overwritten later (rollback by position).
      verify_rows: ``[slots]`` int32: as :class:`CompressState`'s, the rows of a begun verify forward.
    """

    rows: jax.Array
    verify_rows: jax.Array

    @classmethod
    def create(
        cls, layers: int, slots: int, head_dim: int, max_draft: int, dtype=jnp.float32
    ) -> OfflineState:
        rows = jnp.zeros((layers, slots, BLOCK + max_draft, 2 * head_dim), dtype)
        return cls(rows, jnp.full((slots,), -1, jnp.int32))

    layers = property(lambda self: self.rows.shape[0])
    max_draft = property(lambda self: self.rows.shape[2] - BLOCK)
    slots = property(lambda self: self.rows.shape[1])
    head_dim = property(lambda self: self.rows.shape[3] // 2)
    dtype = property(lambda self: self.rows.dtype)

    def state_bytes(self) -> int:
        """Device bytes of this state, all slots (also for a ``jax.eval_shape`` of it)."""
        return nbytes(self)

    def replace(self, **fields) -> OfflineState:
        return dataclasses.replace(self, **fields)

    def alloc(self, slots) -> OfflineState:
        cleared = self.rows.at[:, drop_index(slots, self.slots)].set(0, mode="drop")
        return self.free(slots).replace(rows=cleared)

    def free(self, slots) -> OfflineState:
        """Release ``slots``: a verify begun for them is dropped (their rows are cleared on reuse)."""
        return self.replace(
            verify_rows=self.verify_rows.at[drop_index(slots, self.slots)].set(-1, mode="drop")
        )

    def write(self, kv_score, seq_lens, new_lens, slots, ape, *, layer: int = 0):
        """Write the new rows by position into layers ``layer .. layer + Lk - 1`` and pool every block the
        new tokens close, from the ring (earlier positions) and the new tokens. Arguments and results as
        :func:`jax_oc128.compress`: returns ``(state, entries [Lk, bs, T//128+1, D], entry_blocks
        [bs, T//128+1])``."""
        num_layers, rows, tokens, two_d = kv_score.shape
        dim, ring = two_d // 2, self.rows.shape[2]
        per_row = tokens // BLOCK + 1
        valid = valid_rows(slots, seq_lens, self.slots) & (new_lens >= 0) & (new_lens <= tokens)
        n = jnp.where(valid, new_lens, 0)
        safe = jnp.where(valid, slots, 0)
        if tokens == 0:
            kv_score = jnp.zeros((num_layers, rows, 1, two_d), kv_score.dtype)
        block = seq_lens[:, None] // BLOCK + jnp.arange(per_row)  # [rows, per_row]
        closed = valid[:, None] & ((block + 1) * BLOCK <= (seq_lens + n)[:, None])
        position = block[:, :, None] * BLOCK + jnp.arange(BLOCK)  # [rows, per_row, 128]
        new = jnp.clip(position - seq_lens[:, None, None], 0, kv_score.shape[2] - 1)
        from_new = jnp.take_along_axis(kv_score, new.reshape(1, rows, -1, 1), axis=2)
        layer_rows = self.rows[layer : layer + num_layers]
        from_ring = layer_rows[:, safe[:, None, None], position % ring].astype(jnp.float32)
        is_new = (position >= seq_lens[:, None, None])[None, ..., None]
        block_rows = jnp.where(is_new, from_new.reshape(from_ring.shape), from_ring)
        _, _, pooled = pool(block_rows[..., dim:] + ape[:, None, None], block_rows[..., :dim], axis=3)
        entries = jnp.where(closed[None, :, :, None], pooled, 0.0)
        entry_blocks = jnp.where(closed, block, -1).astype(jnp.int32)

        t = jnp.arange(kv_score.shape[2])
        write = valid[:, None] & (t < n[:, None]) & (t >= n[:, None] - ring)  # the last `ring` new tokens
        index = jnp.where(write, safe[:, None], self.slots)
        updated = self.rows.at[layer : layer + num_layers, index, (seq_lens[:, None] + t) % ring].set(
            kv_score.astype(self.rows.dtype), mode="drop"
        )
        return self.replace(rows=updated), entries, entry_blocks

    def open_block(self, slots, seq_lens, ape):
        """``(max, sum, mean)`` float32 ``[layers, bs, D]`` of each row's open block at ``seq_lens``,
        pooled from the raw rows (:func:`~jax_oc128.reference.pool`; ``(-inf, 0, 0)`` where the block has no
        weight, as where none is open); ``ape`` ``[layers, 128, D]``."""
        dim, ring = self.head_dim, self.rows.shape[2]
        safe = jnp.where((slots >= 0) & (slots < self.slots), slots, 0)
        start = seq_lens // BLOCK * BLOCK
        position = start[:, None] + jnp.arange(BLOCK)  # [bs, 128]
        rows = self.rows[:, safe[:, None], position % ring].astype(jnp.float32)  # [L, bs, 128, 2D]
        sigma = jnp.where(
            (position < seq_lens[:, None])[None, ..., None], rows[..., dim:] + ape[:, None], -jnp.inf
        )
        return pool(sigma, rows[..., :dim], axis=2)


def bytes_per_slot(state_type, layers: int, head_dim: int, max_draft: int, dtype=jnp.float32) -> int:
    """Device bytes one slot (request) takes in a ``state_type`` (:class:`CompressState` or
    :class:`OfflineState`) of that layout; nothing is allocated."""
    shapes = jax.eval_shape(lambda: state_type.create(layers, 1, head_dim, max_draft, dtype))
    return state_type.state_bytes(shapes)


def nbytes(tree) -> int:
    """Device bytes of the arrays of ``tree`` (also of a ``jax.eval_shape`` of it; any dtype, PRNG keys'
    included)."""
    return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))
