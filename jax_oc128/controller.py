"""The functional controller: pure transitions on the compressed-state pytree, usable inside ``jax.jit``.

SGLang's controller (SPEC section 4) is an object with device state that commits pending verifies lazily
at the start of the next forward and forgets them on idle forwards or when the request is absent. Here
every transition is ``state in -> state out`` (donate the state to the enclosing jit); modes are static
(:class:`ForwardMode`); lengths, slots and the active batch size are device values, and no transition
branches on them in Python or synchronises with the host.

The rules of :class:`Controller`, per slot:

* **A verify is pending once its banks are written.** A verify forward is ``prepare_forward`` with
  ``TARGET_VERIFY`` (it begins the verify: nothing is committed or forgotten yet), then ``write_prefix``
  for every C128 layer in layer order; the ``write_prefix`` that covers the state's last layer closes the
  verify: the slot's pending verify becomes this one (its length and its N). A verify begun and never
  written (abandoned, or begun again with the same or other lengths: a retry) changes nothing that a
  later forward reads: what was pending stays pending. A verify forward stopped between the write_prefix
  calls of its layers leaves the slot's layers at different points; the controller does not recover
  from that (nor could the model: its attention caches are half written too).
* **A pending verify is committed exactly once**: eagerly by :meth:`Controller.commit`, or lazily by the
  slot's next forward at ``seq_lens`` with ``accept = seq_lens - pending`` (a non-verify
  ``prepare_forward`` in one launch for all layers, or inside each layer's verify kernel of the slot's
  next verify). After a tree verify the commit also names the accepted node's bank (``accept_banks``: node
  k's k + 1, with ``accept`` its depth + 1); without it, the chain's bank ``accept``. It survives any
  number of other forwards, idle and draft forwards and abandoned verifies in between; ``free``/``alloc``
  drop it.
* **Padding is decided once per forward**: rows ``>= verify_bs`` of ``prepare_forward`` (and rows of slot
  -1) are padding for the whole forward. A verify's ``begin_verify`` records the row of each slot in the
  state (``verify_rows``), and its write_prefix calls write only those rows (:func:`verifying_slots`), so a
  padding row that carries a stale slot id (another request's, or an active row's) records nothing and
  writes no bank. An extend or decode forward's padding rows are the rows of ``new_lens`` 0 (or slot -1).
* **A commit that does not fit the pending verify changes nothing**: no verify pending for the slot,
  ``seq_lens`` not the pending verify's length (eager commit), or ``accept`` or its bank outside
  ``[0, N]`` of that verify (banks past N hold an older verify's prefixes). An eager or non-verify commit
  that does not fit leaves the verify pending; a verify whose lengths do not fit it overwrites the banks,
  and then the old verify is dropped uncommitted. Such lengths are a caller's bug: the slot's state no
  longer follows its tokens, but no stale bank is ever copied.

Both backends implement :class:`CompressController`, one protocol with the same signatures:
:class:`Controller` over :class:`~jax_oc128.state.CompressState` and :class:`OfflineController` over
:class:`~jax_oc128.state.OfflineState` (raw rows, rollback by position: the baseline for memory and speed
and a second oracle in tests). The offline state verifies chains only: its ``write_prefix`` refuses a
``tree``, and its ``accept_banks`` (always a chain's after a chain verify) are checked and need nothing.

Shapes, for a batch of ``bs`` rows: ``slots``, ``seq_lens``, ``new_lens``, ``accept_lens``,
``accept_banks`` are ``[bs]`` int32 (slot -1 marks a padding row); ``kv_score`` is ``[Lk, bs, T, 2*D]``
float32 (score without ape) for layers ``layer .. layer + Lk - 1``; ``ape`` is ``[Lk, 128, D]`` float32.
Wrong shapes or dtypes of the per-row arguments, and a mode that is not a :class:`ForwardMode`, raise at
trace time, naming the argument.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Protocol

import jax
import jax.numpy as jnp

from jax_oc128 import ops
from jax_oc128.rules import commits_pending, committed_bank, drop_index, lazy_commits, valid_rows
from jax_oc128.state import CompressState, OfflineState

#: a C128 state of either backend
State = CompressState | OfflineState
#: ``(state, entries, entry_blocks)``: what ``write_prefix`` and ``compress`` return
Written = tuple[State, jax.Array, jax.Array]
#: ``(max, sum, mean)`` float32 ``[layers, bs, D]``: what ``open_state`` returns
OpenBlock = tuple[jax.Array, jax.Array, jax.Array]


class ForwardMode(enum.Enum):
    """What a forward does; static (hashable), so it can be a ``static_argnames`` of a jit."""

    EXTEND = "extend"  # prefill or chunked prefill: compress
    DECODE = "decode"  # one token per row: compress
    TARGET_VERIFY = "target_verify"  # N tokens per row: write_prefix, then commit (eager or lazy)
    DRAFT_EXTEND = "draft_extend"  # the draft model's forward: no C128 layer of the target runs
    IDLE = "idle"  # nothing for this rank: no transition at all


def _check_per_row_args(**rows):
    """Trace-time checks of per-row arguments, given by name: each an int32 array ``[bs]``, one ``bs``
    for all. Raises ``ValueError``/``TypeError`` naming the argument."""
    first = size = None
    for name, x in rows.items():
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name}: expected an int32 array [batch], got {type(x).__name__}")
        if len(x.shape) != 1:
            raise ValueError(f"{name}: expected shape [batch], got {list(x.shape)}")
        if jnp.dtype(x.dtype) != jnp.int32:
            raise TypeError(f"{name}: expected dtype int32, got {x.dtype}")
        if first is None:
            first, size = name, x.shape[0]
        elif x.shape[0] != size:
            raise ValueError(f"{name}: expected shape [{size}] (the rows of {first}), got {list(x.shape)}")


def _given(**rows):
    """The keyword arguments that are not None (optional per-row arguments, for
    :func:`_check_per_row_args`)."""
    return {name: x for name, x in rows.items() if x is not None}


def _check_prepare_forward_args(mode, slots, seq_lens, verify_bs, accept_banks):
    """Trace-time checks of ``prepare_forward``'s arguments."""
    if not isinstance(mode, ForwardMode):
        raise TypeError(f"mode: expected a ForwardMode, got {mode!r}")
    _check_per_row_args(slots=slots, seq_lens=seq_lens, **_given(accept_banks=accept_banks))
    if verify_bs is not None and jnp.ndim(verify_bs) != 0:
        raise ValueError(f"verify_bs: expected a scalar, got shape {list(jnp.shape(verify_bs))}")


