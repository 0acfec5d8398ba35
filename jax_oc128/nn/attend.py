"""The seam of DeepSeek-V4's attention math: one softmax, with the head's sink in the denominator, over a
query's window keys and its HCA entries or CSA picks, and the weighted sum of those keys (K = V), by one of
two implementations, chosen by a setting:

- ``"jnp"``: einsums over masked logits (the oracle, and the CPU path);
- ``"kernel"``: the attention op (:func:`jax_oc128.attention_op.attention`: the CUDA kernel on a GPU, the CPU
  handler's reference loop on a CPU) over one pool of the same keys, the window and picks by index and a
  chain's HCA entries by range; a CSA layer's picks are gathered into the pool where they are fewer rows
  than its entries (decode), else the pool holds the entries and the picks index them (prefill);
- ``"auto"``: the kernel where the default backend is a GPU with the CUDA module built, else jnp.

A model's layers take it from ``RuntimeConfig.attention_impl`` (default ``"jnp"``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_oc128 import attention_op, ops
from jax_oc128.checks import ArgumentError
from jax_oc128.nn import kv_cache
from jax_oc128.nn.functional import FULL

IMPLS = ("jnp", "kernel", "auto")
#: queries per iteration of a long chain's loop over its query blocks (:func:`by_query_blocks`)
LOOP_QUERIES = 512


def check_impl(impl: str) -> None:
    """ArgumentError (``attention_impl``) unless ``impl`` is one of :data:`IMPLS`."""
    if impl not in IMPLS:
        raise ArgumentError("attention_impl", f"must be one of {IMPLS}, got {impl!r}")


def resolve(impl: str) -> str:
    """``"jnp"`` or ``"kernel"``: what ``impl`` runs on the default backend."""
    check_impl(impl)
    if impl == "auto":
        gpu = jax.default_backend() == "gpu" and attention_op.TARGET in ops.native_targets("cuda")
        return "kernel" if gpu else "jnp"
    return impl


def attend(
    q, keys, visible, extra, extra_visible, sinks, scale: float, *, impl, entries_prefix: bool, picks=None
):
    """The attention of ``q`` over its window and its compressed keys.

    Args:
      q: ``[batch, T, heads, D]`` float32.
      keys: ``[batch, n, K, D]`` float32: the window keys of each of n query blocks of ``B`` queries.
      visible: ``[batch, n, B, K]`` bool: which of its block's keys query ``i * B + j`` sees (``n * B >= T``).
      extra: None; an HCA layer's entries ``[batch, E, D]`` float32; or a CSA layer's
        :class:`~jax_oc128.nn.kv_cache.SlotEntries` (E of them, any cache format, read where stored), of
        which each query sees its ``picks``.
      extra_visible: an HCA layer's ``[batch, T, E]`` bool: which entries each query sees; None with picks.
      sinks: ``[heads]`` float32.
      scale: the logits' scale.
      impl: the setting (module docstring).
      entries_prefix: each query's visible HCA entries are a prefix of them (a chain): the kernel gets one
        range.
      picks: a CSA layer's ``[batch, T, k]`` int32 rows of ``extra`` (-1: none), else None.

    Returns:
      ``[batch, T, heads, D]`` float32.
    """
    kernel = resolve(impl) == "kernel"
    if picks is not None and kernel and q.shape[1] * picks.shape[2] > extra.rows:
        entries = kv_cache.decode(extra.view())
        return _kernel(q, keys, visible, entries, None, sinks, scale, entries_prefix, picks)
    if picks is not None:  # each query's own rows
        extra, extra_visible = gather(extra, picks), picks >= 0
    if kernel:
        return _kernel(q, keys, visible, extra, extra_visible, sinks, scale, entries_prefix)
    return _jnp(q, keys, visible, extra, extra_visible, sinks, scale)


def gather(entries, picks):
    """``[batch, T, k, D]`` float32: the entries ``picks`` ``[batch, T, k]`` (-1: zeros) of ``entries``, a
    :class:`~jax_oc128.nn.kv_cache.SlotEntries`, each read where it is stored."""
    picked = kv_cache.decode(entries.take(jnp.maximum(picks, 0)))
    return jnp.where((picks >= 0)[..., None], picked, 0.0)


def by_query_blocks(fn, keys, visible, rows, tokens: int):
    """``fn`` over groups of a forward's query blocks, one group at a time, so that nothing the queries make
    (their projections, logits, outputs) is held for more than ``max(B, LOOP_QUERIES)`` queries at once.

    Args:
      fn: ``fn(keys, visible, *rows) -> [batch, L, ...]``: the outputs of ``L`` queries, given their window
        keys ``[batch, g, K, D]`` and ``visible`` ``[batch, g, B, K]`` (``g * B >= L``) and their ``rows``.
      keys: ``[batch, n, K, D]``: the window keys of the n blocks of ``B`` queries.
      visible: ``[batch, n, B, K]`` bool (:func:`attend`'s).
      rows: pytrees of arrays ``[batch, T, ...]`` by query (a layer kind's record, e.g.
        :class:`~jax_oc128.nn.csa.IndexerQueries`; None passed on as None).
      tokens: T.

    Returns:
      ``[batch, T, ...]``: ``fn``'s outputs, in order. One group (``n * B <= LOOP_QUERIES``, or one
      block): ``fn`` called once on everything; otherwise in a loop (``lax.map``) over groups of
      ``LOOP_QUERIES // B`` blocks, the last padded (keys zero, nothing visible, rows zero).
    """
    batch, blocks, block = visible.shape[:3]
    group = max(1, LOOP_QUERIES // block)
    if blocks <= group:
        return fn(keys, visible, *rows)[:, :tokens]
    groups = -(-blocks // group)
    size = group * block

    def pad(a, length):
        return jnp.pad(a, [(0, 0), (0, length - a.shape[1])] + [(0, 0)] * (a.ndim - 2))

    keys, visible = pad(keys, groups * group), pad(visible, groups * group)
    rows = jax.tree.map(lambda a: pad(a, groups * size), tuple(rows))

    def run(i):
        def take(a, length):
            return lax.dynamic_slice_in_dim(a, i * length, length, axis=1)

        group_rows = jax.tree.map(lambda a: take(a, size), rows)
        return fn(take(keys, group), take(visible, group), *group_rows)

    out = lax.map(run, jnp.arange(groups))  # [groups, batch, size, ...]
    return jnp.moveaxis(out, 0, 1).reshape(batch, groups * size, *out.shape[3:])[:, :tokens]


def _jnp(q, keys, visible, extra, extra_visible, sinks, scale):
    batch, tokens, heads = q.shape[:3]
    blocks, block = visible.shape[1:3]
    q_blocks = jnp.pad(q, ((0, 0), (0, blocks * block - tokens), (0, 0), (0, 0)))
    q_blocks = q_blocks.reshape(batch, blocks, block, *q.shape[2:])
    logits = jnp.einsum("bnthd,bnkd->bhntk", q_blocks, keys, precision=FULL) * scale
    logits = jnp.where(visible[:, None], logits, -jnp.inf)
    logits = logits.reshape(batch, heads, blocks * block, -1)[:, :, :tokens]
    parts = [logits]  # the window's; then an HCA layer's entries or a CSA layer's picks, per query
    spec = "bed" if extra is not None and extra.ndim == 3 else "btkd"
    if extra is not None:
        extra_logits = jnp.einsum(f"bthd,{spec}->bht{spec[-2]}", q, extra, precision=FULL) * scale
        parts.append(jnp.where(extra_visible[:, None], extra_logits, -jnp.inf))
    logits = jnp.concatenate(parts, axis=-1)
    sink = sinks[None, :, None]
    top = jnp.maximum(jnp.max(logits, axis=-1), sink)
    weights = jnp.exp(logits - top[..., None])
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + jnp.exp(sink - top)[..., None])
    window, rest = weights[..., : keys.shape[2]], weights[..., keys.shape[2] :]
    window = jnp.pad(window, ((0, 0), (0, 0), (0, blocks * block - tokens), (0, 0)))
    window = window.reshape(batch, heads, blocks, block, -1)
    out = jnp.einsum("bhntk,bnkd->bnthd", window, keys, precision=FULL)
    out = out.reshape(batch, blocks * block, *out.shape[3:])[:, :tokens]
    if extra is not None:
        out += jnp.einsum(f"bht{spec[-2]},{spec}->bthd", rest, extra, precision=FULL)
    return out


def _kernel(q, keys, visible, extra, extra_visible, sinks, scale, entries_prefix, picks=None):
    """The attention op over one pool per row: [the blocks' window keys | HCA entries, CSA picks or, with
    ``picks``, CSA entries]."""
    batch, tokens = q.shape[:2]
    _, blocks, width, dim = keys.shape
    block = visible.shape[2]
    t = jnp.arange(tokens)
    pool = [keys.reshape(batch, blocks * width, dim)]
    seen = visible.reshape(batch, blocks * block, width)[:, :tokens]
    index = [jnp.where(seen, (t // block * width)[:, None] + jnp.arange(width), -1)]
    ranges = jnp.zeros((batch, tokens, 0, 2), jnp.int32)
    if extra is not None:
        offset = blocks * width
        if picks is not None:  # CSA entries, by the picks
            index.append(jnp.where(picks >= 0, offset + picks, -1))
        elif extra.ndim == 3 and entries_prefix:  # HCA entries seen: a prefix of them, one range
            seen = jnp.sum(extra_visible, axis=-1, dtype=jnp.int32)
            ranges = jnp.stack([jnp.full_like(seen, offset), offset + seen], axis=-1)[:, :, None]
        elif extra.ndim == 3:  # a tree's HCA entries, by index
            index.append(jnp.where(extra_visible, offset + jnp.arange(extra.shape[1]), -1))
        else:  # CSA picks, each query's own rows
            count = extra.shape[2]
            extra = extra.reshape(batch, tokens * count, dim)
            index.append(jnp.where(extra_visible, offset + t[:, None] * count + jnp.arange(count), -1))
        pool.append(extra)
    index = jnp.concatenate(index, axis=-1).astype(jnp.int32)
    return attention_op.attention(q, jnp.concatenate(pool, axis=1), index, ranges, sinks, scale=scale)
