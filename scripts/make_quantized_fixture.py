"""Write tests/fixtures/v4_quantized.npz: transformers' logits of the tiny checkpoint in DeepSeek's released
format that tests/test_quantized.py loads (``hf_fixtures.quantized_checkpoint``: the builder both share)
on its dequantized weights, so that the test checks the quantized model against transformers without torch.

The FP8 and FP4 weights are dequantized exactly (:func:`jax_oc128.nn.quant.dequantize`, float32) and written
with the rest, under DeepSeek's names, as a float checkpoint that transformers reads itself
(``DeepseekV4ForCausalLM.from_pretrained``: its own renaming of DeepSeek's names and of the released
config.json; the MTP layer it ignores). Then a prefill of 2 prompts of 64 tokens (the small-window fixture's
first 64) and 40 cached greedy decode steps, in float32 with eager attention on CPU. The meta holds the
checksum of the dequantized weights (``hf_fixtures.checksum``), which the test recomputes. Needs torch and
transformers (5.24.0 is the reference) besides jax_oc128's requirements:
    pip install torch transformers==5.24.0 && PYTHONPATH=. python scripts/make_quantized_fixture.py
"""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile

import jax
import numpy as np
import torch
import transformers
from transformers import DeepseekV4ForCausalLM
from transformers.cache_utils import DynamicCache

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import hf_fixtures


def main():
    config, tensors = hf_fixtures.quantized_checkpoint()
    floats = hf_fixtures.dequantized_tensors(tensors)
    with tempfile.TemporaryDirectory() as root:
        directory = hf_fixtures.write_dequantized(pathlib.Path(root) / "float", config, floats)
        model, info = DeepseekV4ForCausalLM.from_pretrained(
            directory, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
        )
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert all(name.startswith("mtp.") for name in info["unexpected_keys"]), info["unexpected_keys"]
    model.eval()
    _, _, small_window = hf_fixtures.fixture("small_window")
    prompt = torch.from_numpy(small_window["prompt"][:, : hf_fixtures.QUANTIZED_PROMPT]).long()
    batch, length = prompt.shape
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        prefill = model(input_ids=prompt, cache=cache, use_cache=True).logits
        step = prefill[:, -1]
        tokens, logits = [], []
        for i in range(hf_fixtures.QUANTIZED_STEPS):
            token = step.argmax(-1, keepdim=True)
            position = torch.full((batch, 1), length + i)
            step = model(input_ids=token, position_ids=position, cache=cache, use_cache=True).logits[:, -1]
            tokens.append(token)
            logits.append(step)
    meta = {
        "checksum": hf_fixtures.checksum(floats),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "jax": jax.__version__,
    }
    arrays = {
        "prompt": prompt.numpy().astype(np.int32),
        "prefill_logits": prefill.numpy(),
        "decode_tokens": torch.cat(tokens, 1).numpy().astype(np.int32),
        "decode_logits": torch.stack(logits, 1).numpy(),
        "meta": np.frombuffer(json.dumps(meta).encode(), np.uint8),
    }
    np.savez_compressed(hf_fixtures.QUANTIZED_FIXTURE, **arrays)
    size = hf_fixtures.QUANTIZED_FIXTURE.stat().st_size
    print(f"wrote {hf_fixtures.QUANTIZED_FIXTURE} ({size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
