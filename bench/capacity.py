"""Cache capacity from the cache shapes: bytes per request and per token of context by cache kind, and the
tokens of context that fit in an HBM budget, for float32 / bfloat16 / FP8 caches (FP8 or FP4 indexer keys)
and the online vs offline C128 state.

Computed on the host, nothing allocated: the caches are ``jax.eval_shape`` of ``ModelCache.create`` (every
layer's caches and the C128 state) and of the draft head's window (``AttentionCache.create`` of a sliding
layer) at each ``max_len``; the per-slot vectors of the engine's decode state
(:func:`jax_oc128.engine.state.init_state`) and the weights from ``nnx.eval_shape`` of the model, once per
preset.

* ``v4-flash``, ``v4-pro``: the full models (``ModelConfig.deepseek_v4_flash()`` / ``deepseek_v4_pro()``,
  their MTP layer as the draft head) on 8 x H200, less their weights at the released precision
  (:func:`weight_bytes`).
* ``v4-flash-slice``: the V4-Flash slice that ``bench/bench_decode.py`` runs on one H200 (its first 6 layers,
  16 routed experts, bfloat16), less its weights as this library stores them.
* ``tiny``: ``ModelConfig.tiny`` with a CSA layer, on 1 GB (the test's).

In the dense layout every slot holds ``max_len`` tokens' worth of entries, so a slot's bytes are its request's
whatever its length, and the budget holds ``budget // per_slot`` requests of up to ``max_len`` tokens. "Per
token of context" is a full request's bytes over ``max_len``; "growth" is what one more token of ``max_len``
adds (the entries and indexer keys). The paged layout (``Engine(pages=...)``: the entries in pages of
:data:`PAGE_SIZE` tokens from a pool the slots share) is compared at a mix of request lengths
(:data:`LENGTH_MIX`): a request holds its slot's fixed part and the pages of its length.

Usage: python bench/capacity.py [--presets v4-flash v4-pro v4-flash-slice] [--max-lens 4096 32768 131072]
[--max-draft 4] [--out capacity.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jax_oc128.controller import OFFLINE, ONLINE
from jax_oc128.engine.state import init_state
from jax_oc128.nn import (
    CSA,
    HCA,
    SLIDING,
    AttentionCache,
    ModelCache,
    ModelConfig,
    RuntimeConfig,
    SpeculativeModel,
)
from jax_oc128.nn.sharding import path_names
from jax_oc128.state import nbytes

#: one H200's memory (NVIDIA's 141 GB)
H200_BYTES = 141e9
#: the cache formats compared, by the config fields that select them: float32, bfloat16, and DeepSeek's FP8
#: entries with FP8 or FP4 indexer keys beside a bfloat16 window and raw rows (the weights are counted as the
#: preset says)
FORMATS = {
    "float32": ("float32", {}),
    "bfloat16": ("bfloat16", {}),
    "fp8": ("fp8", dict(dtype="bfloat16")),
    "fp8_fp4": ("fp8_fp4", dict(dtype="bfloat16")),
}
#: the engine's default page size (``Engine(pages=..., page_size=256)``), in tokens
PAGE_SIZE = 256
#: the mix of request lengths, as fractions of ``max_len``: log-uniform over 1/16 .. 1 (serving traffic is
#: skewed short); a dense slot holds ``max_len`` whatever its request's length, a paged request its pages
LENGTH_MIX = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 1)
#: the cache kinds reported, in order
KINDS = ("window", "CSA entries", "indexer keys", "HCA entries", "CSA raw rows", "C128 state", "per slot")
#: the attention projections, the indexer's query projection, the shared experts and the MTP layer's
#: projections (by the last name of the parameter path): FP8 e4m3 with one e8m0 scale per 128 x 128 block in
#: DeepSeek's release
FP8_WEIGHTS = (
    "q_a_proj",
    "q_b_proj",
    "kv_proj",
    "o_a_proj",
    "o_b_proj",
    "indexer_q_b_proj",
    "shared_gate",
    "shared_up",
    "shared_down",
    "embed_proj",
    "hidden_proj",
)
#: the routed experts: FP4 e2m1, two per byte, with one e8m0 scale per 32 along the input
FP4_WEIGHTS = ("experts_gate_up", "experts_down")


def presets() -> dict[str, tuple[ModelConfig, float, bool]]:
    """name -> (config, HBM budget in bytes, whether its weights count at the released precision)."""
    return {
        "v4-flash": (ModelConfig.deepseek_v4_flash(), 8 * H200_BYTES, True),
        "v4-pro": (ModelConfig.deepseek_v4_pro(), 8 * H200_BYTES, True),
        "v4-flash-slice": (
            ModelConfig.deepseek_v4_flash(num_layers=6, num_experts=16, dtype="bfloat16"),
            H200_BYTES,
            False,
        ),
        "tiny": (ModelConfig.tiny(layer_types=(SLIDING, HCA, CSA)), 1e9, True),
    }


def abstract_model(config: ModelConfig, runtime: RuntimeConfig, backend=ONLINE) -> SpeculativeModel:
    return nnx.eval_shape(lambda: SpeculativeModel(config, runtime, backend=backend, rngs=nnx.Rngs(0)))


def weight_bytes(model: SpeculativeModel, released: bool) -> int:
    """The model's parameter bytes: as stored (``released`` False), or at DeepSeek's released precision:
    :data:`FP8_WEIGHTS` 1 byte per weight plus a byte per 128 x 128 block, :data:`FP4_WEIGHTS` half a byte
    plus a byte per 32 along the input, the other matrices bfloat16, every other parameter as stored
    (float32 norms, hyper-connections, sinks, biases; int32 hash tables)."""
    total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
        name, count = path_names(path)[-1], math.prod(leaf.shape)
        if not released:
            total += count * jnp.dtype(leaf.dtype).itemsize
        elif name in FP8_WEIGHTS:
            *lead, out, inp = leaf.shape
            total += count + math.prod(lead) * math.ceil(out / 128) * math.ceil(inp / 128)
        elif name in FP4_WEIGHTS:
            total += count // 2 + count // 32
        elif jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.ndim >= 2:
            total += count * 2
        else:
            total += count * jnp.dtype(leaf.dtype).itemsize
    return total


def per_slot_bytes(model: SpeculativeModel) -> int:
    """Bytes of one slot's vectors of the engine's decode state besides the caches (token, position, the
    draft head's hidden input, flags, budget, sampling parameters)."""
    state = jax.eval_shape(lambda: init_state(model, 1, 0, 0))
    vectors = (state.token, state.position, state.hidden, state.active, state.remaining, state.sampling)
    return nbytes(vectors)


def slot_bytes(config: ModelConfig, runtime: RuntimeConfig, backend, per_slot: int) -> dict[str, int]:
    """Bytes of one slot of the engine's decode state by kind (:data:`KINDS`) of a model of ``config``
    running as ``runtime`` says."""
    cache = jax.eval_shape(lambda: ModelCache.create(config, runtime, backend, 1))
    layers, types = list(cache.layers), list(config.layer_types)
    if config.mtp:  # the draft head's one sliding layer
        sliding = config.attention(SLIDING, runtime)
        layers.append(
            jax.eval_shape(lambda: AttentionCache.create(sliding, runtime.max_draft, 1, runtime.max_len))
        )
        types.append(SLIDING)
    kinds = dict.fromkeys(KINDS, 0)
    for layer, layer_type in zip(layers, types, strict=True):
        kinds["window"] += nbytes((layer.window, layer.window_positions))
        if layer_type in (CSA, HCA):
            kinds[f"{'CSA' if layer_type == CSA else 'HCA'} entries"] += nbytes(
                (layer.entries, layer.tree_entries)
            )
        kinds["indexer keys"] += nbytes((layer.index_keys, layer.tree_index_keys))
        kinds["CSA raw rows"] += nbytes(layer.rows)
    kinds["C128 state"] = nbytes(cache.compressed)
    kinds["per slot"] = per_slot
    return kinds


def rows(names, max_lens, max_draft):
    """Every (preset, format, max_len) row: bytes by kind and in total, online and offline, and the capacity
    in the preset's budget."""
    table = presets()
    out = []
    for name in names:
        base, budget, released = table[name]
        model = abstract_model(base, RuntimeConfig(max_draft=max_draft))
        weights, per_slot = weight_bytes(model, released), per_slot_bytes(model)
        for fmt, (kv_cache_dtype, fields) in FORMATS.items():
            growth = None
            config = dataclasses.replace(base, **fields)
            for max_len in max_lens:
                runtime = RuntimeConfig(max_len, max_draft, kv_cache_dtype)
                online, offline = (slot_bytes(config, runtime, b, per_slot) for b in (ONLINE, OFFLINE))
                row = dict(preset=name, format=fmt, max_len=max_len, kinds=online)
                row |= dict(c128_offline=offline["C128 state"], weights=weights, budget=budget)
                for backend, kinds in (("online", online), ("offline", offline)):
                    total = sum(kinds.values())
                    slots = max(int((budget - weights) // total), 0)
                    row |= {f"{backend}_bytes": total, f"{backend}_slots": slots}
                    row |= {f"{backend}_tokens": slots * max_len}
                if growth is None:
                    longer = dataclasses.replace(runtime, max_len=2 * max_len)
                    growth = (
                        sum(slot_bytes(config, longer, ONLINE, per_slot).values()) - row["online_bytes"]
                    ) / max_len
                row["growth_per_token"] = growth
                row |= mix_capacity(row, max_len)
                out.append(row)
    return out


def mix_capacity(row: dict, max_len: int) -> dict:
    """Concurrent requests of :data:`LENGTH_MIX` that fit the budget, dense and paged, online and offline
    C128 state: a dense slot costs its ``max_len`` request's bytes; a paged request its slot's fixed part
    (window, raw rows, C128 state, per-slot vectors: the request's bytes less ``growth * max_len``) and its
    length rounded up to whole pages of entries."""
    free = row["budget"] - row["weights"]
    lengths = [fraction * max_len for fraction in LENGTH_MIX]
    pages = sum(math.ceil(n / PAGE_SIZE) * PAGE_SIZE * row["growth_per_token"] for n in lengths) / len(
        lengths
    )
    out = {}
    for backend in ("online", "offline"):
        fixed = row[f"{backend}_bytes"] - row["growth_per_token"] * max_len
        out[f"mix_dense_{backend}"] = max(int(free // row[f"{backend}_bytes"]), 0)
        out[f"mix_paged_{backend}"] = max(int(free // (fixed + pages)), 0)
    out["mix_mean_length"] = sum(lengths) / len(lengths)
    return out


def mib(n):
    return f"{n / 2**20:.1f}"


def print_tables(out):
    print("## Bytes per request (MiB) and per token of context (KB = 1000 bytes), dense caches\n")
    print(
        "| preset | caches | max_len | " + " | ".join(KINDS[:-2]) + " | C128 online / offline | per slot | "
        "request online / offline | per token online / offline | growth per token |"
    )
    print("|---" * 12 + "|")
    for r in out:
        k = r["kinds"]
        print(
            f"| {r['preset']} | {r['format']} | {r['max_len']} | "
            + " | ".join(mib(k[name]) for name in KINDS[:-2])
            + f" | {mib(k['C128 state'])} / {mib(r['c128_offline'])} | {mib(k['per slot'])}"
            f" | {mib(r['online_bytes'])} / {mib(r['offline_bytes'])}"
            f" | {r['online_bytes'] / r['max_len'] / 1e3:.2f} / {r['offline_bytes'] / r['max_len'] / 1e3:.2f}"
            f" | {r['growth_per_token'] / 1e3:.2f} |"
        )
    print("\n## Tokens of context that fit (requests of max_len each, dense caches)\n")
    print(
        "| preset | budget GB | weights GB | caches | max_len | requests online / offline | "
        "tokens online / offline | online / offline |"
    )
    print("|---" * 8 + "|")
    for r in out:
        ratio = r["online_tokens"] / r["offline_tokens"] if r["offline_tokens"] else math.inf
        print(
            f"| {r['preset']} | {r['budget'] / 1e9:.0f} | {r['weights'] / 1e9:.1f} | {r['format']} | "
            f"{r['max_len']} | {r['online_slots']} / {r['offline_slots']} | "
            f"{r['online_tokens']:,} / {r['offline_tokens']:,} | {ratio:.3f} |"
        )


def print_mix(out):
    mix = ", ".join(f"{f:g}" for f in LENGTH_MIX)
    print(f"\n## Concurrent requests at a mix of lengths (max_len x {mix}); pages of {PAGE_SIZE} tokens\n")
    print(
        "| preset | caches | max_len | dense online / offline | paged online / offline | "
        "paged / dense (online) | paged online / dense offline |"
    )
    print("|---" * 7 + "|")
    for r in out:
        dense, paged = (
            (r["mix_dense_online"], r["mix_dense_offline"]),
            (r["mix_paged_online"], r["mix_paged_offline"]),
        )
        print(
            f"| {r['preset']} | {r['format']} | {r['max_len']} | {dense[0]} / {dense[1]} | "
            f"{paged[0]} / {paged[1]} | "
            f"{paged[0] / max(dense[0], 1):.2f} | {paged[0] / max(dense[1], 1):.2f} |"
        )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--presets", nargs="+", choices=sorted(presets()), default=["v4-flash", "v4-pro", "v4-flash-slice"]
    )
    parser.add_argument("--max-lens", nargs="+", type=int, default=[4096, 32768, 131072])
    parser.add_argument("--max-draft", type=int, default=4)
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    out = rows(args.presets, args.max_lens, args.max_draft)
    print_tables(out)
    print_mix(out)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(rows=out), f, indent=1)
    return out


if __name__ == "__main__":
    main()
