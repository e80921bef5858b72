"""Eviction as a strategy of the tree: what a run's `rank` is when a request uses it (`use`: its
match, or its publish inserting the run) or uses it again (`refresh`: its publish walking pages
a sibling published).
Runs leave their medium smallest rank first (allocator.Pages keeps the candidates in a heap keyed
by rank), so a policy is only this: how to rank a run now.

- `lru` (the default): rank = the time of the last use. What the tree always did.
- `frequency`: rank = last use + b * log2(1 + k), k = the run's uses, b = 2 x the mean reuse gap
  observed (between two uses of one run). A run used often outlives, by that many gaps, one used
  once: on the in-repo Mooncake conversation trace, pooled, 2.1x LRU's hit ratio at 1M tokens,
  1.8x at 2M, 1.07x at 8M (prefixcache_bench/sim/eviction.py measures it against Belady).

A rank is fixed when the run is used (b included), so heap entries go stale only by use, as with
LRU: O(log n) per page operation, no re-keying of the heap when b moves. A run that leaves its
medium hands its rank, uses and last use up to its parent (allocator.hand_up), so a prefix ranks
at least as high as any run below it (it was used whenever they were).
"""
from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable

from cache_service.tree import HASH, Node

# log2(1 + k), precomputed for the counts runs reach in practice.
_LOG2 = [math.log2(1 + k) for k in range(1025)]


class Lru:
    name = "lru"

    def use(self, node: Node, now: float) -> None:
        node.uses += 1
        node.used_at = node.rank = now

    def refresh(self, node: Node, now: float) -> None:
        """The run is used again by the request that used it last (a publish after its
        match): recency only, no new use."""
        node.used_at = node.rank = now

    def dropped(self, hashes: bytes, uses: int) -> None:
        """Pages left the tree (LRU keeps no history)."""


class Frequency:
    name = "frequency"
    # Dropped runs whose uses are remembered (by the hash of their first dropped page).
    GHOSTS = 65_536

    def __init__(self) -> None:
        self.gap_sum = 0.0
        self.gaps = 0
        self._ghosts: OrderedDict[bytes, int] = OrderedDict()

    def dropped(self, hashes: bytes, uses: int) -> None:
        """Pages left the tree: a run published again from the first of them (a conversation
        resumed where its cached prefix ends) starts with their uses, not from nothing (the
        history is what tells a prefix used often from one used once)."""
        ghosts = self._ghosts
        ghosts[hashes[:HASH]] = uses
        ghosts.move_to_end(hashes[:HASH])
        if len(ghosts) > self.GHOSTS:
            ghosts.popitem(last=False)

    @property
    def weight(self) -> float:
        """b: twice the mean reuse gap seen so far (0 before any reuse: plain LRU)."""
        return 2.0 * self.gap_sum / self.gaps if self.gaps else 0.0

    def use(self, node: Node, now: float) -> None:
        if node.uses:
            self.gap_sum += now - node.used_at
            self.gaps += 1
        else:  # new in the tree: dropped before?
            node.uses = self._ghosts.pop(node.hashes[:HASH], 0)
        node.uses += 1
        self.refresh(node, now)

    def refresh(self, node: Node, now: float) -> None:
        """As Lru.refresh: recency only (a gap within one request would drag b toward 0)."""
        node.used_at = now
        node.rank = now + self.weight * _LOG2[min(node.uses, 1024)]


