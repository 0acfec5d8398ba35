"""Batch generation over a fixed number of slots: prefill, plain greedy steps and jit-compiled MTP speculative
steps, with the whole cache pytree donated.

A speculative step drafts N-1 tokens with the MTP head, verifies the N tokens (the newest token + the drafts)
with the target in one forward, accepts (greedy: the longest prefix of drafts the target agrees with;
sampling: the speculative rejection rule, so that tokens follow the target's distribution), and keeps the
bonus token.
The C128 states' commits are lazy: the next forward of a slot commits them, fused into its verify kernel.
Each step compiles once per (slots, N); nothing syncs with the host but reading the tokens out.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_oc128.controller import ForwardMode
from jax_oc128.nn import AttentionCache, ModelCache, SpeculativeModel


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything that changes per step, a pytree (donated to every step).

    Attributes:
      cache: the target's :class:`~jax_oc128.nn.ModelCache` (per-layer caches and the C128 state).
      mtp_cache: the MTP head's :class:`~jax_oc128.nn.AttentionCache`.
      token: ``[slots]`` int32, the newest token of each slot (not yet in the caches).
      position: ``[slots]`` int32, its position (the number of tokens in the caches).
      hidden: ``[slots, hidden]`` float32, the target's hidden state at ``position - 1``.
      active: ``[slots]`` bool, slots holding a request.
    """

    cache: ModelCache
    mtp_cache: AttentionCache
    token: jax.Array
    position: jax.Array
    hidden: jax.Array
    active: jax.Array


def _pick(logits, key, temperature):
    """Greedy (temperature 0, static) or a sample of softmax(logits / temperature)."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature"), donate_argnames=("state",))
def _prefill(graphdef, params, state, slots, tokens, lengths, key, temperature):
    """New requests: clear ``slots`` [slots] (-1: none) and feed right-padded prompts ``tokens`` [slots, P]
    (``lengths`` 0 for rows that are not new); the first generated token comes from the last prompt token."""
    model = nnx.merge(graphdef, params)
    cache = state.cache.clear(slots)
    mtp_cache = state.mtp_cache.clear(slots)
    rows, width = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (rows, width))
    logits, hidden, cache = model.target(tokens, positions, cache, lengths=lengths, mode=ForwardMode.EXTEND)
    last = jnp.maximum(lengths - 1, 0)[:, None]
    first = _pick(jnp.take_along_axis(logits, last[..., None], axis=1)[:, 0], key, temperature)
    # the MTP head sees token p with the target's hidden state at p - 1, for p = 1 .. length - 1
    prev = jnp.concatenate([jnp.zeros_like(hidden[:, :1]), hidden[:, :-1]], axis=1)
    _, _, mtp_cache = model.mtp(tokens, prev, positions, mtp_cache, lengths=lengths)
    new = lengths > 0
    return DecodeState(
        cache,
        mtp_cache,
        jnp.where(new, first, state.token),
        jnp.where(new, lengths, state.position),
        jnp.where(new[:, None], jnp.take_along_axis(hidden, last[..., None], axis=1)[:, 0], state.hidden),
        state.active | new,
    )


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature"), donate_argnames=("state",))
def _plain_step(graphdef, params, state, key, temperature):
    """One token per active slot with the target alone. Returns (state, tokens [slots, 1], counts [slots])."""
    model = nnx.merge(graphdef, params)
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


@functools.partial(
    jax.jit, static_argnames=("graphdef", "num_tokens", "temperature"), donate_argnames=("state",)
)
def _speculative_step(graphdef, params, state, key, num_tokens, temperature):
    """Draft N-1 tokens, verify N, accept, keep the bonus. Returns (state, tokens [slots, N], counts [slots]):
    each active slot's first ``counts`` tokens are its new output."""
    model = nnx.merge(graphdef, params)
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
        accepted = jnp.sum(jnp.cumprod(agree, axis=1), axis=1)  # drafts kept
        last = jnp.take_along_axis(target, accepted[:, None], axis=1)[:, 0]
    else:
        accepted, last = _rejection_sample(
            logits, jnp.stack(draft_logits, 1), tokens[:, 1:], keys[n - 1 :], temperature
        )
    out = jnp.where(jnp.arange(n)[None] < accepted[:, None], jnp.roll(tokens, -1, axis=1), 0)
    out = out.at[jnp.arange(out.shape[0]), accepted].set(last)
    counts = jnp.where(active, accepted + 1, 0)
    state = DecodeState(
        cache,
        mtp_cache,
        jnp.where(active, last, state.token),
        state.position + counts,
        jnp.where(
            active[:, None], jnp.take_along_axis(hiddens, accepted[:, None, None], axis=1)[:, 0], state.hidden
        ),
        active,
    )
    return state, out, counts