def active_slots(slots, verify_bs=None):
    """``slots`` with rows ``>= verify_bs`` (a device or Python int) turned into padding (-1)."""
    slots = jnp.asarray(slots, jnp.int32)
    if verify_bs is None:
        return slots
    return jnp.where(jnp.arange(slots.shape[0]) < verify_bs, slots, -1)


def begun_rows(verify_rows, slots):
    """A state's ``verify_rows`` ``[slots]`` once a verify forward of ``slots`` (``[bs]``, padding -1) is
    begun: each slot of the forward holds its row, every other slot -1."""
    rows = jnp.arange(slots.shape[0], dtype=jnp.int32)
    return jnp.full_like(verify_rows, -1).at[drop_index(slots, verify_rows.shape[0])].set(rows, mode="drop")


def verifying_slots(verify_rows, slots):
    """The one padding rule of a verify forward, for its write_prefix calls: ``slots`` with every row that
    is not the row its slot was begun with (:func:`begun_rows`) made padding (-1). So rows that
    prepare_forward treated as padding (``verify_bs``, or -1) write nothing and record no pending verify,
    whatever stale slot ids they carry."""
    in_range = (slots >= 0) & (slots < verify_rows.shape[0])
    begun = verify_rows[jnp.where(in_range, slots, 0)] == jnp.arange(slots.shape[0])
    return jnp.where(in_range & begun, slots, -1)


def _close_verify(cs: State, slots, seq_lens, layer: int, layers_written: int, tokens: int) -> State:
    """After a write_prefix of layers ``layer .. layer + layers_written - 1``: the call that covers the
    state's last layer closes the verify (its rows' slots begun no more; the online state's verify becomes
    pending, with its N = ``tokens``)."""
    if layer + layers_written != cs.layers:
        return cs
    index = drop_index(slots, cs.slots, valid_rows(slots, seq_lens, cs.slots))
    closed = dict(verify_rows=cs.verify_rows.at[index].set(-1, mode="drop"))
    if isinstance(cs, CompressState):
        closed |= dict(
            pending=cs.pending.at[index].set(seq_lens, mode="drop"),
            pending_tokens=cs.pending_tokens.at[index].set(tokens, mode="drop"),
            to_commit=cs.to_commit.at[index].set(-1, mode="drop"),
        )
    return cs.replace(**closed)


