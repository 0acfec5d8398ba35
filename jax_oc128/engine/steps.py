"""The engine's device steps, pure functions of a model (a :class:`~jax_oc128.protocols.Model`) and a
:class:`~jax_oc128.engine.DecodeState`: the prefill, the plain step, the speculative step, the stop rule
and the decode loop that runs K steps in a ``lax.while_loop``.

**One speculative step for chains and trees.** A speculative step drafts a static draft tree (a
:class:`~jax_oc128.tree.Tree`; the chain of N, ``Tree.chain(N)``, is what ``num_tokens=N`` means) with
the model's drafter level by level (:func:`~jax_oc128.tree.draft_tree`), verifies its N nodes (node 0 the
newest token) with the model in one forward, accepts a path (:func:`~jax_oc128.tree.accept`: greedy, or
sampled so that the emitted tokens follow the target's distribution), keeps that path in the caches (the
model's and the drafter's ``keep_path``) and the bonus token.

**Sampling per slot.** Each slot samples by its own parameters (``state.sampling``, a
:class:`~jax_oc128.sampling.Sampling` of ``[slots]`` arrays set by the prefill: temperature, 0 greedy;
top-p; top-k), so requests of any parameters share a batch and a compilation.

On a mesh every function runs on one device's slots (``axis`` the mesh axis of the slots, None without a
mesh): the PRNG key is folded with the device's index and the loop's condition and counts are summed over
the axis.

**Cost follows the context.** Every forward is given a static context bound (the model's ``context``,
:func:`bound`): the prefill's chunk c the bucket of its end position, the decode loop the one the host
chose for the dispatch (the longest live position + the K x N positions its steps may write). A bound is a
power-of-two bucket, so that the compilations are few (one per bucket met).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp

from jax_oc128.controller import ForwardMode
from jax_oc128.engine.state import DecodeOutput, DecodeState
from jax_oc128.rules import batch_slots, context_bucket, per_row
from jax_oc128.sampling import Sampling, pick
from jax_oc128.tree import Tree, accept, draft_tree


def bound(longest: int, max_len: int, floor: int | None) -> int | None:
    """The static context bound of a forward (or a dispatch) whose rows reach at most ``longest`` positions:
    :func:`~jax_oc128.nn.context_bucket` of ``min(longest, max_len)`` from ``floor``, or None (every
    ``max_len`` position read) for ``floor`` None."""
    return None if floor is None else context_bucket(min(longest, max_len), max_len, floor)


def stop_rule(tokens, counts, remaining, stop_tokens):
    """A step's output per row cut at the first stop token (kept) and at the remaining budget.

    ``tokens`` ``[slots, W]`` int32, ``counts`` ``[slots]`` int32 (0 for idle rows), ``remaining``
    ``[slots]`` int32, ``stop_tokens`` ``[MAX_STOP_TOKENS]`` int32 (-1 padding). Returns ``(kept [slots],
    done [slots])``: the row ends when it kept a stop token or spent its budget."""
    width = tokens.shape[1]
    produced = jnp.arange(width)[None] < counts[:, None]
    is_stop = produced & jnp.any(tokens[..., None] == stop_tokens[None, None], axis=-1)
    through_stop = jnp.where(
        jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1).astype(jnp.int32) + 1, width + 1
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


def _prefill_segment(model, tokens, start, lengths, cache, draft_cache, before, context):
    """Feed the model (and its drafter, if any) ``tokens`` ``[slots, T]`` int32 at positions ``start``
    (``[slots, 1]`` int32) + 0 .. T - 1, the first ``lengths`` ``[slots]`` int32 of each row valid (rows of
    length 0 untouched), bounded by ``context`` (static, :func:`bound`); ``before`` ``[slots, H]`` float32 is
    the target's hidden state at ``start - 1`` (zeros at ``start`` 0), the drafter's input at the segment's
    first position. Returns ``(logits [slots, V], hidden [slots, H], end [slots, H], cache, draft_cache)``:
    the logits and the model's hidden state at each row's last valid token of the segment (the first
    position's for rows of length 0), its hidden state at the segment's last position (the next segment's
    ``before``), the updated caches."""
    rows, width = tokens.shape
    positions = start + jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (rows, width))
    last = jnp.maximum(lengths - 1, 0)
    logits, hidden, cache = model(
        tokens, positions, cache, lengths=lengths, mode=ForwardMode.EXTEND, context=context, logits_at=last
    )
    if model.drafter is not None:  # it sees token p with the model's hidden state at p - 1
        prev = jnp.concatenate([before[:, None], hidden[:, :-1]], axis=1)
        _, _, draft_cache = model.drafter(tokens, prev, positions, draft_cache, lengths=lengths)
    return logits[:, 0], per_row(hidden, last), hidden[:, -1], cache, draft_cache


def _prefill_chunks(
    model, tokens, starts, lengths, cache, draft_cache, chunk: int, before, floor, start_bound
):
    """:func:`_prefill_segment` over the ``P // chunk`` chunks of ``tokens`` ``[slots, P]`` (``P`` a multiple
    of ``chunk``), the caches in the carry of a ``lax.scan`` per context bound: chunk c holds positions
    ``starts + c * chunk ..``, ``clip(lengths - c * chunk, 0, chunk)`` of each row valid, and is bounded by
    :func:`bound` of ``start_bound + (c + 1) * chunk`` from ``floor`` (the chunks of one bound one scan, at
    most one scan per bucket). The carry keeps the logits and the hidden
    state of each row's last prompt token (taken in the chunk that holds it) and the target's hidden state at
    the chunk's last position (the next chunk's drafter input, first ``before`` ``[slots, H]`` float32).
    Returns ``(logits [slots, V], hidden [slots, H], cache, draft_cache)``."""
    rows, width = tokens.shape
    offsets = jnp.arange(0, width, chunk, dtype=jnp.int32)

    def step(carry, segment, *, context):
        logits, hidden, before, cache, draft_cache = carry
        chunk_tokens, offset = segment
        seg_lengths = jnp.clip(lengths - offset, 0, chunk)
        seg_logits, seg_hidden, end, cache, draft_cache = _prefill_segment(
            model, chunk_tokens, starts[:, None] + offset, seg_lengths, cache, draft_cache, before, context
        )
        holds_last = ((seg_lengths > 0) & (lengths - offset <= chunk))[:, None]
        logits = jnp.where(holds_last, seg_logits, logits)
        hidden = jnp.where(holds_last, seg_hidden, hidden)
        return (logits, hidden, end, cache, draft_cache), None

    segments = tokens.reshape(rows, -1, chunk).swapaxes(0, 1)
    no_logits = jnp.zeros((rows, model.vocab_size), jnp.float32)
    carry = (no_logits, jnp.zeros_like(before), before, cache, draft_cache)
    contexts = [bound(start_bound + (c + 1) * chunk, model.max_len, floor) for c in range(width // chunk)]
    first = 0
    for context, run in itertools.groupby(contexts):
        last = first + len(list(run))
        body = functools.partial(step, context=context)
        carry, _ = jax.lax.scan(body, carry, (segments[first:last], offsets[first:last]))
        first = last
    logits, hidden, _, cache, draft_cache = carry
    return logits, hidden, cache, draft_cache


def feed(model, state: DecodeState, tokens, starts, lengths, *, chunk=None, floor=None, start_bound=0):
    """Feed rows ``tokens`` ``[slots, T]`` int32 at positions ``starts`` ``[slots]`` int32 on, the first
    ``lengths`` ``[slots]`` int32 of each row valid: a row with ``starts`` 0 is cleared first (a new
    request), one past 0 continues what its slot holds (its caches and ``hidden`` those of its first
    ``starts`` tokens: an earlier feed, or a restored prefix, :mod:`~jax_oc128.engine.prefix_cache`); rows
    of length 0 are untouched. Static: ``chunk``: None, one forward of the T positions; an int dividing T,
    chunks of ``chunk`` positions one after the other (:func:`_prefill_chunks`: the activations and logits
    of one chunk at a time); ``floor``: the context buckets' floor, each forward bounded by :func:`bound`
    of ``start_bound`` (at least every row's ``starts``) + its end (None: unbounded). Returns ``(state,
    logits [slots, V])``: the caches fed and ``hidden`` set at each fed row's last token, and its logits."""
    cache = model.clear(state.cache, batch_slots(jnp.where(starts == 0, lengths, 0)))
    drafter = model.drafter
    draft_cache = state.draft_cache
    if drafter is not None:
        draft_cache = drafter.clear(draft_cache, batch_slots(jnp.where(starts == 0, lengths, 0)))
    before = jnp.where((starts > 0)[:, None], state.hidden, 0.0)
    if chunk is None:
        context = bound(start_bound + tokens.shape[1], model.max_len, floor)
        logits, hidden, _, cache, draft_cache = _prefill_segment(
            model, tokens, starts[:, None], lengths, cache, draft_cache, before, context
        )
    else:
        logits, hidden, cache, draft_cache = _prefill_chunks(
            model, tokens, starts, lengths, cache, draft_cache, chunk, before, floor, start_bound
        )
    new = (lengths > 0)[:, None]
    state = dataclasses.replace(
        state, cache=cache, draft_cache=draft_cache, hidden=jnp.where(new, hidden, state.hidden)
    )
    return state, logits


