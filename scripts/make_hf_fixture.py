"""Write tests/fixtures/hf_deepseek_v4.npz: a tiny random transformers DeepSeek-V4's sliding and HCA attention
layers, their inputs, outputs and compressed entries, so that the tests check parity without torch.

Needs torch and transformers (5.24.0 is the reference):
    pip install torch==2.13.0 transformers==5.24.0 && python scripts/make_hf_fixture.py
Runs on CPU in float32 with eager attention, seeded.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import torch
import transformers
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.cache_utils import DynamicCache

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf_deepseek_v4.npz"
BATCH, PROMPT, CHUNKS, DECODE_FROM, DECODE_TO = 2, 300, (100, 60, 140), 250, 300


def tiny_config():
    return DeepseekV4Config(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "heavily_compressed_attention"],
        num_attention_heads=4,
        head_dim=64,
        partial_rotary_factor=0.25,  # 16 rope dims
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        sliding_window=16,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
        max_position_embeddings=1024,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        index_n_heads=16,
        index_head_dim=32,
        index_topk=4,
        hc_mult=2,
        num_nextn_predict_layers=0,
        initializer_range=0.1,
        attn_implementation="eager",
    )


def randomise(model, generator):
    """Re-draw the parameters HF initialises to constants, so the comparison exercises them."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("sinks", "position_bias")) or "norm" in name:
                param.copy_(
                    torch.randn(param.shape, generator=generator) * 0.5 + (1.0 if "norm" in name else 0.0)
                )


def rotary(model, x, positions):
    emb = model.model.rotary_emb
    return {kind: emb(x, positions, layer_type=kind) for kind in ("main", "compress")}


def sliding_mask(config, query_pos, key_pos):
    """Additive mask [B, 1, T, K]: key j visible to query t iff t - window < j <= t."""
    q, k = query_pos[:, None, :, None], key_pos[:, None, None, :]
    visible = (k <= q) & (k > q - config.sliding_window) & (k >= 0)
    return torch.where(visible, 0.0, float("-inf"))


def run(model, config, layer, x, chunks):
    """Feed x [B, T, hidden] to one attention layer in chunks through an HF cache; outputs [B, T, hidden]."""
    attn = model.model.layers[layer].self_attn
    cache = DynamicCache(config=config)
    outputs, start = [], 0
    for size in chunks:
        positions = torch.arange(start, start + size)[None].expand(BATCH, -1)
        cached = min(start, config.sliding_window - 1)
        key_pos = torch.arange(start - cached, start + size)[None].expand(BATCH, -1)
        y, _ = attn(
            x[:, start : start + size],
            rotary(model, x, positions),
            positions,
            sliding_mask(config, positions, key_pos),
            cache=cache,
        )
        outputs.append(y)
        start += size
    entries = None
    if attn.compressor is not None:
        entries = cache.layers[layer].compressed_kv["compressor"]
    return torch.cat(outputs, dim=1), entries


def main():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    config = tiny_config()
    model = DeepseekV4ForCausalLM(config).eval()
    randomise(model, generator)
    x = torch.randn(BATCH, PROMPT, config.hidden_size, generator=generator)
    arrays = {"x": x.numpy()}
    with torch.no_grad():
        for layer in range(2):
            prefix = f"model.layers.{layer}.self_attn."
            for name, value in model.state_dict().items():
                if name.startswith(prefix):
                    arrays[f"layer{layer}/{name[len(prefix) :]}"] = value.float().numpy()
            full, entries = run(model, config, layer, x, (PROMPT,))
            chunked, _ = run(model, config, layer, x, CHUNKS)
            decoded, decode_entries = run(
                model, config, layer, x, (DECODE_FROM,) + (1,) * (DECODE_TO - DECODE_FROM)
            )
            arrays[f"layer{layer}/full"] = full.numpy()
            arrays[f"layer{layer}/chunked"] = chunked.numpy()
            arrays[f"layer{layer}/decoded"] = decoded.numpy()
            if entries is not None:
                arrays[f"layer{layer}/entries"] = entries.numpy()
                arrays[f"layer{layer}/decode_entries"] = decode_entries.numpy()
    meta = {
        "config": config.to_dict(),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "chunks": CHUNKS,
        "decode_from": DECODE_FROM,
    }
    arrays["meta"] = np.frombuffer(json.dumps(meta, default=str).encode(), np.uint8)
    np.savez_compressed(OUT, **arrays)
    print(
        f"wrote {OUT} ({OUT.stat().st_size / 1024:.0f} KiB):",
        sorted(k for k in arrays if "/" not in k or "full" in k),
    )


if __name__ == "__main__":
    main()
