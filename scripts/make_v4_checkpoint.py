"""Write tests/fixtures/v4_small_window_hf/: the small-window parity fixture's model as transformers itself
saves it (``save_pretrained``: config.json and model.safetensors, tensors under the names transformers
writes, a mixture of DeepSeek's and its own, one tensor per expert), so that the tests check
``jax_oc128.load_pretrained`` on transformers' own output.

The weights come from tests/fixtures/v4_small_window.npz (scripts/make_v4_fixture.py): they are loaded into
a ``DeepseekV4ForCausalLM`` of the fixture's config, whose prompt logits are checked against the fixture's,
and saved in bfloat16, but for the tensors whose values are not bfloat16 values (the routers' correction
biases), kept in float32: nothing is rounded. Needs torch and
transformers (5.24.0 is the reference):
    pip install torch transformers==5.24.0 && python scripts/make_v4_checkpoint.py
"""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures"
NAME = "small_window"


def main():
    data = dict(np.load(FIXTURES / f"v4_{NAME}.npz"))
    config = json.loads(bytes(data["meta"]).decode())["config"]
    weights = {k.removeprefix("weights/"): torch.from_numpy(v) for k, v in data.items() if "weights/" in k}
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**config)).eval()
    model.load_state_dict(weights, strict=True)
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(data["prompt"]).long()).logits.numpy()
    error = np.abs(logits - data["prefill_logits"]).max() / np.abs(data["prefill_logits"]).max()
    assert error < 1e-5, f"the fixture's weights do not give its logits ({error})"
    out = FIXTURES / f"v4_{NAME}_hf"
    shutil.rmtree(out, ignore_errors=True)
    exact = {name: t.clone() for name, t in model.state_dict().items() if t.is_floating_point()}
    model.to(torch.bfloat16)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name in exact and not torch.equal(tensor.float(), exact[name]):  # not a bfloat16 value: float32
            tensor.data = exact[name]
    model.save_pretrained(out)
    (out / "generation_config.json").unlink(missing_ok=True)
    print(f"wrote {out}: {sorted(p.name for p in out.iterdir())}")


if __name__ == "__main__":
    main()
