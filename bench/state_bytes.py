"""Compressed-state bytes per request, online vs offline, at DeepSeek-V4-Flash shapes (markdown table): by
default its C128 layers and head_dim (``ModelConfig.deepseek_v4_flash``: 20 and 512).

Usage: python bench/state_bytes.py [--layers 20] [--head-dim 512]
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp

from jax_oc128.nn import ModelConfig
from jax_oc128.state import CompressState, OfflineState, bytes_per_slot

V4FLASH = ModelConfig.deepseek_v4_flash()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=V4FLASH.compressed_layers)
    parser.add_argument("--head-dim", type=int, default=V4FLASH.head_dim)
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
