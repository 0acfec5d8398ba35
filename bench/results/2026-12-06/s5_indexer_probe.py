"""What the CSA indexer's jnp path costs per key chunk on the GPU (issue 40): for one query group of 512
queries and 64 index heads of 128, the float32 `relu(q . k)` over a chunk of 1024 keys (precision FULL, as
nn/csa.py), the weighted head sum, and the running top-512 merge (`lax.top_k` of 512 + 1024); the same at
bf16 inputs with float32 accumulation (precision DEFAULT); and one `lax.top_k` of 512 over 32768 scores."""

import time

import jax
import jax.numpy as jnp

L, H, D, CHUNK, K = 512, 64, 128, 1024, 512
key = jax.random.key(0)
q = jax.random.normal(key, (1, L, H, D), jnp.float32)
k = jax.random.normal(jax.random.key(1), (1, CHUNK, D), jnp.float32)
w = jax.random.normal(jax.random.key(2), (1, L, H), jnp.float32)
top = jnp.full((1, L, K), -jnp.inf)


def step(q, k, w, top, precision):
    relu = jax.nn.relu(jnp.einsum("bthi,bei->bthe", q, k, precision=precision))
    score = jnp.einsum("bth,bthe->bte", w, relu, precision=precision)
    return jax.lax.top_k(jnp.concatenate([top, score], axis=-1), K)[0]


def scores_only(q, k, w, precision):
    relu = jax.nn.relu(jnp.einsum("bthi,bei->bthe", q, k, precision=precision))
    return jnp.einsum("bth,bthe->bte", w, relu, precision=precision)


def timed(fn, *args, reps=20):
    fn = jax.jit(fn)
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps * 1e3


full, default = jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT
print(f"per key chunk of {CHUNK}, {L} queries x {H} heads x {D}:")
print(f"  scores, float32 FULL:   {timed(lambda *a: scores_only(*a, full), q, k, w):.3f} ms")
print(f"  scores, bf16 DEFAULT:   {timed(lambda *a: scores_only(*a, default), q, k, w):.3f} ms")


def merge(top, score):
    return jax.lax.top_k(jnp.concatenate([top, score], -1), K)[0]


print(f"  top_k merge 512 of 1536: {timed(merge, top, scores_only(q, k, w, full)):.3f} ms")
print(f"  the whole step (FULL):  {timed(lambda *a: step(*a, full), q, k, w, top):.3f} ms")
wide = jax.random.normal(key, (1, L, 32768), jnp.float32)
print(f"  top_k 512 of 32768:     {timed(lambda s: jax.lax.top_k(s, K)[0], wide):.3f} ms")
