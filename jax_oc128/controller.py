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

import jax.numpy as jnp

from jax_oc128 import ops
from jax_oc128.rules import commits_bank, drop_index, pending_commits
from jax_oc128.state import CompressState, OfflineState


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
        index = drop_index(slots, cs.slots, seq_lens >= 0)
        previous = cs.pending[jnp.clip(slots, 0, cs.slots - 1)]
        return cs.replace(
            pending=cs.pending.at[index].set(seq_lens, mode="drop"),
            to_commit=cs.to_commit.at[index].set(previous, mode="drop"),
        )

    def prepare_forward(self, cs: CompressState, mode: ForwardMode, slots, seq_lens, verify_bs=None):
        """Before a forward of ``slots`` at their current ``seq_lens``: commit what is pending for them
        (accept = seq_lens - pending), then for a verify forward begin the verify. Rows ``>= verify_bs``
        are padding. An idle forward changes nothing, and slots not in the batch keep their pending
        verify.

        For a verify forward the commit is not a launch of its own: it is handed to write_prefix, whose
        kernel commits each row before folding (so a lazily committed speculative step is one launch).
        write_prefix must then run once for every C128 layer, as the protocol requires anyway. Any other
        mode commits with one launch for all layers.
        """
        if mode is ForwardMode.IDLE:
            return cs
        slots = active_slots(slots, verify_bs)
        if mode is ForwardMode.TARGET_VERIFY:
            return self.begin_verify(cs, slots, seq_lens)
        verify_seq_lens, accept_lens, committing_slots = pending_commits(cs.pending, slots, seq_lens)
        return self.commit(cs, committing_slots, verify_seq_lens, accept_lens)

    def write_prefix(self, cs: CompressState, kv_score, seq_lens, slots, ape, *, layer: int = 0):
        """The verify's bank writes for layers ``layer .. layer + Lk - 1`` (all layers in one call when
        ``kv_score`` has them all), after committing the rows' previous verify where prepare_forward left
        it pending. Returns ``(cs, entries [Lk, bs, 1, D], entry_blocks [bs, 1])``."""
        banks, entries, blocks = ops.verify(
            cs.banks, kv_score, seq_lens, slots, ape, layer=layer, pending=cs.to_commit
        )
        return cs.replace(banks=banks), entries, blocks

    def commit(self, cs: CompressState, slots, seq_lens, accept_lens) -> CompressState:
        """Keep ``accept_lens`` tokens of the verify at ``seq_lens`` (the eager path), all layers, and clear
        the slots' pending verify."""
        banks = ops.commit(cs.banks, seq_lens, accept_lens, slots)
        return cs.replace(
            banks=banks, pending=cs.pending.at[drop_index(slots, cs.slots)].set(-1, mode="drop")
        )

    def compress(self, cs: CompressState, kv_score, seq_lens, new_lens, slots, ape, *, layer: int = 0):
        """An extend or decode forward's compression. Returns ``(cs, entries [Lk, bs, T//128+1, D],
        entry_blocks [bs, T//128+1])``."""
        banks, entries, blocks = ops.compress(cs.banks, kv_score, seq_lens, new_lens, slots, ape, layer=layer)
        return cs.replace(banks=banks), entries, blocks

    def open_state(self, cs: CompressState, slots, seq_lens, ape):
        """``(max, sum, mean)`` float32 ``[layers, bs, D]`` of each row's open block at ``seq_lens``, as it
        is once any pending verify is committed (meaningless where ``seq_lens % 128 == 0``)."""
        del ape  # the online state holds it already
        ok = (slots >= 0) & (slots < cs.slots)
        safe = jnp.where(ok, slots, 0)
        verify_seq_lens = cs.pending[safe]
        accept = jnp.where(verify_seq_lens >= 0, seq_lens - verify_seq_lens, 0)
        bank = jnp.where(commits_bank(verify_seq_lens, accept, cs.max_draft + 1), accept, 0)
        rows = cs.banks[:, bank, safe].astype(jnp.float32)
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
        """Write the rows by position and pool the blocks they close (:meth:`OfflineState.write`)."""
        return cs.write(kv_score, seq_lens, new_lens, slots, ape, layer=layer)

    def open_state(self, cs: OfflineState, slots, seq_lens, ape):
        """``(max, sum, mean)`` float32 ``[layers, bs, D]`` of the open block, pooled from the raw rows."""
        return cs.open_block(slots, seq_lens, ape)


@dataclasses.dataclass(frozen=True)
class Backend:
    """A C128 compressor backend: its state type and the controller of its transitions (both stateless
    Python objects; hashable, so a backend can be a static argument or a module's attribute)."""

    name: str
    state_type: type
    controller: Controller | OfflineController

    def create(self, layers: int, slots: int, head_dim: int, max_draft: int, dtype=jnp.float32):
        """A fresh state of this backend (see :meth:`CompressState.create`)."""
        return self.state_type.create(layers, slots, head_dim, max_draft, dtype)


#: the online C128 state (banks of ``(max, sum, mean)``), the point of this library
ONLINE = Backend("online", CompressState, Controller())
#: the offline baseline: raw rows of the open block, rollback by position
OFFLINE = Backend("offline", OfflineState, OfflineController())
BACKENDS = {backend.name: backend for backend in (ONLINE, OFFLINE)}
