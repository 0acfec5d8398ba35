"""The indexer op (`jax_oc128.indexer_op.indexer_scores`) against the jnp path's scores in chunks of 1024 keys
(float32, precision FULL, as nn/csa.py) for L queries x E keys (env L, E; 64 index heads of 128): ms each and
their largest difference relative to the scores' largest magnitude."""

import os
import time

import jax
import jax.numpy as jnp

from jax_oc128.indexer_op import indexer_scores
from jax_oc128.nn.functional import FULL

L, E = int(os.environ.get("L", 8192)), int(os.environ.get("E", 32768))
B, H, D, C = 1, 64, 128, 1024
keys = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(keys[0], (B, L, H, D), jnp.bfloat16)
kv = jax.random.normal(keys[1], (B, E, D), jnp.bfloat16)
w = jax.random.normal(keys[2], (B, L, H))
limit = jnp.full((B, L), E, jnp.int32)
op = jax.jit(lambda q, kv, w, limit: indexer_scores(q, kv, w, limit, scale=D**-0.5))


def chunk(q, w, part):
    relu = jax.nn.relu(jnp.einsum("blhd,bed->blhe", q, part.astype(jnp.float32), precision=FULL))
    return jnp.einsum("blh,blhe->ble", w, relu * D**-0.5, precision=FULL)


@jax.jit
def reference(q, kv, w):
    parts = kv.reshape(B, E // C, C, D).swapaxes(0, 1)
    out = jax.lax.map(lambda part: chunk(q.astype(jnp.float32), w, part), parts)
    return out.transpose(1, 2, 0, 3).reshape(B, L, E)


def timed(fn, *args, reps=5):
    fn(*args).block_until_ready()
    start = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    out.block_until_ready()
    return (time.perf_counter() - start) / reps * 1e3


got, want = op(q, kv, w, limit), reference(q, kv, w)
error = float(jnp.abs(got - want).max() / jnp.abs(want).max())
print(
    f"{jax.devices()[0].device_kind} L {L} E {E}: op {timed(op, q, kv, w, limit):.1f} ms, jnp chunks of {C} "
    f"{timed(reference, q, kv, w):.1f} ms, max |op - jnp| / max |jnp| {error:.1e}"
)
