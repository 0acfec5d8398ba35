"""The host's side of paged caches: :class:`PagePool`, which pages of the device pool each slot holds (its row
of the page table), how many each request has reserved, and which are free.

A request reserves, when it is admitted, the pages of the most tokens it can ever write (its prompt, its
``max_new_tokens`` and a verify's N); it takes pages out of its reservation as the dispatches need them (the
tokens the next dispatch can write, K steps x N tokens ahead) and gives all back when it ends. A request
that finds too few unreserved pages waits, so a running request always finds its next page and never writes
one it does not hold (writes past its pages are dropped on the device, :mod:`~jax_oc128.nn.kv_cache`).

With data parallelism the pool is split over the ``"data"`` devices like the slots: slot s's pages are those
of its device (shard ``s // (slots // shards)``), numbered locally from 0.
"""

from __future__ import annotations

import numpy as np


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
        self.handed_out: set[tuple[int, int]] = set()
        self.waits = 0

    def pages_for(self, tokens: int) -> int:
        """Pages that hold ``tokens`` tokens."""
        return -(-tokens // self.page_size)

    def shard(self, slot: int) -> int:
        """The device whose pool slot ``slot`` draws from."""
        return slot // self.slots_per_shard

    def can_reserve(self, slot: int, tokens: int) -> bool:
        """Whether ``slot``'s device has pages for ``tokens`` more tokens beyond what is reserved."""
        shard = self.shard(slot)
        return self._reserved[shard] + self.pages_for(tokens) <= self.per_shard

    def reserve(self, slot: int, tokens: int) -> None:
        """``slot`` (holding nothing) reserves the pages of ``tokens`` tokens (:meth:`can_reserve` first)."""
        if self._reservation[slot] or not self.can_reserve(slot, tokens):
            raise RuntimeError(f"slot {slot}: reserved already, or too few pages for {tokens} tokens")
        self._reservation[slot] = self.pages_for(tokens)
        self._reserved[self.shard(slot)] += self._reservation[slot]

    def grow(self, slot: int, tokens: int) -> bool:
        """``slot`` holds pages for its first ``tokens`` tokens, at most its reservation; returns whether
        its row of :attr:`table` changed."""
        want = min(self.pages_for(tokens), int(self._reservation[slot]))
        held = int(self._held[slot])
        free = self._free[self.shard(slot)]
        for k in range(held, want):
            self.table[slot, k] = free.pop()
            self.handed_out.add((self.shard(slot), int(self.table[slot, k])))
        self._held[slot] = max(held, want)
        return want > held

    def release(self, slot: int) -> bool:
        """``slot``'s pages back to its device's free pages and its reservation ended; returns whether it
        held any."""
        held = int(self._held[slot])
        free = self._free[self.shard(slot)]
        free.extend(int(page) for page in self.table[slot, :held][::-1])
        free.sort(reverse=True)  # the lowest page next
        self.table[slot] = -1
        self._reserved[self.shard(slot)] -= self._reservation[slot]
        self._reservation[slot] = self._held[slot] = 0
        return held > 0

    @property
    def free_pages(self) -> int:
        """Pages held by no slot, over all devices."""
        return sum(map(len, self._free))

    def holds(self, slot: int) -> bool:
        """Whether ``slot`` has a reservation."""
        return bool(self._reservation[slot])
