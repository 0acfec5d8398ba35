"""The attention op: each query's heads attend, in one softmax with a per-head sink, to the keys its lists
name in a pool of rows (K = V, one KV head: MQA), as DeepSeek-V4's attention does over its window, its HCA
entries and its CSA picks. The native target ``oc128_attention`` (ffi/attention_ffi.h): on CPU a reference
loop, on CUDA a tensor-core kernel (online softmax, float32 accumulation, no ``[heads, T, keys]`` logits in
memory); :func:`attention_reference` is its jnp twin.

A query's keys are a multiset of pool rows: its ``index`` entries (``-1``, or any value outside ``[0,
pool)``: no key) then the rows of each of its ``ranges`` (``[begin, end)``, clipped to ``[0, pool)``; empty
when ``end <= begin``). A row named twice counts twice. A range costs no memory per key: the HCA entries a
query sees (all those closed before it) are one range, so nothing sized by the context is built per query.
Only the rows a query names are read; the rest of the pool may hold anything (NaN). ``sinks`` are finite.

Precision: the CPU handler and the twin compute in float32 (the twin's matmuls at HIGHEST); the CUDA kernel
rounds q, kv and the softmax weights to bfloat16 (tensor cores) and accumulates in float32. The CUDA kernel
takes head_dim 32, 64, 128, 256 or 512; where a call has few queries it splits each query's keys into parts
(:func:`splits`) and combines their partial results in a fixed order (deterministic).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_oc128 import ops
from jax_oc128.checks import check_scale
from jax_oc128.ops import FULL

TARGET = "oc128_attention"
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
HEAD_TILE = 64  # heads per block of the CUDA kernel
SPLIT_BLOCKS = 128  # blocks the split aims at: about one per multiprocessor of an H100 (132)
SPLIT_KEYS = 64  # the fewest keys (bound) a part of a split takes
MAX_SPLITS = 16


def _check(q, kv, index, ranges, sinks, scale):
    """The shapes and dtypes of :func:`attention`'s operands, at trace time."""
    if q.ndim != 4:
        raise ValueError(f"q: expected rank 4 [batch, tokens, heads, head_dim], got shape {q.shape}")
    batch, tokens, heads, dim = q.shape
    if q.dtype not in DTYPES:
        raise TypeError(f"q: dtype must be float32 or bfloat16, got {q.dtype}")
    if kv.dtype != q.dtype:
        raise TypeError(f"kv: dtype must be q's ({q.dtype}), got {kv.dtype}")
    if kv.ndim != 3 or kv.shape[0] != batch or kv.shape[2] != dim:
        raise ValueError(f"kv: expected shape [{batch}, pool, {dim}], got {kv.shape}")
    if index.ndim != 3 or index.shape[:2] != (batch, tokens):
        raise ValueError(f"index: expected shape [{batch}, {tokens}, picks], got {index.shape}")
    if ranges.ndim != 4 or ranges.shape[:2] != (batch, tokens) or ranges.shape[3] != 2:
        raise ValueError(f"ranges: expected shape [{batch}, {tokens}, num_ranges, 2], got {ranges.shape}")
    for name, x in (("index", index), ("ranges", ranges)):
        if x.dtype != jnp.int32:
            raise TypeError(f"{name}: dtype must be int32, got {x.dtype}")
    if sinks.shape != (heads,) or sinks.dtype != jnp.float32:
        raise ValueError(f"sinks: expected float32 [{heads}], got {sinks.dtype} {sinks.shape}")
    check_scale(scale)


