"""The byte floor of a decode step (``bench_decode.py``'s ``floor us`` and ``x floor``): the weight bytes a
step must read whatever its kernels (:func:`step_read_bytes`), from a model's parameter bytes by kind and by
what a forward reads of them (:class:`WeightReads`), and the summary of a model's weights the benchmark prints
and records (:func:`weights_summary`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jax_oc128.nn import SpeculativeModel
from jax_oc128.nn.functional import build_abstract
from jax_oc128.nn.quant import QuantizedArray
from jax_oc128.nn.sharding import path_names
from jax_oc128.state import nbytes
from jax_oc128.tree import Tree

#: the routed experts' parameters, by their attribute names (one expert per index of the leading axis)
EXPERT_WEIGHTS = ("experts_gate_up", "experts_down")
#: the tables a forward reads at its tokens' rows only (the embedding, the hash layers' token -> experts)
GATHERED = ("embed", "tid2eid")


@dataclasses.dataclass(frozen=True)
class WeightReads:
    """A model's parameter bytes on the device, by kind and by what a decode step reads of them.

    Attributes:
      kinds: bytes of the routed experts (``experts``), of the other matrices (``matrices``: every float or
        quantized parameter of two or more axes) and of the rest (``rest``: norms, biases, sinks, hash
        tables).
      target: what a target forward reads whole: every parameter of the target but its routed experts and
        the tables read at their tokens' rows (:data:`GATHERED`), the LM head included.
      draft: what a forward of the draft head reads whole: its own parameters (the same exclusions) and the
        LM head it shares with the target (0 without a draft head).
      moe: per MoE layer ``(owner, experts, bytes of one expert)``, owner ``"target"`` or ``"mtp"``.
    """

    kinds: dict
    target: int
    draft: int
    moe: tuple[tuple[str, int, int], ...]


def weight_reads(model) -> WeightReads:
    """The :class:`WeightReads` of ``model`` (a model or its :func:`build_abstract`)."""
    kinds, reads, experts = dict(experts=0, matrices=0, rest=0), dict(target=0, mtp=0), {}
    leaves = jax.tree_util.tree_leaves_with_path(
        nnx.state(model), is_leaf=lambda x: isinstance(x, QuantizedArray)
    )
    for path, leaf in leaves:
        names, size = path_names(path), nbytes(leaf)
        matrix = isinstance(leaf, QuantizedArray) or (
            jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.ndim > 1
        )
        if names[-1] in EXPERT_WEIGHTS:
            kinds["experts"] += size
            owner, count, one = experts.get(names[:-1], (names[0], leaf.shape[0], 0))
            experts[names[:-1]] = owner, count, one + size // count
            continue
        kinds["matrices" if matrix else "rest"] += size
        if names[-1] == "lm_head":  # (shared by the draft head: under its path where it has one)
            reads["target"] += size
            reads["mtp"] += size if model.mtp is not None else 0
        elif names[-1] not in GATHERED:
            reads[names[0]] += size
    return WeightReads(kinds, reads["target"], reads["mtp"], tuple(experts.values()))


def expected_experts(experts: int, top_k: int, tokens: int) -> float:
    """The expected number of distinct experts ``tokens`` tokens pick, each ``top_k`` of ``experts`` at
    random: ``E (1 - (1 - k / E)^tokens)`` (hash routing of random tokens likewise)."""
    return experts * (1 - (1 - top_k / experts) ** tokens)


def step_read_bytes(reads: WeightReads, mode: dict, slots: int, top_k: int) -> float:
    """The weight bytes a decode step of ``mode`` over ``slots`` slots must read at least, whatever its
    kernels: the target's forward of ``slots x N`` tokens reads its parameters whole once (``reads.target``:
    all but the routed experts and the embedding and hash tables, which it reads at its tokens' rows) and,
    per MoE layer, each expert its tokens pick once (:func:`expected_experts` of the layer's experts, top-k
    of ``slots x N`` tokens, times one expert's bytes; the shared expert is in ``reads.target``); a
    speculative step's draft head runs once per level of its draft tree (N - 1 for the chain of N) on
    ``slots`` x the level's nodes tokens, each forward reading the head and the LM head whole
    (``reads.draft``) and the experts its tokens pick in the head's MoE layer."""
    width = mode_width(mode)
    tree = mode.get("tree") or (Tree.chain(width) if width > 1 else None)
    forwards = [("target", slots * width)]
    forwards += [("mtp", slots * len(level)) for level in (tree.expanded if tree is not None else ())]
    total = 0.0
    for owner, tokens in forwards:
        total += reads.target if owner == "target" else reads.draft
        total += sum(expected_experts(e, top_k, tokens) * one for o, e, one in reads.moe if o == owner)
    return total


def mode_width(mode: dict) -> int:
    """Tokens a step of ``mode`` verifies (1: plain)."""
    return mode["tree"].size if "tree" in mode else mode.get("num_tokens", 1)


def gigabytes(kinds: dict) -> str:
    """Bytes by kind, and their total, in GB (for a line of text)."""
    total = sum(kinds.values())
    return (
        ", ".join(f"{kind} {size / 1e9:.3f}" for kind, size in kinds.items()) + f" (total {total / 1e9:.3f})"
    )


def weights_summary(config: str, weights: str, model) -> tuple[dict, WeightReads]:
    """The weights' bytes on the device by kind and the same model's in bfloat16 (printed, and as a dict),
    and the :class:`WeightReads` of the floor."""
    reads = weight_reads(model)
    bf16_config = dataclasses.replace(model.config, dtype="bfloat16")
    bf16 = weight_reads(build_abstract(lambda rngs: SpeculativeModel(bf16_config, rngs=rngs))).kinds
    print(
        f"{config} {weights}: weights GB on the device: {gigabytes(reads.kinds)}; "
        f"in bfloat16: {gigabytes(bf16)}"
    )
    experts = sorted({f"{one / 1e6:.2f} MB" for _, _, one in reads.moe})
    moe = f"; {len(reads.moe)} MoE layers, one expert {' / '.join(experts)}" if experts else ""
    print(
        f"  read whole per forward: target {reads.target / 1e9:.3f} GB, draft head and LM head "
        f"{reads.draft / 1e9:.3f} GB{moe}",
        flush=True,
    )
    summary = dict(config=config, weights=weights, kinds=reads.kinds, bf16_kinds=bf16)
    summary |= dict(target_bytes=reads.target, draft_bytes=reads.draft)
    summary["moe"] = [dict(owner=o, experts=e, expert_bytes=one) for o, e, one in reads.moe]
    return summary, reads
