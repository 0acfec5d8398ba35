"""The names of a DeepSeek-V4 checkpoint's tensors: transformers' state-dict names
(``model.layers.0.self_attn.q_a_proj.weight``, the experts stacked in ``mlp.experts.gate_up_proj`` and
``mlp.experts.down_proj``) and DeepSeek's (``layers.0.attn.wq_a.weight``, one tensor per expert and
projection: ``layers.0.ffn.experts.{e}.w1.weight``), with or without a ``model.`` prefix, the MTP layer's
under ``mtp.0.`` or ``model.layers.{num_hidden_layers}.``; a quantized weight's scale is its name with
``.scale`` for ``.weight``. :func:`part` maps a stored name to where it goes (:class:`Part`),
:func:`deepseek_name` back.
A layer index is ASCII digits, without leading zeros, at most 9 of them; any other name is unexpected.
"""

from __future__ import annotations

import dataclasses
import re

from jax_oc128.nn import SpeculativeModel, weights

#: DeepSeek's name of a top-level tensor -> transformers' (each also accepted under its own name)
DEEPSEEK_TOP_NAMES = {name: weight.hf for weight in weights.TOP for name in weight.deepseek}
#: DeepSeek's name of a decoder layer's tensor (within ``layers.{i}.``) -> transformers' (within
#: ``model.layers.{i}.``); the experts' tensors are :data:`DEEPSEEK_EXPERT`
DEEPSEEK_LAYER_NAMES = {
    name: weight.hf
    for weight in weights.LAYER
    if weight.hf is not None and weight.stored != weights.EXPERTS
    for name in weight.deepseek
}
#: DeepSeek's per-expert projection -> (transformers' stacked tensor, which half of its rows: w1 the gate's,
#: w3 the up projection's; None: all of them)
DEEPSEEK_EXPERT = {
    projection: (weight.hf, half if len(weight.deepseek) > 1 else None)
    for weight in weights.EXPERT_WEIGHTS
    for half, projection in enumerate(weight.deepseek)
}
# (indices of at most 9 digits: a name with a longer one is an unexpected tensor)
EXPERT_NAME = re.compile(rf"ffn\.experts\.(0|[1-9][0-9]{{0,8}})\.({'|'.join(DEEPSEEK_EXPERT)})\.weight")
LAYER_PARAM = re.compile(r"model\.layers\.[0-9]+\.(.+)")
LAYER_NAME = re.compile(r"(?:model\.)?(layers|mtp)\.(0|[1-9][0-9]{0,8})\.(.+)")
#: the parameters (within ``model.layers.{i}.``) a quantized checkpoint stores in FP8: the attention's
#: projections, the indexer's query projection and the shared expert
FP8_PARAMS = tuple(weight.hf for weight in weights.LAYER if weight.stored == weights.FP8)
#: the MTP layer's projections: FP8 where stored so (F8_E4M3 with a scale), float otherwise
OPTIONAL_FP8_PARAMS = tuple(weight.hf for weight in weights.MTP if weight.stored == weights.OPTIONAL_FP8)
#: the routed experts' parameters, in the format of ``expert_dtype``
EXPERT_PARAMS = tuple(weight.hf for weight in weights.EXPERT_WEIGHTS)
SCALE = ".scale"


@dataclasses.dataclass(frozen=True)
class Part:
    """Where a stored tensor goes: the parameter ``param`` (its transformers-style name) whole
    (``expert`` None) or one expert's slice of it (DeepSeek's per-expert tensors): rows
    ``[half * n, (half + 1) * n)`` of ``param[expert]``, ``n`` half its rows (``half`` None: all); ``scale``:
    the part's scale (a quantized checkpoint's ``.scale`` tensor), not its weight."""

    param: str
    expert: int | None = None
    half: int | None = None
    scale: bool = False


