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

import math
from collections import OrderedDict

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


POLICIES = {"lru": Lru, "frequency": Frequency}


def make_policy(name: str) -> Lru | Frequency:
    """ValueError naming the choices for an unknown name."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"eviction policy: {name!r} is not one of "
                         f"{', '.join(POLICIES)}") from None
