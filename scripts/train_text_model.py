"""Train the shipped text model, jax_oc128/assets/text_model/: a tiny DeepSeek-V4 (sliding, CSA and HCA
layers, hash-routed and learned-routed MoE, hyper-connections, an MTP layer) and its byte-level BPE tokenizer,
both trained on the docstrings of Python's standard library (:func:`train_default_model.docstrings`), written
in DeepSeek's released layout (:mod:`jax_oc128.released`: FP8 linears, FP4 routed experts, DeepSeek's names,
shards and index) with ``tokenizer.json`` and ``tokenizer_config.json`` (BOS, EOS, a chat template) beside it:

    PYTHONPATH=. python scripts/train_text_model.py [--steps 500] [--out jax_oc128/assets/text_model]

Reproducible (fixed seeds, the corpus in sorted file order) and CPU-trainable (a few minutes of 2 free cores).
Each docstring is one document, ``BOS text EOS``, so the model ends its text with EOS.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tokenizers
from flax import nnx
from train_default_model import docstrings, loss_fn, optimizer

from jax_oc128 import released
from jax_oc128.controller import OFFLINE
from jax_oc128.nn import CSA, HCA, SLIDING, ModelConfig, RuntimeConfig, SpeculativeModel
from jax_oc128.nn.moe import HASH_MOE, MOE
from jax_oc128.text import TOKENIZER, TOKENIZER_CONFIG

OUT = pathlib.Path(__file__).resolve().parents[1] / "jax_oc128" / "assets" / "text_model"
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
#: one user turn and the opened assistant turn, as plain text the model has seen (docstring-like prose)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}Question: "
    "{{ message['content'] }}\n\n{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Answer: {% endif %}"
)

#: the model: transformers' DeepseekV4Config fields (released.released_config turns them into DeepSeek's)
CONFIG = {
    "model_type": "deepseek_v4",
    "architectures": ["DeepseekV4ForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "layer_types": [SLIDING.value, CSA.value, HCA.value, CSA.value],
    "mlp_layer_types": [HASH_MOE, HASH_MOE, MOE, MOE],
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 32,
    "sliding_window": 32,
    "moe_intermediate_size": 64,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "swiglu_limit": 10.0,
    "hc_mult": 2,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "index_n_heads": 2,
    "index_head_dim": 32,
    "index_topk": 8,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_parameters": {
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "compress": {"rope_type": "default", "rope_theta": 160000.0, "partial_rotary_factor": 0.25},
    },
    "max_position_embeddings": 4096,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def train_tokenizer(texts: list[str], vocab_size: int) -> tokenizers.Tokenizer:
    """A byte-level BPE (GPT-2's pre-tokenizer and decoder) of ``vocab_size`` tokens over ``texts``, BOS and
    EOS its first two."""
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def documents(tokenizer: tokenizers.Tokenizer, texts: list[str]) -> np.ndarray:
    """The texts' ids as one stream, each ``BOS ids EOS`` (int32)."""
    bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    ids = [[bos, *encoding.ids, eos] for encoding in tokenizer.encode_batch(texts)]
    return np.concatenate(ids).astype(np.int32)


def _floating(path, value) -> bool:
    """The trained parameters: the float ones (not the hash layers' token -> expert tables)."""
    return jnp.issubdtype(value.get_value().dtype, jnp.floating)


def train(config: ModelConfig, stream: np.ndarray, args) -> SpeculativeModel:
    """The model of ``config`` trained on windows of ``stream`` (the target's next token and the MTP head's
    token after it), AdamW with warm-up and cosine decay."""
    # the dense dispatch: the grouped one has no gradient
    runtime = RuntimeConfig(max_draft=4, moe_dispatch="dense")
    model = SpeculativeModel(config, runtime, backend=OFFLINE, rngs=nnx.Rngs(0))
    graphdef, params, fixed = nnx.split(model, _floating, ...)
    tx = optimizer(args.steps, args.lr, final=0.1)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, tokens):
        def loss(p):
            return loss_fn(nnx.merge(graphdef, p, fixed), tokens, 0.5)

        (_, parts), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, parts

    rng = np.random.default_rng(0)
    start = time.time()
    for i in range(args.steps):
        offsets = rng.integers(0, len(stream) - args.length - 3, args.batch)
        tokens = jnp.asarray(np.stack([stream[o : o + args.length + 2] for o in offsets]))
        params, opt_state, (target_loss, mtp_loss) = step(params, opt_state, tokens)
        if i % 100 == 0 or i == args.steps - 1:
            losses = f"target {float(target_loss):.3f}  mtp {float(mtp_loss):.3f}"
            print(f"step {i:5d}  {losses}  {time.time() - start:.0f}s")
    return nnx.merge(graphdef, params, fixed)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128, help="tokens per training window")
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--out", type=pathlib.Path, default=OUT, help="the directory (must not exist)")
    args = parser.parse_args()

    texts = docstrings()
    tokenizer = train_tokenizer(texts, args.vocab_size)
    stream = documents(tokenizer, texts)
    print(f"corpus: {len(texts)} docstrings, {len(stream)} tokens of a {tokenizer.get_vocab_size()} BPE")
    hf = CONFIG | {
        "vocab_size": tokenizer.get_vocab_size(),
        "bos_token_id": tokenizer.token_to_id(BOS),
        "eos_token_id": tokenizer.token_to_id(EOS),
    }
    # the dense dispatch: the grouped one (a Pallas gather) has no gradient
    model = train(ModelConfig.from_hf(hf), stream, args)
    released.write_released(
        args.out, released.released_config(hf), released.released_tensors(model), shards=2
    )
    tokenizer.save(str(args.out / TOKENIZER))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "model_max_length": hf["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    (args.out / TOKENIZER_CONFIG).write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"wrote {args.out} ({size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
