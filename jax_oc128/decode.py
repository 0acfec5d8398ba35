"""Batch generation over a fixed number of slots: prefill, then plain or MTP speculative steps run K at a
time inside one on-device loop, with the whole decode state donated.

A speculative step drafts N-1 tokens with the MTP head, verifies the N tokens (the newest token + the drafts)
with the target in one forward, accepts (greedy: the longest prefix of drafts the target agrees with;
sampling: the speculative rejection rule, so that tokens follow the target's distribution), and keeps the
bonus token. The C128 state's commits are lazy: the next forward of a slot commits them, fused into its
verify kernels.

One dispatch (:meth:`Engine.decode`) runs up to K steps in a ``lax.while_loop``, writing each step's tokens
into a device buffer and ending rows on the device (max new tokens, stop tokens); it leaves early when every
row is done, or when a row finishes while requests wait. :meth:`Engine.generate` reads each dispatch's
buffer while the next one runs, and admits waiting requests between dispatches. The engine's functions are
built and jitted once per engine; each compiles once per (slots, N, K, temperature).

Every argument of the engine's methods is checked on the host before anything is compiled or dispatched: a
wrong type is a TypeError, a wrong value a ValueError, each message starting with the argument's name. One
function per rule (below :class:`Engine`), shared by :meth:`Engine.generate`, :meth:`Engine.prefill` and
:meth:`Engine.decode`. A decode state is checked against the engine's layout and for donation without
reading the device; what it holds (which slots are active) is not checked.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import time
from collections.abc import Collection, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_oc128.checks import check_int, is_int
from jax_oc128.controller import ONLINE, ForwardMode
from jax_oc128.nn import AttentionCache, ModelCache, SpeculativeModel, batch_slots, sharding
from jax_oc128.nn.attention import HCA
from jax_oc128.tree import Tree, accept_greedy, accept_sampled, check_parents, draft_tree

#: stop token ids per generate call (padded with -1 to this size, so their number never recompiles)
MAX_STOP_TOKENS = 8
#: seeds are 32-bit (``jax.random.key`` of a seed in [0, 2**32) is the same with and without x64)
MAX_SEED = 2**32 - 1
#: the most of a count the engine keeps in int32 (steps per dispatch, slots, prompt bucket)
MAX_INT32 = 2**31 - 1
#: decoding steps per dispatch by default: on the H200 (shipped model, 8 slots, plain) K = 1 / 4 / 16 / 64
#: gave 2724 / 9659 / 17127 / 21197 tokens/s end to end (bench/RESULTS.md, bench/bench_decode.py --sweep-k)
STEPS_PER_DISPATCH = 64
#: XLA options of the decode loop on a GPU: XLA's default command buffer (CUDA graph) contents plus WHILE
#: and CONDITIONAL, so that the ``while_loop`` and its condition are recorded too (conditional nodes) and a
#: dispatch of K steps runs without the host. With XLA's default the host evaluates the loop's condition
#: after every step: the call blocks for the whole dispatch and the GPU waits for the host between steps
#: (bench/RESULTS.md). Not applied when ``XLA_FLAGS`` sets ``--xla_gpu_enable_command_buffer`` itself.
GPU_LOOP_OPTIONS = {
    "xla_gpu_enable_command_buffer": ",".join(
        (
            "FUSION",
            "CUBLAS",
            "CUBLASLT",
            "CUSTOM_CALL",
            "CUDNN",
            "DYNAMIC_SLICE_FUSION",
            "WHILE",
            "CONDITIONAL",
        )
    )
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything that changes per step, a pytree (donated to every dispatch).

    Attributes:
      cache: the target's :class:`~jax_oc128.nn.ModelCache` (per-layer caches and the C128 state).
      mtp_cache: the MTP head's :class:`~jax_oc128.nn.AttentionCache` (None for a model without one).
      token: ``[slots]`` int32, the newest token of each slot (not yet in the caches).
      position: ``[slots]`` int32, its position (the number of tokens in the caches).
      hidden: ``[slots, draft_hidden_size]`` float32, the target's hidden state at ``position - 1``.
      active: ``[slots]`` bool, slots whose request is still generating.
      remaining: ``[slots]`` int32, tokens the slot's request may still generate.
      key: the PRNG key of the next step (split on the device).
    """

    cache: ModelCache
    mtp_cache: AttentionCache
    token: jax.Array
    position: jax.Array
    hidden: jax.Array
    active: jax.Array
    remaining: jax.Array
    key: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeOutput:
    """What one dispatch gives the host (device arrays; read them once the next dispatch is queued).

    Attributes:
      tokens: ``[K, slots, N]`` int32, each step's tokens; step i's first ``counts[i, slot]`` are new output.
      counts: ``[K, slots]`` int32, tokens kept per step and slot (0 for idle slots and steps not run).
      active: ``[slots]`` bool, the slots still generating after the dispatch (a slot that was active and is
        not has finished: its last kept token is a stop token or its budget is spent).
      steps: int32 scalar, the steps the loop ran.
      slot_steps: int32 scalar, active slots summed over those steps.
      accepted: int32 scalar, tokens the steps produced before truncation at stop tokens and budgets.
    """

    tokens: jax.Array
    counts: jax.Array
    active: jax.Array
    steps: jax.Array
    slot_steps: jax.Array
    accepted: jax.Array


