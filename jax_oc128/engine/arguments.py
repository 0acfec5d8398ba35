"""The engine's argument checks, on the host before anything is compiled or dispatched: one function per
concept, shared by :class:`~jax_oc128.engine.Engine`'s constructor, ``init_state``, ``generate``,
``prefill`` and ``decode``. A wrong type is a :class:`~jax_oc128.checks.ArgumentTypeError` (a TypeError), a
wrong value a :class:`~jax_oc128.checks.ArgumentError` (a ValueError), each naming the argument (``argument``,
and the message's start). A decode state is checked against the engine's layout and for donation without
reading the device; what it holds (which slots are active) is not checked."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from jax_oc128.checks import (
    ArgumentError,
    ArgumentNotSupported,
    ArgumentTypeError,
    NamedError,
    check_int,
    is_int,
)
from jax_oc128.engine.pages import pages_for
from jax_oc128.engine.state import DecodeState
from jax_oc128.nn import sharding
from jax_oc128.protocols import Drafter, Model, members
from jax_oc128.rules import BLOCK, MAX_DRAFT
from jax_oc128.sampling import MIN_TEMPERATURE, Sampling
from jax_oc128.tree import Tree, check_parents

#: stop token ids per call (padded with -1 to this size, so their number never recompiles)
MAX_STOP_TOKENS = 8
#: seeds are 32-bit (``jax.random.key`` of a seed in [0, 2**32) is the same with and without x64)
MAX_SEED = 2**32 - 1
#: the most of a count the engine keeps in int32 (steps per dispatch, slots, prompt bucket)
MAX_INT32 = 2**31 - 1


def check_model(model) -> Model:
    """``model`` a :class:`flax.nnx.Module` (the engine places its parameters) with every member of the
    :class:`~jax_oc128.protocols.Model` protocol, its static facts in range: ``vocab_size``, ``max_len``
    and ``draft_hidden_size`` counts, ``max_draft`` in [1, 16], ``verifies_trees`` a bool, ``drafter``
    None or with every member of :class:`~jax_oc128.protocols.Drafter`."""
    kind = type(model).__name__
    if not isinstance(model, nnx.Module):
        raise ArgumentTypeError(
            "model", f"must be a flax.nnx.Module implementing jax_oc128.protocols.Model, got {kind}"
        )
    missing = [name for name in members(Model) if not hasattr(model, name)]
    if missing:
        raise ArgumentTypeError(
            "model", f"must implement jax_oc128.protocols.Model, {kind} has no {', '.join(missing)}"
        )
    for name in ("vocab_size", "max_len", "draft_hidden_size"):
        check_count(f"model.{name}", getattr(model, name))
    check_int("model.max_draft", model.max_draft, 1, MAX_DRAFT)
    if not isinstance(model.verifies_trees, bool):
        raise ArgumentTypeError("model.verifies_trees", f"must be a bool, got {model.verifies_trees!r}")
    check_stop_tokens(default_stop_tokens(model), model, "model.eos_token_ids")
    drafter = model.drafter
    missing = [] if drafter is None else [name for name in members(Drafter) if not hasattr(drafter, name)]
    if missing:
        kind = type(drafter).__name__
        raise ArgumentTypeError(
            "model.drafter", f"must implement jax_oc128.protocols.Drafter, {kind} has no {', '.join(missing)}"
        )
    return model


def check_count(name: str, value) -> int:
    """A count the engine keeps in int32 (``name`` in errors): an int in [1, 2**31)."""
    return check_int(name, value, 1, MAX_INT32)


def check_slots(slots, mesh) -> int:
    """The slot count (:func:`check_count`), a multiple of the data axis of ``mesh`` (a checked mesh or
    None)."""
    slots = check_count("slots", slots)
    devices = sharding.data_devices(mesh)
    if slots % devices:
        raise ArgumentError("slots", f"must be a multiple of the mesh's data axis ({devices}), got {slots}")
    return slots


#: the prefill's chunk on a GPU by default (``Engine(..., prefill_chunk="auto")``): its temporaries are one
#: chunk's (the window attention's banded logits, the activations, ``[slots, chunk, vocab]`` logits)
GPU_PREFILL_CHUNK = 2048
#: the most positions one forward of that default feeds a device (its slots x the chunk): where a device's
#: slots would pass it at :data:`GPU_PREFILL_CHUNK`, the chunk is the largest power of two that keeps within
#: it, so that the prefill's temporaries follow this many positions, not the slots (8 slots: 2048; 64: 256)
GPU_PREFILL_POSITIONS = 16384


def check_prefill_chunk(prefill_chunk, on_gpu: bool, device_slots: int) -> int | None:
    """The prefill's chunk: ``"auto"`` (on a GPU :data:`GPU_PREFILL_CHUNK`, less for a device of more than
    :data:`GPU_PREFILL_POSITIONS` / that chunk slots, ``device_slots``; else None), None (one forward of the
    whole prompt bucket) or a count (:func:`check_count`). Any size is right: a forward in EXTEND mode
    continues the caches at any position (the sliding windows, the CSA windows of 4 and the C128 blocks are
    cut anywhere, tests/test_v4_parity.py::test_chunked_prefill_matches_transformers), so nothing is
    aligned."""
    if isinstance(prefill_chunk, str) and prefill_chunk == "auto":
        if not on_gpu:
            return None
        fits = max(1, GPU_PREFILL_POSITIONS // device_slots)
        return min(GPU_PREFILL_CHUNK, 1 << (fits.bit_length() - 1))
    return None if prefill_chunk is None else check_count("prefill_chunk", prefill_chunk)


def check_seed(seed) -> np.uint32:
    """A PRNG seed, an int in [0, 2**32), as the uint32 the engine's jitted functions take."""
    return np.uint32(check_int("seed", seed, 0, MAX_SEED))


