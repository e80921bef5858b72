"""`RoutedPrefixes`: what the gateway routed where, for engines that publish no events (and for
the affinity policy's memory of prompts routed but not yet reported by events)."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from gateway.core.index import bit_positions

# The holders' map is this many dicts, chosen by the key's Python hash (cached on the bytes
# object, so free after the first lookup; a page hash's own bytes need not be uniform: the fleet
# bench's synthetic ones start with zeros). One dict of a fleet's recent pages (4,096 a worker:
# 4M at 1,000 workers) rebuilds its whole table in one step each time inserts and deletions
# fill it, inside a routing decision: 13-15 ms at ~200k entries in the fleet bench, more the
# bigger it gets. A shard rebuilds 1/256 of that.
SHARDS = 256
_MASK = SHARDS - 1


class RoutedPrefixes:
    """What the gateway routed where, for engines that publish no events: per worker an LRU set
    of page hashes (bounded by max_pages_per_worker), with the same bitmask layout as KvIndex."""

    def __init__(self, max_pages_per_worker: int) -> None:
        self.max_pages = max_pages_per_worker
        # page hash -> mask of the workers remembering it, in SHARDS dicts by the key's hash
        self._holders: list[dict[bytes, int]] = [{} for _ in range(SHARDS)]
        self._lru: dict[str, OrderedDict[bytes, None]] = {}
        self._slots: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._free_slots: list[int] = []
        self._all = 0

    def record(self, worker: str, hashes: Sequence[bytes]) -> None:
        """The prompt with these page hashes was routed to `worker`."""
        slot = self._slots.get(worker)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slots)
            self._slots[worker], self._names[slot], self._lru[worker] = slot, worker, OrderedDict()
            self._all |= 1 << slot
        lru, holders, bit = self._lru[worker], self._holders, 1 << slot
        # Deepest page first, root last: the root ends most recent, so the LRU drops leaves first
        # and what stays is always a prefix.
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                shard = holders[hash(h) & _MASK]
                shard[h] = shard.get(h, 0) | bit
        nbit = ~bit
        for _ in range(len(lru) - self.max_pages):
            h = lru.popitem(last=False)[0]
            shard = holders[hash(h) & _MASK]
            m = shard[h] & nbit
            if m:
                shard[h] = m
            else:
                del shard[h]

    def match(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """Leading pages per worker (workers matching nothing are absent)."""
        holders, alive = self._holders, self._all
        ends: dict[int, int] = {}
        for i, h in enumerate(hashes):
            m = alive & holders[hash(h) & _MASK].get(h, 0)
            if m != alive:
                for slot in bit_positions(alive & ~m):
                    ends[slot] = i
                alive = m
                if not alive:
                    break
        else:
            for slot in bit_positions(alive):
                ends[slot] = len(hashes)
        return {self._names[slot]: n for slot, n in ends.items() if n}

    def extend(self, worker: str, hashes: Sequence[bytes], start: int) -> int:
        """End of the run of pages remembered for `worker` from position `start` on."""
        lru = self._lru.get(worker)
        if lru is None:
            return start
        n = len(hashes)
        while start < n and hashes[start] in lru:
            start += 1
        return start

    def holders(self, h: bytes) -> list[str]:
        """The workers remembering page `h` (the only ones whose run from page 0 is not empty)."""
        mask = self._holders[hash(h) & _MASK].get(h, 0)
        return [self._names[slot] for slot in bit_positions(mask)]

    def size(self, worker: str) -> int:
        """Pages remembered for a worker."""
        lru = self._lru.get(worker)
        return len(lru) if lru is not None else 0

    def remove_worker(self, worker: str) -> None:
        slot = self._slots.pop(worker, None)
        if slot is None:
            return
        nbit = ~(1 << slot)
        for h in self._lru.pop(worker):
            shard = self._holders[hash(h) & _MASK]
            m = shard[h] & nbit
            if m:
                shard[h] = m
            else:
                del shard[h]
        del self._names[slot]
        self._all &= nbit
        self._free_slots.append(slot)
