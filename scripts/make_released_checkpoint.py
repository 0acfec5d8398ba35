"""Write a tiny DeepSeek-V4 checkpoint in DeepSeek's released format (FP8 linears with 128 x 128 ue8m0 block
scales, FP4 routed experts, DeepSeek's names and config.json with its quantization_config, shards with an
index) from a random float model of the small-window parity fixture's config, through
:mod:`jax_oc128.released` (which the tests call directly):

    PYTHONPATH=. python scripts/make_released_checkpoint.py OUT [--shards 3] [--expert-dtype fp8] [--seed 0]

``jax_oc128.load_pretrained(OUT)`` loads it with its weights kept quantized.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np
from flax import nnx

from jax_oc128 import released
from jax_oc128.nn import ModelConfig, SpeculativeModel

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "v4_small_window.npz"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path, help="the checkpoint directory (must not exist)")
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--expert-dtype", choices=sorted(released.pretrained.EXPERT_DTYPES), default="fp4")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = json.loads(bytes(np.load(FIXTURE)["meta"]).decode())["config"]
    # 32-wide experts (FP4 groups of 32), a q_lora_rank past one 128 block, one MTP layer
    config |= {"moe_intermediate_size": 32, "q_lora_rank": 136, "num_nextn_predict_layers": 1}
    model = SpeculativeModel(ModelConfig.from_hf(config), rngs=nnx.Rngs(args.seed))
    tensors = released.released_tensors(model, args.expert_dtype)
    released.write_released(
        args.out, released.released_config(config, args.expert_dtype), tensors, args.shards
    )
    print(f"wrote {args.out}: {len(tensors)} tensors in {args.shards} shards")


if __name__ == "__main__":
    main()