def _check_drafter(name: str, value, model: Model) -> None:
    """Speculation (``name`` given as ``value``) needs a drafter: refused for a model without one."""
    if model.drafter is None:
        raise ArgumentError(
            name,
            "this model has no MTP head (no drafter: e.g. its checkpoint carries no MTP layer), so "
            f"it decodes plainly only: pass num_tokens=None and tree=None, got {name}={value!r}",
        )


def check_speculation(num_tokens, tree, model: Model) -> Tree | None:
    """The draft tree of a speculative step for ``model``, or None (plain steps). ``num_tokens`` N, an int
    in [2, max_draft], is the chain of N (:meth:`Tree.chain`); ``tree`` a :class:`Tree` or its parents
    (:func:`~jax_oc128.tree.check_parents`) of 2 to max_draft nodes, ``num_tokens`` then None or its
    size. A tree that is not a chain needs a model that verifies trees (``model.verifies_trees``)."""
    if tree is None:
        if num_tokens is None:
            return None
        _check_drafter("num_tokens", num_tokens, model)
        return Tree.chain(check_int("num_tokens", num_tokens, 2, model.max_draft, " = max_draft"))
    tree = tree if isinstance(tree, Tree) else Tree(check_parents(tree, "tree"))
    _check_drafter("tree", tree, model)
    if tree.size < 2:
        raise ArgumentError("tree", f"must have drafts (at least 2 nodes), got {tree}")
    if tree.size > model.max_draft:
        raise ArgumentError("tree", f"at most max_draft = {model.max_draft} nodes, got {tree.size}")
    if max(tree.widths) > model.vocab_size:
        raise ArgumentError(
            "tree",
            f"a node has {max(tree.widths)} children, more than the vocabulary's {model.vocab_size} "
            f"tokens (a node's children are distinct tokens), got {tree}",
        )
    if num_tokens is not None and num_tokens != tree.size:
        raise ArgumentError("num_tokens", f"None or the tree's {tree.size} nodes, got {num_tokens!r}")
    if not tree.is_chain and not model.verifies_trees:
        raise ArgumentNotSupported(
            "tree",
            "this model verifies chains only (model.verifies_trees is False: for DeepSeek-V4, the "
            f"offline C128 state), got {tree}",
        )
    return tree


def check_max_new_tokens(max_new_tokens, tree: Tree | None, model) -> int:
    """A request's budget, an int in [1, max_len - N - 1] (N the nodes of ``tree``, 1 for plain steps), so
    that a prompt of one token fits. Returns the longest prompt it leaves room for,
    ``max_len - max_new_tokens - N`` (a step writes up to N positions)."""
    n = 1 if tree is None else tree.size
    budget = check_int("max_new_tokens", max_new_tokens, 1, model.max_len - n - 1, " = max_len - N - 1")
    return model.max_len - budget - n