def prefill(
    model,
    state: DecodeState,
    tokens,
    starts,
    lengths,
    budgets,
    sampling: Sampling,
    stop_tokens,
    *,
    chunk=None,
    floor=None,
    start_bound=0,
    axis=None,
):
    """New requests: :func:`feed` the rows with ``lengths`` ``[slots]`` > 0 their right-padded prompts
    ``tokens`` ``[slots, P]`` int32 from ``starts`` ``[slots]`` int32 (0: the whole prompt, its slot
    cleared; past 0: the rest of a prompt whose first ``starts`` tokens the slot holds), ``budgets``
    ``[slots]`` their max new tokens, ``sampling`` their sampling parameters (``[slots]`` each, kept in the
    state); the first generated token comes from the last prompt token. ``chunk``, ``floor``,
    ``start_bound``: static, as :func:`feed` takes them. Returns ``(state, DecodeOutput)``, the output
    holding the first tokens as one step with no steps counted."""
    feeding = dict(chunk=chunk, floor=floor, start_bound=start_bound)
    state, logits = feed(model, state, tokens, starts, lengths, **feeding)
    new = lengths > 0
    sampling = jax.tree.map(lambda given, kept: jnp.where(new, given, kept), sampling, state.sampling)
    key, sub = _split_key(state.key, axis)
    first = pick(logits, sub, sampling)
    kept, done = stop_rule(first[:, None], new.astype(jnp.int32), budgets, stop_tokens)
    state = dataclasses.replace(
        state,
        token=jnp.where(new, first, state.token),
        position=jnp.where(new, starts + lengths, state.position),
        active=jnp.where(new, ~done, state.active),
        remaining=jnp.where(new, budgets - kept, state.remaining),
        sampling=sampling,
        key=key,
    )
    zero = jnp.zeros((), jnp.int32)
    return state, DecodeOutput(first[None, :, None], kept[None], state.active, zero, zero, zero)


