"""Probe (issue 40: the CSA indexer at a decode's shapes): ways to make the indexer's scores
``Σ_h w_h relu(q_h · k)`` of float32 queries over bfloat16-valued keys, timed on the device at V4-Flash's
shapes (64 heads x 128, one query per row, 64 rows, 9216 keys: a 32k context's bucket), each checked against
float64 (the largest error over the float32 accumulation bound, ``384 u Σ_h |w_h| Σ_i |q_hi k_i|``, must be
at most 1):

  concat  the model's (nn.csa.key_products): q's three bfloat16 parts against the keys repeated thrice along
          the channels, one bfloat16 contraction of 384
  rows    the three parts as rows of one contraction of 128 (``[.., 3 heads, E]`` float32), summed after
  three   three contractions of 128, one a part, added
  float32 the float32 product at full precision (the path before the parts)

``python bench/results/2026-12-08/indexer_products_probe.py [rows keys]`` (default 64 9216). Not the project's
code path."""

import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_oc128.nn import csa
from jax_oc128.ops import FULL

HEADS, DIM = 64, 128


def products(how, q, k):
    """``[b, t, h, E]`` float32 q.k of ``q`` ``[b, t, h, d]`` float32 and ``k`` ``[b, E, d]`` bfloat16."""
    if how == "concat":
        return csa.key_products(q, k)
    parts = csa.split_bf16(q).reshape(*q.shape[:-1], 3, q.shape[-1])
    if how == "rows":
        return jnp.einsum("bthpd,bed->bthpe", parts, k, preferred_element_type=jnp.float32).sum(axis=3)
    if how == "three":
        dot = functools.partial(jnp.einsum, "bthd,bed->bthe", preferred_element_type=jnp.float32)
        return dot(parts[..., 0, :], k) + dot(parts[..., 1, :], k) + dot(parts[..., 2, :], k)
    return jnp.einsum("bthd,bed->bthe", q, k.astype(jnp.float32), precision=FULL)


def main(rows=64, keys=9216):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((rows, 1, HEADS, DIM)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((rows, keys, DIM)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((rows, 1, HEADS)), jnp.float32)
    q64, k64, w64 = (np.asarray(x, np.float64) for x in (q, k, w))
    want = np.einsum("bth,bthe->bte", w64, np.maximum(np.einsum("bthd,bed->bthe", q64, k64), 0))
    size = np.einsum("bth,bthe->bte", np.abs(w64), np.einsum("bthd,bed->bthe", np.abs(q64), np.abs(k64)))
    bound = 3 * DIM * 2.0**-24 * size
    print(f"{jax.devices()[0].device_kind}: {rows} rows x {keys} keys, {HEADS} heads x {DIM}", flush=True)
    for how in ("concat", "rows", "three", "float32"):
        fn = jax.jit(lambda q, k, w, how=how: jnp.sum(w[..., None] * jax.nn.relu(products(how, q, k)), 2))
        got = np.asarray(fn(q, k, w), np.float64)
        times = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(10):
                out = fn(q, k, w)
            out.block_until_ready()
            times.append((time.perf_counter() - start) / 10)
        error = float(np.max(np.abs(got - want) / bound))
        print(f"{how:8s} {1e6 * np.median(times):9.1f} us   error / bound {error:.3f}", flush=True)


if __name__ == "__main__":
    main(*[int(a) for a in sys.argv[1:]])