def check_temperature(temperature) -> float:
    """A finite number >= 0 (bools refused), as a float (a static argument of the jitted functions)."""
    if not isinstance(temperature, int | float | np.integer | np.floating) or isinstance(temperature, bool):
        raise ArgumentTypeError("temperature", f"must be a number, got {temperature!r}")
    try:
        value = float(temperature)  # an int past float's range overflows
    except OverflowError:
        value = math.inf
    if not 0 <= value < math.inf:
        huge = isinstance(temperature, int) and value == math.inf
        shown = f"an int of {len(str(temperature))} digits" if huge else temperature
        raise ArgumentError("temperature", f"must be finite and >= 0, got {shown}")
    return value


def check_top_p(top_p) -> float:
    """None (off) or a number in (0, 1] (bools refused; 1: off), as a float (1.0 when off)."""
    if top_p is None:
        return 1.0
    if not isinstance(top_p, int | float | np.integer | np.floating) or isinstance(top_p, bool):
        raise ArgumentTypeError("top_p", f"must be a number or None, got {top_p!r}")
    if not 0 < top_p <= 1:
        raise ArgumentError("top_p", f"must be in (0, 1] (1 or None: off), got {top_p}")
    return float(top_p)


def check_top_k(top_k) -> int:
    """None or an int >= 0 (0 or None: off; any k >= vocab_size keeps every token), as an int (0 when
    off)."""
    return 0 if top_k is None else check_int("top_k", top_k, 0)


def sampling_rows(slots: int, params: Mapping) -> Sampling:
    """The device's :class:`~jax_oc128.sampling.Sampling` rows (numpy, ``[slots]`` each) of checked
    parameters ``params`` {slot: an object with ``temperature``, ``top_p`` (a float, 1 off) and ``top_k``
    (an int, 0 off)}, other rows greedy; a positive temperature below
    :data:`~jax_oc128.sampling.MIN_TEMPERATURE` is sent as it (float32 would round it to 0: greedy)."""
    rows = Sampling(np.zeros(slots, np.float32), np.ones(slots, np.float32), np.zeros(slots, np.int32))
    for slot, p in params.items():
        rows.temperature[slot] = max(p.temperature, MIN_TEMPERATURE) if p.temperature > 0 else 0.0
        rows.top_p[slot], rows.top_k[slot] = p.top_p, min(p.top_k, MAX_INT32)
    return rows


def default_stop_tokens(model) -> tuple:
    """The stop tokens of a request that gives none: the model's EOS ids (``model.eos_token_ids``, () if it
    has none; checked by :func:`check_model`)."""
    return getattr(model, "eos_token_ids", ())


def check_stop_tokens(stop_tokens, model, name: str = "stop_tokens") -> tuple[int, ...]:
    """A collection (list, tuple, bytes, 1-D integer array) of at most :data:`MAX_STOP_TOKENS` token ids
    (ints, bools refused) in [0, vocab_size), as a tuple of ints; None: the model's EOS ids
    (:func:`default_stop_tokens`). Errors name ``name``."""
    if stop_tokens is None:
        stop_tokens = default_stop_tokens(model)
    if isinstance(stop_tokens, np.ndarray | jax.Array):
        stop_tokens = np.asarray(stop_tokens).tolist()  # a 0-d array gives a scalar, refused below
    if not isinstance(stop_tokens, Collection) or isinstance(stop_tokens, str):
        raise ArgumentTypeError(name, f"must be a sequence of token ids, got {stop_tokens!r}")
    if len(stop_tokens) > MAX_STOP_TOKENS:
        raise ArgumentError(name, f"at most {MAX_STOP_TOKENS} ids, got {len(stop_tokens)}")
    for token in stop_tokens:
        if not is_int(token):
            raise ArgumentTypeError(name, f"ids must be ints, got {token!r}")
        if not 0 <= token < model.vocab_size:
            raise ArgumentError(name, f"ids must be in [0, {model.vocab_size}), got {token}")
    return tuple(map(int, stop_tokens))


def stop_array(stop_tokens: tuple[int, ...]) -> np.ndarray:
    """Checked ``stop_tokens`` as ``[MAX_STOP_TOKENS]`` int32 padded with -1."""
    return np.array([*stop_tokens, *[-1] * (MAX_STOP_TOKENS - len(stop_tokens))], np.int32)