def plain_step(model, state: DecodeState, key, context=None):
    """One token per active slot with the model alone, bounded by ``context`` (static). Returns ``(state,
    tokens [slots, 1], counts [slots])``."""
    lengths = state.active.astype(jnp.int32)
    with jax.named_scope("target"):
        logits, hidden, cache = model(
            state.token[:, None],
            state.position[:, None],
            state.cache,
            lengths=lengths,
            mode=ForwardMode.DECODE,
            context=context,
        )
    nxt = pick(logits[:, 0], key, state.sampling)
    state = dataclasses.replace(
        state,
        cache=cache,
        token=jnp.where(state.active, nxt, state.token),
        position=state.position + lengths,
        hidden=jnp.where(state.active[:, None], hidden[:, 0], state.hidden),
    )
    return state, nxt[:, None], lengths


def _draft_level(model, tree: Tree, position, active, carry, tokens, level: int):
    """:func:`~jax_oc128.tree.draft_tree`'s ``draft_fn``: the drafter on the nodes of ``level`` that have
    children (``tokens`` ``[slots, N]``, at ``position`` ``[slots]`` + ``level``), each reading its parent's
    hidden state from ``carry = (draft_cache, hidden)``, ``hidden`` ``[slots, n, H]`` the drafter's outputs
    at the nodes of the level before (``tree.expanded[level - 1]``; at level 0 the model's hidden state of
    the root). Returns ``(logits [slots, nodes, V], (draft_cache, the drafter's outputs at the level's
    nodes))``."""
    draft_cache, hidden = carry
    nodes = tree.expanded[level]
    if level:  # each node's parent among the level before's nodes (for a chain, the one node)
        parents = tree.expanded[level - 1]
        hidden = hidden[:, [parents.index(tree.parents[node]) for node in nodes]]
    positions = jnp.broadcast_to((position + level)[:, None], (position.shape[0], len(nodes)))
    logits, hidden, draft_cache = model.drafter(
        tokens[:, nodes],
        hidden,
        positions,
        draft_cache,
        lengths=active.astype(jnp.int32) * len(nodes),
        tree=tree,
        nodes=nodes,
    )
    return logits, (draft_cache, hidden)


