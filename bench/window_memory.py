"""The window attention's prefill temporaries at DeepSeek-V4-Flash attention shapes (a sliding layer: 64 heads
x 512, window 128, bf16 weights, one row): the compiled program's temporary bytes
(``compiled.memory_analysis()``) of one prefill chunk, lowered and compiled from shapes only (nothing runs,
no weights made). Markdown table on stdout; run it on two commits for before / after.

Usage: python bench/window_memory.py [--chunks 2048 8192]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from flax import nnx

from jax_oc128.controller import ForwardMode
from jax_oc128.nn import SLIDING, DeepseekV4Attention, ForwardBatch, ModelConfig, RuntimeConfig
from jax_oc128.nn.attention import AttentionCache
from jax_oc128.nn.functional import build_abstract


def temp_bytes(chunk: int) -> int:
    """Temporary bytes of a V4-Flash sliding layer's forward of ``chunk`` tokens (one row)."""
    config = ModelConfig.deepseek_v4_flash(num_layers=1, dtype="bfloat16")
    runtime = RuntimeConfig(max_len=131072, max_draft=4)
    layer_config = config.attention(SLIDING, runtime)
    layer = build_abstract(lambda rngs: DeepseekV4Attention(layer_config, max_draft=4, rngs=rngs))
    graphdef, params = nnx.split(layer)
    cache = jax.eval_shape(lambda: AttentionCache.create(layer_config, 4, 1, runtime.max_len))

    def forward(params, cache, x, positions):
        fb = ForwardBatch.create(positions, mode=ForwardMode.EXTEND)
        y, cache, _ = nnx.merge(graphdef, params)(x, cache, None, fb)
        return y, cache

    x = jax.ShapeDtypeStruct((1, chunk, config.hidden_size), jnp.float32)
    positions = jax.ShapeDtypeStruct((1, chunk), jnp.int32)
    compiled = jax.jit(forward, donate_argnums=1).lower(params, cache, x, positions).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[2048, 8192])
    args = parser.parse_args(argv)
    print("| chunk | temp MiB |")
    print("|---|---|")
    for chunk in args.chunks:
        print(f"| {chunk} | {temp_bytes(chunk) / 2**20:.1f} |", flush=True)


if __name__ == "__main__":
    main()
