"""Pure-jnp twins of the native ops: the oracle in tests and the fallback where no native target exists.

Each function has the signature, shapes and semantics of its namesake in :mod:`jax_oc128` (see there) and
runs the same recurrence as ``ffi/oc128_math.h`` in float32, so native and reference agree to rounding.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_oc128.rules import BLOCK, commits_bank, drop_index, pending_commits, valid_rows


def fold(m, s, num, pos, v, sigma):
    """One token of the online recurrence (SPEC section 3), elementwise, as ``Online fold`` of
    ``ffi/oc128_math.h``.

    ``(m, s, num)`` is the running state with the mean carried as its numerator ``num = mean * s``,
    ``v`` the token's kv and ``sigma`` its score plus ape, ``pos`` its position in the block
    (broadcastable); ``pos == 0`` starts a new block and ignores the state.
    """
    new_max = sigma > m
    t = jnp.exp(jnp.where(new_max, m - sigma, sigma - m))
    keep, add = jnp.where(new_max, t, 1.0), jnp.where(new_max, 1.0, t)
    m2, s2, num2 = jnp.where(new_max, sigma, m), s * keep + add, num * keep + v * add
    start = pos == 0
    return jnp.where(start, sigma, m2), jnp.where(start, 1.0, s2), jnp.where(start, v, num2)


def load_state(rows):
    """``[..., 3, D]`` stored ``[max | sum | mean]`` rows -> float32 ``(m, s, num)``, each ``[..., D]``."""
    rows = rows.astype(jnp.float32)
    return rows[..., 0, :], rows[..., 1, :], rows[..., 2, :] * rows[..., 1, :]


def store_state(m, s, num, dtype):
    """float32 ``(m, s, num)`` -> ``[..., 3, D]`` rows of ``dtype``. For bf16 the max is rounded first
    and the sum rescaled to it, so that the stored pair stays consistent."""
    mq = m.astype(dtype)
    sq = s if jnp.dtype(dtype) == jnp.float32 else s * jnp.exp(m - mq.astype(jnp.float32))
    return jnp.stack([mq, sq.astype(dtype), (num / s).astype(dtype)], axis=-2)


def compress(state, kv_score, seq_lens, new_lens, slots, ape, *, layer=0):
    """Reference of :func:`jax_oc128.compress`.

    The tokens of each row are laid out by block segment (segment g holds block positions 0..127 of the
    g-th block touched), and a scan over the 128 positions folds every segment at once.
    """
    num_layers, rows, tokens, two_d = kv_score.shape
    dim = two_d // 2
    num_slots = state.shape[2]
    per_row = tokens // BLOCK + 1
    segments = (tokens + 2 * BLOCK - 2) // BLOCK
    valid = valid_rows(slots, seq_lens, num_slots) & (new_lens >= 0) & (new_lens <= tokens)
    n = jnp.where(valid, new_lens, 0)
    p0 = jnp.where(valid, seq_lens % BLOCK, 0)

    # t[row, g, j]: the token at position j of segment g.
    t = (jnp.arange(segments)[:, None] * BLOCK + jnp.arange(BLOCK))[None] - p0[:, None, None]
    active = (t >= 0) & (t < n[:, None, None])
    if tokens == 0:
        kv_score = jnp.zeros((num_layers, rows, 1, two_d), jnp.float32)
    index = jnp.clip(t, 0, kv_score.shape[2] - 1).reshape(1, rows, segments * BLOCK, 1)
    x = jnp.take_along_axis(kv_score, index, axis=2).reshape(num_layers, rows, segments, BLOCK, two_d)

    bank0 = state[layer : layer + num_layers, 0][:, jnp.where(valid, slots, 0)]
    init = tuple(
        jnp.broadcast_to(f[:, :, None], (num_layers, rows, segments, dim)) for f in load_state(bank0)
    )

    def body(carry, inputs):
        j, xj, ape_j, act = inputs
        new = fold(*carry, j, xj[..., :dim], xj[..., dim:] + ape_j[:, None, None, :])
        act = act[None, :, :, None]
        return tuple(jnp.where(act, nw, old) for nw, old in zip(new, carry, strict=True)), None

    xs = (jnp.arange(BLOCK), jnp.moveaxis(x, 3, 0), jnp.moveaxis(ape, 1, 0), jnp.moveaxis(active, 2, 0))
    (m, s, num), _ = lax.scan(body, init, xs)

    g = jnp.arange(per_row)
    closed = (g[None] * BLOCK + BLOCK - 1 - p0[:, None]) < n[:, None]  # [rows, per_row]
    entries = jnp.where(closed[None, :, :, None], (num / s)[:, :, :per_row], 0.0)
    entry_blocks = jnp.where(closed, seq_lens[:, None] // BLOCK + g[None], -1).astype(jnp.int32)

    trailing = jnp.clip((p0 + n - 1) // BLOCK, 0, segments - 1)
    pick = trailing[None, :, None, None]
    final = [jnp.take_along_axis(f, pick, axis=2)[:, :, 0] for f in (m, s, num)]
    write = valid & (n > 0) & ((p0 + n) % BLOCK != 0)
    rows_out = store_state(*final, state.dtype)
    state = state.at[layer : layer + num_layers, 0, drop_index(slots, num_slots, write)].set(
        rows_out, mode="drop"
    )
    return state, entries, entry_blocks


def verify(state, kv_score, seq_lens, slots, ape, pending=None, *, layer=0):
    """Reference of :func:`jax_oc128.verify`: the pending commit, then N <= 16 steps, statically unrolled."""
    num_layers, rows, tokens, two_d = kv_score.shape
    dim = two_d // 2
    num_slots = state.shape[2]
    valid = valid_rows(slots, seq_lens, num_slots)
    if pending is not None and pending.shape[0]:
        state = commit(state, *pending_commits(pending, slots, seq_lens), layer=layer, num_layers=num_layers)
    p0 = jnp.where(valid, seq_lens % BLOCK, 0)
    m, s, num = load_state(state[layer : layer + num_layers, 0][:, jnp.where(valid, slots, 0)])
    entry = jnp.zeros((num_layers, rows, dim), jnp.float32)
    entry_block = jnp.full((rows,), -1, jnp.int32)
    banks = []
    for k in range(tokens):
        pos = (p0 + k) % BLOCK
        sigma = kv_score[:, :, k, dim:] + ape[:, pos]
        m, s, num = fold(m, s, num, pos[None, :, None], kv_score[:, :, k, :dim], sigma)
        closes = pos == BLOCK - 1
        entry = jnp.where(closes[None, :, None], num / s, entry)
        entry_block = jnp.where(closes, (seq_lens + k) // BLOCK, entry_block)
        banks.append((closes, store_state(m, s, num, state.dtype)))
    entry = jnp.where(valid[None, :, None], entry, 0.0)[:, :, None]
    entry_block = jnp.where(valid, entry_block, -1)[:, None].astype(jnp.int32)
    for k, (closes, rows_k) in enumerate(banks, start=1):
        index = drop_index(slots, num_slots, valid & ~closes)
        state = state.at[layer : layer + num_layers, k, index].set(rows_k, mode="drop")
    return state, entry, entry_block


def commit(state, seq_lens, accept_lens, slots, *, layer=0, num_layers=None):
    """Reference of :func:`jax_oc128.commit`."""
    num_layers = state.shape[0] - layer if num_layers is None else num_layers
    num_banks, num_slots = state.shape[1], state.shape[2]
    ok = valid_rows(slots, seq_lens, num_slots) & commits_bank(seq_lens, accept_lens, num_banks)
    src = state[layer : layer + num_layers, jnp.where(ok, accept_lens, 0), jnp.where(ok, slots, 0)]
    index = drop_index(slots, num_slots, ok)
    return state.at[layer : layer + num_layers, 0, index].set(src, mode="drop")
