"""Write tests/fixtures/v4_<name>.npz: tiny random transformers DeepSeek-V4 models (the whole
``DeepseekV4ForCausalLM``), their weights by transformers name, and their logits over a prompt and over 40
cached greedy decode steps, so that the tests check the JAX decoder's parity without torch.

Together the configs cover every layer type (sliding, CSA with an index top-k below the number of compressed
entries, HCA), both MLP types (hash-routed and top-k routed MoE), hc_mult 2 and 4, a sliding window below
and one above 128, default and YaRN compress RoPE. Needs torch and transformers (5.24.0 is the reference):
    pip install torch transformers==5.24.0 && python scripts/make_v4_fixture.py
Runs on CPU in float32 with eager attention, seeded. Every weight is rounded to a bfloat16 value (still
stored and used as float32) so that the archives compress to about half.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import torch
import transformers
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.cache_utils import DynamicCache

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures"
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
BATCH, PROMPT, DECODE_STEPS = 2, 220, 40  # decoding crosses the 256 boundary of the C128 blocks

COMMON = dict(
    vocab_size=64,
    num_attention_heads=4,
    partial_rotary_factor=0.25,
    o_groups=2,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    index_n_heads=16,  # >= 16: no exact-zero indexer scores whose ties topk would break by length
    num_nextn_predict_layers=0,
    initializer_range=0.1,
    max_position_embeddings=512,
    attn_implementation="eager",
)
CONFIGS = {
    # hc 2, window 16 < 128, YaRN compress RoPE, index top-k 4 of up to 65 entries
    "small_window": dict(
        hidden_size=32,
        head_dim=32,
        q_lora_rank=16,
        o_lora_rank=16,
        moe_intermediate_size=16,
        num_hidden_layers=4,
        layer_types=[SLIDING, CSA, HCA, CSA],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        sliding_window=16,
        hc_mult=2,
        hc_sinkhorn_iters=20,
        index_head_dim=16,
        index_topk=4,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    ),
    # hc 4, window 160 > 128, default RoPE, index top-k 16
    "large_window": dict(
        hidden_size=48,
        head_dim=64,
        q_lora_rank=32,
        o_lora_rank=16,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        layer_types=[HCA, CSA, SLIDING],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        sliding_window=160,
        hc_mult=4,
        hc_sinkhorn_iters=7,
        index_head_dim=32,
        index_topk=16,
        swiglu_limit=1.0,  # small enough that the clamps are active for these weights
    ),
}


def randomise(model, config, generator):
    """Re-draw what transformers initialises to constants (sinks, ape, norms, hc base and scale, the routers'
    correction bias and hash table), so the comparison exercises them; then round every weight to bf16."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("sinks", "position_bias", "base", "hc_base")):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
            elif name.endswith(("scale", "hc_scale")):
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
            elif "norm" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2 + 1.0)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.1)
            elif name.endswith("tid2eid"):
                picks = [
                    torch.randperm(config.n_routed_experts, generator=generator)[: config.num_experts_per_tok]
                    for _ in range(config.vocab_size)
                ]
                buffer.copy_(torch.stack(picks))
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).float())


def make(name, fields, seed):
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    config = DeepseekV4Config(**COMMON, **fields)
    model = DeepseekV4ForCausalLM(config).eval()
    randomise(model, config, generator)
    prompt = torch.randint(0, config.vocab_size, (BATCH, PROMPT), generator=generator)
    with torch.no_grad():
        full = model(input_ids=prompt).logits  # no cache
        cache = DynamicCache(config=config)
        step = model(input_ids=prompt, cache=cache, use_cache=True).logits[:, -1]
        tokens, logits = [], []
        for i in range(DECODE_STEPS):
            token = step.argmax(-1, keepdim=True)
            position = torch.full((BATCH, 1), PROMPT + i)
            step = model(input_ids=token, position_ids=position, cache=cache, use_cache=True).logits[:, -1]
            tokens.append(token)
            logits.append(step)
    arrays = {f"weights/{k}": v.numpy() for k, v in model.state_dict().items()}
    arrays |= {
        "prompt": prompt.numpy().astype(np.int32),
        "prefill_logits": full.numpy(),
        "decode_tokens": torch.cat(tokens, 1).numpy().astype(np.int32),
        "decode_logits": torch.stack(logits, 1).numpy(),
    }
    meta = {"config": config.to_dict(), "transformers": transformers.__version__, "torch": torch.__version__}
    arrays["meta"] = np.frombuffer(json.dumps(meta, default=str).encode(), np.uint8)
    path = OUT / f"v4_{name}.npz"
    np.savez_compressed(path, **arrays)
    print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")


def main():
    for seed, (name, fields) in enumerate(CONFIGS.items()):
        make(name, fields, seed)


if __name__ == "__main__":
    main()
