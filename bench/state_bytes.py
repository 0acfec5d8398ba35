"""Compressed-state bytes per request, online vs offline, at DeepSeek-V4-Flash shapes (markdown table).

Usage: python bench/state_bytes.py [--layers 20] [--head-dim 512]
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp

from jax_oc128.state import CompressState, OfflineState, bytes_per_slot


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--head-dim", type=int, default=512)
    args = parser.parse_args()
    print(
        "| draft tokens (banks) | online fp32 | offline fp32 | ratio | online bf16 | offline bf16 | ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for draft in range(1, 9):
        cells = []
        for dtype in (jnp.float32, jnp.bfloat16):
            online = bytes_per_slot(CompressState, args.layers, args.head_dim, draft, dtype)
            offline = bytes_per_slot(OfflineState, args.layers, args.head_dim, draft, dtype)
            cells += [f"{online / 1024:.1f} KiB", f"{offline / 1024:.0f} KiB", f"{offline / online:.1f}x"]
        print(f"| {draft} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
