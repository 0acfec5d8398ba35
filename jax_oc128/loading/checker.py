"""The loaders' one check of a checkpoint's tensors against the model of its config, from the headers
alone: :func:`check_tensors`, for Hugging Face-format checkpoints (safetensors files, or tensors in memory:
:mod:`jax_oc128.pretrained`, a layer's ``from_hf``) and this library's ``.npz`` files
(:mod:`jax_oc128.checkpoint`).
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp

from jax_oc128.checks import shown
from jax_oc128.loading.formats import (
    EXPERT_SCALE_DTYPES,
    SCALE_DTYPES,
    WEIGHT_DTYPE,
    scale_shape,
    stored_shape,
)
from jax_oc128.loading.names import (
    EXPERT_PARAMS,
    Part,
    deepseek_name,
    halves,
    layer_suffix,
    part_shape,
    scale_name,
)
from jax_oc128.nn.quant import FP4, GROUP

#: the most tensor names one list of an error message shows (the others are counted)
MAX_LISTED = 20
#: safetensors dtypes a floating / an integer parameter may be stored in (cast on load)
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
INT_DTYPES = {"I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8"}


def safetensors_dtypes(dtype) -> tuple[set[str], str]:
    """The safetensors dtypes a parameter of ``dtype`` may be stored in (any of its kind: cast on load), and
    how a message says them."""
    if jnp.issubdtype(dtype, jnp.integer):
        return INT_DTYPES, "an integer dtype"
    return FLOAT_DTYPES, "a floating-point dtype"


def check_tensors(
    directory,
    headers: dict,
    parts: dict,
    params: dict,
    layers: int | None,
    formats: dict | None = None,
    dtypes=safetensors_dtypes,
) -> None:
    """Every parameter of ``params`` (name -> its abstract value) given exactly once (whole, or every
    expert's part), no other tensor (``headers``: stored name -> (file, shape, dtype name); ``parts``:
    stored name -> its :class:`~jax_oc128.loading.names.Part`, None for no parameter's), each of its shape
    and of a dtype ``dtypes(parameter dtype)`` allows (-> the allowed names, how a message says them); a
    quantized one's (``formats``: parameter -> FP8 or FP4, :func:`~.formats.checkpoint_formats`) each part
    in its format's dtype and stored shape, with its scale of the format's shape and dtype; raises one
    ValueError naming ``directory`` and listing every problem (``layers``: the decoder layers, for
    DeepSeek's names of missing tensors; None: a format of no other naming)."""
    formats = formats or {}
    unexpected, problems, given, scales = [], [], {}, {}
    for name, part in parts.items():
        if part is None or part.param not in params or (part.scale and part.param not in formats):
            unexpected.append(name)  # (a scale of an unquantized weight too)
            continue
        want = params[part.param]
        if part.expert is not None and part.expert >= want.shape[0]:  # an expert the config has not
            unexpected.append(name)
            continue
        (scales if part.scale else given).setdefault(part.param, {}).setdefault(
            (part.expert, part.half), []
        ).append(name)
        _, shape, stored = headers[name]
        logical, fmt = part_shape(part, want.shape), formats.get(part.param)
        if part.scale:
            _check_scale(
                problems, name, headers[name], fmt, logical, layer_suffix(part.param) in EXPERT_PARAMS
            )
            continue
        if fmt is not None:
            _check_codes(problems, name, headers[name], fmt, logical)
            continue
        if shape != logical:
            problems.append(f"tensor {shown(name)}: shape {shape}, the config gives {logical}")
        allowed, expected = dtypes(want.dtype)
        if stored not in allowed:
            note = ""
            if stored.startswith(("F8", "F6", "F4")) or (stored == "I8" and allowed is FLOAT_DTYPES):
                where = "the format stores this tensor unquantized" if formats else "no quantization_config"
                note = f" (quantized: {where})"
            problems.append(f"tensor {shown(name)}: dtype {stored}, expected {expected}{note}")
    unscaled = []  # the quantized weights given without their scales
    for param, pieces in given.items():
        have = scales.get(param, {}) if param in formats else None
        if have is None:
            continue
        unscaled += [scale_name(names[0]) for key, names in pieces.items() if key not in have]
        for key, names in have.items():
            if key not in pieces:
                problems.append(f"tensor {shown(names[0])}: a scale without its weight")
            if len(names) > 1:
                problems.append(f"tensors {', '.join(map(shown, sorted(names)))}: the same scale twice")
        stored = {headers[name][2] for names in have.values() for name in names}
        if len(stored) > 1:
            problems.append(f"tensor {param}: scales of different dtypes ({', '.join(sorted(stored))})")
    if unscaled:
        problems.insert(0, f"missing scales ({len(unscaled)}): {listed(sorted(unscaled), len(unscaled))}")
    missing, absent = [], 0  # the first MAX_LISTED names of the missing tensors, and how many are missing
    for param, want in params.items():
        pieces = given.get(param, {})
        for names in pieces.values():
            if len(names) > 1:
                problems.append(
                    f"tensors {', '.join(map(shown, sorted(names)))}: the same parameter ({param}) twice"
                )
        if (None, None) in pieces and len(pieces) > 1:
            problems.append(f"tensor {param}: given whole and per expert")
        split = halves(param)
        if not pieces:
            theirs = (deepseek_name(Part(param, None, h), layers) for h in split)
            named = param if layers is None else f"{param} (DeepSeek: {' and '.join(theirs)})"
            missing += [named][: MAX_LISTED - len(missing)]
            absent += 1
        elif (
            None,
            None,
        ) not in pieces:  # counted, not listed: the config's experts are not bounded by the files
            absent += want.shape[0] * len(split) - len(pieces)
            names = (
                deepseek_name(Part(param, expert, h), layers)
                for expert in range(want.shape[0])
                for h in split
                if (expert, h) not in pieces
            )
            missing += itertools.islice(names, MAX_LISTED - len(missing))
    if absent:
        problems.insert(0, f"missing tensors ({absent}): {listed(missing, absent)}")
    if unexpected:
        problems.insert(
            0, f"unexpected tensors ({len(unexpected)}): {listed(sorted(unexpected), len(unexpected))}"
        )
    if problems:
        raise ValueError(f"{directory}: the checkpoint does not fit its config:\n  " + "\n  ".join(problems))


def _check_scale(problems: list, name: str, header: tuple, fmt: str, logical: tuple, expert: bool) -> None:
    """The scale ``name`` (``header``: file, shape, dtype) of a weight part of shape ``logical`` in
    ``fmt`` (``expert``: a routed expert's) has the format's shape and dtype; each problem appended."""
    _, shape, stored = header
    if shape != scale_shape(fmt, logical):
        expected = scale_shape(fmt, logical)
        problems.append(
            f"tensor {shown(name)}: shape {shape}, the config gives {expected} (the {fmt} scales)"
        )
    allowed = (EXPERT_SCALE_DTYPES if expert else SCALE_DTYPES)[fmt]
    if stored not in allowed:
        problems.append(
            f"tensor {shown(name)}: dtype {stored}, expected {' or '.join(allowed)} ({fmt} scales)"
        )


def _check_codes(problems: list, name: str, header: tuple, fmt: str, logical: tuple) -> None:
    """The quantized weight part ``name`` (``header``: file, shape, dtype) of shape ``logical`` in ``fmt``
    has the format's stored shape and dtype; each problem appended."""
    _, shape, stored = header
    if fmt == FP4 and logical[-1] % GROUP[FP4]:
        problems.append(f"tensor {shown(name)}: the config's {logical[-1]} columns are not FP4 groups of 32")
    elif shape != stored_shape(fmt, logical):
        packed = ", two codes a byte" if fmt == FP4 else ""
        expected = stored_shape(fmt, logical)
        problems.append(f"tensor {shown(name)}: shape {shape}, the config gives {expected} ({fmt}{packed})")
    if stored != WEIGHT_DTYPE[fmt]:
        problems.append(
            f"tensor {shown(name)}: dtype {stored}, expected {WEIGHT_DTYPE[fmt]} ({fmt}: quantization_config)"
        )


def listed(names: list[str], count: int) -> str:
    """The first :data:`MAX_LISTED` of ``names``, ``count`` in all, for a message (each :func:`shown`)."""
    more = count - min(len(names), MAX_LISTED)
    return ", ".join(map(shown, names[:MAX_LISTED])) + (f" and {more} more" if more else "")
