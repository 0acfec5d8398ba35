"""The FLOP floor of a prefill (``bench_prefill.py``'s ``floor ms`` and ``x floor``): the FLOPs one prompt of
P tokens must run whatever its kernels, by part of the model (:func:`prefill_flops`), from the matrices of the
model's parameters (:func:`token_params`) and the keys each position's attention and indexer see
(:func:`attention_flops`).

Per prompt token, 2 x the matrix parameters it runs through: every dense projection (attention, compressors,
indexer, hyper-connections, router, shared expert), the ``num_experts_per_tok`` routed experts of each MoE
layer (hash-routed likewise), the draft head's layer (its caches are filled at every prompt token; its
``hidden_proj`` once per residual stream); not the embedding nor the compressors' positional biases
(``ape``); the LM head once per prompt (the first token's logits). Plus, summed over the prompt's positions
p = 0 .. P - 1, the attention, 4 x heads x head_dim per key a query sees (its window ``min(p + 1,
sliding_window)``, an HCA layer's ``(p + 1) // 128`` entries, a CSA layer's ``min(index_topk, (p + 1) // 4)``
picks), and a CSA layer's indexer, 2 x index_heads x index_head_dim per compressed key it scores
(``(p + 1) // 4``). Not counted: the compressors' pooling, norms, RoPE, softmax and the hyper-connections'
mixing (elementwise, a small share)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_oc128.nn import CSA, HCA, SLIDING, LayerType, ModelConfig, RuntimeConfig, SpeculativeModel
from jax_oc128.nn.functional import build_abstract
from jax_oc128.nn.sharding import path_names

#: parameters of two or more axes that are no matmul's: the tables read at their tokens' rows, the
#: compressors' positional biases
NOT_MATMULS = ("embed", "tid2eid", "ape", "indexer_ape")
#: the routed experts' parameters (one expert per index of the leading axis)
EXPERT_WEIGHTS = ("experts_gate_up", "experts_down")
#: the draft head's projections applied to each of the target's residual streams
PER_STREAM = ("hidden_proj",)
#: compression rates of the compressed layers' entries (tokens per entry)
RATES = {CSA: 4, HCA: 128}
#: the layer kinds' short names
KINDS = {SLIDING: "sliding", CSA: "csa", HCA: "hca"}
#: the parts of :func:`prefill_flops` besides the target's layers
HEAD, DRAFT = "head", "draft"


def token_params(config: ModelConfig) -> dict:
    """Matrix parameters one prompt token runs through, by part: ``layer i`` (the target's blocks),
    :data:`DRAFT` (the draft head: its projections and its block) and :data:`HEAD` (the target's stream
    collapse before the LM head); and ``"lm_head"``: the LM head's, run once per prompt. From the
    parameters' shapes of a model of ``config`` (built abstract, nothing allocated)."""
    model = build_abstract(lambda rngs: SpeculativeModel(config, RuntimeConfig(max_len=128), rngs=rngs))
    parts = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model)):
        names = path_names(path)
        if leaf.ndim < 2 or not jnp.issubdtype(leaf.dtype, jnp.floating) or names[-1] in NOT_MATMULS:
            continue
        size = float(np.prod(leaf.shape))
        if names[-1] in EXPERT_WEIGHTS:
            size *= config.num_experts_per_tok / leaf.shape[0]
        if names[-1] in PER_STREAM:
            size *= config.hc_mult or 1
        if names[-1] == "lm_head":
            part = "lm_head"
        elif names[0] == "mtp":
            part = DRAFT
        elif names[1] == "blocks":
            part = f"layer {names[2]}"
        else:
            part = HEAD
        parts[part] = parts.get(part, 0.0) + size
    return parts


def visible_keys(config: ModelConfig, layer_type: str, prompt_len: int) -> tuple[int, int]:
    """``(attended, scored)``: the keys the attention of a ``layer_type`` layer sees summed over the
    positions of a prompt of ``prompt_len`` tokens, and the compressed keys its indexer scores (0 but CSA)."""
    seen = np.arange(1, prompt_len + 1, dtype=np.int64)  # tokens seen at each position, itself included
    attended = int(np.minimum(seen, config.sliding_window).sum())
    scored = 0
    if layer_type == HCA:
        attended += int((seen // RATES[HCA]).sum())
    elif layer_type == CSA:
        scored = int((seen // RATES[CSA]).sum())
        attended += int(np.minimum(seen // RATES[CSA], config.index_topk).sum())
    return attended, scored


def attention_flops(config: ModelConfig, layer_type: str, prompt_len: int) -> float:
    """The attention's and the indexer's FLOPs of one ``layer_type`` layer over a prompt (see the module
    doc)."""
    attended, scored = visible_keys(config, layer_type, prompt_len)
    per_key = 4.0 * config.num_heads * config.head_dim
    return per_key * attended + 2.0 * config.index_n_heads * config.index_head_dim * scored


def prefill_flops(config: ModelConfig, prompt_len: int) -> dict:
    """FLOPs of one prompt of ``prompt_len`` tokens through a model of ``config``, by part: ``layer i``
    (the target's blocks: matrices, attention, indexer), :data:`DRAFT` (the draft head and its sliding
    attention) and :data:`HEAD` (the stream collapse, and the LM head once)."""
    params = token_params(config)
    flops = {}
    for part, size in params.items():
        if part != "lm_head":
            flops[part] = 2.0 * size * prompt_len
    for i, layer_type in enumerate(config.layer_types):
        flops[f"layer {i}"] += attention_flops(config, layer_type, prompt_len)
    if DRAFT in flops:
        flops[DRAFT] += attention_flops(config, SLIDING, prompt_len)
    flops[HEAD] = flops.get(HEAD, 0.0) + 2.0 * params["lm_head"]
    return flops


def by_kind(config: ModelConfig, flops: dict) -> dict:
    """:func:`prefill_flops`'s ``flops`` summed by layer kind (``sliding``, ``csa``, ``hca``: each layer's
    attention and MLP), :data:`DRAFT` and :data:`HEAD`, with ``layers``: how many layers of each kind."""
    kinds, layers = {}, {}
    for part, value in flops.items():
        kind = part
        if part.startswith("layer "):
            kind = KINDS[LayerType(config.layer_types[int(part.split()[1])])]
            layers[kind] = layers.get(kind, 0) + 1
        kinds[kind] = kinds.get(kind, 0.0) + value
    return dict(flops=kinds, layers=layers)
