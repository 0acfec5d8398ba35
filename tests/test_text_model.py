"""The shipped text model (``jax_oc128/assets/text_model``, written by ``scripts/train_text_model.py``): its
files as recorded, every part of DeepSeek-V4 in DeepSeek's released layout with a BPE tokenizer and a chat
template, and ``jax-oc128 generate`` with no path printing the text of the tokens it generated."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json

from jax_oc128 import __main__ as cli
from jax_oc128.engine import Engine, arguments
from jax_oc128.engine.scheduler import on_gpu
from jax_oc128.loading.hf_config import read_config
from jax_oc128.nn import CSA, HCA, SLIDING
from jax_oc128.nn.moe import HASH_MOE, MOE
from jax_oc128.nn.quant import FP4
from jax_oc128.pretrained import CONFIG, INDEX
from jax_oc128.text import SHIPPED_MODEL, load_tokenizer

#: sha256 of each shipped file (scripts/train_text_model.py at its defaults writes them)
SHIPPED_SHA256 = {
    "config.json": "442c0bfce630b98886aee1642b0e934bc0a630bd0bf0b118bb1862d9c11b0b5b",
    "model-00001-of-00002.safetensors": "f9d4458d6046a0ff8a1817f26c799c5edfbeba8055315b03dee2617a750bef3a",
    "model-00002-of-00002.safetensors": "44962d72f878dfcea6afe035ccc7506d67aa4c05d1be13279dcfc1d26ca925fc",
    "model.safetensors.index.json": "906dca96c1ca72bc43103e4ef99451879288168afe28ae7f3495082e1b4701f1",
    "tokenizer.json": "90c97615b5d0dd6eae4eceb5803a150070770475f85d79c6874573fc7e4c34ad",
    "tokenizer_config.json": "3fd5062beaf04c54025d4efbdfe1c84c38aac1315570cf11e934cbd756bd5d02",
}


def test_shipped_files_are_as_recorded():
    """The files are those the script wrote (a retrained or edited model changes this record)."""
    digests = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in SHIPPED_MODEL.iterdir()}
    assert digests == SHIPPED_SHA256


def test_shipped_model_is_a_released_deepseek_v4():
    """Sliding, CSA and HCA layers, hash-routed then learned-routed MoE, hyper-connections, an MTP layer, FP8
    linears and FP4 experts under DeepSeek's names; a BPE tokenizer of the model's vocabulary whose BOS,
    EOS and chat template are the checkpoint's."""
    hf = read_config(SHIPPED_MODEL / CONFIG)
    config, mtp_layers, quantization = hf.config, hf.mtp_layers, hf.quantization
    assert set(config.layer_types) == {SLIDING, CSA, HCA} and config.mlp_layer_types[0] == HASH_MOE
    assert set(config.mlp_layer_types) == {HASH_MOE, MOE} and config.hc_mult > 1 and mtp_layers == 1
    assert quantization == FP4
    names = json.loads((SHIPPED_MODEL / INDEX).read_text())["weight_map"]
    assert "layers.0.ffn.gate.tid2eid" in names and "mtp.0.e_proj.weight" in names
    assert "layers.2.ffn.experts.3.w2.scale" in names
    tokenizer = load_tokenizer(SHIPPED_MODEL)
    raw = json.loads((SHIPPED_MODEL / CONFIG).read_text())
    assert tokenizer.vocab_size == config.vocab_size
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids) == (raw["bos_token_id"], (raw["eos_token_id"],))
    assert tokenizer.tokenizer.get_vocab()["Ġthe"] > 255  # merges learned: " the" is one token
    ids = tokenizer.encode("Return the file", chat=True)
    assert ids[0] == tokenizer.bos_token_id and tokenizer.decode(ids).endswith("Answer: ")


def test_generate_with_no_path_prints_the_text_of_its_tokens(monkeypatch):
    """``jax-oc128 generate --prompt TEXT``: the shipped model greedily continues the prompt, and stdout is
    the decode of the tokens the engine generated (words, not noise)."""
    generated = []
    original = Engine.generate

    def recording(engine, prompts, *args, **kwargs):
        result = original(engine, prompts, *args, **kwargs)
        generated.append((prompts, result.tokens[0], engine.model.config))
        # --prefill-chunk's default: the engine's own choice
        assert engine.prefill_chunk == arguments.check_prefill_chunk("auto", on_gpu(None), engine.slots)
        return result

    monkeypatch.setattr(Engine, "generate", recording)
    out, err = io.StringIO(), io.StringIO()
    argv = ["generate", "--prompt", "Return the", "--max-new-tokens", "6", "--steps-per-dispatch", "6"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert cli.main(argv) == 0
    [(prompts, tokens, config)] = generated
    tokenizer = load_tokenizer(SHIPPED_MODEL)
    assert prompts == [tokenizer.encode("Return the")] and config.vocab_size == tokenizer.vocab_size
    assert 1 <= len(tokens) <= 6 and out.getvalue() == tokenizer.decode(tokens) + "\n"
    assert any(c.isalpha() for c in out.getvalue()), out.getvalue()
    assert f"{len(tokens)} tokens in " in err.getvalue()
