"""`RoutedPrefixes`: what the gateway routed where, for engines that publish no events (and for
the affinity policy's memory of prompts routed but not yet reported by events).

Worker names map to slots here; the pages live in a store keyed by slot: `NativePages` (C,
gateway/core/routed_native.py) when the gateway's C library loads (--index-native), else
`DictPages` below, the reference (tests/gateway/test_routed_prefixes.py runs both on the same
calls and compares every result).

The dicts keep each page's holders as a mask of slots; the C store a list of them and, once a
page has several, a mask too. So `match` ANDs one mask a page: O(pages x workers / 64) words,
however many workers share a prefix. A 64-page prefix that every worker holds, matched (a
scratch probe, a day the machine ran ~2.5x slow): 8 workers 6.7 µs (C) against 25 µs, 100
workers 31 against 68 µs, 1,000 workers 0.19 against 0.53 ms.

A record is queued, not applied: the decision that routed the prompt returns without it, and the
next reader applies it first (every method that reads or changes the pages does), or the router's
ingest slice does (`settle`, under the router's lock, off any decision's path). A decision's
record is ~32 pages stored and as many evicted, a few cache misses each: ~60 µs of a ~200 µs
decision at 1,000 workers (~100 µs with cold caches, as during ingest). What a decision reads is
never older than what was routed before it.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Protocol

from gateway.core import index_native
from gateway.core.index import bit_positions

# DictPages' holders' map is this many dicts, chosen by the key's Python hash (cached on the
# bytes object, so free after the first lookup; a page hash's own bytes need not be uniform: the
# fleet bench's synthetic ones start with zeros). One dict of a fleet's recent pages (4,096 a
# worker: 4M at 1,000 workers) rebuilds its whole table in one step each time inserts and
# deletions fill it, inside a routing decision: 13-15 ms at ~200k entries in the fleet bench,
# more the bigger it gets. A shard rebuilds 1/256 of that.
SHARDS = 256
_MASK = SHARDS - 1
# DictPages' resident memory a remembered page (its nbytes estimate): measured at 1,000 workers
# x 4,096 pages (prefixcache_bench.gateway_fleet.routed,
# docs/results/gateway/fleet/routed_prefixes.json).
DICT_BYTES_PER_PAGE = 286
# Records queued at most: one more applies them all (decisions whose requests name no pages read
# nothing, so nothing would apply theirs otherwise).
MAX_QUEUED = 64


class Pages(Protocol):
    """Per worker slot, an LRU set of the page hashes routed to it (at most max_pages)."""

    def record(self, slot: int, hashes: Sequence[bytes]) -> None:
        """Deepest page first, root last: the root ends most recent, so the LRU drops leaves
        first and what stays is always a prefix; then the least recent over max_pages go."""

    def match(self, hashes: Sequence[bytes]) -> list[tuple[int, int]]:
        """(slot, leading pages) for each slot matching page 0, in the order the runs end
        (ascending slots within a page)."""

    def extend(self, slot: int, hashes: Sequence[bytes], start: int) -> int:
        """End of the run of pages remembered for `slot` from position `start` on."""

    def extend_many(self, slots: Sequence[int], hashes: Sequence[bytes],
                    starts: Sequence[int]) -> list[int]:
        """`extend` for each (slot, start): a shared prompt's ~100 extenders in one call."""

    def holders(self, h: bytes) -> list[int]:
        """The slots remembering page `h`, ascending."""

    def size(self, slot: int) -> int: ...

    def remove(self, slot: int) -> None: ...

    def pages(self) -> int:
        """Pages remembered, all slots together."""

    def nbytes(self) -> int:
        """The store's memory."""