def _pick(logits, key, temperature):
    """Greedy (temperature 0, static) or a sample of softmax(logits / temperature)."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature).astype(jnp.int32)


def _stop_rule(tokens, counts, remaining, stop_tokens):
    """A step's output per row cut at the first stop token (kept) and at the remaining budget.

    ``tokens`` ``[slots, N]``, ``counts`` ``[slots]`` (0 for idle rows), ``remaining`` ``[slots]``,
    ``stop_tokens`` ``[MAX_STOP_TOKENS]`` (-1 padding). Returns ``(kept [slots], done [slots])``: the row
    ends when it kept a stop token or spent its budget."""
    n = tokens.shape[1]
    produced = jnp.arange(n)[None] < counts[:, None]
    is_stop = produced & jnp.any(tokens[..., None] == stop_tokens[None, None], axis=-1)
    through_stop = jnp.where(
        jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1).astype(jnp.int32) + 1, n + 1
    )
    kept = jnp.minimum(jnp.minimum(counts, through_stop), remaining)
    done = (counts > 0) & ((through_stop <= kept) | (kept >= remaining))
    return kept, done


def _split_key(key, axis):
    """``(key, sub)``: the next key and a key for this step's draws, on a mesh (``axis`` the mesh axis of the
    slots, None without one) each device's own."""
    key, sub = jax.random.split(key)
    return key, sub if axis is None else jax.random.fold_in(sub, jax.lax.axis_index(axis))


def _any(x, axis):
    """Whether any of ``x`` (bool) is set: on a mesh, on any device along ``axis``."""
    return jnp.any(x) if axis is None else jax.lax.psum(jnp.any(x).astype(jnp.int32), axis) > 0


def _total(x, axis):
    """The int32 sum of ``x`` over all slots: on a mesh, over every device along ``axis`` too."""
    total = jnp.sum(x, dtype=jnp.int32)
    return total if axis is None else jax.lax.psum(total, axis)


def _prefill(model, state, tokens, lengths, budgets, stop_tokens, temperature, axis=None):
    """New requests: clear the slots of the rows with ``lengths`` > 0 and feed them right-padded prompts
    ``tokens`` [slots, P] (``budgets`` [slots] their max new tokens); the first generated token comes from
    the last prompt token. ``axis``: the mesh axis of the slots (the arrays are a device's slots), None
    without a mesh. Returns ``(state, DecodeOutput)``, the output holding the first tokens as one step with
    no steps counted."""
    slots = batch_slots(lengths)
    cache = state.cache.clear(slots)
    rows, width = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (rows, width))
    logits, hidden, cache = model.target(tokens, positions, cache, lengths=lengths, mode=ForwardMode.EXTEND)
    last = jnp.maximum(lengths - 1, 0)[:, None]
    key, sub = _split_key(state.key, axis)
    first = _pick(jnp.take_along_axis(logits, last[..., None], axis=1)[:, 0], sub, temperature)
    mtp_cache = state.mtp_cache
    if model.mtp is not None:  # it sees token p with the target's hidden state at p - 1, p = 1 .. length - 1
        prev = jnp.concatenate([jnp.zeros_like(hidden[:, :1]), hidden[:, :-1]], axis=1)
        _, _, mtp_cache = model.mtp(tokens, prev, positions, mtp_cache.clear(slots), lengths=lengths)
    new = lengths > 0
    kept, done = _stop_rule(first[:, None], new.astype(jnp.int32), budgets, stop_tokens)
    state = DecodeState(
        cache,
        mtp_cache,
        jnp.where(new, first, state.token),
        jnp.where(new, lengths, state.position),
        jnp.where(new[:, None], jnp.take_along_axis(hidden, last[..., None], axis=1)[:, 0], state.hidden),
        jnp.where(new, ~done, state.active),
        jnp.where(new, budgets - kept, state.remaining),
        key,
    )
    zero = jnp.zeros((), jnp.int32)
    return state, DecodeOutput(first[None, :, None], kept[None], state.active, zero, zero, zero)


def _plain_step(model, state, key, temperature):
    """One token per active slot with the target alone. Returns (state, tokens [slots, 1], counts [slots])."""
    lengths = state.active.astype(jnp.int32)
    logits, hidden, cache = model.target(
        state.token[:, None], state.position[:, None], state.cache, lengths=lengths, mode=ForwardMode.DECODE
    )
    nxt = _pick(logits[:, 0], key, temperature)
    state = dataclasses.replace(
        state,
        cache=cache,
        token=jnp.where(state.active, nxt, state.token),
        position=state.position + lengths,
        hidden=jnp.where(state.active[:, None], hidden[:, 0], state.hidden),
    )
    return state, nxt[:, None], lengths