def part(name: str, layers: int) -> Part | None:
    """Where the stored tensor ``name`` goes (see :class:`Part`), None for a name of neither naming. A
    quantized weight's scale is its name with ``.scale`` for ``.weight`` (DeepSeek's)."""
    if name.endswith(SCALE):
        weight = part(name.removesuffix(SCALE) + ".weight", layers)
        if weight is not None and layer_suffix(weight.param) in (*FP8_PARAMS, *OPTIONAL_FP8_PARAMS):
            return dataclasses.replace(weight, scale=True)
        if weight is not None and weight.expert is not None:  # an expert's (EXPERT_NAME)
            return dataclasses.replace(weight, scale=True)
    bare = name.removeprefix("model.")
    if bare in DEEPSEEK_TOP_NAMES:
        return Part(DEEPSEEK_TOP_NAMES[bare])
    if name in DEEPSEEK_TOP_NAMES.values():
        return Part(name)
    match = LAYER_NAME.fullmatch(name)
    if match is None:
        return None
    kind, index, suffix = match.groups()
    prefix = f"model.layers.{int(index) + (layers if kind == 'mtp' else 0)}."
    expert = EXPERT_NAME.fullmatch(suffix)
    if expert is not None:
        param, half = DEEPSEEK_EXPERT[expert.group(2)]
        return Part(prefix + param, int(expert.group(1)), half)
    return Part(prefix + DEEPSEEK_LAYER_NAMES.get(suffix, suffix))


def layer_suffix(param: str) -> str | None:
    """The name of the parameter ``param`` within its layer (``model.layers.{i}.``), None for a top-level
    one."""
    match = LAYER_PARAM.fullmatch(param)
    return None if match is None else match.group(1)


def scale_name(weight: str) -> str:
    """The name of the scale of the stored weight ``weight``."""
    return weight.removesuffix(".weight") + SCALE


def parameter_paths(model: SpeculativeModel) -> dict[str, tuple]:
    """Every parameter of ``model`` (what a checkpoint of its config holds) by its transformers-style name
    (the MTP layer's under ``model.layers.{num_hidden_layers}.``, its own tensors by DeepSeek's names) ->
    attribute path (:mod:`jax_oc128.nn.weights`; a NotImplementedError for a model that has no
    transformers counterpart: a dense MLP, or no hyper-connections)."""
    if not hasattr(model.target, "hc_head"):
        raise NotImplementedError("a model without hyper-connections has no transformers counterpart")
    paths = {name: ("target", *path) for name, path in weights.hf_paths(model.target, weights.TOP).items()}
    for i, block in enumerate(model.target.blocks):
        paths |= {
            f"model.layers.{i}.{name}": ("target", "blocks", i, *path)
            for name, path in weights.hf_paths(block, weights.LAYER).items()
        }
    if model.mtp is not None:
        prefix = f"model.layers.{len(model.config.layer_types)}."
        own = weights.hf_paths(model.mtp, weights.MTP)
        block = weights.hf_paths(model.mtp.block, weights.LAYER)
        paths |= {prefix + name: ("mtp", *path) for name, path in own.items()}
        paths |= {prefix + name: ("mtp", "block", *path) for name, path in block.items()}
    return paths


def part_shape(part: Part, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of ``part`` of a parameter of ``shape``."""
    if part.expert is None:
        return shape
    if part.half is None:
        return shape[1:]
    return (shape[1] // 2, *shape[2:])


def deepseek_name(part: Part, layers: int) -> str:
    """DeepSeek's name of ``part`` (for messages; ``{e}`` for every expert of a whole stacked parameter)."""
    top = {hf: theirs for theirs, hf in DEEPSEEK_TOP_NAMES.items()}
    if part.param in top:
        return top[part.param]
    layer, suffix = re.fullmatch(r"model\.layers\.([0-9]+)\.(.+)", part.param).groups()
    prefix = f"mtp.{int(layer) - layers}." if int(layer) >= layers else f"layers.{layer}."
    projections = [w for w, (param, half) in DEEPSEEK_EXPERT.items() if suffix == param and half == part.half]
    if not projections:  # not an expert tensor (the first DeepSeek name of each, the checkpoints')
        theirs = {hf: name for name, hf in reversed(DEEPSEEK_LAYER_NAMES.items())}
        return prefix + theirs.get(suffix, suffix)
    expert = "{e}" if part.expert is None else part.expert
    return prefix + f"ffn.experts.{expert}.{projections[0]}.weight"


def halves(param: str) -> tuple[int | None, ...]:
    """The halves of the stacked expert parameter ``param`` that DeepSeek stores as tensors of their own
    (gate_up_proj: w1 and w3), ``(None,)`` for one whole."""
    return (0, 1) if param.endswith(DEEPSEEK_EXPERT["w1"][0]) else (None,)