def check_prompt(name: str, prompt, model, longest: int) -> np.ndarray:
    """A prompt (named ``name`` in errors): a sequence (list, tuple, bytes) of ints or a 1-D integer array,
    1 to ``longest`` token ids in [0, vocab_size). Returns it as ``[length]`` int32."""
    if isinstance(prompt, np.ndarray | jax.Array):
        ids = np.asarray(prompt)
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ArgumentTypeError(name, f"must be a 1-D integer array, got {ids.dtype}{list(ids.shape)}")
    elif isinstance(prompt, Sequence) and not isinstance(prompt, str):
        ids = list(prompt)  # bytes as ints
        for token in ids:
            if not is_int(token):
                raise ArgumentTypeError(name, f"token ids must be ints, got {token!r}")
    else:
        raise ArgumentTypeError(name, f"must be a sequence of token ids, got {type(prompt).__name__}")
    if not 0 < len(ids) <= longest:
        raise ArgumentError(
            name, f"length {len(ids)} must be in [1, {longest} = max_len - max_new_tokens - N]"
        )
    low, high = (ids.min(), ids.max()) if isinstance(ids, np.ndarray) else (min(ids), max(ids))
    if low < 0 or high >= model.vocab_size:
        bad = low if low < 0 else high
        raise ArgumentError(name, f"token ids must be in [0, {model.vocab_size}), got {bad}")
    return np.asarray(ids, np.int32)


def check_prompts(prompts, model, longest: int) -> list[np.ndarray]:
    """``generate``'s prompts: a sequence (list, tuple, array) of prompts, each checked by
    :func:`check_prompt` as ``prompts[i]``."""
    if isinstance(prompts, str | bytes | bytearray) or not isinstance(prompts, Sequence | np.ndarray):
        kind = type(prompts).__name__
        raise ArgumentTypeError(
            "prompts", f"must be a sequence of prompts (each a sequence of token ids), got {kind}"
        )
    return [check_prompt(f"prompts[{i}]", prompt, model, longest) for i, prompt in enumerate(prompts)]


def check_assignments(assignments, slots: int, model, longest: int) -> dict[int, np.ndarray]:
    """``prefill``'s requests: a non-empty mapping from a slot (an int in [0, slots)) to its prompt, checked
    by :func:`check_prompt` as ``assignments[slot]``."""
    if not isinstance(assignments, Mapping):
        raise ArgumentTypeError(
            "assignments", f"must be a mapping {{slot: prompt}}, got {type(assignments).__name__}"
        )
    if not assignments:
        raise ArgumentError("assignments", "no request (a mapping {slot: prompt} with at least one entry)")
    prompts = {}
    for slot, prompt in assignments.items():
        try:
            slot = check_int("a slot", slot, 0, slots - 1)
        except NamedError as error:  # the argument at fault is the mapping
            raise type(error)("assignments", str(error)) from None
        prompts[slot] = check_prompt(f"assignments[{slot}]", prompt, model, longest)
    return prompts


def check_waiting(waiting) -> np.bool_:
    """Whether requests wait for a slot, a bool (numpy's too)."""
    if not isinstance(waiting, bool | np.bool_):
        raise ArgumentTypeError("waiting", f"must be a bool, got {waiting!r}")
    return np.bool_(waiting)


def check_callback(name: str, value) -> None:
    """``generate``'s callback ``name`` (``progress``, ``stream``), a callable or None."""
    if value is not None and not callable(value):
        raise ArgumentTypeError(name, f"must be callable or None, got {value!r}")