class Shadow:
    """An id-only cache of runs replaying what the live tree sees under one ranking: keys are
    the hashes of the runs' first pages, sizes their page counts, no pages or tokens. It only
    answers how many of a run's pages it would still hold (set dueling's score)."""

    def __init__(self, capacity: int, weight: Callable[[], float]):
        """`weight`: b of the rank last use + b * log2(1 + uses) (0: LRU)."""
        self.capacity, self.weight = capacity, weight
        self.size = 0
        self.entries: dict[bytes, tuple[float, int, int]] = {}  # key -> (rank, pages, uses)
        self._heap: list[tuple[float, bytes]] = []

    def access(self, key: bytes, pages: int, now: float) -> int:
        """The run is used now: the pages it held of it (0 on a miss, then it holds them)."""
        held = self.entries.get(key)
        hit, uses = (held[1], held[2] + 1) if held else (0, 1)
        if held:
            self.size -= held[1]
        rank = now + self.weight() * _LOG2[min(uses, 1024)]
        self.entries[key] = (rank, pages, uses)
        self.size += pages
        heap = self._heap
        if len(heap) > 2 * len(self.entries) + 64:  # mostly stale entries: keep it O(entries)
            heap[:] = [(r, k) for k, (r, _, _) in self.entries.items()]
            heapq.heapify(heap)
        heapq.heappush(heap, (rank, key))
        while self.size > self.capacity and self._heap:
            old, victim = heapq.heappop(self._heap)
            entry = self.entries.get(victim)
            if entry is not None and entry[0] == old:  # else stale: used again since
                del self.entries[victim]
                self.size -= entry[1]
        return min(hit, pages)


class Adaptive(Frequency):
    """Set dueling between `lru` and `frequency`: two id-only shadow caches (Shadow) of the
    pool's size replay the runs each match walks and each publish inserts, and the live tree
    ranks by the one that held more of them recently (an exponential average over about
    WINDOW runs; the other takes over only when 5% ahead). Large pools shadow a sample of the
    runs (those whose first page hash falls in 1/SAMPLE of the hash space) in 1/SAMPLE of the
    pages, as sampled set dueling does, so the shadows cost a fraction of the tree's own work.

    A switch re-ranks nothing: runs keep the rank their last use gave them until used again
    (no heap rebuild), so the live order moves to the winner's as the runs in use are used."""
    name = "adaptive"
    WINDOW = 2_000
    SAMPLE = 8
    SAMPLE_FROM = 4_096  # pools smaller than this many pages shadow every run

    def __init__(self, capacity_pages: int = 0) -> None:
        super().__init__()
        self.sample = self.SAMPLE if capacity_pages >= self.SAMPLE_FROM else 1
        capacity = max(1, capacity_pages // self.sample)
        self.shadows = {"lru": Shadow(capacity, lambda: 0.0),
                        "frequency": Shadow(capacity, self.frequency_weight)}
        self.score = {"lru": 0.0, "frequency": 0.0}
        self.choice = "lru"
        self._decay = 1.0 - 1.0 / self.WINDOW
        self._cut = 256 // self.sample  # first hash byte below this: a sampled run

    def frequency_weight(self) -> float:
        return Frequency.weight.fget(self)

    @property
    def weight(self) -> float:
        """The live ranking's b: the frequency policy's while it leads, else 0 (LRU)."""
        return self.frequency_weight() if self.choice == "frequency" else 0.0

    def use(self, node: Node, now: float) -> None:
        super().use(node, now)
        run = node
        while type(run) is Node:  # a match uses the deepest run, and so every run above it
            if run.hashes[0] < self._cut:
                self._duel(run.hashes[:HASH], len(run.hashes) // HASH, now)
            run = run.parent

    def _duel(self, key: bytes, pages: int, now: float) -> None:
        score, decay = self.score, self._decay
        for name, shadow in self.shadows.items():
            score[name] = score[name] * decay + shadow.access(key, pages, now)
        other = "frequency" if self.choice == "lru" else "lru"
        if score[other] > 1.05 * score[self.choice]:
            self.choice = other


POLICIES = {"lru": Lru, "frequency": Frequency, "adaptive": Adaptive}


def make_policy(name: str, capacity_pages: int = 0) -> Lru | Frequency:
    """`capacity_pages`: the pool's pages (device and host: the adaptive policy's shadows are
    that large). ValueError naming the choices for an unknown name."""
    try:
        policy = POLICIES[name]
        return policy(capacity_pages) if policy is Adaptive else policy()
    except KeyError:
        raise ValueError(f"eviction policy: {name!r} is not one of "
                         f"{', '.join(POLICIES)}") from None