@dataclasses.dataclass(frozen=True)
class Controller:
    """Transitions of the online backend (:class:`~jax_oc128.state.CompressState`); no state of its own.
    The rules they keep are in this module's docstring."""

    def begin_verify(self, cs: CompressState, slots, seq_lens, accept_banks=None) -> CompressState:
        """Begin a verify of ``slots`` at ``seq_lens`` (SGLang's mark_pending): record in ``to_commit``
        the pending verify that the forward's write_prefix commits first, where ``seq_lens`` (and the kept
        bank ``accept_banks``, default the chain's) fits it (-1 elsewhere), and in ``to_commit_banks`` the
        bank it keeps, and the forward's rows by slot (:func:`begun_rows`: the rows its write_prefix calls
        write). ``pending`` is untouched: the verify becomes pending when write_prefix closes it."""
        _check_per_row_args(slots=slots, seq_lens=seq_lens, **_given(accept_banks=accept_banks))
        verify_lens, accept_lens, rows = lazy_commits(
            cs.pending, cs.pending_tokens, slots, seq_lens, accept_banks
        )
        index = drop_index(slots, cs.slots)
        banks = accept_lens if accept_banks is None else accept_banks
        return cs.replace(
            to_commit=cs.to_commit.at[index].set(jnp.where(rows >= 0, verify_lens, -1), mode="drop"),
            to_commit_banks=cs.to_commit_banks.at[index].set(banks, mode="drop"),
            verify_rows=begun_rows(cs.verify_rows, slots),
        )

    def prepare_forward(
        self, cs: CompressState, mode: ForwardMode, slots, seq_lens, verify_bs=None, accept_banks=None
    ) -> CompressState:
        """Before a forward of ``slots`` at their current ``seq_lens``; rows ``>= verify_bs`` are padding.
        ``accept_banks``: the banks the commits of the rows' pending verifies keep, after a tree verify
        (default: the chain's).

        * ``TARGET_VERIFY``: begins the verify (:meth:`begin_verify`); its write_prefix calls commit what
          is pending, inside each layer's verify kernel (a lazily committed speculative step is one launch
          per layer), and the last layer's call makes the verify pending.
        * ``EXTEND``, ``DECODE``: commits what is pending for the rows (accept = seq_lens - pending, where
          it fits), one launch for all layers.
        * ``IDLE``, ``DRAFT_EXTEND``: no C128 layer of the target runs; nothing changes.

        Slots not in the batch keep their pending verify.
        """
        _check_prepare_forward_args(mode, slots, seq_lens, verify_bs, accept_banks)
        if mode in (ForwardMode.IDLE, ForwardMode.DRAFT_EXTEND):
            return cs
        slots = active_slots(slots, verify_bs)
        if mode is ForwardMode.TARGET_VERIFY:
            return self.begin_verify(cs, slots, seq_lens, accept_banks)
        verify_lens, accept_lens, rows = lazy_commits(
            cs.pending, cs.pending_tokens, slots, seq_lens, accept_banks
        )
        return self.commit(cs, rows, verify_lens, accept_lens, accept_banks)

    def write_prefix(
        self, cs: CompressState, kv_score, seq_lens, slots, ape, *, layer: int = 0, tree=None
    ) -> Written:
        """The verify's bank writes for layers ``layer .. layer + Lk - 1`` (all layers in one call when
        ``kv_score`` has them all), each row first committing its slot's pending verify where
        prepare_forward recorded it (``to_commit``, keeping ``to_commit_banks``), in the same kernel.
        ``tree``: the draft tree's static parents (:func:`jax_oc128.verify`), None for the chain. Rows
        that the begun verify does not hold (:func:`verifying_slots`: prepare_forward's padding) are padding.
        The call that covers the state's last layer closes the verify: for its valid rows, ``pending =
        seq_lens`` and ``pending_tokens = N`` (``kv_score.shape[2]``). Returns ``(cs, entries,
        entry_blocks)``, for the chain ``[Lk, bs, 1, D]`` and ``[bs, 1]``, for a tree ``[Lk, bs, N, D]`` and
        ``[bs, N]``."""
        slots = verifying_slots(cs.verify_rows, slots)
        banks, entries, blocks = ops.verify(
            cs.banks,
            kv_score,
            seq_lens,
            slots,
            ape,
            layer=layer,
            pending=cs.to_commit,
            pending_banks=cs.to_commit_banks,
            tree=tree,
        )
        cs = _close_verify(cs.replace(banks=banks), slots, seq_lens, layer, *kv_score.shape[::2])
        return cs, entries, blocks

    def commit(self, cs: CompressState, slots, seq_lens, accept_lens, accept_banks=None) -> CompressState:
        """Keep ``accept_lens`` tokens of the slots' pending verify at ``seq_lens`` (the eager path), all
        layers in one launch, and clear it; ``accept_banks`` the kept banks after a tree verify (the
        accepted nodes' k + 1; default: the chain's). A row whose commit does not fit the pending verify
        (nothing pending, ``seq_lens`` not its length, ``accept_lens`` or its bank outside ``[0, N]``)
        changes nothing and its verify stays pending."""
        _check_per_row_args(
            slots=slots, seq_lens=seq_lens, accept_lens=accept_lens, **_given(accept_banks=accept_banks)
        )
        fits = commits_pending(cs.pending, cs.pending_tokens, slots, seq_lens, accept_lens, accept_banks)
        rows = jnp.where(fits, slots, -1)
        # accept 0 where the row is padding: concrete values outside [0, max_draft] raise in ops.commit
        kept = None if accept_banks is None else jnp.where(fits, accept_banks, 0)
        banks = ops.commit(cs.banks, seq_lens, jnp.where(fits, accept_lens, 0), rows, accept_banks=kept)
        index = drop_index(rows, cs.slots)
        return cs.replace(
            banks=banks,
            pending=cs.pending.at[index].set(-1, mode="drop"),
            to_commit=cs.to_commit.at[index].set(-1, mode="drop"),
        )

    def compress(
        self, cs: CompressState, kv_score, seq_lens, new_lens, slots, ape, *, layer: int = 0
    ) -> Written:
        """An extend or decode forward's compression. Returns ``(cs, entries [Lk, bs, T//128+1, D],
        entry_blocks [bs, T//128+1])``."""
        banks, entries, blocks = ops.compress(cs.banks, kv_score, seq_lens, new_lens, slots, ape, layer=layer)
        return cs.replace(banks=banks), entries, blocks

    def open_state(self, cs: CompressState, slots, seq_lens, ape, accept_banks=None) -> OpenBlock:
        """``(max, sum, mean)`` float32 ``[layers, bs, D]`` of each row's open block at ``seq_lens``, as it
        is once the slot's next forward at ``seq_lens`` commits what is pending, keeping ``accept_banks``
        (default: the chain's) (meaningless where ``seq_lens % 128 == 0``)."""
        del ape  # the online state holds it already
        _check_per_row_args(slots=slots, seq_lens=seq_lens, **_given(accept_banks=accept_banks))
        verify_lens, accept_lens, rows = lazy_commits(
            cs.pending, cs.pending_tokens, slots, seq_lens, accept_banks
        )
        kept = committed_bank(verify_lens, accept_lens, cs.max_draft + 1, accept_banks)
        bank = jnp.where(rows >= 0, kept, 0)
        safe = jnp.where((slots >= 0) & (slots < cs.slots), slots, 0)
        stored = cs.banks[:, bank, safe].astype(jnp.float32)
        return stored[..., 0, :], stored[..., 1, :], stored[..., 2, :]