def check_state_is_this_engines(state, layout: DecodeState) -> None:
    """``state`` a :class:`DecodeState` of the engine's ``layout`` (its tree, shapes and dtypes), made by
    this engine (``layout.engine``), whose buffers were not donated yet; read on the host only (no device
    sync)."""
    if not isinstance(state, DecodeState):
        raise ArgumentTypeError(
            "state", f"must be a DecodeState (from init_state, prefill or decode), got {type(state).__name__}"
        )
    # the layout first (the more telling error), then the engine that made it
    leaves, tree = jax.tree_util.tree_flatten_with_path(dataclasses.replace(state, engine=layout.engine))
    expected, expected_tree = jax.tree.flatten(layout)
    if tree != expected_tree:
        raise ArgumentError("state", "not this engine's (its caches have another structure: another model?)")
    for (path, leaf), want in zip(leaves, expected, strict=True):
        where = f"state{jax.tree_util.keystr(path)}"
        if not isinstance(leaf, jax.Array):
            raise ArgumentTypeError("state", f"{where} must be a jax.Array, got {type(leaf).__name__}")
        if leaf.shape != want.shape or leaf.dtype != want.dtype:
            raise ArgumentError(
                "state",
                f"not this engine's: {where} is {leaf.dtype}{list(leaf.shape)}, this engine's is "
                f"{want.dtype}{list(want.shape)} (another slot count or model?)",
            )
    if state.engine != layout.engine:
        raise ArgumentError(
            "state",
            f"not this engine's: made by engine {state.engine}, this is engine {layout.engine} (of "
            "the same layout; a state is used by the engine that made it)",
        )
    if any(leaf.is_deleted() for _, leaf in leaves):
        raise ArgumentError("state", "already donated to an earlier call; use the state it returned")


def check_pages(pages, page_size, model, mesh) -> tuple[int | None, int]:
    """An engine's paging: ``pages`` None (dense) or a count (:func:`check_count`), a multiple of the data
    axis of ``mesh``; ``page_size`` a multiple of 128 (the HCA block) dividing ``max_len``."""
    page_size = check_count("page_size", page_size)
    if pages is None:
        return None, page_size
    pages = check_count("pages", pages)
    devices = sharding.data_devices(mesh)
    if pages % devices:
        raise ArgumentError("pages", f"must be a multiple of the mesh's data axis ({devices}), got {pages}")
    if page_size % BLOCK or model.max_len % page_size:
        raise ArgumentError(
            "page_size", f"must be a multiple of {BLOCK} dividing max_len ({model.max_len}), got {page_size}"
        )
    return pages, page_size


def check_page_table(page_table, shape: tuple[int, int], pages, mesh) -> np.ndarray:
    """A paged engine's page table: an integer array of ``shape`` (``[slots, max_len // page_size]``), each
    entry -1 or a page of its slot's device's pool, no page held by two slots; as int32. ``pages`` None (a
    dense engine) refuses any."""
    if pages is None:
        raise ArgumentError("page_table", "this engine's caches are dense (Engine(..., pages=None))")
    table = np.asarray(page_table)
    if table.shape != shape or not np.issubdtype(table.dtype, np.integer):
        raise ArgumentError(
            "page_table", f"must be integers of shape {shape}, got {table.dtype} {table.shape}"
        )
    devices = sharding.data_devices(mesh)
    per_device = pages // devices
    if np.any((table < -1) | (table >= per_device)):
        raise ArgumentError(
            "page_table", f"entries must be -1 or pages in [0, {per_device}) of the slot's device"
        )
    for device, rows in enumerate(np.split(table, devices)):
        held = rows[rows >= 0]
        if len(np.unique(held)) != len(held):
            raise ArgumentError("page_table", f"a page is held twice (the slots of device {device})")
    return table.astype(np.int32)


def check_context_floor(context_floor, pages, page_size: int) -> int | None:
    """The context buckets' floor: None (every forward reads all ``max_len`` positions) or a positive
    multiple of 128 (whole C128 blocks); paged (``pages`` not None), the least common multiple with
    ``page_size``, so that every bucket covers whole pages."""
    if context_floor is None:
        return None
    context_floor = check_count("context_floor", context_floor)
    if context_floor % BLOCK:
        raise ArgumentError("context_floor", f"must be None or a multiple of {BLOCK}, got {context_floor}")
    return context_floor if pages is None else math.lcm(context_floor, page_size)


def check_context(context, model) -> int | None:
    """A dispatch's context (the most positions any of its rows reaches): None (``max_len``) or an int in
    [1, max_len]."""
    return None if context is None else check_int("context", context, 1, model.max_len)


def check_request_fits(name: str, tokens: int, page_size: int, pages: int) -> None:
    """A request (named ``name`` in errors) writing at most ``tokens`` tokens (prompt + max_new_tokens + N)
    fits in a device's pool of ``pages`` pages of ``page_size`` tokens, else ValueError."""
    needs = pages_for(tokens, page_size)
    if needs > pages:
        raise ArgumentError(
            name,
            f"needs {needs} pages of {page_size} tokens (prompt + max_new_tokens + N = {tokens} tokens), "
            f"more than the {pages} of a device's pool (Engine(..., pages=))",
        )
