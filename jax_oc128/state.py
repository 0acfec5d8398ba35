"""The compressed-state pytrees: the online state (banks + pending table) and the offline baseline.

Both are registered dataclasses whose leaves are device arrays and whose layout is derived from the
arrays' shapes, so they pass through ``jax.jit`` (donated) and ``jax.tree`` untouched.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jax_oc128 import ops

BLOCK = ops.BLOCK


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CompressState:
    """Online C128 state of every slot of every C128 layer.

    Attributes:
      state: ``[layers, 1 + max_draft, slots, 3, head_dim]`` float32 or bfloat16: ``[max | sum | mean]``
        per slot per bank; bank 0 is committed, banks ``1..max_draft`` hold the last verify's prefixes.
      pending: ``[slots]`` int32: the slot's sequence length at its last verify whose acceptance has not
        been committed yet, -1 when nothing is pending.
      committing: ``[slots]`` int32: for the slots of the current verify forward, the pending verify that
        its write_prefix commits before folding (-1 for none); set by ``prepare_forward``.
    """

    state: jax.Array
    pending: jax.Array
    committing: jax.Array

    @classmethod
    def create(
        cls, layers: int, slots: int, head_dim: int, max_draft: int, dtype=jnp.float32
    ) -> CompressState:
        """A zeroed state with nothing pending; every leaf is its own buffer, so the pytree can be donated."""
        state = ops.init_state(layers, slots, head_dim, max_draft, dtype)
        return cls(state, jnp.full((slots,), -1, jnp.int32), jnp.full((slots,), -1, jnp.int32))

    layers = property(lambda self: self.state.shape[0])
    max_draft = property(lambda self: self.state.shape[1] - 1)
    slots = property(lambda self: self.state.shape[2])
    head_dim = property(lambda self: self.state.shape[4])
    dtype = property(lambda self: self.state.dtype)

    def state_bytes(self) -> int:
        """Device bytes of this state, all slots (also for a ``jax.eval_shape`` of it)."""
        return _nbytes(self.state) + _nbytes(self.pending) + _nbytes(self.committing)

    def replace(self, **fields) -> CompressState:
        return dataclasses.replace(self, **fields)

    def alloc(self, slots) -> CompressState:
        """Give ``slots`` ([n] int32, -1 ignored) to new requests: their rows are cleared in every bank and
        layer and nothing is pending for them."""
        cleared = self.state.at[:, :, _scatter_index(slots, self.slots)].set(0, mode="drop")
        return self.free(slots).replace(state=cleared)

    def free(self, slots) -> CompressState:
        """Release ``slots``: whatever is pending for them is dropped (their rows are cleared on reuse)."""
        index = _scatter_index(slots, self.slots)
        return self.replace(
            pending=self.pending.at[index].set(-1, mode="drop"),
            committing=self.committing.at[index].set(-1, mode="drop"),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OfflineState:
    """Offline C128 state, the baseline: raw rows of the open block per slot, addressed by position.

    Attributes:
      rows: ``[layers, slots, 128 + max_draft, 2 * head_dim]``: ``[kv | score]`` (score without ape) of
        position p in row ``p % (128 + max_draft)``: the open block plus a verify's drafts fit without
        overlap, so rejected drafts are simply overwritten later (rollback by position).
    """

    rows: jax.Array

    @classmethod
    def create(
        cls, layers: int, slots: int, head_dim: int, max_draft: int, dtype=jnp.float32
    ) -> OfflineState:
        return cls(jnp.zeros((layers, slots, BLOCK + max_draft, 2 * head_dim), dtype))

    layers = property(lambda self: self.rows.shape[0])
    max_draft = property(lambda self: self.rows.shape[2] - BLOCK)
    slots = property(lambda self: self.rows.shape[1])
    head_dim = property(lambda self: self.rows.shape[3] // 2)
    dtype = property(lambda self: self.rows.dtype)

    def state_bytes(self) -> int:
        """Device bytes of this state, all slots (also for a ``jax.eval_shape`` of it)."""
        return _nbytes(self.rows)

    def alloc(self, slots) -> OfflineState:
        return OfflineState(self.rows.at[:, _scatter_index(slots, self.slots)].set(0, mode="drop"))

    def free(self, slots) -> OfflineState:
        return self


def bytes_per_slot(state_type, layers: int, head_dim: int, max_draft: int, dtype=jnp.float32) -> int:
    """Device bytes one slot (request) takes in a ``state_type`` (:class:`CompressState` or
    :class:`OfflineState`) of that layout; nothing is allocated."""
    shapes = jax.eval_shape(lambda: state_type.create(layers, 1, head_dim, max_draft, dtype))
    return state_type.state_bytes(shapes)


def _nbytes(x) -> int:
    return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize


def _scatter_index(slots, num_slots):
    """Slots for a ``mode="drop"`` scatter: -1 and out-of-range slots write nothing."""
    slots = jnp.asarray(slots, jnp.int32)
    return jnp.where((slots >= 0) & (slots < num_slots), slots, num_slots)
