"""The engine's pytrees: the decode state donated to every dispatch and the output a dispatch gives the host,
and the host's :class:`Result` of a ``generate`` call."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_oc128.protocols import Cache, Model
from jax_oc128.sampling import Sampling


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything that changes per step, a pytree (donated to every dispatch).

    Attributes:
      cache: the model's cache (:meth:`jax_oc128.protocols.Model.init_cache`).
      draft_cache: the drafter's cache (:meth:`jax_oc128.protocols.Drafter.init_cache`; None for a model
        without a drafter).
      token: ``[slots]`` int32, the newest token of each slot (not yet in the caches).
      position: ``[slots]`` int32, its position (the number of tokens in the caches).
      hidden: ``[slots, draft_hidden_size]`` float32, the target's hidden state at ``position - 1``.
      active: ``[slots]`` bool, slots whose request is still generating.
      remaining: ``[slots]`` int32, tokens the slot's request may still generate.
      sampling: the slots' sampling parameters (:class:`~jax_oc128.sampling.Sampling`, ``[slots]`` each),
        set by the prefill.
      key: the PRNG key of the next step (split on the device).
      engine: static (pytree metadata), the number of the :class:`~jax_oc128.engine.Engine` that made it:
        another engine refuses it, even one of the same layout.
    """

    cache: Cache
    draft_cache: Cache
    token: jax.Array
    position: jax.Array
    hidden: jax.Array
    active: jax.Array
    remaining: jax.Array
    sampling: Sampling
    key: jax.Array
    engine: int = dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeOutput:
    """What one dispatch gives the host (device arrays; read them once the next dispatch is queued).

    Attributes:
      tokens: ``[K, slots, W]`` int32, each step's tokens (W: 1 for plain steps, the draft tree's depth + 1
        for speculative ones, N for the chain of N); step i's first ``counts[i, slot]`` are new output.
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


@dataclasses.dataclass
class Result:
    """What :meth:`~jax_oc128.engine.Engine.generate` returns.

    Attributes:
      tokens: per prompt, its generated token ids.
      steps: decoding steps run (each a plain or a speculative step of every active slot).
      dispatches: on-device loops run.
      seconds: the call's wall time.
      mean_accepted: tokens a slot gains per step (1 for plain decoding).
      request_steps: per prompt, the steps that gave it tokens (its prefill one of them): ``len(tokens[i]) /
        request_steps[i]`` is its tokens per step.
      prefills: prefill calls run (each admits the prompts that free slots take at once: one when every
        prompt has a slot, more when prompts wait for slots).
    """

    tokens: list[list[int]]
    steps: int
    dispatches: int
    seconds: float
    mean_accepted: float
    request_steps: list[int] = dataclasses.field(default_factory=list)
    prefills: int = 0


def init_state(model: Model, slots: int, engine: int, seed, pages=None, page_size: int = 0) -> DecodeState:
    """An empty decode state of ``slots`` slots for ``model`` made by the engine numbered ``engine``, its PRNG
    key ``jax.random.key(seed)``, its caches paged with ``pages`` pages of ``page_size`` tokens (None:
    dense): the caches' layout comes from the model's static facts, no parameter is read."""
    drafter = model.drafter
    return DecodeState(
        model.init_cache(slots, pages, page_size),
        None if drafter is None else drafter.init_cache(slots),
        token=jnp.zeros((slots,), jnp.int32),
        position=jnp.zeros((slots,), jnp.int32),
        hidden=jnp.zeros((slots, model.draft_hidden_size), jnp.float32),
        active=jnp.zeros((slots,), bool),
        remaining=jnp.zeros((slots,), jnp.int32),
        sampling=Sampling(
            jnp.zeros((slots,), jnp.float32), jnp.ones((slots,), jnp.float32), jnp.zeros((slots,), jnp.int32)
        ),
        key=jax.random.key(seed),
        engine=engine,
    )


def set_page_table(model: Model, state: DecodeState, page_table) -> DecodeState:
    """``state`` with the page table ``page_table`` ``[slots, max_len // page_size]`` int32 in ``model``'s
    cache (:meth:`~jax_oc128.protocols.Model.with_page_table`)."""
    return dataclasses.replace(state, cache=model.with_page_table(state.cache, page_table))


def restart(state: DecodeState, seed) -> DecodeState:
    """``state`` with every slot idle and the PRNG key ``jax.random.key(seed)`` (the caches kept: a slot is
    cleared when a request takes it)."""
    zeros = jnp.zeros_like(state.remaining)
    return dataclasses.replace(state, active=zeros > 0, remaining=zeros, key=jax.random.key(seed))
