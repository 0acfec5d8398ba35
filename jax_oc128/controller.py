"""The functional controller: pure transitions on the compressed-state pytree, usable inside ``jax.jit``.

SGLang's controller (SPEC section 4) is an object with device state that commits pending verifies lazily
at the start of the next forward and forgets them on idle forwards or when the request is absent. Here:

* every transition is ``state in -> state out`` (donate the state to the enclosing jit);
* pending commits belong to slots (``CompressState.pending``) and survive any interleaving of
  forwards until committed (lazily by :meth:`Controller.prepare_forward`, or eagerly by
  :meth:`Controller.commit`) or until the slot is freed;
* modes are static (:class:`ForwardMode`); lengths, slots and the active batch size are device values,
  and no transition branches on them in Python or synchronises with the host.

:class:`OfflineController` has the same interface over :class:`~jax_oc128.state.OfflineState` (raw rows,
rollback by position): the baseline for memory and speed and a second oracle in tests.

Shapes, for a batch of ``bs`` rows: ``slots``, ``seq_lens``, ``new_lens``, ``accept_lens`` are ``[bs]``
int32 (slot -1 marks a padding row); ``kv_score`` is ``[Lk, bs, T, 2*D]`` float32 (score without ape)
for layers ``layer .. layer + Lk - 1``; ``ape`` is ``[Lk, 128, D]`` float32.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp

from jax_oc128 import ops, reference
from jax_oc128.state import BLOCK, CompressState, OfflineState, _scatter_index


class ForwardMode(enum.Enum):
    """What a forward does; static (hashable), so it can be a ``static_argnames`` of a jit."""

    EXTEND = "extend"  # prefill or chunked prefill: compress
    DECODE = "decode"  # one token per row: compress
    TARGET_VERIFY = "target_verify"  # N tokens per row: write_prefix, then commit (eager or lazy)
    DRAFT_EXTEND = "draft_extend"  # the draft model's forward: no C128 layer of the target runs
    IDLE = "idle"  # nothing for this rank: no transition at all


def active_slots(slots, verify_bs=None):
    """``slots`` with rows ``>= verify_bs`` (a device or Python int) turned into padding (-1)."""
    slots = jnp.asarray(slots, jnp.int32)
    if verify_bs is None:
        return slots
    return jnp.where(jnp.arange(slots.shape[0]) < verify_bs, slots, -1)


@dataclasses.dataclass(frozen=True)
class Controller:
    """Transitions of the online backend (:class:`~jax_oc128.state.CompressState`); no state of its own."""

    def begin_verify(self, cs: CompressState, slots, seq_lens) -> CompressState:
        """Record ``seq_lens`` as the pending verify of ``slots`` (SGLang's mark_pending); what was pending
        for them becomes what their write_prefix commits first (``committing``)."""
        index = _scatter_index(jnp.where(seq_lens >= 0, slots, -1), cs.slots)
        previous = cs.pending[jnp.clip(slots, 0, cs.slots - 1)]
        return cs.replace(
            pending=cs.pending.at[index].set(seq_lens, mode="drop"),
            committing=cs.committing.at[index].set(previous, mode="drop"),
        )

    def prepare_forward(self, cs: CompressState, mode: ForwardMode, slots, seq_lens, verify_bs=None):
        """Before a forward of ``slots`` at their current ``seq_lens``: commit what is pending for them
        (accept = seq_lens - pending), then for a verify forward begin the verify. Rows ``>= verify_bs``
        are padding. An idle forward changes nothing, and slots not in the batch keep their pending
        verify.

        For a verify forward the commit is not a launch of its own: it is handed to write_prefix, whose
        kernel commits each row before folding (so a lazily committed speculative step is one launch).
        write_prefix must then run once for every C128 layer, as the protocol requires anyway.
        """
        if mode is ForwardMode.IDLE:
            return cs
        slots = active_slots(slots, verify_bs)
        if mode is ForwardMode.TARGET_VERIFY:
            return self.begin_verify(cs, slots, seq_lens)
        seq_before, accept, committed = reference.pending_commits(cs.pending, slots, seq_lens)
        return self.commit(cs, committed, seq_before, accept)

    def write_prefix(self, cs: CompressState, kv_score, seq_lens, slots, ape, *, layer: int = 0):
        """The verify's bank writes for layers ``layer .. layer + Lk - 1`` (all layers in one call when
        ``kv_score`` has them all), after committing the rows' previous verify where prepare_forward left
        it pending. Returns ``(cs, entries [Lk, bs, 1, D], entry_blocks [bs, 1])``."""
        state, entries, blocks = ops.verify(
            cs.state, kv_score, seq_lens, slots, ape, layer=layer, pending=cs.committing
        )
        return cs.replace(state=state), entries, blocks

    def commit(self, cs: CompressState, slots, seq_lens, accept_lens) -> CompressState:
        """Keep ``accept_lens`` tokens of the verify at ``seq_lens`` (the eager path), all layers, and clear
        the slots' pending verify."""
        state = ops.commit(cs.state, seq_lens, accept_lens, slots)
        return cs.replace(
            state=state, pending=cs.pending.at[_scatter_index(slots, cs.slots)].set(-1, mode="drop")
        )

    def compress(self, cs: CompressState, kv_score, seq_lens, new_lens, slots, ape, *, layer: int = 0):
        """An extend or decode forward's compression. Returns ``(cs, entries [Lk, bs, T//128+1, D],
        entry_blocks [bs, T//128+1])``."""
        state, entries, blocks = ops.compress(cs.state, kv_score, seq_lens, new_lens, slots, ape, layer=layer)
        return cs.replace(state=state), entries, blocks

    def open_state(self, cs: CompressState, slots, seq_lens, ape):
        """``(max, sum, mean)`` float32 ``[layers, bs, D]`` of each row's open block at ``seq_lens``, as it
        is once any pending verify is committed (meaningless where ``seq_lens % 128 == 0``)."""
        del ape  # the online state holds it already
        ok = (slots >= 0) & (slots < cs.slots)
        safe = jnp.where(ok, slots, 0)
        accept = jnp.where(cs.pending[safe] >= 0, seq_lens - cs.pending[safe], 0)
        bank = jnp.where((accept >= 1) & (accept <= cs.max_draft), accept, 0)
        rows = cs.state[:, bank, safe].astype(jnp.float32)
        return rows[..., 0, :], rows[..., 1, :], rows[..., 2, :]


