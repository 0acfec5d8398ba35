"""Pure-jnp twins of the native ops: the oracle in tests and the fallback where no native target exists.

Each function has the signature, shapes and semantics of its namesake in :mod:`jax_oc128` (see there) and
runs the same recurrence as ``ffi/oc128_math.h`` in float32, so native and reference agree to rounding. The
arguments are those the ops check (a state with at least one slot, shapes as documented).

The score domain, as in ``ffi/oc128_math.h``: kv values are finite and a score (score + ape) is finite or
-inf. A -inf score has weight zero; a block whose scores are all -inf so far has the state
``(max, sum, mean) = (-inf, 0, 0)`` and, closed so, the entry 0. NaN and +inf scores are outside the domain
(the block's state and entry are unspecified, nothing else is affected). :func:`fold` is the online form and
:func:`pool` the offline one (a whole block at once).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_oc128.rules import BLOCK, committed_bank, drop_index, pending_commits, valid_rows


def processed_rows(slots, valid):
    """``[bs]`` bool: the rows of a call an op processes, as ``Rows::processed`` of ``ffi/oc128_math.h``:
    ``valid`` rows (the op's own conditions, ``[bs]`` bool) whose slot no earlier valid row of the call has.
    Every other row is skipped: nothing is read or written for it and its outputs are a padding row's."""
    row = jnp.arange(slots.shape[0])
    earlier = (slots[None, :] == slots[:, None]) & valid[None, :] & (row[None, :] < row[:, None])
    return valid & ~jnp.any(earlier, axis=1)


def mean(num, s):
    """The mean ``num / s`` of a pooled state, 0 where the block has no weight (``s == 0``)."""
    return jnp.where(s == 0, 0.0, num / s)


def fold(m, s, num, pos, v, sigma):
    """One token of the online recurrence (SPEC section 3), elementwise, as ``Online fold`` of
    ``ffi/oc128_math.h``.

    ``(m, s, num)`` is the running state with the mean carried as its numerator ``num = mean * s``,
    ``v`` the token's kv and ``sigma`` its score plus ape, ``pos`` its position in the block
    (broadcastable); ``pos == 0`` starts a new block and ignores the state. A -inf ``sigma`` has weight
    zero: it leaves the state as it is, or starts the block without weight, ``(-inf, 0, 0)``.
    """
    new_max = sigma > m
    t = jnp.exp(jnp.where(new_max, m - sigma, sigma - m))
    keep, add = jnp.where(new_max, t, 1.0), jnp.where(new_max, 1.0, t)
    m2, s2, num2 = jnp.where(new_max, sigma, m), s * keep + add, num * keep + v * add
    start, zero = pos == 0, sigma == -jnp.inf
    return (
        jnp.where(start, sigma, jnp.where(zero, m, m2)),
        jnp.where(zero, jnp.where(start, 0.0, s), jnp.where(start, 1.0, s2)),
        jnp.where(zero, jnp.where(start, 0.0, num), jnp.where(start, v, num2)),
    )


def pool(sigma, kv, axis):
    """The offline pooling of whole blocks: float32 ``(max, sum, mean)`` over ``axis`` of the scores
    ``sigma`` (score + ape) and their ``kv`` (same shape), ``axis`` reduced: the softmax of the scores
    weighting the kv, with the domain of :func:`fold` (a -inf score has weight zero; a block without
    weight is ``(-inf, 0, 0)``)."""
    m = jnp.max(sigma, axis=axis)
    w = jnp.where(sigma == -jnp.inf, 0.0, jnp.exp(sigma - jnp.expand_dims(m, axis)))
    s = jnp.sum(w, axis=axis)
    return m, s, mean(jnp.sum(w * kv, axis=axis), s)


def load_state(rows):
    """``[..., 3, D]`` stored ``[max | sum | mean]`` rows -> float32 ``(m, s, num)``, each ``[..., D]``."""
    rows = rows.astype(jnp.float32)
    return rows[..., 0, :], rows[..., 1, :], rows[..., 2, :] * rows[..., 1, :]


def widen(x):
    """``x`` (float32 or bfloat16) as float32, exactly, on the bits for bfloat16: XLA on GPUs drops a
    float32 -> bfloat16 -> float32 round trip by default (``xla_allow_excess_precision``), which would skip
    the rounding that :func:`store_state` rescales the sum for."""
    if jnp.dtype(x.dtype) == jnp.float32:
        return x
    bits = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
    return lax.bitcast_convert_type(bits, jnp.float32)


def store_state(m, s, num, dtype):
    """float32 ``(m, s, num)`` -> ``[..., 3, D]`` rows of ``dtype``. For bf16 the max is rounded first
    and the sum rescaled to it (where rounding changed it), so that the stored pair stays consistent."""
    mq = m.astype(dtype)
    rounded = widen(mq)
    sq = jnp.where(rounded == m, s, s * jnp.exp(m - rounded))
    return jnp.stack([mq, sq.astype(dtype), mean(num, s).astype(dtype)], axis=-2)


def set_rows(state, index, rows):
    """``state.at[index].set(rows, mode="drop")``, done on the bits: XLA may compute a bfloat16 scatter in
    float32, which would turn every NaN of the state, written or not, into the canonical NaN."""
    bits = jnp.uint16 if jnp.dtype(state.dtype).itemsize == 2 else jnp.uint32
    rows = lax.bitcast_convert_type(rows.astype(state.dtype), bits)
    written = lax.bitcast_convert_type(state, bits).at[index].set(rows, mode="drop")
    return lax.bitcast_convert_type(written, state.dtype)


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
    valid = processed_rows(slots, valid)
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
    entries = jnp.where(closed[None, :, :, None], mean(num, s)[:, :, :per_row], 0.0)
    entry_blocks = jnp.where(closed, seq_lens[:, None] // BLOCK + g[None], -1).astype(jnp.int32)

    trailing = jnp.clip((p0 + n - 1) // BLOCK, 0, segments - 1)
    pick = trailing[None, :, None, None]
    final = [jnp.take_along_axis(f, pick, axis=2)[:, :, 0] for f in (m, s, num)]
    write = valid & (n > 0) & ((p0 + n) % BLOCK != 0)
    rows_out = store_state(*final, state.dtype)
    state = set_rows(
        state, (slice(layer, layer + num_layers), 0, drop_index(slots, num_slots, write)), rows_out
    )
    return state, entries, entry_blocks


def verify(state, kv_score, seq_lens, slots, ape, pending=None, pending_banks=None, tree=None, *, layer=0):
    """Reference of :func:`jax_oc128.verify`: the pending commit, then N <= 16 steps, statically unrolled.
    ``tree`` is ``[N]`` int32 (a traced value is fine: the nodes' parents are gathered), or None or empty for
    the chain."""
    num_layers = kv_score.shape[0]
    num_slots = state.shape[2]
    valid = processed_rows(slots, valid_rows(slots, seq_lens, num_slots))
    if pending is not None and pending.shape[0]:
        skipped_as_padding = jnp.where(valid, slots, -1)
        verify_lens, accept_lens, rows_slots = pending_commits(pending, skipped_as_padding, seq_lens)
        accept_banks = None
        if pending_banks is not None and pending_banks.shape[0]:
            accept_banks = pending_banks[jnp.maximum(rows_slots, 0)]
        state = commit(
            state,
            verify_lens,
            accept_lens,
            rows_slots,
            layer=layer,
            num_layers=num_layers,
            accept_banks=accept_banks,
        )
    chain = tree is None or not tree.shape[0]
    p0 = jnp.where(valid, seq_lens % BLOCK, 0)
    m, s, num = load_state(state[layer : layer + num_layers, 0][:, jnp.where(valid, slots, 0)])
    nodes, entry = fold_verify(m, s, num, kv_score, p0, ape, None if chain else tree)
    blocks = []
    for k, (closes, depth, after) in enumerate(nodes):
        blocks.append(jnp.where(closes, (seq_lens + depth) // BLOCK, -1))
        index = drop_index(slots, num_slots, valid & ~closes)
        state = set_rows(
            state, (slice(layer, layer + num_layers), k + 1, index), store_state(*after, state.dtype)
        )
    if chain:
        entries, entry_blocks = entry[:, :, None], jnp.max(jnp.stack(blocks, axis=1), axis=1, keepdims=True)
    else:
        closed = [
            jnp.where(closes[None, :, None], mean(after[2], after[1]), 0.0) for closes, _, after in nodes
        ]
        entries, entry_blocks = jnp.stack(closed, axis=2), jnp.stack(blocks, axis=1)
    entries = jnp.where(valid[None, :, None, None], entries, 0.0)
    entry_blocks = jnp.where(valid[:, None], entry_blocks, -1).astype(jnp.int32)
    return state, entries, entry_blocks


def fold_verify(m, s, num, kv_score, p0, ape, tree=None):
    """A verify's tokens ``kv_score`` ``[Lk, bs, N, 2*D]`` folded into the open blocks' float32
    ``(m, s, num)`` ``[Lk, bs, D]``, the root at position ``p0`` ``[bs]`` of its block: in order (the chain,
    ``tree`` None), or node k from the state after its parent ``tree[k]`` (``[N]`` int32, may be traced; a
    parent that is not an earlier node makes the node a root, as in ``ffi/oc128_math.h``) at depth + 1.
    Returns ``(nodes, entry)``: per node, ``(closes [bs], depth, (m, s, num))``, whether it closed its block,
    its depth (an int, or a traced int32 scalar for a tree) and the state after it; ``entry`` ``[Lk, bs, D]``,
    the mean of the block the last closing node closed (0 where none: the chain closes at most one)."""
    dim = kv_score.shape[3] // 2
    start = (m, s, num)
    entry = jnp.zeros_like(m)
    nodes = []
    for k in range(kv_score.shape[2]):
        if tree is None:
            depth, before = k, nodes[-1][2] if k else start
        else:
            parent = jnp.where((tree[k] >= 0) & (tree[k] < k), tree[k], -1)  # -1: the committed state
            depth, before = 0, start
            for j, (_, node_depth, after) in enumerate(nodes):
                depth = jnp.where(parent == j, node_depth + 1, depth)
                before = tuple(jnp.where(parent == j, x, y) for x, y in zip(after, before, strict=True))
        pos = (p0 + depth) % BLOCK
        sigma = kv_score[:, :, k, dim:] + ape[:, pos]
        after = fold(*before, pos[None, :, None], kv_score[:, :, k, :dim], sigma)
        closes = pos == BLOCK - 1
        entry = jnp.where(closes[None, :, None], mean(after[2], after[1]), entry)
        nodes.append((closes, depth, after))
    return nodes, entry


def commit(state, seq_lens, accept_lens, slots, accept_banks=None, *, layer=0, num_layers=None):
    """Reference of :func:`jax_oc128.commit`; ``accept_banks`` None or empty: the chain's."""
    num_layers = state.shape[0] - layer if num_layers is None else num_layers
    num_banks, num_slots = state.shape[1], state.shape[2]
    if accept_banks is not None and not accept_banks.shape[0]:
        accept_banks = None
    valid = valid_rows(slots, seq_lens, num_slots) & (accept_lens >= 0) & (accept_lens < num_banks)
    bank = committed_bank(seq_lens, accept_lens, num_banks, accept_banks)
    ok = processed_rows(slots, valid) & (bank > 0)
    src = state[layer : layer + num_layers, jnp.where(ok, bank, 0), jnp.where(ok, slots, 0)]
    index = drop_index(slots, num_slots, ok)
    return set_rows(state, (slice(layer, layer + num_layers), 0, index), src)