def attention(q, kv, index, ranges, sinks, *, scale: float):
    """Attention of each query over the keys its lists name (module docstring).

    Args:
      q: ``[batch, tokens, heads, head_dim]`` float32 or bfloat16.
      kv: ``[batch, pool, head_dim]``, q's dtype: the keys, which are also the values.
      index: ``[batch, tokens, picks]`` int32 pool rows (picks may be 0).
      ranges: ``[batch, tokens, num_ranges, 2]`` int32 ``[begin, end)`` of pool rows (num_ranges may be 0).
      sinks: ``[heads]`` float32: each head's sink logit, in the denominator only.
      scale: the logits are ``scale * q . k``.

    Returns:
      ``[batch, tokens, heads, head_dim]`` float32: ``sum_k exp(l_k) v_k / (sum_k exp(l_k) + exp(sink))``; 0
      for a query without keys.
    """
    q, kv, index, ranges, sinks = (jnp.asarray(x) for x in (q, kv, index, ranges, sinks))
    _check(q, kv, index, ranges, sinks, scale)
    has_native = {p: TARGET in ops.native_targets(p) for p in ("cpu", "cuda")}

    batch, tokens, heads, dim = q.shape
    cuda_splits = splits(batch * tokens, heads, index.shape[2] + ranges.shape[2] * kv.shape[1])

    def native(*operands, parts):
        workspace = batch * tokens * heads * (dim + 2) * parts if parts > 1 else 0
        results = (
            jax.ShapeDtypeStruct(q.shape, jnp.float32),
            jax.ShapeDtypeStruct((workspace,), jnp.float32),
        )
        call = jax.ffi.ffi_call(TARGET, results, vmap_method="sequential")
        return call(*operands, scale=np.float32(scale))[0]

    def reference(*operands):
        return attention_reference(*operands, scale=scale)

    parts = {"cpu": 1, "cuda": cuda_splits}  # the CPU handler does not split
    branches = {p: functools.partial(native, parts=parts[p]) for p, has in has_native.items() if has}
    return jax.lax.platform_dependent(q, kv, index, ranges, sinks, default=reference, **branches)


def splits(queries: int, heads: int, keys: int) -> int:
    """How many parts the CUDA kernel splits each query's keys into (flash-decoding): enough that its
    blocks, one per (query, 64 heads, part), about fill the GPU (``SPLIT_BLOCKS``), with at least
    ``SPLIT_KEYS`` of a query's at most ``keys`` keys a part, at most ``MAX_SPLITS``; 1 (no split) for a
    prefill's many queries."""
    blocks = queries * -(-heads // HEAD_TILE)
    return max(1, min(MAX_SPLITS, -(-SPLIT_BLOCKS // blocks), keys // SPLIT_KEYS))


def attention_reference(q, kv, index, ranges, sinks, *, scale: float):
    """The jnp twin of :func:`attention`, float32: logits over the picks and over the whole pool (a pool row
    weighted by how many of the query's ranges hold it); pool rows no query of the batch row reads are zeroed
    first, so that only named rows reach the output."""
    q, kv = q.astype(jnp.float32), kv.astype(jnp.float32)
    pool = kv.shape[1]
    picked = (index >= 0) & (index < pool)  # [batch, T, picks]
    rows = jnp.arange(kv.shape[0])[:, None, None]
    keys = jnp.where(picked[..., None], kv[rows, jnp.where(picked, index, 0)], 0.0)  # [batch, T, picks, D]
    begin, end = (jnp.clip(ranges[..., i], 0, pool)[..., None] for i in (0, 1))  # [batch, T, ranges, 1]
    at = jnp.arange(pool)
    times = jnp.sum((at >= begin) & (at < end), axis=2).astype(jnp.float32)  # [batch, T, pool]
    kv = jnp.where(jnp.any(times > 0, axis=1)[..., None], kv, 0.0)
    logits = jnp.concatenate(
        [
            jnp.where(picked[:, :, None], jnp.einsum("bthd,btkd->bthk", q, keys, precision=FULL), -jnp.inf),
            jnp.where(times[:, :, None] > 0, jnp.einsum("bthd,bsd->bths", q, kv, precision=FULL), -jnp.inf),
        ],
        axis=-1,
    )
    logits = logits * scale
    sink = sinks[None, None, :]
    top = jnp.maximum(jnp.max(logits, axis=-1), sink)
    counts = jnp.concatenate([picked.astype(jnp.float32), times], axis=-1)[:, :, None]  # [batch, T, 1, keys]
    weights = jnp.exp(logits - top[..., None]) * counts
    norm = jnp.sum(weights, axis=-1) + jnp.exp(sink - top)
    picks = index.shape[2]
    out = jnp.einsum("bthk,btkd->bthd", weights[..., :picks], keys, precision=FULL)
    out += jnp.einsum("bths,bsd->bthd", weights[..., picks:], kv, precision=FULL)
    return out / norm[..., None]