def _speculative_step(model, state, key, num_tokens, temperature):
    """Draft N-1 tokens, verify N, accept, keep the bonus. Returns (state, tokens [slots, N], counts [slots]):
    each active slot's first ``counts`` tokens are its new output."""
    n, active = num_tokens, state.active
    one = active.astype(jnp.int32)
    keys = jax.random.split(key, n + 1)
    token, hidden, mtp_cache = state.token, state.hidden, state.mtp_cache
    drafts, draft_logits = [], []
    for i in range(n - 1):  # statically unrolled
        position = (state.position + i)[:, None]
        logits, h, mtp_cache = model.mtp(token[:, None], hidden[:, None], position, mtp_cache, lengths=one)
        token, hidden = _pick(logits[:, 0], keys[i], temperature), h[:, 0]
        drafts.append(token)
        draft_logits.append(logits[:, 0])
    tokens = jnp.stack([state.token, *drafts], axis=1)  # [slots, N]
    positions = state.position[:, None] + jnp.arange(n, dtype=jnp.int32)
    logits, hiddens, cache = model.target(
        tokens, positions, state.cache, lengths=one * n, mode=ForwardMode.TARGET_VERIFY
    )
    if temperature == 0:
        target = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [slots, N]
        agree = tokens[:, 1:] == target[:, :-1]
        accepted = jnp.sum(jnp.cumprod(agree, axis=1), axis=1, dtype=jnp.int32)  # drafts kept
        last = jnp.take_along_axis(target, accepted[:, None], axis=1)[:, 0]
    else:
        accepted, last = _rejection_sample(
            logits, jnp.stack(draft_logits, 1), tokens[:, 1:], keys[n - 1 :], temperature
        )
    out = jnp.where(jnp.arange(n)[None] < accepted[:, None], jnp.roll(tokens, -1, axis=1), 0)
    out = out.at[jnp.arange(out.shape[0]), accepted].set(last)
    counts = jnp.where(active, accepted + 1, 0)
    state = dataclasses.replace(
        state,
        cache=cache,
        mtp_cache=mtp_cache,
        token=jnp.where(active, last, state.token),
        position=state.position + counts,
        hidden=jnp.where(
            active[:, None], jnp.take_along_axis(hiddens, accepted[:, None, None], axis=1)[:, 0], state.hidden
        ),
    )
    return state, out, counts


def _tree_step(model, state, key, tree: Tree, temperature):
    """Draft ``tree`` with the MTP head level by level, verify its N nodes at once, keep the accepted path.
    Returns (state, tokens [slots, N], counts [slots]): each active slot's first ``counts`` tokens (the
    path's drafts, then the bonus token) are its new output."""
    n, active = tree.size, state.active
    one = active.astype(jnp.int32)
    draft_key, accept_key = jax.random.split(key)
    hidden = jnp.zeros((*state.hidden.shape[:1], n, state.hidden.shape[1]), state.hidden.dtype)
    drafted = tuple(node for level in tree.expanded for node in level)

    def draft_level(carry, tokens, level):
        """The MTP head on the level's nodes with children, each reading its parent's hidden state."""
        mtp_cache, hidden = carry
        nodes = tree.expanded[level]
        positions = jnp.broadcast_to((state.position + level)[:, None], (state.position.shape[0], len(nodes)))
        logits, h, mtp_cache = model.mtp(
            tokens[:, nodes],
            hidden[:, nodes],
            positions,
            mtp_cache,
            lengths=one * len(nodes),
            tree=tree,
            nodes=nodes,
        )
        for i, node in enumerate(nodes):
            hidden = hidden.at[:, list(tree.children[node])].set(h[:, i : i + 1])
        return logits, (mtp_cache, hidden)

    hidden = hidden.at[:, 0].set(state.hidden)
    tokens, draft_logits, (mtp_cache, _) = draft_tree(
        tree, state.token, draft_level, (state.mtp_cache, hidden), draft_key, temperature
    )
    positions = state.position[:, None] + jnp.asarray(tree.depths)
    logits, hiddens, cache = model.target(
        tokens, positions, state.cache, lengths=one * n, mode=ForwardMode.TARGET_VERIFY, tree=tree
    )
    if temperature == 0:
        accepted = accept_greedy(tree, logits, tokens)
    else:
        accepted = accept_sampled(tree, logits, draft_logits, tokens, accept_key, temperature)
    nodes = jnp.where(active, accepted.node, -1)
    counts = jnp.where(active, accepted.length, 0)
    out = jnp.zeros((tokens.shape[0], n), jnp.int32).at[:, : accepted.emitted.shape[1]].set(accepted.emitted)
    rows = jnp.arange(tokens.shape[0])
    state = dataclasses.replace(
        state,
        cache=model.target.keep_path(cache, tree, state.position, nodes),
        mtp_cache=mtp_cache.keep_path(tree, state.position, nodes, written=drafted),
        token=jnp.where(active, accepted.bonus, state.token),
        position=state.position + counts,
        hidden=jnp.where(active[:, None], hiddens[rows, accepted.node], state.hidden),
    )
    return state, out, counts


def _decode(model, state, stop_tokens, waiting, *, steps, num_tokens, temperature, tree=None, axis=None):
    """Up to ``steps`` plain (``num_tokens`` None), speculative (chain of ``num_tokens``) or tree (``tree``, a
    :class:`~jax_oc128.tree.Tree` of ``num_tokens`` nodes) steps in a ``lax.while_loop``; rows end on
    the device by :func:`_stop_rule`. The loop leaves early when no row is active, or when a row ended and
    ``waiting`` (a bool scalar: requests wait for a slot); on a mesh (``axis`` the mesh axis of the slots,
    the arrays a device's slots) every device runs the same steps. Returns ``(state, DecodeOutput)``."""
    slots, n = state.token.shape[0], num_tokens or 1
    zero = jnp.zeros((), jnp.int32)
    output = DecodeOutput(
        jnp.zeros((steps, slots, n), jnp.int32),
        jnp.zeros((steps, slots), jnp.int32),
        state.active,
        zero,
        zero,
        zero,
    )

    def running(carry):
        state, output, ended = carry
        return (output.steps < steps) & _any(state.active, axis) & ~(ended & waiting)

    def step(carry):
        state, output, ended = carry
        active, remaining = state.active, state.remaining
        key, sub = _split_key(state.key, axis)
        state = dataclasses.replace(state, key=key)
        if num_tokens is None:
            state, tokens, counts = _plain_step(model, state, sub, temperature)
        elif tree is not None:
            state, tokens, counts = _tree_step(model, state, sub, tree, temperature)
        else:
            state, tokens, counts = _speculative_step(model, state, sub, num_tokens, temperature)
        kept, done = _stop_rule(tokens, counts, remaining, stop_tokens)
        state = dataclasses.replace(state, active=active & ~done, remaining=remaining - kept)
        i = output.steps
        output = DecodeOutput(
            output.tokens.at[i].set(tokens),
            output.counts.at[i].set(kept),
            state.active,
            i + 1,
            output.slot_steps + _total(active, axis),
            output.accepted + _total(counts, axis),
        )
        return state, output, ended | _any(done, axis)

    state, output, _ = jax.lax.while_loop(running, step, (state, output, jnp.zeros((), bool)))
    return state, output


