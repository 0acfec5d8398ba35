"""The slot and bank rules of the C128 state, in one place: the ops' jnp twins, the states, the
controller and the attention all import them from here; and the gather of each batch row's own position
(:func:`per_row`), which the model and the engine share.

Shapes: ``slots``, ``seq_lens``, ``verify_lens``, ``accept_lens``, ``accept_banks`` are ``[bs]`` int32 per
row of a call (slot -1 marks a padding row); ``pending`` and ``pending_tokens`` are ``[num_slots]`` int32 per
slot of a state.
"""

from __future__ import annotations

import jax.numpy as jnp

#: tokens pooled into one compressed entry
BLOCK = 128
#: the most tokens one verify may fold (banks ``1..MAX_DRAFT``); the native verify is compiled per N
MAX_DRAFT = 16


def batch_slots(lengths):
    """``[batch]`` int32: the slot of each batch row of a forward (batch row b is slot b); -1 (padding) for
    rows of length 0 (``lengths`` ``[batch]`` int32), which leave every state untouched."""
    return jnp.where(lengths > 0, jnp.arange(lengths.shape[0], dtype=jnp.int32), -1)


def per_row(x, index):
    """``[batch, ...]``: ``x[b, index[b]]`` of ``x`` ``[batch, T, ...]`` for ``index`` ``[batch]`` int32 in
    ``[0, T)``: each batch row's entry at its own position (its last valid token's, its kept tree node's)."""
    return x[jnp.arange(x.shape[0]), index]


def valid_rows(slots, seq_lens, num_slots):
    """``[bs]`` bool: rows that address a slot of the state at a non-negative length; other rows are
    skipped by every op (nothing read or written)."""
    return (slots >= 0) & (slots < num_slots) & (seq_lens >= 0)


def drop_index(slots, num_slots, keep=None):
    """Slot indices for a ``mode="drop"`` scatter: rows that are out of range, padding (-1) or not
    ``keep`` get index ``num_slots`` and write nothing."""
    slots = jnp.asarray(slots, jnp.int32)
    ok = (slots >= 0) & (slots < num_slots)
    if keep is not None:
        ok = ok & keep
    return jnp.where(ok, slots, num_slots)


def committed_bank(seq_lens, accept_lens, num_banks, accept_banks=None):
    """``[bs]`` int32: the bank a commit of ``accept_lens`` tokens of the verify at ``seq_lens`` copies into
    bank 0, 0 for none (``committed_bank`` of ``ffi/oc128_math.h``). The kept bank is ``accept_banks``
    (after a tree verify, the accepted node k's bank k + 1), by default ``accept_lens`` (the chain). Nothing
    is copied when nothing is kept (accept 0), when the accept or the bank is past the banks, or when the
    kept tokens end exactly on a block boundary (the block closed: bank 0 of a fresh block is never read,
    so it stays as it is)."""
    bank = accept_lens if accept_banks is None else accept_banks
    in_range = (accept_lens >= 1) & (accept_lens < num_banks) & (bank >= 1) & (bank < num_banks)
    return jnp.where(in_range & ((seq_lens + accept_lens) % BLOCK != 0), bank, 0).astype(jnp.int32)


def pending_commits(pending, slots, seq_lens):
    """``(seq_lens, accept_lens, slots)`` for a commit that keeps each row's pending verify: the row whose
    slot has ``pending[slot] >= 0`` (the length at that verify) keeps ``seq_lens - pending[slot]`` tokens
    of it; other rows become padding."""
    valid = valid_rows(slots, seq_lens, pending.shape[0])
    before = jnp.where(valid, pending[jnp.where(valid, slots, 0)], -1)
    has = before >= 0
    return jnp.where(has, before, 0), jnp.where(has, seq_lens - before, 0), jnp.where(has, slots, -1)


def commits_pending(pending, pending_tokens, slots, verify_lens, accept_lens, accept_banks=None):
    """``[bs]`` bool: the row's commit keeps ``accept_lens`` tokens of its slot's pending verify (and its
    bank ``accept_banks``, default ``accept_lens``: the chain). It does when the row addresses a slot of the
    state whose pending verify was at ``verify_lens`` (``pending``, >= 0) and the accept and the bank are in
    ``[0, N]``, N the tokens that verify folded into banks ``1..N`` (``pending_tokens``): banks past N hold an
    older verify's prefixes. Any other commit changes nothing."""
    valid = valid_rows(slots, verify_lens, pending.shape[0])
    safe = jnp.where(valid, slots, 0)
    bank = accept_lens if accept_banks is None else accept_banks
    folded = pending_tokens[safe]
    fits = (pending[safe] == verify_lens) & (accept_lens >= 0) & (accept_lens <= folded)
    return valid & fits & (bank >= 0) & (bank <= folded)


def lazy_commits(pending, pending_tokens, slots, seq_lens, accept_banks=None):
    """``(verify_lens, accept_lens, slots)``: the commit a forward of ``slots`` at ``seq_lens`` makes of
    their pending verifies (:func:`pending_commits`), keeping the banks ``accept_banks`` (default: the
    chain's), with rows whose commit does not fit the verify (:func:`commits_pending`) made padding."""
    verify_lens, accept_lens, rows = pending_commits(pending, slots, seq_lens)
    fits = commits_pending(pending, pending_tokens, rows, verify_lens, accept_lens, accept_banks)
    return verify_lens, accept_lens, jnp.where(fits, rows, -1)


def context_bucket(longest: int, max_len: int, floor: int = 256) -> int:
    """The context bound of a forward or a dispatch (the model's static ``context``,
    :attr:`ForwardBatch.context <jax_oc128.nn.forward.ForwardBatch.context>`) whose rows reach at most
    ``longest`` positions: ``floor * 2^k``, the least at least ``longest``, capped at ``max_len`` (a bounded
    set of compilations: ``log2(max_len / floor) + 1`` buckets). ``floor``: a multiple of 128 (and of a paged
    cache's page size), so that every bucket covers whole blocks and pages.

    The contract (the host's; nothing on the device checks it): ``longest`` is at least every row's position
    plus every token the dispatch may add to it (K steps of up to N verified tokens each: K * N). A row
    past its bucket reads entries as missing: wrong logits, no error.

    Raises:
      ValueError: ``longest`` past ``max_len`` (naming both), or a ``floor`` that is not a positive multiple
        of 128.
    """
    if floor < 1 or floor % BLOCK:
        raise ValueError(f"floor: a positive multiple of {BLOCK} (whole C128 blocks), got {floor}")
    if longest > max_len:
        raise ValueError(f"longest: {longest} positions exceed max_len {max_len}")
    bucket = floor
    while bucket < longest:
        bucket *= 2
    return min(bucket, max_len)
