""":class:`Engine`, the host scheduler: it checks every argument (:mod:`~jax_oc128.engine.arguments`), places
the parameters and the decode state (:mod:`~jax_oc128.engine.placement`), dispatches the jitted device
steps (:mod:`~jax_oc128.engine.steps`) and, in :meth:`Engine.generate`, admits waiting requests into free
slots between dispatches while it reads each dispatch's output as the next one runs."""

from __future__ import annotations

import functools
import itertools
import os
import time
from collections.abc import Mapping
from typing import NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jax_oc128.checks import check_int
from jax_oc128.engine import arguments, memory, placement
from jax_oc128.engine import steps as step_fns
from jax_oc128.engine.requests import RequestScheduler, SamplingParams
from jax_oc128.engine.state import DecodeOutput, DecodeState, Result, init_state, restart, set_page_table
from jax_oc128.nn import sharding
from jax_oc128.protocols import Model

#: numbers the engines of this process (:attr:`Engine.number`)
_ENGINE_NUMBERS = itertools.count(1)
#: decoding steps per dispatch by default: the host's per-dispatch cost shrinks with K; the end-to-end rate
#: measured highest at 64 of 1 / 4 / 16 / 64 (bench/RESULTS.md, bench/bench_decode.py --sweep-k)
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


def on_gpu(mesh: Mesh | None) -> bool:
    """Whether the engine's first device (the mesh's, else JAX's default) is a GPU."""
    return (jax.devices()[0] if mesh is None else mesh.devices.flat[0]).platform == "gpu"


def loop_compiler_options(mesh: Mesh | None) -> dict | None:
    """The decode loop's XLA options on the engine's first device: :data:`GPU_LOOP_OPTIONS` on a GPU
    unless ``XLA_FLAGS`` sets the command buffer, else None."""
    if on_gpu(mesh) and "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
        return GPU_LOOP_OPTIONS
    return None


class PromptRows(NamedTuple):
    """A feed's host rows and static shape (:meth:`Engine._prompt_rows`).

    Attributes:
      tokens: ``[slots, width]`` int32, each slot's prompt from column 0 (width a multiple of
        ``prompt_bucket``, zeros past the prompt and in slots without one).
      starts: ``[slots]`` int32, the position each slot's tokens start at (0 where new).
      lengths: ``[slots]`` int32, each slot's tokens (0: none).
      chunk: ``prefill_chunk`` with the width a multiple of it, or None: one forward, for a width of at most
        one chunk.
      start_bound: a context bucket at least every row's start, 0 when none continues (so the chunks' bounds
        stay few).
    """

    tokens: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    chunk: int | None
    start_bound: int


