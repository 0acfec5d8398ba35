"""Run each op once at DeepSeek-V4-Flash shapes, for a kernel profiler (ncu) to time.

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
    for rows in args.batch:
        state, kv, seq, slots, ape, accept = make_inputs(rows, args.draft, jnp.dtype(args.dtype))
        state, _, _ = jax.jit(oc.verify, donate_argnums=0)(state, kv, seq, slots, ape)
        state = jax.jit(oc.commit, donate_argnums=0)(state, seq, accept, slots)
        jax.block_until_ready(state)


if __name__ == "__main__":
    main()
