"""The lightning indexer's scores op: each query's score of each key, ``scale * sum_h w_h relu(q_h . k)``,
as DeepSeek-V4's CSA indexer scores its compressed keys (:meth:`jax_oc128.nn.csa.CSACompressor.select`).
The native target ``oc128_indexer_scores`` (ffi/indexer_ffi.h): on CPU a reference loop, on CUDA a
tensor-core kernel that never builds the ``[L, heads, E]`` products (per block a tile of queries x a tile
of keys, float32 accumulation, relu and the weighted head sum in registers); :func:`indexer_scores_reference`
is its jnp twin.

Precision: q and the keys are bfloat16 operands (the model's path rounds its float32 queries and keys to
bfloat16 for it, as DeepSeek's own indexer runs in FP8); every product of two bfloat16 values is exact in
float32, and the CPU handler, the twin and the kernel all sum in float32 (in different orders). The CUDA
kernel takes dim 128 (V4's ``index_head_dim``) and heads a multiple of 16; other shapes run the twin on a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_oc128 import ops
from jax_oc128.checks import check_scale
from jax_oc128.ops import FULL

TARGET = "oc128_indexer_scores"
CUDA_DIM, CUDA_HEAD_MULTIPLE = 128, 16  # the shapes the CUDA kernel takes (elsewhere a GPU runs the twin)


def _check(q, keys, weights, limit, scale):
    """The shapes and dtypes of :func:`indexer_scores`'s operands, at trace time."""
    if q.ndim != 4:
        raise ValueError(f"q: expected rank 4 [batch, L, heads, dim], got shape {q.shape}")
    batch, tokens, heads, dim = q.shape
    for name, x in (("q", q), ("keys", keys)):
        if x.dtype != jnp.bfloat16:
            raise TypeError(f"{name}: dtype must be bfloat16, got {x.dtype}")
    if keys.ndim != 3 or keys.shape[0] != batch or keys.shape[2] != dim:
        raise ValueError(f"keys: expected shape [{batch}, E, {dim}], got {keys.shape}")
    if weights.shape != (batch, tokens, heads) or weights.dtype != jnp.float32:
        raise ValueError(
            f"weights: expected float32 [{batch}, {tokens}, {heads}], got {weights.dtype} {weights.shape}"
        )
    if limit.shape != (batch, tokens) or limit.dtype != jnp.int32:
        raise ValueError(f"limit: expected int32 [{batch}, {tokens}], got {limit.dtype} {limit.shape}")
    check_scale(scale)


def indexer_scores(q, keys, weights, limit, *, scale: float):
    """Each query's scores of the keys it sees (module docstring).

    Args:
      q: ``[batch, L, heads, dim]`` bfloat16: the queries' index heads.
      keys: ``[batch, E, dim]`` bfloat16.
      weights: ``[batch, L, heads]`` float32: each query's weight of each head.
      limit: ``[batch, L]`` int32: a query sees the keys below it (<= 0: none); the others may hold NaN.
      scale: a finite Python number.

    Returns:
      ``[batch, L, E]`` float32: ``scale * sum_h weights[.., h] * relu(q[.., h, :] . keys[b, e])`` where ``e <
      limit``, ``-inf`` elsewhere.
    """
    q, keys, weights, limit = (jnp.asarray(x) for x in (q, keys, weights, limit))
    _check(q, keys, weights, limit, scale)
    out = jax.ShapeDtypeStruct((*q.shape[:2], keys.shape[1]), jnp.float32)

    def native(*operands):
        return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(*operands, scale=np.float32(scale))

    def reference(*operands):
        return indexer_scores_reference(*operands, scale=scale)

    heads, dim = q.shape[2:]
    kernel_shape = dim == CUDA_DIM and heads % CUDA_HEAD_MULTIPLE == 0
    branches = {
        p: native for p in ("cpu", "cuda") if TARGET in ops.native_targets(p) and (p == "cpu" or kernel_shape)
    }
    return jax.lax.platform_dependent(q, keys, weights, limit, default=reference, **branches)


def indexer_scores_reference(q, keys, weights, limit, *, scale: float):
    """The jnp twin of :func:`indexer_scores`: the same math in float32 on the bfloat16 inputs (materializes
    ``[batch, L, heads, E]``)."""
    dots = jnp.einsum("blhd,bed->blhe", q.astype(jnp.float32), keys.astype(jnp.float32), precision=FULL)
    score = jnp.einsum("blh,blhe->ble", weights, jax.nn.relu(dots), precision=FULL) * np.float32(scale)
    return jnp.where(jnp.arange(keys.shape[1]) < limit[..., None], score, -jnp.inf)