class Engine:
    """Generation over ``slots`` slots with a model (a :class:`~jax_oc128.protocols.Model`, e.g. a
    :class:`~jax_oc128.nn.SpeculativeModel`).

    Requests beyond the slots wait; a finished request frees its slot and the next one takes it (the slot's
    rows are cleared on allocation). The parameters are placed on the device once; the prefill and the
    decode loop are jitted once per engine with the decode state donated, and each compiles once per
    (slots, draft tree, K, context bucket; the prefill per padded width): the sampling parameters are per slot
    on the device. On a GPU the loop is
    compiled with :data:`GPU_LOOP_OPTIONS` (one CUDA graph per dispatch). :meth:`generate` keeps its state
    between calls and reuses its buffers.

    Speculation is given as ``num_tokens=N`` (the chain of N: each step drafts N - 1 tokens one after the
    other) or ``tree`` (a draft tree of N nodes); both are one speculative step of a
    :class:`~jax_oc128.tree.Tree` (``num_tokens=N`` is ``tree=Tree.chain(N)``), see
    :mod:`jax_oc128.engine.steps`.

    Args:
      model: a :class:`flax.nnx.Module` implementing :class:`~jax_oc128.protocols.Model` (the target and
        its drafter, e.g. a :class:`~jax_oc128.nn.SpeculativeModel`: DeepSeek-V4 and its MTP head).
      slots: requests decoded together, an int >= 1.
      prompt_bucket: prompts are padded to a multiple of this (fewer prefill shapes, fewer compilations),
        an int >= 1.
      prefill_chunk: ``"auto"`` (the default: on a GPU :data:`GPU_PREFILL_CHUNK`, less where a device's
        slots times it would pass :data:`GPU_PREFILL_POSITIONS`; None elsewhere), None (the
        prefill is one forward of the padded prompts), or an int >= 1: a prefill of padded prompts longer
        than ``prefill_chunk`` feeds them ``prefill_chunk`` positions at a time, one chunk after the other
        in a ``lax.scan`` (one compilation), so that its activations and logits are those of one chunk
        (``[slots, prefill_chunk, vocab]`` logits, not ``[slots, P, vocab]``); their padded width is then
        rounded up to a multiple of ``prefill_chunk`` too (shorter ones: one forward). No alignment is
        needed (a chunk may end inside a CSA window or a C128 block); the tokens are those of one forward,
        up to float rounding.
      steps_per_dispatch: K, the most decoding steps one dispatch runs on the device (1: a dispatch per
        step, the host reading each step's tokens), an int >= 1.
      mesh: None (one device), or a :class:`jax.sharding.Mesh` of the axes ``("data", "model")``
        (:func:`jax_oc128.nn.sharding.make_mesh`, or ``jax.make_mesh``: Explicit axes are taken as Auto,
        ``engine.mesh``). The slots are split over ``"data"`` (``slots`` a multiple
        of its size): each device runs the prefill and the decode loop on its own slots (``shard_map``),
        communicating only the loop's condition and counts; the parameters are split over ``"model"`` by
        :mod:`jax_oc128.nn.sharding` (tensor parallel). The jitted steps take and return the decode state
        in that layout. Greedy tokens are those of one device; sampling draws per device.
      pages: None (dense caches: every slot holds ``max_len`` tokens of entries), or an int >= 1 (a
        multiple of the mesh's data axis): paged caches, the entries and indexer keys of every compressed
        layer in a pool of ``pages`` pages of ``page_size`` tokens shared by the slots
        (``[pages, page_size // rate, ...]`` per layer; a page table ``[slots, max_len // page_size]``
        int32 in the model's cache, :meth:`~jax_oc128.protocols.Model.with_page_table`; a model without
        paged caches refuses ``pages``). :meth:`generate` reserves for a
        request the pages of its prompt + ``max_new_tokens`` + N tokens when it admits it (a request waits
        while too few are unreserved), assigns them as the dispatches can write them (K x N tokens ahead)
        and frees them when the request ends (:class:`~jax_oc128.engine.pages.PagePool`); with
        :meth:`prefill` and :meth:`decode` the caller sets the page table (:meth:`set_page_table`). Tokens
        are the dense layout's.
      page_size: tokens per page, a multiple of 128 dividing ``max_len`` (paged only).
      context_floor: the smallest context bucket, None or a multiple of 128 (paged: rounded up to a
        common multiple of ``page_size``). Every forward reads only the first ``context`` positions of each
        slot's caches (the model's ``context``), ``context`` the least ``context_floor * 2^k`` (capped at
        ``max_len``) covering what the forward's rows may reach: a prefill chunk's end; the longest live
        request + the K x N positions a dispatch may write, known on the host
        (:func:`~jax_oc128.engine.steps.bound`): the cost follows the context, not ``max_len``, with one
        compilation per bucket met (at most ``log2(max_len / context_floor) + 1`` of each step). None:
        every forward reads all ``max_len`` positions.

    Attributes:
      number: this engine's number in the process (from 1), carried by its decode states
        (:attr:`DecodeState.engine`): another engine's state is refused, even one of the same layout.
      page_pool: paged, the last :meth:`generate` call's :class:`~jax_oc128.engine.pages.PagePool` (None
        before, and for dense caches); once the call returns, every page is back in it.
    """

    def __init__(
        self,
        model: Model,
        slots: int,
        *,
        prompt_bucket: int = 128,
        prefill_chunk: int | str | None = "auto",
        steps_per_dispatch: int = STEPS_PER_DISPATCH,
        mesh: Mesh | None = None,
        pages: int | None = None,
        page_size: int = 256,
        context_floor: int | None = 256,
    ):
        self.model = arguments.check_model(model)
        self.mesh = None if mesh is None else sharding.check_mesh(mesh)
        self.slots = arguments.check_slots(slots, self.mesh)
        self.prompt_bucket = arguments.check_count("prompt_bucket", prompt_bucket)
        device_slots = self.slots // sharding.data_devices(self.mesh)
        self.prefill_chunk = arguments.check_prefill_chunk(prefill_chunk, on_gpu(self.mesh), device_slots)
        self.steps_per_dispatch = arguments.check_count("steps_per_dispatch", steps_per_dispatch)
        self.pages, self.page_size = arguments.check_pages(pages, page_size, model, self.mesh)
        self.context_floor = arguments.check_context_floor(context_floor, self.pages, self.page_size)
        graphdef, params = nnx.split(model)
        self.number = next(_ENGINE_NUMBERS)  # the decode states it makes carry it
        new_state = functools.partial(
            init_state, model, self.slots, self.number, pages=self.pages, page_size=self.page_size
        )
        # the decode state's tree, shapes and dtypes (traced, not compiled), what prefill and decode accept
        self._state_layout = jax.eval_shape(new_state, np.uint32(0))
        self._placement = where = placement.Placement(self.mesh, params, self._state_layout)
        self._state_bytes = memory.per_device_bytes(self._state_layout, where.state, self.mesh)
        self.params = where.put_params(params)
        self._init_state = jax.jit(new_state, **where.state_options())
        self._restart = jax.jit(restart, donate_argnames="state", **where.state_options())
        self._set_page_table = jax.jit(
            functools.partial(set_page_table, model), donate_argnames="state", **where.state_options()
        )
        self._prefill = jax.jit(
            functools.partial(placement.prefill, graphdef, where, floor=self.context_floor),
            static_argnames=("chunk", "start_bound"),
            donate_argnames="state",
            **where.jit_options(*where.prefill_specs),
        )
        self._decode = jax.jit(
            functools.partial(placement.decode, graphdef, where),
            static_argnames=("steps", "tree", "context"),
            donate_argnames="state",
            compiler_options=loop_compiler_options(self.mesh),
            **where.jit_options(*where.decode_specs),
        )
        self._idle_state = None  # generate's state between calls (its buffers reused, their slots cleared)
        self.page_pool = None  # paged: the last generate call's PagePool
        self._fitted = set()  # the dispatches' compilations found to fit the devices' memory (_check_fits)

    def init_state(self, seed: int = 0) -> DecodeState:
        """An empty decode state (no active slot), its PRNG key ``jax.random.key(seed)`` (``seed`` an int in
        [0, 2**32)); one dispatch, every leaf its own buffer (the state is donated). Where the devices report
        their memory, a state larger than a device's free bytes is refused first, naming ``max_len`` (dense)
        or ``pages`` (:func:`~jax_oc128.engine.memory.check_state`)."""
        seed = arguments.check_seed(seed)
        if self.pages is None:
            what = f"{self.slots} slots of max_len {self.model.max_len}"
            memory.check_state(
                self._state_bytes, self.mesh, what, "max_len", "lower max_len or slots, or use pages"
            )
        else:
            what = f"{self.pages} pages of {self.page_size} tokens, {self.slots} slots"
            memory.check_state(self._state_bytes, self.mesh, what, "pages", "lower pages or slots")
        return self._init_state(seed)

    def _check_fits(self, key: tuple, lower, describe, others: str) -> None:
        """:func:`~jax_oc128.engine.memory.check_program` of a dispatch's jitted function, once per ``key``
        (its static arguments and shapes: one compilation) found to fit; ``describe()`` names the dispatch
        (called only to raise: a dispatch formats nothing)."""
        if key not in self._fitted and memory.check_program(lower, self.mesh, describe, others):
            self._fitted.add(key)

    def set_page_table(self, state: DecodeState, page_table) -> DecodeState:
        """A paged engine's ``state`` (donated) with the page table ``page_table``, ``[slots, max_len //
        page_size]`` integers: slot s's tokens ``[k * page_size, (k + 1) * page_size)`` in page
        ``page_table[s, k]`` of its device's pool (in [0, pages / data devices); -1: none, what a forward
        would write there is dropped). No two slots may share a page."""
        arguments.check_state_is_this_engines(state, self._state_layout)
        shape = (self.slots, self.model.max_len // self.page_size)
        table = arguments.check_page_table(page_table, shape, self.pages, self.mesh)
        return self._set_page_table(state, self._placement.host_rows(table))

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
        top_p=None,
        top_k=None,
    ) -> tuple[DecodeState, DecodeOutput]:
        """Start the requests of ``assignments`` {slot: prompt}, each generating up to ``max_new_tokens``:
        their slots are cleared and their prompts fed (padded to a multiple of ``prompt_bucket``, and of
        ``prefill_chunk`` if set). A slot still active in ``state`` is not refused (that would need a device
        read): its request is dropped and the slot restarts with the new one.

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
          temperature, top_p, top_k: the new slots' sampling (as :meth:`generate` takes them), kept in the
            state for the :meth:`decode` calls.

        Returns ``(state, DecodeOutput)``: the output's one step holds each new slot's first generated token
        (greedy, or sampled); a request whose first token ends it is no longer active."""
        arguments.check_state_is_this_engines(state, self._state_layout)
        tree = arguments.check_speculation(num_tokens, tree, self.model)
        longest_prompt = arguments.check_max_new_tokens(max_new_tokens, tree, self.model)
        stops = arguments.stop_array(arguments.check_stop_tokens(stop_tokens, self.model))
        params = SamplingParams(
            max_new_tokens,
            arguments.check_temperature(temperature),
            top_p=arguments.check_top_p(top_p),
            top_k=arguments.check_top_k(top_k),
        )
        prompts = arguments.check_assignments(assignments, self.slots, self.model, longest_prompt)
        return self._prefill_rows(state, prompts, dict.fromkeys(prompts, params), stops)

    def _prefill_rows(self, state, prompts: dict, params: dict, stops, starts=None, names=None):
        """:meth:`prefill` of checked arguments: ``prompts`` {slot: ``[length]`` int32}, ``params`` {slot:
        its :class:`SamplingParams`, checked (``top_p`` a float, ``top_k`` an int)}, ``stops``
        ``[MAX_STOP_TOKENS]`` int32 (``arguments.stop_array``); ``starts`` None, or {slot: the position its
        prompt's tokens start at, the slot holding the ones before (:func:`~jax_oc128.engine.steps.feed`)};
        ``names`` None, or {slot: its request as an error names it} (default "slot S's prompt")."""
        rows = self._prompt_rows(prompts, starts)
        args = self._prefill_args(rows, prompts, params, stops)
        self._check_feed_fits(
            "prefill", lambda: self._prefill.lower(self.params, state, *args), prompts, starts, names, rows
        )
        return self._prefill(self.params, state, *args)

    def _check_feed_fits(self, kind: str, lower, prompts: dict, starts, names, rows: PromptRows) -> None:
        """:meth:`_check_fits` of a dispatch feeding ``prompts`` from ``starts`` (:meth:`_prefill_rows`'
        arguments, ``names`` too), ``lower`` giving its program of ``rows`` (:meth:`_prompt_rows`'); ``kind``
        names it: its error names the slot that reaches furthest."""
        tokens, start_bound = rows.tokens, rows.start_bound

        def describe():
            ends = {
                slot: len(prompt) + (0 if starts is None else starts.get(slot, 0))
                for slot, prompt in prompts.items()
            }
            slot = max(ends, key=ends.get)
            name = f"slot {slot}'s prompt" if names is None else names[slot]
            return f"the {kind} of {name} ({self._context_words(ends[slot], start_bound + tokens.shape[1])})"

        key = (kind, tokens.shape, rows.chunk, start_bound)
        self._check_fits(key, lower, describe, "prefill_chunk, slots or the prompt")

    def _context_words(self, longest: int, reach: int) -> str:
        """How an error names a dispatch's context: ``longest`` positions, and the bucket of ``reach`` (what
        its forwards may reach)."""
        bucket = self.bound(reach) or self.model.max_len
        return f"a context of {longest} positions, context bucket {bucket}"

    def _dispatch_decode(self, state, stops, waiting, steps: int, tree, context, describe):
        """The jitted decode loop on ``state`` (donated; the arguments checked), its program first found to
        fit the devices' memory (:meth:`_check_fits`; ``describe()`` names the dispatch)."""
        args = (self.params, state, stops, waiting, steps, tree, context)
        key = ("decode", steps, tree, context)
        self._check_fits(key, lambda: self._decode.lower(*args), describe, "slots or the draft tree")
        return self._decode(*args)

    def _prefill_args(self, rows: PromptRows, prompts: dict, params: dict, stops) -> tuple:
        """The jitted prefill's arguments after the parameters and the state (:meth:`_prefill_rows`'): the
        host rows of ``rows`` and of ``params``, ``stops``, the chunk and the start bound."""
        rows_budget = np.zeros(self.slots, np.int32)
        for slot in prompts:
            rows_budget[slot] = params[slot].max_new_tokens
        sampling = arguments.sampling_rows(self.slots, params)
        host = (rows.tokens, rows.starts, rows.lengths, rows_budget, sampling)
        return (*jax.tree.map(self._placement.host_rows, host), stops, rows.chunk, rows.start_bound)

    def lower_prefill(self, prompt_len: int) -> jax.stages.Lowered:
        """The prefill that :meth:`prefill` dispatches for new prompts (from position 0), the longest of
        ``prompt_len`` tokens (an int in [1, max_len - 2]: it sets the padded width and the chunk), lowered
        from the shapes alone (nothing runs, no state is needed): e.g. ``.compile().memory_analysis()``, its
        temporaries."""
        prompt_len = check_int("prompt_len", prompt_len, 1, self.model.max_len - 2, " = max_len - 2")
        prompts = {0: np.zeros(prompt_len, np.int32)}
        params = {0: SamplingParams(1, top_p=1.0, top_k=0)}  # the values do not reach the lowering
        args = self._prefill_args(self._prompt_rows(prompts), prompts, params, arguments.stop_array(()))
        return self._prefill.lower(self.params, self._state_layout, *args)

    def _prompt_rows(self, prompts: dict, starts=None) -> PromptRows:
        """The :class:`PromptRows` of ``prompts`` {slot: ``[length]`` int32} from ``starts`` {slot: position}
        (None: 0)."""
        longest = max(map(len, prompts.values()))
        width = -(-longest // self.prompt_bucket) * self.prompt_bucket
        chunk = self.prefill_chunk
        if chunk is not None and width > chunk:  # whole chunks
            width = -(-width // chunk) * chunk
        else:  # one forward, at most a chunk
            chunk = None
        tokens = np.zeros((self.slots, width), np.int32)
        row_starts = np.zeros(self.slots, np.int32)
        lengths = np.zeros(self.slots, np.int32)
        for slot, prompt in prompts.items():
            tokens[slot, : len(prompt)], lengths[slot] = prompt, len(prompt)
            row_starts[slot] = 0 if starts is None else starts.get(slot, 0)
        start_bound = (self.bound(int(row_starts.max())) or 0) if row_starts.any() else 0
        return PromptRows(tokens, row_starts, lengths, chunk, start_bound)

    def _take_state(self, seed: np.uint32) -> DecodeState:
        """The decode state :meth:`generate` keeps between calls (taken: the next taker gets a new one), its
        slots made idle and its key ``jax.random.key(seed)``: no allocation, and the decode loop's CUDA graph
        sees the same buffers as before; the first call allocates it (and compiles the restart)."""
        state, self._idle_state = self._idle_state, None
        return self._restart(self.init_state(seed) if state is None else state, seed)

    def decode(
        self,
        state: DecodeState,
        *,
        num_tokens=None,
        tree=None,
        stop_tokens=(),
        steps=None,
        waiting=False,
        context=None,
    ) -> tuple[DecodeState, DecodeOutput]:
        """One dispatch: up to ``steps`` (default K) plain (``num_tokens`` and ``tree`` None) or speculative
        (the chain of N = ``num_tokens``, an int in [2, max_draft], or the draft tree ``tree``, as
        :meth:`generate` takes them) steps of every active slot, on the device, each slot greedy or sampled
        by the parameters its :meth:`prefill` gave; rows end at a stop token (``stop_tokens``: at most 8
        ids in [0, vocab_size)) or when their budget is spent, and with ``waiting`` (a bool) the loop also
        leaves once a row ends. ``state`` (this engine's, not yet donated) is donated; nothing is read back
        to the host. ``context``: None (every forward reads all ``max_len`` positions), or an int in [1,
        max_len], the caller's promise that no active row's position + ``steps`` x N exceeds it (the
        forwards read the positions of its bucket, ``context_floor``; a row past it gets wrong tokens, no
        error)."""
        arguments.check_state_is_this_engines(state, self._state_layout)
        tree = arguments.check_speculation(num_tokens, tree, self.model)
        stops = arguments.stop_array(arguments.check_stop_tokens(stop_tokens, self.model))
        steps = self.steps_per_dispatch if steps is None else arguments.check_count("steps", steps)
        waiting = arguments.check_waiting(waiting)
        context = arguments.check_context(context, self.model)
        given = self.model.max_len if context is None else context

        def describe():
            return f"decode(context={context}) ({self._context_words(given, given)})"

        return self._dispatch_decode(state, stops, waiting, steps, tree, self.bound(given), describe)

    def bound(self, longest: int) -> int | None:
        """The context bound of a dispatch whose rows reach at most ``longest`` positions (``context_floor``,
        :func:`~jax_oc128.engine.steps.bound`)."""
        return step_fns.bound(longest, self.model.max_len, self.context_floor)

    def generate(
        self,
        prompts,
        max_new_tokens,
        *,
        num_tokens=None,
        tree=None,
        temperature=0.0,
        top_p=None,
        top_k=None,
        stop_tokens=None,
        seed=0,
        progress=None,
        stream=None,
    ) -> Result:
        """Generate up to ``max_new_tokens`` for each prompt with speculative steps of N = ``num_tokens``
        tokens or of the draft tree ``tree`` (both None: plain steps of the target alone), greedy or sampled
        at ``temperature`` (truncated by ``top_p`` / ``top_k``). A request ends after ``max_new_tokens`` or at
        the first of ``stop_tokens``, which is its last token.

        Args:
          prompts: a sequence (list, tuple) of prompts, each a sequence (list, tuple, bytes) or a 1-D
            integer array of token ids in [0, vocab_size), 1 to ``max_len - max_new_tokens - N`` long. An
            empty sequence returns an empty :class:`Result` at once (nothing dispatched).
          max_new_tokens: an int in [1, max_len - N - 1].
          num_tokens: None, or an int in [2, max_draft]: the chain of N, each step drafting N - 1 tokens one
            after the other (the same as ``tree=Tree.chain(N)``; None only, for a model without an MTP
            head).
          tree: None, or a draft tree of N nodes (a :class:`~jax_oc128.tree.Tree` or its parents, a tuple of
            ints: ``tree[0] == -1``, ``0 <= tree[k] < k``; ``num_tokens`` None or N): the MTP head drafts
            each node's children as its top-k tokens (greedy) or k draws without replacement (sampled), the
            target verifies all N nodes in one forward and the row keeps the deepest accepted path
            (multi-draft speculative sampling at ``temperature`` > 0). Every layer type, on the online C128
            state (the offline one verifies chains only).
          temperature: a number >= 0 (0: greedy).
          top_p: None, or a number in (0, 1]: nucleus sampling (1 or None: off).
          top_k: None, or an int >= 0: the k most probable tokens (0 or None: off). Both as
            :class:`SamplingParams` takes them; exact under speculation (the draft truncated the same way).
          stop_tokens: None (default: the model's EOS ids, ``model.eos_token_ids``, those of a loaded
            checkpoint's config; none for a model built from a config), or at most 8 token ids in [0,
            vocab_size) (``()``: no stop token).
          seed: the sampling's PRNG seed, an int in [0, 2**32).
          progress: None, or a callable called with the number of tokens generated so far.
          stream: None, or a callable called as ``stream(i, tokens)`` whenever request ``i`` gains tokens
            (``tokens`` a list of ints, in order: their concatenation is ``tokens[i]`` of the result), as
            each dispatch's output is read.

        Returns a :class:`Result`, ``tokens[i]`` the output of ``prompts[i]``."""
        tree = arguments.check_speculation(num_tokens, tree, self.model)
        longest_prompt = arguments.check_max_new_tokens(max_new_tokens, tree, self.model)
        temperature = arguments.check_temperature(temperature)
        top_p, top_k = arguments.check_top_p(top_p), arguments.check_top_k(top_k)
        stop_tokens = arguments.check_stop_tokens(stop_tokens, self.model)
        seed = arguments.check_seed(seed)
        arguments.check_callback("progress", progress)
        arguments.check_callback("stream", stream)
        prompts = arguments.check_prompts(prompts, self.model, longest_prompt)
        if not prompts:
            return Result([], steps=0, dispatches=0, seconds=0.0, mean_accepted=0.0)
        params = SamplingParams(max_new_tokens, temperature, stop_tokens, top_p=top_p, top_k=top_k)
        start = time.perf_counter()
        scheduler = RequestScheduler(self, tree=tree, seed=seed)
        outputs = [[] for _ in prompts]
        steps = [0] * len(prompts)  # per request, the steps that gave it tokens
        try:
            for i, prompt in enumerate(prompts):  # every request fits the pages, before anything runs
                scheduler.check_request(prompt, params, f"prompts[{i}]")
            self.page_pool = scheduler.page_pool
            ids = {scheduler.add_request(prompt, params): i for i, prompt in enumerate(prompts)}
            while scheduler.busy:
                read = scheduler.step()
                for request, count in read.steps.items():
                    steps[ids[request]] += count
                for request, new in read.tokens.items():
                    outputs[ids[request]].extend(new)
                    if stream is not None:
                        stream(ids[request], new)
                if progress is not None:
                    progress(sum(map(len, outputs)))
        finally:
            scheduler.close()
        totals = scheduler.totals
        mean = totals["accepted"] / max(1, totals["slot_steps"])
        seconds = time.perf_counter() - start
        return Result(
            outputs, totals["steps"], scheduler.dispatches, seconds, mean, steps, prefills=totals["prefills"]
        )