def _rejection_sample(target_logits, draft_logits, drafts, keys, temperature):
    """Speculative sampling: draft i is kept with probability min(1, p_i / q_i) while all before it were kept;
    at the first rejection the token is drawn from normalize(max(p - q, 0)), else the bonus from p_N.
    Returns (accepted drafts [slots], the last token [slots])."""
    p = jax.nn.softmax(target_logits / temperature, axis=-1)  # [slots, N, V]
    q = jax.nn.softmax(draft_logits / temperature, axis=-1)  # [slots, N-1, V]
    p_d = jnp.take_along_axis(p[:, :-1], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(keys[0], p_d.shape, p_d.dtype)
    keep = u * q_d < p_d  # u < p/q, without dividing by a zero q
    accepted = jnp.sum(jnp.cumprod(keep, axis=1), axis=1, dtype=jnp.int32)
    rows = jnp.arange(p.shape[0])
    p_at = p[rows, accepted]
    q_at = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)[rows, accepted]  # no draft after the last
    residual = jnp.maximum(p_at - q_at, 0.0)
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_at)
    last = jax.random.categorical(keys[1], jnp.log(residual)).astype(jnp.int32)
    return accepted, last


@dataclasses.dataclass
class Result:
    tokens: list[list[int]]
    steps: int  # decoding steps run (each a plain or a speculative step of every active slot)
    dispatches: int  # on-device loops run
    seconds: float
    mean_accepted: float  # tokens a slot gains per step (1 for plain decoding)


class _Placement:
    """Where an engine's arrays lie and how its steps run: on one device (``mesh`` None), or on a mesh of the
    axes ``("data", "model")``: the decode state split by slot over ``"data"``, each device running the steps
    on its own slots (a ``shard_map``), the parameters split over ``"model"`` by their rules
    (:mod:`jax_oc128.nn.sharding`), the dispatch's output gathered on every device.

    Args:
      mesh: the mesh, or None; params: the model's parameters; state: the decode state's layout.
    """

    def __init__(self, mesh: Mesh | None, params, state: DecodeState):
        self.mesh = mesh
        self.axis = None if mesh is None else sharding.DATA  # the mesh axis of the slots inside the steps
        self.params = None if mesh is None else sharding.param_specs(params, mesh)
        self.state = dataclasses.replace(sharding.slot_specs(state), key=P())  # the PRNG key everywhere
        per_step = sharding.slots_at(1)
        self.output = DecodeOutput(per_step, per_step, sharding.slots_at(0), P(), P(), P())

    def put_params(self, params):
        """The parameters on the device, or split over the mesh."""
        return jax.device_put(params, None if self.mesh is None else sharding.named(self.params, self.mesh))

    def per_slot_shard(self, fn, in_specs, out_specs):
        """``fn(params, *args)`` on each device's slots (the parameters whole, the args by ``in_specs``), or
        ``fn`` itself without a mesh."""
        if self.mesh is None:
            return fn
        # check_vma off: the C128 ops' custom calls and platform branches carry no varying-axes types
        return jax.shard_map(
            fn,
            mesh=self.mesh,
            in_specs=(P(), *in_specs),
            out_specs=out_specs,
            axis_names={self.axis},
            check_vma=False,
        )

    def jit_options(self, in_specs, out_specs) -> dict:
        """``jax.jit``'s placement of a step's arguments (the parameters first, then by ``in_specs``) and of
        its ``(state, output)``: the state as it came, the output, small, whole on every device (every
        process reads it)."""
        if self.mesh is None:
            return {}
        return dict(
            in_shardings=sharding.named((self.params, *in_specs), self.mesh),
            out_shardings=sharding.named((out_specs[0], P()), self.mesh),
        )

    def state_options(self) -> dict:
        """``jax.jit``'s placement of a function's decode state result."""
        return {} if self.mesh is None else dict(out_shardings=sharding.named(self.state, self.mesh))

    def host_rows(self, array):
        """A host array of the slots as a step takes it: on a mesh, each process gives its devices their slots
        (every process holds the whole array)."""
        if self.mesh is None:
            return array
        placement = NamedSharding(self.mesh, sharding.slots_at(0))
        return jax.make_array_from_callback(array.shape, placement, lambda index: array[index])