@dataclasses.dataclass(frozen=True)
class OfflineController:
    """Transitions of the offline backend (:class:`~jax_oc128.state.OfflineState`), the
    :class:`CompressController` protocol as :class:`Controller` has it. Verifies write their rows by
    position and nothing needs committing; a verify is a chain (``write_prefix`` refuses a tree), so the
    ``accept_banks`` a caller names are a chain's and are only checked."""

    def begin_verify(self, cs: OfflineState, slots, seq_lens, accept_banks=None) -> OfflineState:
        """Record the forward's rows by slot (:func:`begun_rows`), the rows its write_prefix calls write."""
        _check_per_row_args(slots=slots, seq_lens=seq_lens, **_given(accept_banks=accept_banks))
        return cs.replace(verify_rows=begun_rows(cs.verify_rows, slots))

    def prepare_forward(
        self, cs: OfflineState, mode: ForwardMode, slots, seq_lens, verify_bs=None, accept_banks=None
    ) -> OfflineState:
        """``TARGET_VERIFY`` begins the verify (:meth:`begin_verify`, rows ``>= verify_bs`` padding); other
        modes change nothing (nothing is ever pending)."""
        _check_prepare_forward_args(mode, slots, seq_lens, verify_bs, accept_banks)
        if mode is not ForwardMode.TARGET_VERIFY:
            return cs
        return self.begin_verify(cs, active_slots(slots, verify_bs), seq_lens, accept_banks)

    def write_prefix(
        self, cs: OfflineState, kv_score, seq_lens, slots, ape, *, layer: int = 0, tree=None
    ) -> Written:
        """A chain verify's rows, written as a compress of its N tokens for the rows the begun verify holds
        (:func:`verifying_slots`); ``tree`` must be None. The call that covers the last layer closes it."""
        if tree is not None:
            raise ValueError(
                f"tree: the offline C128 state verifies chains only (tree=None; the online one verifies "
                f"trees), got {tree!r}"
            )
        slots = verifying_slots(cs.verify_rows, slots)
        new_lens = jnp.full(seq_lens.shape, kv_score.shape[2], jnp.int32)
        cs, entries, blocks = self.compress(cs, kv_score, seq_lens, new_lens, slots, ape, layer=layer)
        return _close_verify(cs, slots, seq_lens, layer, *kv_score.shape[::2]), entries, blocks

    def commit(self, cs: OfflineState, slots, seq_lens, accept_lens, accept_banks=None) -> OfflineState:
        _check_per_row_args(
            slots=slots, seq_lens=seq_lens, accept_lens=accept_lens, **_given(accept_banks=accept_banks)
        )
        return cs

    def compress(
        self, cs: OfflineState, kv_score, seq_lens, new_lens, slots, ape, *, layer: int = 0
    ) -> Written:
        """Write the rows by position and pool the blocks they close (:meth:`OfflineState.write`)."""
        return cs.write(kv_score, seq_lens, new_lens, slots, ape, layer=layer)

    def open_state(self, cs: OfflineState, slots, seq_lens, ape, accept_banks=None) -> OpenBlock:
        """``(max, sum, mean)`` float32 ``[layers, bs, D]`` of the open block, pooled from the raw rows."""
        _check_per_row_args(slots=slots, seq_lens=seq_lens, **_given(accept_banks=accept_banks))
        return cs.open_block(slots, seq_lens, ape)


