"""Run each op once at DeepSeek-V4-Flash shapes, for a kernel profiler (ncu) to time.

Per batch, in this order: the batched verify and commit of all 20 layers; then the two calls that the
patterns of ``bench_ops.py`` repeat per layer: one layer's verify with the previous step's commit fused
(``model``), and the verify of one padding row (``launch``, the do-nothing floor).

Usage: ncu --clock-control none -k regex:oc128 python bench/profile_kernels.py --batch 256
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from bench_ops import make_inputs

import jax_oc128 as oc


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 256])
    parser.add_argument("--draft", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    verify = jax.jit(oc.verify, donate_argnums=0, static_argnames="layer")
    for rows in args.batch:
        state, kv, seq, slots, ape, accept = make_inputs(rows, args.draft, jnp.dtype(args.dtype))
        state, _, _ = verify(state, kv, seq, slots, ape)
        state = jax.jit(oc.commit, donate_argnums=0)(state, seq, accept, slots)
        pending = seq - accept  # the previous step's seq_lens: this step's verify commits its accept
        state, _, _ = verify(state, kv[:1], seq, slots, ape[:1], layer=0, pending=pending)
        padding = jnp.full((1,), -1, jnp.int32)
        state, _, _ = verify(state, kv[:1, :1], jnp.zeros((1,), jnp.int32), padding, ape[:1], layer=0)
        jax.block_until_ready(state)


if __name__ == "__main__":
    main()
