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
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_oc128.controller import ForwardMode
from jax_oc128.nn import AttentionCache, ModelCache, SpeculativeModel

#: stop token ids per generate call (padded with -1 to this size, so their number never recompiles)
MAX_STOP_TOKENS = 8
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
      mtp_cache: the MTP head's :class:`~jax_oc128.nn.AttentionCache`.
      token: ``[slots]`` int32, the newest token of each slot (not yet in the caches).
      position: ``[slots]`` int32, its position (the number of tokens in the caches).
      hidden: ``[slots, hidden]`` float32, the target's hidden state at ``position - 1``.
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


def _prefill(model, state, slots, tokens, lengths, budgets, stop_tokens, temperature):
    """New requests: clear ``slots`` [slots] (-1: none) and feed right-padded prompts ``tokens`` [slots, P]
    (``lengths`` 0 for rows that are not new; ``budgets`` [slots] their max new tokens); the first generated
    token comes from the last prompt token. Returns ``(state, DecodeOutput)``, the output holding the first
    tokens as one step with no steps counted."""
    cache = state.cache.clear(slots)
    mtp_cache = state.mtp_cache.clear(slots)
    rows, width = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (rows, width))
    logits, hidden, cache = model.target(tokens, positions, cache, lengths=lengths, mode=ForwardMode.EXTEND)
    last = jnp.maximum(lengths - 1, 0)[:, None]
    key, sub = jax.random.split(state.key)
    first = _pick(jnp.take_along_axis(logits, last[..., None], axis=1)[:, 0], sub, temperature)
    # the MTP head sees token p with the target's hidden state at p - 1, for p = 1 .. length - 1
    prev = jnp.concatenate([jnp.zeros_like(hidden[:, :1]), hidden[:, :-1]], axis=1)
    _, _, mtp_cache = model.mtp(tokens, prev, positions, mtp_cache, lengths=lengths)
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


def _decode(model, state, stop_tokens, waiting, *, steps, num_tokens, temperature):
    """Up to ``steps`` plain (``num_tokens`` None) or speculative steps in a ``lax.while_loop``; rows end on
    the device by :func:`_stop_rule`. The loop leaves early when no row is active, or when a row ended and
    ``waiting`` (a bool scalar: requests wait for a slot). Returns ``(state, DecodeOutput)``."""
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
        return (output.steps < steps) & jnp.any(state.active) & ~(ended & waiting)

    def step(carry):
        state, output, ended = carry
        active, remaining = state.active, state.remaining
        key, sub = jax.random.split(state.key)
        state = dataclasses.replace(state, key=key)
        if num_tokens is None:
            state, tokens, counts = _plain_step(model, state, sub, temperature)
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
            output.slot_steps + jnp.sum(active, dtype=jnp.int32),
            output.accepted + jnp.sum(counts, dtype=jnp.int32),
        )
        return state, output, ended | jnp.any(done)

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