class DictPages:
    """`Pages` in Python dicts: an OrderedDict a slot, and a page's holders as a bitmask of
    slots (the layout of KvIndex)."""

    def __init__(self, max_pages: int) -> None:
        self.max_pages = max_pages
        # page hash -> mask of the slots remembering it, in SHARDS dicts by the key's hash
        self._holders: list[dict[bytes, int]] = [{} for _ in range(SHARDS)]
        self._lru: dict[int, OrderedDict[bytes, None]] = {}
        self._all = 0

    def record(self, slot: int, hashes: Sequence[bytes]) -> None:
        lru = self._lru.get(slot)
        if lru is None:
            lru = self._lru[slot] = OrderedDict()
            self._all |= 1 << slot
        holders, bit = self._holders, 1 << slot
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                shard = holders[hash(h) & _MASK]
                shard[h] = shard.get(h, 0) | bit
        nbit = ~bit
        for _ in range(len(lru) - self.max_pages):
            self._forget(lru.popitem(last=False)[0], nbit)

    def _forget(self, h: bytes, nbit: int) -> None:
        shard = self._holders[hash(h) & _MASK]
        m = shard[h] & nbit
        if m:
            shard[h] = m
        else:
            del shard[h]

    def match(self, hashes: Sequence[bytes]) -> list[tuple[int, int]]:
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
        return [(slot, n) for slot, n in ends.items() if n]

    def extend(self, slot: int, hashes: Sequence[bytes], start: int) -> int:
        lru = self._lru.get(slot)
        if lru is None:
            return start
        n = len(hashes)
        while start < n and hashes[start] in lru:
            start += 1
        return start

    def extend_many(self, slots: Sequence[int], hashes: Sequence[bytes],
                    starts: Sequence[int]) -> list[int]:
        return [self.extend(slot, hashes, start) for slot, start in zip(slots, starts)]

    def holders(self, h: bytes) -> list[int]:
        return list(bit_positions(self._holders[hash(h) & _MASK].get(h, 0)))

    def size(self, slot: int) -> int:
        lru = self._lru.get(slot)
        return len(lru) if lru is not None else 0

    def pages(self) -> int:
        return sum(map(len, self._lru.values()))

    def nbytes(self) -> int:
        """An estimate: the pages at the measured bytes a page (counting 4M objects would take
        seconds)."""
        return self.pages() * DICT_BYTES_PER_PAGE

    def remove(self, slot: int) -> None:
        lru = self._lru.pop(slot, None)
        if lru is None:
            return
        nbit = ~(1 << slot)
        for h in lru:
            self._forget(h, nbit)
        self._all &= nbit


def make_pages(max_pages: int, native: bool | None = None) -> Pages:
    """The C store when the gateway's library loads (or `native` says so), else DictPages."""
    lib = index_native.kernel() if native is not False else None
    if native and lib is None:
        raise RuntimeError(f"routed pages: no C library ({index_native.TABLE.reason})")
    if lib is None:
        return DictPages(max_pages)
    from gateway.core.routed_native import NativePages
    return NativePages(max_pages, lib)


class RoutedPrefixes:
    """What the gateway routed where, for engines that publish no events: per worker an LRU set
    of page hashes (bounded by max_pages_per_worker)."""

    def __init__(self, max_pages_per_worker: int, native: bool | None = None) -> None:
        self.max_pages = max_pages_per_worker
        self._pages = make_pages(max_pages_per_worker, native)
        self._slots: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._free_slots: list[int] = []
        self._queued: deque[tuple[str, tuple[bytes, ...]]] = deque()

    def record(self, worker: str, hashes: Sequence[bytes]) -> None:
        """The prompt with these page hashes was routed to `worker`: queued, applied before
        anything reads the pages (`settle`)."""
        self._queued.append((worker, tuple(hashes)))
        if len(self._queued) > MAX_QUEUED:
            self.settle()

    def queued(self) -> int:
        """Records not applied yet."""
        return len(self._queued)

    def settle(self) -> None:
        """Applies the records queued, in the order they came."""
        queued = self._queued
        while queued:
            worker, hashes = queued.popleft()
            slot = self._slots.get(worker)
            if slot is None:
                slot = self._free_slots.pop() if self._free_slots else len(self._slots)
                self._slots[worker], self._names[slot] = slot, worker
            self._pages.record(slot, hashes)

    def match(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """Leading pages per worker (workers matching nothing are absent)."""
        self.settle()
        names = self._names
        return {names[slot]: n for slot, n in self._pages.match(hashes)}

    def extend(self, worker: str, hashes: Sequence[bytes], start: int) -> int:
        """End of the run of pages remembered for `worker` from position `start` on."""
        self.settle()
        slot = self._slots.get(worker)
        return start if slot is None else self._pages.extend(slot, hashes, start)

    def extend_many(self, workers: Sequence[str], hashes: Sequence[bytes],
                    starts: Sequence[int]) -> list[int]:
        """`extend` for each (worker, start), in one call of the store for those it
        remembers."""
        self.settle()
        ends, slots, at = list(starts), [], []
        for i, worker in enumerate(workers):
            if (slot := self._slots.get(worker)) is not None:
                slots.append(slot)
                at.append(i)
        if slots:
            for i, end in zip(at, self._pages.extend_many(slots, hashes, [ends[i] for i in at])):
                ends[i] = end
        return ends

    def holders(self, h: bytes) -> list[str]:
        """The workers remembering page `h` (the only ones whose run from page 0 is not empty)."""
        self.settle()
        names = self._names
        return [names[slot] for slot in self._pages.holders(h)]

    def size(self, worker: str) -> int:
        """Pages remembered for a worker."""
        self.settle()
        slot = self._slots.get(worker)
        return 0 if slot is None else self._pages.size(slot)

    def remembered(self) -> tuple[int, int]:
        """(pages remembered for all workers, the memory they take)."""
        self.settle()
        return self._pages.pages(), self._pages.nbytes()

    def remove_worker(self, worker: str) -> None:
        self.settle()
        slot = self._slots.pop(worker, None)
        if slot is None:
            return
        self._pages.remove(slot)
        del self._names[slot]
        self._free_slots.append(slot)