def speculative_step(model, state: DecodeState, key, tree: Tree, context=None):
    """Draft ``tree`` (N nodes) with the model's drafter level by level, verify its N nodes at once (bounded
    by ``context``, static), accept a path (each slot by its sampling parameters) and keep it. Returns
    ``(state, tokens [slots, depth + 1], counts [slots])``: each active slot's first ``counts`` tokens (the
    path's drafts, then the bonus token) are its new output."""
    active = state.active
    draft_key, accept_key = jax.random.split(key)
    draft_fn = functools.partial(_draft_level, model, tree, state.position, active)
    with jax.named_scope("draft"):
        tokens, draft_logits, (draft_cache, _) = draft_tree(
            tree, state.token, draft_fn, (state.draft_cache, state.hidden[:, None]), draft_key, state.sampling
        )
    positions = state.position[:, None] + jnp.asarray(tree.depths)
    with jax.named_scope("target"):
        logits, hiddens, cache = model(
            tokens,
            positions,
            state.cache,
            lengths=active.astype(jnp.int32) * tree.size,
            mode=ForwardMode.TARGET_VERIFY,
            tree=tree,
            context=context,
        )
    accepted = accept(tree, logits, draft_logits, tokens, accept_key, state.sampling)
    nodes = jnp.where(active, accepted.node, -1)
    counts = jnp.where(active, accepted.length, 0)
    drafted = tuple(node for level in tree.expanded for node in level)
    state = dataclasses.replace(
        state,
        cache=model.keep_path(cache, tree, state.position, nodes),
        draft_cache=model.drafter.keep_path(draft_cache, tree, state.position, nodes, drafted),
        token=jnp.where(active, accepted.bonus, state.token),
        position=state.position + counts,
        hidden=jnp.where(active[:, None], per_row(hiddens, accepted.node), state.hidden),
    )
    return state, accepted.emitted, counts


def decode_loop(
    model, state: DecodeState, stop_tokens, waiting, *, steps: int, tree, context=None, axis=None
):
    """Up to ``steps`` plain (``tree`` None) or speculative (``tree`` a static :class:`~jax_oc128.tree.Tree`)
    steps in a ``lax.while_loop``, every forward bounded by ``context`` (static: None, or at least every
    active row's position + ``steps`` x N, :func:`bound`); rows end on the device by :func:`stop_rule`
    (``stop_tokens`` ``[MAX_STOP_TOKENS]`` int32). The loop leaves early when no row is active, or when a row
    ended and ``waiting`` (a bool scalar: requests wait for a slot); on a mesh every device runs the same
    steps. Returns ``(state, DecodeOutput)``."""
    width = 1 if tree is None else tree.depth + 1
    slots = state.token.shape[0]
    zero = jnp.zeros((), jnp.int32)
    output = DecodeOutput(
        jnp.zeros((steps, slots, width), jnp.int32),
        jnp.zeros((steps, slots), jnp.int32),
        state.active,
        *[zero] * 3,
    )
    step = functools.partial(_loop_step, model, stop_tokens, tree=tree, context=context, axis=axis)
    running = functools.partial(_loop_running, waiting, steps=steps, axis=axis)
    state, output, _ = jax.lax.while_loop(running, step, (state, output, jnp.zeros((), bool)))
    return state, output


def _loop_running(waiting, carry, *, steps: int, axis):
    """The decode loop's condition on its carry ``(state, output, ended)``."""
    state, output, ended = carry
    return (output.steps < steps) & _any(state.active, axis) & ~(ended & waiting)


def _loop_step(model, stop_tokens, carry, *, tree, context, axis):
    """One step of the decode loop on its carry ``(state, output, ended)``: a plain or speculative step, the
    stop rule, the step's tokens and counts written into the output."""
    state, output, ended = carry
    active, remaining = state.active, state.remaining
    key, sub = _split_key(state.key, axis)
    state = dataclasses.replace(state, key=key)
    if tree is None:
        state, tokens, counts = plain_step(model, state, sub, context)
    else:
        state, tokens, counts = speculative_step(model, state, sub, tree, context)
    kept, done = stop_rule(tokens, counts, remaining, stop_tokens)
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