class Engine:
    """Generation over ``slots`` slots with a :class:`~jax_oc128.nn.SpeculativeModel`.

    Requests beyond the slots wait; a finished request frees its slot and the next one takes it (the slot's
    rows are cleared on allocation). The parameters are placed on the device once; the prefill and the
    decode loop are jitted once per engine with the decode state donated. On a GPU the loop is compiled
    with :data:`GPU_LOOP_OPTIONS` (one CUDA graph per dispatch). :meth:`generate` keeps its state between
    calls and reuses its buffers.

    Args:
      model: the target and its MTP head (a :class:`~jax_oc128.nn.SpeculativeModel`).
      slots: requests decoded together, an int >= 1.
      prompt_bucket: prompts are padded to a multiple of this (fewer prefill shapes, fewer compilations),
        an int >= 1.
      steps_per_dispatch: K, the most decoding steps one dispatch runs on the device (1: a dispatch per
        step, the host reading each step's tokens), an int >= 1.
      mesh: None (one device), or a :class:`jax.sharding.Mesh` of the axes ``("data", "model")``
        (:func:`jax_oc128.nn.sharding.make_mesh`). The slots are split over ``"data"`` (``slots`` a multiple
        of its size): each device runs the prefill and the decode loop on its own slots (``shard_map``),
        communicating only the loop's condition and counts; the parameters are split over ``"model"`` by
        :mod:`jax_oc128.nn.sharding` (tensor parallel). The jitted steps take and return the decode state
        in that layout. Greedy tokens are those of one device; sampling draws per device.
    """

    def __init__(
        self,
        model: SpeculativeModel,
        slots: int,
        *,
        prompt_bucket: int = 128,
        steps_per_dispatch: int = STEPS_PER_DISPATCH,
        mesh: Mesh | None = None,
    ):
        if not isinstance(model, SpeculativeModel):
            raise TypeError(f"model: must be a SpeculativeModel, got {type(model).__name__}")
        self.model = model
        self.slots = check_int("slots", slots, 1, MAX_INT32)
        self.prompt_bucket = check_int("prompt_bucket", prompt_bucket, 1, MAX_INT32)
        self.steps_per_dispatch = check_int("steps_per_dispatch", steps_per_dispatch, 1, MAX_INT32)
        self.mesh = None if mesh is None else sharding.check_mesh(mesh)
        if mesh is not None and self.slots % mesh.shape[sharding.DATA]:
            raise ValueError(
                f"slots: must be a multiple of the mesh's data axis ({mesh.shape[sharding.DATA]}), "
                f"got {self.slots}"
            )
        graphdef, params = nnx.split(model)

        def init_state(seed):  # the caches' layout comes from the config; no parameter is read
            slots = self.slots
            return DecodeState(
                model.target.init_cache(slots),
                None if model.mtp is None else model.mtp.init_cache(slots),
                token=jnp.zeros((slots,), jnp.int32),
                position=jnp.zeros((slots,), jnp.int32),
                hidden=jnp.zeros((slots, model.config.draft_hidden_size), jnp.float32),
                active=jnp.zeros((slots,), bool),
                remaining=jnp.zeros((slots,), jnp.int32),
                key=jax.random.key(seed),
            )

        # the decode state's tree, shapes and dtypes (traced, not compiled), what prefill and decode accept
        self._state_layout = jax.eval_shape(init_state, np.uint32(0))
        self._placement = placement = _Placement(self.mesh, params, self._state_layout)
        self.params = placement.put_params(params)
        row, axis = sharding.slots_at(0), placement.axis
        prefill_specs = ((placement.state, row, row, row, P()), (placement.state, placement.output))
        decode_specs = ((placement.state, P(), P()), (placement.state, placement.output))

        def prefill(params, state, tokens, lengths, budgets, stop_tokens, temperature):
            def run(params, *args):
                return _prefill(nnx.merge(graphdef, params), *args, temperature, axis)

            run = placement.per_slot_shard(run, *prefill_specs)
            return run(params, state, tokens, lengths, budgets, stop_tokens)

        def decode(params, state, stop_tokens, waiting, steps, num_tokens, temperature, tree=None):
            def run(params, *args):
                model = nnx.merge(graphdef, params)
                return _decode(
                    model,
                    *args,
                    steps=steps,
                    num_tokens=num_tokens,
                    temperature=temperature,
                    tree=tree,
                    axis=axis,
                )

            return placement.per_slot_shard(run, *decode_specs)(params, state, stop_tokens, waiting)

        def restart(state, seed):
            zeros = jnp.zeros_like(state.remaining)
            return dataclasses.replace(state, active=zeros > 0, remaining=zeros, key=jax.random.key(seed))

        device = jax.devices()[0] if mesh is None else mesh.devices.flat[0]
        loop_options = None
        if device.platform == "gpu" and "xla_gpu_enable_command_buffer" not in os.environ.get(
            "XLA_FLAGS", ""
        ):
            loop_options = GPU_LOOP_OPTIONS
        self._init_state = jax.jit(init_state, **placement.state_options())
        self._restart = jax.jit(restart, donate_argnames="state", **placement.state_options())
        self._prefill = jax.jit(
            prefill,
            static_argnames="temperature",
            donate_argnames="state",
            **placement.jit_options(*prefill_specs),
        )
        self._decode = jax.jit(
            decode,
            static_argnames=("steps", "num_tokens", "temperature", "tree"),
            donate_argnames="state",
            compiler_options=loop_options,
            **placement.jit_options(*decode_specs),
        )
        self._idle_state = None  # generate's state between calls (its buffers reused, their slots cleared)

    def init_state(self, seed: int = 0) -> DecodeState:
        """An empty decode state (no active slot), its PRNG key ``jax.random.key(seed)`` (``seed`` an int in
        [0, 2**32)); one dispatch, every leaf its own buffer (the state is donated)."""
        return self._init_state(_check_seed(seed))

    def prefill(
        self,
        state: DecodeState,
        assignments: Mapping,
        max_new_tokens: int,
        *,
        num_tokens=None,
        tree=None,
        stop_tokens=(),
        temperature=0.0,
    ):
        """Start the requests of ``assignments`` {slot: prompt}, each generating up to ``max_new_tokens``:
        their slots are cleared and their prompts fed (padded to a multiple of ``prompt_bucket``). A slot
        still active in ``state`` is not refused (that would need a device read): its request is dropped and
        the slot restarts with the new one.

        Args:
          state: this engine's :class:`DecodeState`, donated.
          assignments: a non-empty mapping from a slot (an int in [0, slots)) to its prompt: a sequence
            (list, tuple, bytes) or a 1-D integer array of token ids in [0, vocab_size), 1 to
            ``max_len - max_new_tokens - N`` long.
          max_new_tokens: an int in [1, max_len - N - 1].
          num_tokens, tree: those of the :meth:`decode` calls that will run these requests (None: plain
            steps, N = 1); only the lengths are checked against them (a speculative step writes up to N
            positions).
          stop_tokens: at most 8 token ids in [0, vocab_size).
          temperature: a number >= 0 (0: greedy).

        Returns ``(state, DecodeOutput)``: the output's one step holds each new slot's first generated token
        (greedy, or sampled at ``temperature``); a request whose first token ends it is no longer active."""
        _check_state(state, self._state_layout)
        config = self.model.config
        num_tokens, _ = _check_speculation(num_tokens, tree, self.model)
        longest_prompt = _check_max_new_tokens(max_new_tokens, num_tokens, config)
        stops = _stop_array(_check_stop_tokens(stop_tokens, config))
        temperature = _check_temperature(temperature)
        if not isinstance(assignments, Mapping):
            kind = type(assignments).__name__
            raise TypeError(f"assignments: must be a mapping {{slot: prompt}}, got {kind}")
        if not assignments:
            raise ValueError("assignments: no request (a mapping {slot: prompt} with at least one entry)")
        prompts = {}
        for slot, prompt in assignments.items():
            check_int("assignments: a slot", slot, 0, self.slots - 1)
            prompts[slot] = _prompt_array(f"assignments[{slot}]", prompt, config, longest_prompt)
        longest = max(map(len, prompts.values()))
        width = -(-longest // self.prompt_bucket) * self.prompt_bucket
        tokens = np.zeros((self.slots, width), np.int32)
        lengths = np.zeros(self.slots, np.int32)
        for slot, prompt in prompts.items():
            tokens[slot, : len(prompt)], lengths[slot] = prompt, len(prompt)
        budgets = np.full(self.slots, max_new_tokens, np.int32)
        rows = (self._placement.host_rows(x) for x in (tokens, lengths, budgets))
        return self._prefill(self.params, state, *rows, stops, temperature)

    def decode(
        self,
        state: DecodeState,
        *,
        num_tokens=None,
        tree=None,
        temperature=0.0,
        stop_tokens=(),
        steps=None,
        waiting=False,
    ) -> tuple[DecodeState, DecodeOutput]:
        """One dispatch: up to ``steps`` (default K) plain (``num_tokens`` None) or speculative (N =
        ``num_tokens``, an int in [2, max_draft]; with ``tree`` the nodes of that draft tree, as
        :meth:`generate` takes it) steps of every active slot, on the device, greedy or
        sampled at ``temperature`` (a number >= 0); rows end at a stop token (``stop_tokens``: at most 8 ids
        in [0, vocab_size)) or when their budget is spent, and with ``waiting`` (a bool) the loop also
        leaves once a row ends. ``state`` (this engine's, not yet donated) is donated; nothing is read back
        to the host."""
        _check_state(state, self._state_layout)
        config = self.model.config
        num_tokens, tree = _check_speculation(num_tokens, tree, self.model)
        temperature = _check_temperature(temperature)
        stops = _stop_array(_check_stop_tokens(stop_tokens, config))
        steps = self.steps_per_dispatch if steps is None else check_int("steps", steps, 1, MAX_INT32)
        if not isinstance(waiting, bool | np.bool_):
            raise TypeError(f"waiting: must be a bool, got {waiting!r}")
        waiting = np.bool_(waiting)
        return self._decode(self.params, state, stops, waiting, steps, num_tokens, temperature, tree)

    def generate(
        self,
        prompts,
        max_new_tokens,
        *,
        num_tokens=None,
        tree=None,
        temperature=0.0,
        stop_tokens=(),
        seed=0,
        progress=None,
    ) -> Result:
        """Generate up to ``max_new_tokens`` for each prompt with speculative steps of N = ``num_tokens``
        tokens (None: plain steps of the target alone), greedy or sampled at ``temperature``. A request ends
        after ``max_new_tokens`` or at the first of ``stop_tokens``, which is its last token.

        Args:
          prompts: a sequence (list, tuple) of prompts, each a sequence (list, tuple, bytes) or a 1-D
            integer array of token ids in [0, vocab_size), 1 to ``max_len - max_new_tokens - N`` long. An
            empty sequence returns an empty :class:`Result` at once (nothing dispatched).
          max_new_tokens: an int in [1, max_len - N - 1].
          num_tokens: None, or an int in [2, max_draft] (None only, for a model without an MTP head).
          tree: None (a chain of N: each step drafts N - 1 tokens one after the other), or a draft tree of
            N nodes (a :class:`~jax_oc128.tree.Tree` or its parents, a tuple of ints: ``tree[0] == -1``,
            ``0 <= tree[k] < k``; ``num_tokens`` None or N): the MTP head drafts each node's children as
            its top-k tokens (greedy) or k draws without replacement (sampled), the target verifies all N
            nodes in one forward and the row keeps the deepest accepted path (multi-draft speculative
            sampling at ``temperature`` > 0). Every layer type, on the online C128 state (the offline one
            verifies chains only).
          temperature: a number >= 0 (0: greedy).
          stop_tokens: at most 8 token ids in [0, vocab_size).
          seed: the sampling's PRNG seed, an int in [0, 2**32).
          progress: None, or a callable called with the number of tokens generated so far.

        Returns a :class:`Result`, ``tokens[i]`` the output of ``prompts[i]``."""
        config = self.model.config
        num_tokens, tree = _check_speculation(num_tokens, tree, self.model)
        longest_prompt = _check_max_new_tokens(max_new_tokens, num_tokens, config)
        temperature = _check_temperature(temperature)
        stop_tokens = _check_stop_tokens(stop_tokens, config)
        seed = _check_seed(seed)
        if progress is not None and not callable(progress):
            raise TypeError(f"progress: must be callable or None, got {progress!r}")
        if isinstance(prompts, str | bytes | bytearray) or not isinstance(prompts, Sequence | np.ndarray):
            raise TypeError(
                f"prompts: must be a sequence of prompts (each a sequence of token ids), "
                f"got {type(prompts).__name__}"
            )
        prompts = [_prompt_array(f"prompts[{i}]", p, config, longest_prompt) for i, p in enumerate(prompts)]
        if not prompts:
            return Result([], steps=0, dispatches=0, seconds=0.0, mean_accepted=0.0)
        start = time.perf_counter()
        # the last call's state, its slots made idle (a slot is cleared when a request takes it): no
        # allocation, and the decode loop's CUDA graph sees the same buffers as before; the first call
        # allocates it (and compiles the restart with everything else)
        state, self._idle_state = self._idle_state, None
        state = self._restart(self.init_state(seed) if state is None else state, seed)
        outputs = [[] for _ in prompts]
        waiting = collections.deque(range(len(prompts)))
        owner = {}  # slot -> request, as of the last output read
        unread = collections.deque()  # dispatched, not yet read: (owner of its slots, first tokens | output)
        totals = collections.Counter()

        def read(slots_owner, output):
            """Take a dispatch's (or a prefill's) tokens; free the slots whose request ended."""
            host = jax.device_get(output)  # the copies started at dispatch
            totals.update(steps=int(host.steps), slot_steps=int(host.slot_steps), accepted=int(host.accepted))
            for slot, request in slots_owner.items():
                for step in range(host.tokens.shape[0]):  # counts are 0 past the steps run
                    outputs[request].extend(host.tokens[step, slot, : host.counts[step, slot]].tolist())
                if not host.active[slot]:
                    owner.pop(slot, None)  # (a request that ended at its prefill is in the next snapshot too)
            if progress is not None:
                progress(sum(map(len, outputs)))

        while waiting or owner:
            free = [slot for slot in range(self.slots) if slot not in owner]
            if waiting and free:
                admitted = {slot: waiting.popleft() for slot in free[: len(waiting)]}
                state, output = self.prefill(
                    state,
                    {slot: prompts[r] for slot, r in admitted.items()},
                    max_new_tokens,
                    num_tokens=num_tokens,
                    tree=tree,
                    stop_tokens=stop_tokens,
                    temperature=temperature,
                )
                owner.update(admitted)
                unread.append((admitted, output))
            state, output = self.decode(
                state,
                num_tokens=num_tokens,
                tree=tree,
                temperature=temperature,
                stop_tokens=stop_tokens,
                waiting=bool(waiting),
            )
            totals["dispatches"] += 1
            for leaf in jax.tree.leaves(output):
                leaf.copy_to_host_async()
            unread.append((dict(owner), output))
            # read everything but this dispatch, which runs meanwhile; all of it when a slot must be freed
            while len(unread) > (0 if waiting else 1):
                read(*unread.popleft())
        seconds = time.perf_counter() - start
        self._idle_state = state
        mean = totals["accepted"] / max(1, totals["slot_steps"])
        return Result(outputs, totals["steps"], totals["dispatches"], seconds, mean)


def _check_seed(seed) -> np.uint32:
    """A PRNG seed, an int in [0, 2**32), as the uint32 the engine's jitted functions take."""
    return np.uint32(check_int("seed", seed, 0, MAX_SEED))


def _check_num_tokens(num_tokens, config) -> int | None:
    """N of a speculative step, an int in [2, max_draft], or None (plain steps, the only ones of a model
    without a draft head)."""
    if num_tokens is None:
        return None
    if not config.mtp:
        raise ValueError(
            "num_tokens: this model has no MTP head (its checkpoint carries no MTP layer), so it decodes "
            f"plainly only: pass num_tokens=None, got {num_tokens!r}"
        )
    return check_int("num_tokens", num_tokens, 2, config.max_draft, " = max_draft")


def _check_speculation(num_tokens, tree, model) -> tuple[int | None, Tree | None]:
    """``(num_tokens, tree)`` checked for ``model``: N (or None, plain steps) and the draft tree (None: the
    chain of N), a :class:`~jax_oc128.tree.Tree` or its parents, of N nodes (``num_tokens`` None: its
    size)."""
    config = model.config
    if tree is None:
        return _check_num_tokens(num_tokens, config), None
    tree = tree if isinstance(tree, Tree) else Tree(check_parents(tree, "tree"))
    if tree.size < 2:
        raise ValueError(f"tree: must have drafts (at least 2 nodes), got {tree}")
    if tree.size > config.max_draft:
        raise ValueError(f"tree: at most max_draft = {config.max_draft} nodes, got {tree.size}")
    if num_tokens is not None and num_tokens != tree.size:
        raise ValueError(f"num_tokens: None or the tree's {tree.size} nodes, got {num_tokens!r}")
    num_tokens = _check_num_tokens(tree.size, config)
    if HCA in config.layer_types and model.target.backend is not ONLINE:
        raise NotImplementedError("tree: a tree verifies on the online C128 state only (backend ONLINE)")
    return num_tokens, tree


def _check_max_new_tokens(max_new_tokens, num_tokens, config) -> int:
    """Checks a request's budget: an int in [1, max_len - N - 1] (N = ``num_tokens`` or 1 for plain steps),
    so that a prompt of one token fits. Returns the longest prompt it leaves room for,
    ``max_len - max_new_tokens - N`` (a step writes up to N positions)."""
    n = num_tokens or 1
    budget = check_int("max_new_tokens", max_new_tokens, 1, config.max_len - n - 1, " = max_len - N - 1")
    return config.max_len - budget - n


def _check_temperature(temperature) -> float:
    """A finite number >= 0 (bools refused), as a float (a static argument of the jitted functions)."""
    if not isinstance(temperature, int | float | np.integer | np.floating) or isinstance(temperature, bool):
        raise TypeError(f"temperature: must be a number, got {temperature!r}")
    if not 0 <= temperature < math.inf:
        raise ValueError(f"temperature: must be finite and >= 0, got {temperature}")
    return float(temperature)


def _check_stop_tokens(stop_tokens, config) -> tuple[int, ...]:
    """A collection (list, tuple, bytes, 1-D integer array) of at most :data:`MAX_STOP_TOKENS` token ids
    (ints, bools refused) in [0, vocab_size), as a tuple of ints."""
    if isinstance(stop_tokens, np.ndarray | jax.Array):
        stop_tokens = np.asarray(stop_tokens).tolist()  # a 0-d array gives a scalar, refused below
    if not isinstance(stop_tokens, Collection) or isinstance(stop_tokens, str):
        raise TypeError(f"stop_tokens: must be a sequence of token ids, got {stop_tokens!r}")
    if len(stop_tokens) > MAX_STOP_TOKENS:
        raise ValueError(f"stop_tokens: at most {MAX_STOP_TOKENS} ids, got {len(stop_tokens)}")
    for token in stop_tokens:
        if not is_int(token):
            raise TypeError(f"stop_tokens: ids must be ints, got {token!r}")
        if not 0 <= token < config.vocab_size:
            raise ValueError(f"stop_tokens: ids must be in [0, {config.vocab_size}), got {token}")
    return tuple(map(int, stop_tokens))


def _stop_array(stop_tokens: tuple[int, ...]) -> np.ndarray:
    """Checked ``stop_tokens`` as ``[MAX_STOP_TOKENS]`` int32 padded with -1."""
    return np.array([*stop_tokens, *[-1] * (MAX_STOP_TOKENS - len(stop_tokens))], np.int32)


def _prompt_array(name: str, prompt, config, longest: int) -> np.ndarray:
    """A prompt checked: a sequence (list, tuple, bytes) of ints or a 1-D integer array, 1 to ``longest``
    token ids in [0, vocab_size). Returns it as ``[length]`` int32."""
    if isinstance(prompt, np.ndarray | jax.Array):
        ids = np.asarray(prompt)
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise TypeError(f"{name}: must be a 1-D integer array, got {ids.dtype}{list(ids.shape)}")
    elif isinstance(prompt, Sequence) and not isinstance(prompt, str):
        ids = list(prompt)  # bytes as ints
        for token in ids:
            if not is_int(token):
                raise TypeError(f"{name}: token ids must be ints, got {token!r}")
    else:
        raise TypeError(f"{name}: must be a sequence of token ids, got {type(prompt).__name__}")
    if not 0 < len(ids) <= longest:
        raise ValueError(
            f"{name}: length {len(ids)} must be in [1, {longest} = max_len - max_new_tokens - N]"
        )
    low, high = (ids.min(), ids.max()) if isinstance(ids, np.ndarray) else (min(ids), max(ids))
    if low < 0 or high >= config.vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"{name}: token ids must be in [0, {config.vocab_size}), got {bad}")
    return np.asarray(ids, np.int32)


