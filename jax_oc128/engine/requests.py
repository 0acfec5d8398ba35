"""The request-level scheduler: :class:`RequestScheduler` takes requests at any time
(:meth:`~RequestScheduler.add_request`), runs them in an :class:`~jax_oc128.engine.Engine`'s slots with
continuous batching (:meth:`~RequestScheduler.step`: admit, prefill, one dispatch of K decoding steps, read)
and drops them on :meth:`~RequestScheduler.abort`. :meth:`Engine.generate` is a loop over it.

Per-request parameters and what the device allows:

- ``max_new_tokens``: each slot's own budget, on the device.
- ``stop_tokens``: the device ends rows at one set of stop tokens per dispatch, so it is given the stop
  tokens every running request shares; each request's other stop tokens are applied on the host (its tokens
  cut after the first, the request ended and its slot freed at the next step).
- ``temperature``, ``top_p``, ``top_k``: per slot on the device (:class:`~jax_oc128.sampling.Sampling`), so
  requests of any sampling parameters share the batch and one compilation; they are admitted in arrival
  order.
- ``seed``: the device draws from one PRNG key for all slots, so a sampled request (temperature > 0) with a
  seed runs alone, the key reset to its seed: its tokens are ``Engine.generate([prompt], seed=seed)``'s.
  Sampled requests without a seed share the batch and its key (not reproducible one by one).

A slot freed on the host (an abort, a host-side stop) may still run on the device until a new request's
prefill clears it or its budget ends: its tokens are dropped, and with paged caches its pages are released
and its page-table row cleared (its writes go nowhere).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

import jax
import numpy as np

from jax_oc128.checks import ArgumentTypeError
from jax_oc128.engine import arguments
from jax_oc128.engine.pages import PagePool
from jax_oc128.engine.prefix_cache import Plan, PrefixCache, check_prefix_cache
from jax_oc128.engine.state import DecodeOutput
from jax_oc128.nn import sharding
from jax_oc128.tree import Tree


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """A request's parameters.

    Attributes:
      max_new_tokens: an int in [1, max_len - N - 1].
      temperature: a number >= 0 (0: greedy).
      top_p: None, or a number in (0, 1]: sample from the smallest set of the most probable tokens of
        that mass (nucleus; 1 or None: off).
      top_k: None, or an int >= 0: sample from the k most probable tokens (0 or None: off). With both, top-k
        then top-p, after the temperature (:mod:`jax_oc128.sampling`); both ignored when greedy. Exact
        under speculation: the draft is truncated the same way.
      stop_tokens: None (the model's EOS ids, ``model.eos_token_ids``: a loaded checkpoint's), or at most
        :data:`~jax_oc128.engine.MAX_STOP_TOKENS` token ids (``()``: none); the first generated ends the
        request (it is its last token).
      seed: None, or an int in [0, 2**32): a sampled request with a seed runs alone (module docstring).
    """

    max_new_tokens: int
    temperature: float = 0.0
    stop_tokens: tuple[int, ...] | None = None
    seed: int | None = None
    top_p: float | None = None
    top_k: int | None = None


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against (:meth:`check`), picklable: a server's HTTP process checks requests
    with its engine process's limits (docs/serving.md).

    Attributes:
      max_len, vocab_size, eos_token_ids: the model's (``eos_token_ids``: the stop tokens of a request that
        gives None).
      tree: the speculation's draft tree, or None (plain steps).
      page_size, pages: a paged engine's page size and pages per device, or None (dense).
    """

    max_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    tree: Tree | None
    page_size: int | None = None
    pages: int | None = None

    @property
    def width(self) -> int:
        """The tokens a step writes: the tree's nodes, 1 for plain steps."""
        return 1 if self.tree is None else self.tree.size

    def check(self, prompt, params: SamplingParams, name: str = "prompt") -> tuple[np.ndarray, int]:
        """``prompt`` (named ``name`` in errors) and ``params`` checked as :meth:`Engine.generate` checks
        them, and that the request fits a device's page pool (:class:`~jax_oc128.checks.ArgumentTypeError` /
        :class:`~jax_oc128.checks.ArgumentError` naming the argument: ``name``, or a field of ``params`` by
        its name). Returns the prompt as int32 and the most tokens it writes."""
        if not isinstance(params, SamplingParams):
            raise ArgumentTypeError("params", f"must be a SamplingParams, got {type(params).__name__}")
        longest = arguments.check_max_new_tokens(params.max_new_tokens, self.tree, self)
        arguments.check_temperature(params.temperature)
        arguments.check_top_p(params.top_p)
        arguments.check_top_k(params.top_k)
        arguments.check_stop_tokens(params.stop_tokens, self)
        if params.seed is not None:
            arguments.check_seed(params.seed)
        ids = arguments.check_prompt(name, prompt, self, longest)
        needs = len(ids) + params.max_new_tokens + self.width
        if self.pages is not None:
            arguments.check_request_fits(name, needs, self.page_size, self.pages)
        return ids, needs


