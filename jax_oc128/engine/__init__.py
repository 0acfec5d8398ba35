"""Batch generation over a fixed number of slots: prefill, then plain or speculative steps run K at a time
inside one on-device loop, with the whole decode state donated.

The engine drives any :class:`~jax_oc128.protocols.Model` (it imports no model class). A speculative step
drafts a static draft tree (``num_tokens=N``: the chain of N, ``Tree.chain(N)``) with the model's drafter
(the MTP head) level by level, verifies its N nodes (the newest token + the drafts) with the target in one
forward, accepts a path (greedy: the deepest the target agrees with; sampling: multi-draft speculative
sampling, so that tokens follow the target's distribution) and keeps the bonus token.

One dispatch (:meth:`Engine.decode`) runs up to K steps in a ``lax.while_loop``, writing each step's tokens
into a device buffer and ending rows on the device (max new tokens, stop tokens); it leaves early when every
row is done, or when a row finishes while requests wait. :meth:`Engine.generate` reads each dispatch's
buffer while the next one runs, and admits waiting requests between dispatches.

Modules: :mod:`~jax_oc128.engine.steps` (the device steps: prefill, the plain and the speculative step, the
stop rule, the loop), :mod:`~jax_oc128.engine.placement` (one device or a mesh, and the jitted functions),
:mod:`~jax_oc128.engine.arguments` (the host-side checks of every argument), :mod:`~jax_oc128.engine.memory`
(the decode state and each dispatch's program checked against the devices' free memory),
:mod:`~jax_oc128.engine.state` (the decode state and the outputs), :mod:`~jax_oc128.engine.requests`
(:class:`RequestScheduler`: requests added and aborted at any time, continuous batching),
:mod:`~jax_oc128.engine.scheduler` (:class:`Engine`, the host scheduler; ``generate`` a loop over a
:class:`RequestScheduler`).
"""

from jax_oc128.engine.arguments import MAX_SEED, MAX_STOP_TOKENS
from jax_oc128.engine.requests import RequestScheduler, SamplingParams, StepOutput
from jax_oc128.engine.scheduler import GPU_LOOP_OPTIONS, STEPS_PER_DISPATCH, Engine
from jax_oc128.engine.state import DecodeOutput, DecodeState, Result

__all__ = [
    "GPU_LOOP_OPTIONS",
    "MAX_SEED",
    "MAX_STOP_TOKENS",
    "STEPS_PER_DISPATCH",
    "DecodeOutput",
    "DecodeState",
    "Engine",
    "RequestScheduler",
    "Result",
    "SamplingParams",
    "StepOutput",
]