class Engine:
    """Generation over ``slots`` slots with a :class:`~jax_oc128.nn.SpeculativeModel`.

    Requests beyond the slots wait; a finished request frees its slot and the next one takes it (the slot's
    rows are cleared on allocation). The parameters are placed on the device once; the prefill and the
    decode loop are jitted once per engine with the decode state donated.

    Args:
      model: the target and its MTP head.
      slots: requests decoded together.
      prompt_bucket: prompts are padded to a multiple of this (fewer prefill shapes, fewer compilations).
      steps_per_dispatch: K, the most decoding steps one dispatch runs on the device (1: a dispatch per
        step, the host reading each step's tokens).
    """

    def __init__(
        self,
        model: SpeculativeModel,
        slots: int,
        *,
        prompt_bucket: int = 128,
        steps_per_dispatch: int = STEPS_PER_DISPATCH,
    ):
        for name, value in (
            ("slots", slots),
            ("prompt_bucket", prompt_bucket),
            ("steps_per_dispatch", steps_per_dispatch),
        ):
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name}: must be a positive int, got {value!r}")
        self.model, self.slots, self.prompt_bucket = model, int(slots), int(prompt_bucket)
        self.steps_per_dispatch = int(steps_per_dispatch)
        graphdef, params = nnx.split(model)
        self.params = jax.device_put(params)

        def prefill(params, state, slots, tokens, lengths, budgets, stop_tokens, temperature):
            model = nnx.merge(graphdef, params)
            return _prefill(model, state, slots, tokens, lengths, budgets, stop_tokens, temperature)

        def decode(params, state, stop_tokens, waiting, steps, num_tokens, temperature):
            model = nnx.merge(graphdef, params)
            return _decode(
                model,
                state,
                stop_tokens,
                waiting,
                steps=steps,
                num_tokens=num_tokens,
                temperature=temperature,
            )

        def init_state(seed):  # the caches' layout comes from the config; no parameter is read
            slots = self.slots
            return DecodeState(
                model.target.init_cache(slots),
                model.mtp.init_cache(slots),
                token=jnp.zeros((slots,), jnp.int32),
                position=jnp.zeros((slots,), jnp.int32),
                hidden=jnp.zeros((slots, model.config.hidden_size), jnp.float32),
                active=jnp.zeros((slots,), bool),
                remaining=jnp.zeros((slots,), jnp.int32),
                key=jax.random.key(seed),
            )

        def restart(state, seed):
            zeros = jnp.zeros_like(state.remaining)
            return dataclasses.replace(state, active=zeros > 0, remaining=zeros, key=jax.random.key(seed))

        loop_options = None
        if jax.default_backend() == "gpu" and "xla_gpu_enable_command_buffer" not in os.environ.get(
            "XLA_FLAGS", ""
        ):
            loop_options = GPU_LOOP_OPTIONS
        self._init_state = jax.jit(init_state)
        self._restart = jax.jit(restart, donate_argnames="state")
        self._prefill = jax.jit(prefill, static_argnames="temperature", donate_argnames="state")
        self._decode = jax.jit(
            decode,
            static_argnames=("steps", "num_tokens", "temperature"),
            donate_argnames="state",
            compiler_options=loop_options,
        )
        self._idle_state = None  # generate's state between calls (its buffers reused, their slots cleared)

    def init_state(self, seed: int = 0) -> DecodeState:
        """An empty decode state (no active slot), its PRNG key from ``seed``; one dispatch, every leaf its
        own buffer (the state is donated)."""
        return self._init_state(np.int32(seed))

    def prefill(
        self, state: DecodeState, assignments: dict, max_new_tokens: int, *, stop_tokens=(), temperature=0.0
    ):
        """Start the requests of ``assignments`` {slot: prompt token ids}, each generating up to
        ``max_new_tokens``: their slots are cleared and their prompts fed (padded to a multiple of
        ``prompt_bucket``). Returns ``(state, DecodeOutput)``: the output's one step holds each new slot's
        first generated token (greedy, or sampled at ``temperature``); a request whose first token ends it
        is no longer active. ``state`` is donated."""
        longest = max(len(p) for p in assignments.values())
        width = -(-longest // self.prompt_bucket) * self.prompt_bucket
        tokens = np.zeros((self.slots, width), np.int32)
        lengths = np.zeros(self.slots, np.int32)
        slots = np.full(self.slots, -1, np.int32)
        for slot, prompt in assignments.items():
            tokens[slot, : len(prompt)], lengths[slot], slots[slot] = prompt, len(prompt), slot
        budgets = np.full(self.slots, max_new_tokens, np.int32)
        return self._prefill(
            self.params, state, slots, tokens, lengths, budgets, _stop_array(stop_tokens), temperature
        )

    def decode(
        self,
        state: DecodeState,
        *,
        num_tokens=None,
        temperature=0.0,
        stop_tokens=(),
        steps=None,
        waiting=False,
    ) -> tuple[DecodeState, DecodeOutput]:
        """One dispatch: up to ``steps`` (default K) plain (``num_tokens`` None) or speculative (N =
        ``num_tokens``) steps of every active slot, on the device; rows end at a stop token or when their
        budget is spent, and with ``waiting`` the loop also leaves once a row ends. ``state`` is donated;
        nothing is read back to the host."""
        steps = self.steps_per_dispatch if steps is None else steps
        return self._decode(
            self.params, state, _stop_array(stop_tokens), np.bool_(waiting), steps, num_tokens, temperature
        )

    def generate(
        self,
        prompts,
        max_new_tokens,
        *,
        num_tokens=None,
        temperature=0.0,
        stop_tokens=(),
        seed=0,
        progress=None,
    ) -> Result:
        """Generate up to ``max_new_tokens`` for each prompt (lists of token ids) with speculative steps of
        N = ``num_tokens`` tokens (None: plain steps of the target alone), greedy or sampled at
        ``temperature``. A request ends after ``max_new_tokens`` or at the first of ``stop_tokens`` (at most
        8 ids), which is its last token. ``progress`` is called with the number of tokens generated so far.
        Returns a :class:`Result`."""
        config = self.model.config
        if not _is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be a positive int, got {max_new_tokens!r}")
        if num_tokens is not None and not (_is_int(num_tokens) and 2 <= num_tokens <= config.max_draft):
            raise ValueError(
                f"num_tokens: N must be an int in [2, {config.max_draft}] (None: plain), got {num_tokens!r}"
            )
        if not (isinstance(temperature, int | float | np.number) and 0 <= float(temperature) < math.inf):
            raise ValueError(f"temperature: must be a finite number >= 0, got {temperature!r}")
        for i, prompt in enumerate(prompts):
            if not all(map(_is_int, prompt)):
                raise TypeError(f"prompts[{i}]: token ids must be ints")
            if not 0 < len(prompt) <= config.max_len - max_new_tokens - (num_tokens or 1):
                raise ValueError(
                    f"prompts[{i}]: length {len(prompt)} must be in [1, max_len - max_new_tokens - N]"
                )
            if min(prompt) < 0 or max(prompt) >= config.vocab_size:
                raise ValueError(f"prompts[{i}]: token ids must be in [0, {config.vocab_size})")
        start = time.perf_counter()
        # the last call's state, its slots made idle (a slot is cleared when a request takes it): no
        # allocation, and the decode loop's CUDA graph sees the same buffers as before; the first call
        # allocates it (and compiles the restart with everything else)
        state, self._idle_state = self._idle_state, None
        state = self._restart(self.init_state(seed) if state is None else state, np.int32(seed))
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
                    stop_tokens=stop_tokens,
                    temperature=temperature,
                )
                owner.update(admitted)
                unread.append((admitted, output))
            state, output = self.decode(
                state,
                num_tokens=num_tokens,
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


def _is_int(value) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _stop_array(stop_tokens) -> np.ndarray:
    """``stop_tokens`` (a sequence of token ids, at most :data:`MAX_STOP_TOKENS`) as ``[MAX_STOP_TOKENS]``
    int32 padded with -1."""
    ids = np.asarray(list(stop_tokens), np.int64).reshape(-1)
    if ids.size > MAX_STOP_TOKENS:
        raise ValueError(f"stop_tokens: at most {MAX_STOP_TOKENS} ids, got {ids.size}")
    if ids.size and ids.min() < 0:
        raise ValueError(f"stop_tokens: ids must be >= 0, got {ids.min()}")
    return np.concatenate([ids, np.full(MAX_STOP_TOKENS - ids.size, -1)]).astype(np.int32)