@dataclasses.dataclass(frozen=True)
class OfflineController:
    """Transitions of the offline backend (:class:`~jax_oc128.state.OfflineState`), same interface as
    :class:`Controller`. Verifies write their rows by position and nothing needs committing."""

    def begin_verify(self, cs: OfflineState, slots, seq_lens) -> OfflineState:
        return cs

    def prepare_forward(self, cs: OfflineState, mode: ForwardMode, slots, seq_lens, verify_bs=None):
        return cs

    def commit(self, cs: OfflineState, slots, seq_lens, accept_lens) -> OfflineState:
        return cs

    def write_prefix(self, cs: OfflineState, kv_score, seq_lens, slots, ape, *, layer: int = 0):
        new_lens = jnp.full(seq_lens.shape, kv_score.shape[2], jnp.int32)
        return self.compress(cs, kv_score, seq_lens, new_lens, slots, ape, layer=layer)

    def compress(self, cs: OfflineState, kv_score, seq_lens, new_lens, slots, ape, *, layer: int = 0):
        """Write the rows by position and pool every block the new tokens close, from the ring (earlier
        positions) and the new tokens."""
        num_layers, rows, tokens, two_d = kv_score.shape
        dim, ring = two_d // 2, cs.rows.shape[2]
        per_row = tokens // BLOCK + 1
        valid = (slots >= 0) & (slots < cs.slots) & (seq_lens >= 0) & (new_lens >= 0) & (new_lens <= tokens)
        n = jnp.where(valid, new_lens, 0)
        safe = jnp.where(valid, slots, 0)
        if tokens == 0:
            kv_score = jnp.zeros((num_layers, rows, 1, two_d), kv_score.dtype)
        block = seq_lens[:, None] // BLOCK + jnp.arange(per_row)  # [rows, per_row]
        closed = valid[:, None] & ((block + 1) * BLOCK <= (seq_lens + n)[:, None])
        position = block[:, :, None] * BLOCK + jnp.arange(BLOCK)  # [rows, per_row, 128]
        new = jnp.clip(position - seq_lens[:, None, None], 0, kv_score.shape[2] - 1)
        from_new = jnp.take_along_axis(kv_score, new.reshape(1, rows, -1, 1), axis=2)
        layer_rows = cs.rows[layer : layer + num_layers]
        from_ring = layer_rows[:, safe[:, None, None], position % ring].astype(jnp.float32)
        is_new = (position >= seq_lens[:, None, None])[None, ..., None]
        block_rows = jnp.where(is_new, from_new.reshape(from_ring.shape), from_ring)
        weights = jax.nn.softmax(block_rows[..., dim:] + ape[:, None, None], axis=3)
        entries = jnp.where(closed[None, :, :, None], jnp.sum(weights * block_rows[..., :dim], axis=3), 0.0)
        entry_blocks = jnp.where(closed, block, -1).astype(jnp.int32)

        t = jnp.arange(kv_score.shape[2])
        write = valid[:, None] & (t < n[:, None]) & (t >= n[:, None] - ring)  # the last `ring` new tokens
        index = jnp.where(write, safe[:, None], cs.slots)
        updated = cs.rows.at[layer : layer + num_layers, index, (seq_lens[:, None] + t) % ring].set(
            kv_score.astype(cs.rows.dtype), mode="drop"
        )
        return OfflineState(updated), entries, entry_blocks

    def open_state(self, cs: OfflineState, slots, seq_lens, ape):
        """``(max, sum, mean)`` float32 ``[layers, bs, D]`` of the open block, pooled from the raw rows."""
        dim, ring = cs.head_dim, cs.rows.shape[2]
        safe = jnp.where((slots >= 0) & (slots < cs.slots), slots, 0)
        start = seq_lens // BLOCK * BLOCK
        position = start[:, None] + jnp.arange(BLOCK)  # [bs, 128]
        rows = cs.rows[:, safe[:, None], position % ring].astype(jnp.float32)  # [L, bs, 128, 2D]
        sigma = jnp.where(
            (position < seq_lens[:, None])[None, ..., None], rows[..., dim:] + ape[:, None], -jnp.inf
        )
        m = jnp.max(sigma, axis=2)
        w = jnp.exp(sigma - m[:, :, None])
        s = jnp.sum(w, axis=2)
        return m, s, jnp.sum(w * rows[..., :dim], axis=2) / s