@dataclasses.dataclass
class StepOutput:
    """What one :meth:`RequestScheduler.step` read.

    Attributes:
      tokens: request id -> its new tokens, in order (only requests that gained some).
      finished: request id -> why it ended: ``"stop"`` (a stop token), ``"length"`` (max_new_tokens) or
        ``"abort"``.
      steps: request id -> the steps (its prefill one of them) that gave it the tokens read.
      cached: request id -> the prompt tokens it took from the prefix cache, for the requests admitted by
        this step (0 for a miss; none without prefix caching).
    """

    tokens: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    finished: dict[int, str] = dataclasses.field(default_factory=dict)
    steps: dict[int, int] = dataclasses.field(default_factory=dict)
    cached: dict[int, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Request:
    prompt: np.ndarray
    params: SamplingParams
    needs: int  # the most tokens it writes: prompt + max_new_tokens + N
    plan: Plan | None = None  # prefix caching: where its prompt met the cache at admission
    generated: int = 0  # its tokens read so far
    held: list = dataclasses.field(default_factory=list)  # prefix caching: the nodes it pins

    @property
    def exclusive(self) -> bool:
        return self.params.temperature > 0 and self.params.seed is not None


class RequestScheduler:
    """Requests over ``engine``'s slots, speculating with ``num_tokens`` / ``tree`` (as
    :meth:`Engine.generate` takes them) for all requests, the PRNG key first ``jax.random.key(seed)``.

    It takes the engine's idle decode state (the one :meth:`Engine.generate` keeps between calls) and gives
    it back on :meth:`close`. All methods are called from one thread.

    ``prefix_cache``: 0 (off), or the snapshots kept on the device for prefix caching (paged engines on one
    device): prompts' page-aligned prefixes are cached and shared by later requests
    (:mod:`~jax_oc128.engine.prefix_cache`).

    ``align``: when more requests wait than slots are free and a running request's budget ends within the
    next dispatch, the waiting requests wait for that dispatch (at most every other step) and are admitted
    with the slots it frees, in one prefill (a prefill call runs every slot's row, whatever the rows
    admitted): requests admitted apart, and so ending apart, are brought back together (the server's;
    docs/serving.md).

    Attributes:
      limits: the :class:`RequestLimits` its requests are checked against.
      page_pool: paged engines, the :class:`~jax_oc128.engine.pages.PagePool` of its slots (else None).
      prefix_cache: the :class:`~jax_oc128.engine.prefix_cache.PrefixCache`, or None.
      dispatches: decode dispatches run.
      totals: counts of the dispatches read (``steps``, ``slot_steps``, ``accepted``) and of the prompts
        admitted: ``prefill_tokens`` fed, ``cached_tokens`` taken from the prefix cache, ``prefills`` the
        prefill calls (each runs every slot's row: requests admitted apart cost one each).
    """

    def __init__(self, engine, *, num_tokens=None, tree=None, seed=0, prefix_cache=0, align=False):
        self.engine, self.align = engine, align
        self.tree = arguments.check_speculation(num_tokens, tree, engine.model)
        self.page_pool = None
        if engine.pages is not None:
            shards = sharding.data_devices(engine.mesh)
            pages, size = engine.pages, engine.page_size
            self.page_pool = PagePool(pages, size, engine.slots, engine.model.max_len // size, shards)
        model, pool = engine.model, self.page_pool
        self.limits = RequestLimits(
            model.max_len,
            model.vocab_size,
            tuple(arguments.default_stop_tokens(model)),
            self.tree,
            None if pool is None else pool.page_size,
            None if pool is None else pool.per_shard,
        )
        capacity = check_prefix_cache(prefix_cache, engine)
        self.prefix_cache = PrefixCache(engine, self.page_pool, capacity) if capacity else None
        self.state = engine._take_state(arguments.check_seed(seed))
        self._ids = itertools.count()
        self._requests: dict[int, _Request] = {}
        self._waiting: collections.deque[int] = collections.deque()
        self.owner: dict[int, int] = {}  # slot -> request id, as of the last output read
        self._unread = collections.deque()  # dispatched, not yet read: (owner of its slots, its output)
        self._written = np.zeros(engine.slots, np.int64)  # the tokens each slot may have written
        self._released = False  # paged: pages released since the page table was last sent
        self._exclusive = False  # the running batch is one seeded sampled request
        self._held = False  # align: the last step held the waiting requests
        self._finished: dict[int, str] = {}  # ended since the last step returned
        self.dispatches = 0
        self.totals = collections.Counter()

    def check_request(self, prompt, params: SamplingParams, name: str = "prompt") -> tuple[np.ndarray, int]:
        """:meth:`RequestLimits.check` of this scheduler's :attr:`limits`; no state read or changed (any
        thread)."""
        return self.limits.check(prompt, params, name)

    def add_request(self, prompt, params: SamplingParams) -> int:
        """Queue a request (checked by :meth:`check_request`); it joins the running batch at a coming
        :meth:`step`. Returns its id."""
        ids, needs = self.check_request(prompt, params)
        request = next(self._ids)
        params = dataclasses.replace(
            params,
            temperature=float(params.temperature),
            top_p=arguments.check_top_p(params.top_p),
            top_k=arguments.check_top_k(params.top_k),
            stop_tokens=arguments.check_stop_tokens(params.stop_tokens, self.engine.model),
        )
        self._requests[request] = _Request(ids, params, needs)
        self._waiting.append(request)
        return request

    def abort(self, request: int) -> None:
        """End ``request`` (waiting or running; an unknown or ended id is ignored): its tokens stop, its slot
        and pages are free from the next :meth:`step`, and that step reports it finished (``"abort"``)."""
        if request not in self._requests:
            return
        if request in self._waiting:
            self._waiting.remove(request)
        self._end(request, "abort")

    @property
    def busy(self) -> bool:
        """Whether requests wait or run (:meth:`step` has work)."""
        return bool(self._waiting or self.owner or self._unread)

    @property
    def waiting(self) -> int:
        """Requests not yet admitted."""
        return len(self._waiting)

    def step(self) -> StepOutput:
        """Admit waiting requests into the free slots and prefill them, run one dispatch of up to K decoding
        steps of the running requests and read the outputs (each dispatch's is read while the next runs,
        all of them when requests wait: a slot freed by a dispatch is taken at the next step, never left idle
        for a dispatch unless ``align`` holds it). Returns what was read and the requests that ended."""
        out = StepOutput()
        if self._waiting and self._unread:  # which slots are free: read everything
            self._read_all(out)
        pool, engine = self.page_pool, self.engine
        ahead = engine.steps_per_dispatch * self.limits.width  # the tokens a dispatch may write per slot
        changed, self._released = self._released, False
        free = [slot for slot in range(engine.slots) if slot not in self.owner]
        admitted = {} if self._hold(free) else self._admit(free)
        for slot, request in [*self.owner.items(), *admitted.items()]:  # what the next dispatch can write
            needs = self._requests[request].needs
            self._written[slot] = min(self._written[slot] + ahead, needs)
            if pool is not None:
                changed |= pool.grow(slot, int(self._written[slot]))
        if pool is not None and changed:
            self.state = engine._set_page_table(self.state, engine._placement.host_rows(pool.table))
        running = [*self.owner.values(), *admitted.values()]
        stops = arguments.stop_array(
            tuple(set.intersection(*(set(self._requests[r].params.stop_tokens) for r in running)))
            if running
            else ()
        )
        if admitted:
            self._prefill(admitted, stops, out)
        if self.owner:
            reach = int(self._written.max())

            def describe():
                slot = int(np.argmax(self._written))
                return f"the decode dispatch of {self._name(slot)} ({engine._context_words(reach, reach)})"

            self.state, output = engine._dispatch_decode(
                self.state,
                stops,
                np.bool_(bool(self._waiting)),
                engine.steps_per_dispatch,
                self.tree,
                engine.bound(reach),
                describe,
            )
            self.dispatches += 1
            for leaf in jax.tree.leaves(output):
                leaf.copy_to_host_async()
            self._unread.append((dict(self.owner), output))
        elif self._waiting and not self._unread:  # paged: every slot is free and the first still has no pages
            raise RuntimeError("paged engine: no request runs and none can be admitted (a bug)")
        # read everything but this dispatch, which runs meanwhile; all of it when a slot must be freed
        while len(self._unread) > (0 if self._waiting else 1) or (self._unread and not self.owner):
            self._read(out, *self._unread.popleft())
        out.finished, self._finished = self._finished, {}
        return out

    def _prefill(self, admitted: dict[int, int], stops, out: StepOutput) -> None:
        """Prefill the ``admitted`` requests (slot -> request): without prefix caching, their prompts in one
        call; with it, each slot restored from its hit's snapshot, then fed up to each of its snapshot points
        (stored there), then the rest in one call (:mod:`~jax_oc128.engine.prefix_cache`)."""
        cache, size = self.prefix_cache, self.engine.page_size
        requests = {slot: self._requests[r] for slot, r in admitted.items()}
        starts = dict.fromkeys(admitted, 0)
        names = {slot: self._name(slot, request) for slot, request in admitted.items()}
        if cache is not None:
            for slot, request in requests.items():
                starts[slot] = request.plan.hit * size
                out.cached[admitted[slot]] = starts[slot]
                if request.plan.hit:
                    self.state = cache.restore(self.state, slot, request.plan)
            for point in range(max(len(r.plan.points) for r in requests.values())):
                ends = {s: r.plan.points[point] for s, r in requests.items() if point < len(r.plan.points)}
                rows = {s: requests[s].prompt[starts[s] : end * size] for s, end in ends.items()}
                self.state = cache.feed(self.state, rows, starts, names)
                for slot, end in ends.items():
                    request = requests[slot]
                    cache.insert(self.state, slot, request.prompt, end, request.held)
                    starts[slot] = end * size
        self.totals.update(
            prefill_tokens=sum(len(r.prompt) for r in requests.values()) - sum(out.cached.values()),
            cached_tokens=sum(out.cached.values()),
            prefills=1,
        )
        prompts = {slot: r.prompt[starts[slot] :] for slot, r in requests.items()}
        params = {slot: r.params for slot, r in requests.items()}
        self.state, output = self.engine._prefill_rows(self.state, prompts, params, stops, starts, names)
        self.owner.update(admitted)
        self._unread.append((admitted, output))

    def _name(self, slot: int, request: int | None = None) -> str:
        """How an error names the request of ``slot`` (``request``, else its owner; "slot S" if none)."""
        request = self.owner.get(slot) if request is None else request
        return f"slot {slot}" if request is None else f"request {request} (slot {slot})"

    def _hold(self, free: list[int]) -> bool:
        """Whether the waiting requests wait a dispatch for the ``free`` slots to be joined by others
        (``align``): a running request's budget ends within it (K steps of a token or more), so it frees
        a slot at least (it leaves when a row ends while requests wait). The outputs are all read."""
        waits = self.align and not self._held and len(self._waiting) > len(free) > 0
        self._held = waits and any(
            self._requests[r].params.max_new_tokens - self._requests[r].generated
            <= self.engine.steps_per_dispatch
            for r in self.owner.values()
        )
        return self._held

    def _admit(self, free: list[int]) -> dict[int, int]:
        """Waiting requests into the ``free`` slots, in arrival order; a seeded sampled request waits for an
        empty batch and runs alone (module docstring). Returns slot -> request."""
        pool = self.page_pool
        if not self.owner:  # a new batch
            self._exclusive = False
        admitted = {}
        for slot in free:
            if not self._waiting or self._exclusive:
                break
            request = self._requests[self._waiting[0]]
            if request.exclusive:
                if self.owner or admitted:
                    break
                self._exclusive = True  # it runs alone, on its own key
                self.state = self.engine._restart(self.state, np.uint32(request.params.seed))
            if pool is not None and not self._reserve(slot, request):  # it waits for its device's pages
                pool.waits += 1
                continue
            self._written[slot] = len(request.prompt)
            admitted[slot] = self._waiting.popleft()
        return admitted

    def _reserve(self, slot: int, request: _Request) -> bool:
        """Reserve ``slot``'s pages for ``request`` (the prefix cache's shared, pinned) if its device has
        them; returns whether it did."""
        pool, cache = self.page_pool, self.prefix_cache
        plan = None if cache is None else cache.plan(request.prompt)
        if plan is not None and not pool.can_reserve(slot, request.needs, plan.hit, cache.pins(plan)):
            plan = cache.hit_only(plan)  # the pages of a snapshot at its divergence do not fit now
        shared = [] if plan is None else [node.page for node in plan.path[: plan.hit]]
        if not pool.can_reserve(slot, request.needs, len(shared), 0 if plan is None else cache.pins(plan)):
            return False
        pool.reserve(slot, request.needs, shared)
        if cache is not None:
            request.plan, request.held = plan, cache.pin(plan)
        return True

    def _read_all(self, out: StepOutput) -> None:
        while self._unread:
            self._read(out, *self._unread.popleft())

    def _read(self, out: StepOutput, owner: dict, output: DecodeOutput) -> None:
        """Take a dispatch's (or a prefill's) tokens for the requests that owned its slots (``owner``, slot
        -> request, at dispatch) and still run; end the requests whose rows ended or that met a stop token
        of their own."""
        host = jax.device_get(output)  # the copies started at dispatch
        self.totals.update(
            steps=int(host.steps), slot_steps=int(host.slot_steps), accepted=int(host.accepted)
        )
        kept = np.arange(host.tokens.shape[2]) < host.counts[..., None]  # [K, slots, W]; 0 past the steps run
        for slot, request in owner.items():
            if self.owner.get(slot) != request:  # ended (an abort, a host-side stop) since
                continue
            new = host.tokens[:, slot][kept[:, slot]]  # its tokens, in order
            stops = np.flatnonzero(np.isin(new, self._requests[request].params.stop_tokens))
            if len(stops):
                new = new[: stops[0] + 1]
            self._requests[request].generated += len(new)
            if len(new):
                counts = host.counts[:, slot]
                steps = np.count_nonzero((counts > 0) & (np.cumsum(counts) - counts < len(new)))
                out.tokens.setdefault(request, []).extend(new.tolist())
                out.steps[request] = out.steps.get(request, 0) + int(steps)
            if len(stops):
                self._end(request, "stop")
            elif not host.active[slot]:
                self._end(request, "length")

    def _end(self, request: int, reason: str) -> None:
        """``request`` ended for ``reason``: its slot (if any) free on the host."""
        needs = self._requests[request].needs
        for slot, owner in list(self.owner.items()):
            if owner == request:
                del self.owner[slot]
                self._written[slot] = needs  # its row may run on the device until its budget ends
                if self.page_pool is not None:  # the table is sent before the next dispatch
                    self._released |= self.page_pool.release(slot)
        if self.prefix_cache is not None:
            self.prefix_cache.unpin(self._requests[request].held)
        del self._requests[request]
        self._finished[request] = reason

    def close(self):
        """Give the decode state back to the engine (its slots idle at its next use); the scheduler is
        done."""
        self._read_all(StepOutput())
        self.engine._idle_state, self.state = self.state, None
