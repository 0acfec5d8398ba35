"""The host's side of paged caches: :class:`PagePool`, which pages of the device pool each slot holds (its row
of the page table), how many each request has reserved, and which are free.

A request reserves, when it is admitted, the pages of the most tokens it can ever write (its prompt, its
``max_new_tokens`` and a verify's N); it takes pages out of its reservation as the dispatches need them (the
tokens the next dispatch can write, K steps x N tokens ahead) and gives all back when it ends. A request
that finds too few unreserved pages waits, so a running request always finds its next page and never writes
one it does not hold (writes past its pages are dropped on the device, :mod:`~jax_oc128.nn.kv_cache`).

With data parallelism the pool is split over the ``"data"`` devices like the slots: slot s's pages are those
of its device (shard ``s // (slots // shards)``), numbered locally from 0.

With prefix caching (:mod:`~jax_oc128.engine.prefix_cache`, one device) a slot's row may start with pages it
shares (the cache's, given at :meth:`PagePool.reserve`), and pages it wrote may pass to the cache
(:meth:`PagePool.adopt`): a slot owns, reserves and frees only its own. The cache's pinned pages (those a
running request uses) count against the pool as reserved ones; the others are evicted (least recently used
first) when a slot grows and no page is free, so a request never waits for pages an eviction could free.
"""

from __future__ import annotations

import numpy as np


def pages_for(tokens: int, page_size: int) -> int:
    """Pages of ``page_size`` tokens that hold ``tokens`` tokens."""
    return -(-tokens // page_size)


class PagePool:
    """Pages of ``page_size`` tokens, ``pages`` in all split evenly over ``shards`` devices, for ``slots``
    slots of up to ``max_pages`` pages each.

    Attributes:
      table: ``[slots, max_pages]`` int32, the page table the device reads (local page numbers, -1: none).
      per_shard: pages of each device's pool.
      handed_out: the ``(device, page)`` pairs ever assigned to a slot.
      waits: the times a request that a slot was free for waited for pages.
    """

    def __init__(self, pages: int, page_size: int, slots: int, max_pages: int, shards: int = 1):
        self.page_size, self.per_shard, self.shards = page_size, pages // shards, shards
        self.slots_per_shard = slots // shards
        self.table = np.full((slots, max_pages), -1, np.int32)
        self._free = [list(range(self.per_shard - 1, -1, -1)) for _ in range(shards)]  # lowest page last
        self._reserved = np.zeros(shards, np.int64)
        self._reservation = np.zeros(slots, np.int64)
        self._held = np.zeros(slots, np.int64)
        self._owned = np.zeros((slots, max_pages), bool)  # the slot's own pages (not the prefix cache's)
        self.cache = None  # the prefix cache (pinned, evict()), if any
        self.handed_out: set[tuple[int, int]] = set()
        self.waits = 0

    def pages_for(self, tokens: int) -> int:
        """Pages that hold ``tokens`` tokens."""
        return pages_for(tokens, self.page_size)

    def shard(self, slot: int) -> int:
        """The device whose pool slot ``slot`` draws from."""
        return slot // self.slots_per_shard

    def can_reserve(self, slot: int, tokens: int, shared: int = 0, pins: int = 0) -> bool:
        """Whether ``slot``'s device has pages for ``tokens`` more tokens beyond what is reserved and what the
        prefix cache pins, ``shared`` of them the cache's (pinned already or among ``pins``, the pages the
        request would newly pin)."""
        pinned = pins + (0 if self.cache is None else self.cache.pinned)
        return self._reserved[self.shard(slot)] + self.pages_for(tokens) - shared + pinned <= self.per_shard

    def reserve(self, slot: int, tokens: int, shared=()) -> None:
        """``slot`` (holding nothing) reserves the pages of ``tokens`` tokens, the first ones the prefix
        cache's pages ``shared`` (:meth:`can_reserve` first)."""
        shared = [int(page) for page in shared]
        if self._reservation[slot] or not self.can_reserve(slot, tokens, len(shared)):
            raise RuntimeError(f"slot {slot}: reserved already, or too few pages for {tokens} tokens")
        self.table[slot, : len(shared)] = shared
        self._held[slot] = len(shared)
        self._reservation[slot] = self.pages_for(tokens) - len(shared)
        self._reserved[self.shard(slot)] += self._reservation[slot]

    def grow(self, slot: int, tokens: int) -> bool:
        """``slot`` holds pages for its first ``tokens`` tokens, at most its reservation (its free pages
        taken lowest first, else an unpinned page of the prefix cache evicted); returns whether its row of
        :attr:`table` changed."""
        held = int(self._held[slot])
        want = min(
            self.pages_for(tokens), held - int(self._owned[slot, :held].sum()) + self._reservation[slot]
        )
        free = self._free[self.shard(slot)]
        for k in range(held, want):
            self.table[slot, k] = free.pop() if free else self.cache.evict()
            self._owned[slot, k] = True
            self.handed_out.add((self.shard(slot), int(self.table[slot, k])))
        self._held[slot] = max(held, want)
        return want > held

    def adopt(self, slot: int, k: int) -> int:
        """``slot``'s own page ``k`` passes to the prefix cache (out of its reservation); returns it."""
        if not self._owned[slot, k]:
            raise RuntimeError(f"slot {slot}: page {k} is not its own")
        self._owned[slot, k] = False
        self._reservation[slot] -= 1
        self._reserved[self.shard(slot)] -= 1
        return int(self.table[slot, k])

    def release(self, slot: int) -> bool:
        """``slot``'s own pages back to its device's free pages (the shared ones stay the prefix cache's) and
        its reservation ended; returns whether it held any."""
        held = int(self._held[slot])
        free = self._free[self.shard(slot)]
        free.extend(int(page) for page in self.table[slot, :held][self._owned[slot, :held]])
        free.sort(reverse=True)  # the lowest page next
        self.table[slot] = -1
        self._owned[slot] = False
        self._reserved[self.shard(slot)] -= self._reservation[slot]
        self._reservation[slot] = self._held[slot] = 0
        return held > 0

    @property
    def free_pages(self) -> int:
        """Pages held by no slot, over all devices."""
        return sum(map(len, self._free))

    def holds(self, slot: int) -> bool:
        """Whether ``slot`` holds pages or has a reservation."""
        return bool(self._reservation[slot] or self._held[slot])
