"""The attention layers' prefill temporaries at DeepSeek-V4-Flash attention shapes (64 heads x 512, window
128, bf16 weights, ``max_len`` 131072, one row; a CSA layer's indexer: 64 heads x 128, top 512 of its 32768
entries): the compiled program's temporary bytes (``compiled.memory_analysis()``) of one prefill chunk,
lowered and compiled from shapes only (nothing runs, no weights made). Markdown table on stdout, a column per
layer type; run it on two commits for before / after.

Usage: python bench/window_memory.py [--chunks 2048 8192] [--layers sliding csa hca]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from flax import nnx

from jax_oc128.controller import ForwardMode
from jax_oc128.nn import (
    CSA,
    HCA,
    SLIDING,
    DeepseekV4Attention,
    ForwardBatch,
    ModelConfig,
    RuntimeConfig,
    prepare_forward,
)
from jax_oc128.nn.attention import AttentionCache
from jax_oc128.nn.functional import build_abstract

LAYERS = {"sliding": SLIDING, "csa": CSA, "hca": HCA}
MAX_LEN = 131072


def temp_bytes(chunk: int, layer: str = "sliding") -> int:
    """Temporary bytes of a V4-Flash ``layer`` (a key of :data:`LAYERS`) forward of ``chunk`` tokens (one row)
    with a cache of :data:`MAX_LEN` positions."""
    config = ModelConfig.deepseek_v4_flash(num_layers=1, dtype="bfloat16")
    runtime = RuntimeConfig(max_len=MAX_LEN, max_draft=4)
    layer_config = config.attention(LAYERS[layer], runtime)
    module = build_abstract(lambda rngs: DeepseekV4Attention(layer_config, max_draft=4, rngs=rngs))
    graphdef, params = nnx.split(module)
    cache = jax.eval_shape(lambda: AttentionCache.create(layer_config, 4, 1, runtime.max_len))
    compressed = jax.eval_shape(lambda: module.init_compressed(1))

    def forward(params, cache, compressed, x, positions):
        fb = ForwardBatch.create(positions, mode=ForwardMode.EXTEND)
        if compressed is not None:
            compressed = prepare_forward(compressed, fb)
        return nnx.merge(graphdef, params)(x, cache, compressed, fb)

    x = jax.ShapeDtypeStruct((1, chunk, config.hidden_size), jnp.float32)
    positions = jax.ShapeDtypeStruct((1, chunk), jnp.int32)
    lowered = jax.jit(forward, donate_argnums=(1, 2)).lower(params, cache, compressed, x, positions)
    return lowered.compile().memory_analysis().temp_size_in_bytes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--layers", nargs="+", choices=list(LAYERS), default=["sliding"])
    args = parser.parse_args(argv)
    print("| chunk | " + " | ".join(f"{layer} temp MiB" for layer in args.layers) + " |")
    print("|---|" + "---|" * len(args.layers))
    for chunk in args.chunks:
        mib = (f"{temp_bytes(chunk, layer) / 2**20:.1f}" for layer in args.layers)
        print(f"| {chunk} | " + " | ".join(mib) + " |", flush=True)


if __name__ == "__main__":
    main()