class CompressController(Protocol):
    """The transitions a C128 backend's controller implements, with these signatures (:class:`Controller`
    and :class:`OfflineController`; the rules are in this module's docstring, the arguments' shapes below
    it). ``cs`` is the backend's state; every method returns the new state (``write_prefix`` and
    ``compress`` with the entries they closed)."""

    def begin_verify(self, cs: State, slots, seq_lens, accept_banks=None) -> State:
        """Begin a verify of ``slots`` at ``seq_lens``; nothing is committed or pending yet."""

    def prepare_forward(
        self, cs: State, mode: ForwardMode, slots, seq_lens, verify_bs=None, accept_banks=None
    ) -> State:
        """Before a forward of ``mode``; rows ``>= verify_bs`` are padding."""

    def write_prefix(
        self, cs: State, kv_score, seq_lens, slots, ape, *, layer: int = 0, tree=None
    ) -> Written:
        """A verify's writes (``tree`` None: a chain) -> ``(cs, entries, entry_blocks)``."""

    def commit(self, cs: State, slots, seq_lens, accept_lens, accept_banks=None) -> State:
        """Keep ``accept_lens`` tokens (bank ``accept_banks``) of the pending verify at ``seq_lens``."""

    def compress(self, cs: State, kv_score, seq_lens, new_lens, slots, ape, *, layer: int = 0) -> Written:
        """An extend or decode forward's compression -> ``(cs, entries, entry_blocks)``."""

    def open_state(self, cs: State, slots, seq_lens, ape, accept_banks=None) -> OpenBlock:
        """``(max, sum, mean)`` of each row's open block at ``seq_lens``, what is pending committed."""


@dataclasses.dataclass(frozen=True)
class Backend:
    """A C128 compressor backend: its state type and the controller of its transitions (both stateless
    Python objects; hashable, so a backend can be a static argument or a module's attribute)."""

    name: str
    state_type: type
    controller: CompressController

    def create(self, layers: int, slots: int, head_dim: int, max_draft: int, dtype=jnp.float32) -> State:
        """A fresh state of this backend (see :meth:`CompressState.create`)."""
        return self.state_type.create(layers, slots, head_dim, max_draft, dtype)


#: the online C128 state (banks of ``(max, sum, mean)``), the point of this library
ONLINE = Backend("online", CompressState, Controller())
#: the offline baseline: raw rows of the open block, rollback by position
OFFLINE = Backend("offline", OfflineState, OfflineController())
BACKENDS = {backend.name: backend for backend in (ONLINE, OFFLINE)}


def backend_of(state: State) -> Backend:
    """The backend of a C128 ``state``, found from its type (one of :data:`BACKENDS`): a state is driven
    by its own controller, ``backend_of(state).controller``, and nothing else need carry it."""
    for backend in BACKENDS.values():
        if type(state) is backend.state_type:
            return backend
    raise TypeError(
        f"compressed: a CompressState or OfflineState (a state of BACKENDS), got {type(state).__name__}"
    )