def _rejection_sample(target_logits, draft_logits, drafts, keys, temperature):
    """Speculative sampling: draft i is kept with probability min(1, p_i / q_i) while all before it were kept;
    at the first rejection the token is drawn from normalize(max(p - q, 0)), else the bonus from p_N.
    Returns (accepted drafts [slots], the last token [slots])."""
    p = jax.nn.softmax(target_logits / temperature, axis=-1)  # [slots, N, V]
    q = jax.nn.softmax(draft_logits / temperature, axis=-1)  # [slots, N-1, V]
    p_d = jnp.take_along_axis(p[:, :-1], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(keys[0], p_d.shape)
    keep = u * q_d < p_d  # u < p/q, without dividing by a zero q
    accepted = jnp.sum(jnp.cumprod(keep, axis=1), axis=1)
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
    steps: int
    seconds: float
    mean_accepted: float  # tokens a slot gains per step (1 for plain decoding)


class Engine:
    """Generation over ``slots`` slots with a :class:`~jax_oc128.nn.SpeculativeModel`.

    Requests beyond the slots wait; a finished request frees its slot and the next one takes it (the slot's
    rows are cleared on allocation).
    """

    def __init__(self, model: SpeculativeModel, slots: int, prompt_bucket: int = 128):
        self.model, self.slots, self.prompt_bucket = model, slots, prompt_bucket
        self.graphdef, self.params = nnx.split(model)

    def init_state(self) -> DecodeState:
        target, config = self.model.target, self.model.config
        return DecodeState(
            target.init_cache(self.slots),
            self.model.mtp.init_cache(self.slots),
            jnp.zeros((self.slots,), jnp.int32),
            jnp.zeros((self.slots,), jnp.int32),
            jnp.zeros((self.slots, config.hidden_size), jnp.float32),
            jnp.zeros((self.slots,), bool),
        )

    def prefill(self, state: DecodeState, assignments: dict, key, temperature: float = 0.0) -> DecodeState:
        """Start the requests of ``assignments`` {slot: prompt token ids}: their slots are cleared and their
        prompts fed (padded to a multiple of ``prompt_bucket``); ``state.token`` then holds each new slot's
        first generated token (greedy, or sampled at ``temperature`` with ``key``)."""
        longest = max(len(p) for p in assignments.values())
        width = -(-longest // self.prompt_bucket) * self.prompt_bucket
        tokens = np.zeros((self.slots, width), np.int32)
        lengths = np.zeros(self.slots, np.int32)
        slots = np.full(self.slots, -1, np.int32)
        for slot, prompt in assignments.items():
            tokens[slot, : len(prompt)], lengths[slot], slots[slot] = prompt, len(prompt), slot
        return _prefill(self.graphdef, self.params, state, slots, tokens, lengths, key, temperature)

    def step(self, state: DecodeState, key, *, num_tokens=None, temperature: float = 0.0):
        """One decoding step of every active slot: plain (``num_tokens`` None) or speculative with N =
        ``num_tokens``. Returns ``(state, tokens [slots, N], counts [slots])``: each active slot's first
        ``counts`` tokens are its new output. ``state`` is donated."""
        if num_tokens is None:
            return _plain_step(self.graphdef, self.params, state, key, temperature)
        return _speculative_step(self.graphdef, self.params, state, key, num_tokens, temperature)

    def generate(self, prompts, max_new_tokens, *, num_tokens=None, temperature=0.0, seed=0, progress=None):
        """Generate ``max_new_tokens`` for each prompt (lists of token ids) with speculative steps of N =
        ``num_tokens`` tokens (None: plain steps of the target alone), greedy or sampled at ``temperature``.
        ``progress`` is called with the number of tokens generated so far. Returns a :class:`Result`."""
        config = self.model.config
        if num_tokens is not None and not 2 <= num_tokens <= config.max_draft:
            raise ValueError(
                f"num_tokens: N must be in [2, {config.max_draft}] (None: plain), got {num_tokens}"
            )
        if temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {temperature}")
        for i, prompt in enumerate(prompts):
            if not 0 < len(prompt) <= config.max_len - max_new_tokens - (num_tokens or 1):
                raise ValueError(
                    f"prompts[{i}]: length {len(prompt)} must be in [1, max_len - max_new_tokens - N]"
                )
            if min(prompt) < 0 or max(prompt) >= config.vocab_size:
                raise ValueError(f"prompts[{i}]: token ids must be in [0, {config.vocab_size})")
        state, key = self.init_state(), jax.random.key(seed)
        outputs = [[] for _ in prompts]
        waiting = list(range(len(prompts)))
        owner = {}  # slot -> request
        steps, emitted, slot_steps, start = 0, 0, 0, time.perf_counter()
        while waiting or owner:
            free = [s for s in range(self.slots) if s not in owner]
            if waiting and free:
                admitted = {slot: waiting.pop(0) for slot in free[: len(waiting)]}
                key, sub = jax.random.split(key)
                state = self.prefill(state, {s: prompts[r] for s, r in admitted.items()}, sub, temperature)
                first = np.asarray(state.token)
                for slot, request in admitted.items():
                    owner[slot] = request
                    outputs[request].append(int(first[slot]))
            key, sub = jax.random.split(key)
            state, tokens, counts = self.step(state, sub, num_tokens=num_tokens, temperature=temperature)
            tokens, counts = np.asarray(tokens), np.asarray(counts)  # the one host read of a step
            steps, slot_steps = steps + 1, slot_steps + len(owner)
            done = []
            for slot, request in owner.items():
                emitted += int(counts[slot])
                room = max_new_tokens - len(outputs[request])
                outputs[request].extend(int(t) for t in tokens[slot, : min(counts[slot], room)])
                if len(outputs[request]) >= max_new_tokens:
                    done.append(slot)
            for slot in done:
                del owner[slot]
            if done:
                state = dataclasses.replace(state, active=state.active.at[np.asarray(done)].set(False))
            if progress is not None:
                progress(sum(map(len, outputs)))
        return Result(outputs, steps, time.perf_counter() - start, emitted / max(1, slot_steps))