def _check_state(state, layout: DecodeState) -> None:
    """``state`` a :class:`DecodeState` of the engine's ``layout`` (its tree, shapes and dtypes) whose
    buffers were not donated yet; read on the host only (no device sync)."""
    if not isinstance(state, DecodeState):
        raise TypeError(
            f"state: must be a DecodeState (from init_state, prefill or decode), got {type(state).__name__}"
        )
    leaves, tree = jax.tree_util.tree_flatten_with_path(state)
    expected, expected_tree = jax.tree.flatten(layout)
    if tree != expected_tree:
        raise ValueError("state: not this engine's (its caches have another structure: another model?)")
    for (path, leaf), want in zip(leaves, expected, strict=True):
        where = f"state{jax.tree_util.keystr(path)}"
        if not isinstance(leaf, jax.Array):
            raise TypeError(f"state: {where} must be a jax.Array, got {type(leaf).__name__}")
        if leaf.shape != want.shape or leaf.dtype != want.dtype:
            raise ValueError(
                f"state: not this engine's: {where} is {leaf.dtype}{list(leaf.shape)}, this engine's is "
                f"{want.dtype}{list(want.shape)} (another slot count or model?)"
            )
    if any(leaf.is_deleted() for _, leaf in leaves):
        raise ValueError("state: already donated to an earlier call; use the state it returned")
