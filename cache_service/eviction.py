"""Eviction as a strategy of the tree: what a run's `rank` is when a request uses it (`use`: its
match, or its publish inserting the run) or uses it again (`refresh`: its publish walking pages
a sibling published).
Runs leave their medium smallest rank first (allocator.Pages keeps the candidates in a heap keyed
by rank), so a policy is only this: how to rank a run now.

- `lru` (the default): rank = the time of the last use. What the tree always did.
- `frequency`: rank = last use + b * log2(1 + k), k = the run's uses, b = 2 x the mean reuse gap
  observed (between two uses of one run). A run used often outlives, by that many gaps, one used
  once: on the in-repo Mooncake conversation trace, pooled, 2.1x LRU's hit ratio at 1M tokens,
  1.8x at 2M, 1.07x at 8M (prefixcache_bench/sim/eviction.py measures it against Belady). A gap
  counts once per page of the run, and a dropped run's return counts as one: without either,
  b would be the inter-arrival time of the short shared prefix every request passes through.
- `adaptive`: set dueling between the two (Adaptive: id-only shadow caches of sampled page
  hashes replay every request's pages; the tree ranks by the policy whose shadow held more).
  It also spots dead runs: a leaf a new run branches off beside (a prompt's tail the next
  turn did not extend) ranks below every live run once such tails are seen rarely used
  again (Adaptive.inserted).

A rank is fixed when the run is used (b included), so heap entries go stale only by use, as with
LRU: O(log n) per page operation, no re-keying of the heap when b moves. A run that leaves its
medium hands its rank, uses and last use up to its parent (allocator.hand_up), so a prefix ranks
at least as high as any run below it (it was used whenever they were).

Every medium leaves by the same rank: a device victim is demoted to host with its rank, the host
drops smallest rank first, and write-back L3 writes follow the drops (placement.py). A rank is a
time (last use, plus a bonus in the frequency policy), so a hint that protects a run until time
T can be combined as max(rank, T) without the policies knowing of it.
"""
from __future__ import annotations

from heapq import heapify, heappop, heappush
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

    def dropped(self, hashes: bytes, uses: int, used_at: float) -> None:
        """Pages left the tree (LRU keeps no history)."""

    def inserted(self, node: Node) -> Node | None:
        """A new run entered the tree: the run whose rank fell because of it (to be queued
        again at its new rank), if any. Only `adaptive` spots dead runs."""
        return None


class Frequency:
    name = "frequency"
    # Dropped runs whose uses are remembered (by the hash of their first dropped page).
    GHOSTS = 65_536

    def __init__(self) -> None:
        self.gap_sum = 0.0
        self.gaps = 0
        self._b = 0.0  # weight, kept current as gaps are seen (read on every use)
        self._ghosts: OrderedDict[bytes, tuple[int, float]] = OrderedDict()

    def dropped(self, hashes: bytes, uses: int, used_at: float) -> None:
        """Pages left the tree: a run published again from the first of them (a conversation
        resumed where its cached prefix ends) starts with their uses, not from nothing (the
        history is what tells a prefix used often from one used once), and its return counts
        as a reuse gap (without it b would see only the gaps short enough to hit)."""
        ghosts = self._ghosts
        ghosts[hashes[:HASH]] = (uses, used_at)
        ghosts.move_to_end(hashes[:HASH])
        if len(ghosts) > self.GHOSTS:
            ghosts.popitem(last=False)

    inserted = Lru.inserted

    @property
    def weight(self) -> float:
        """b: twice the mean reuse gap seen so far (0 before any reuse: plain LRU)."""
        return self._b

    def use(self, node: Node, now: float) -> None:
        """Gaps count once per page of the run (as if every page were ranked): a short run
        every request passes through (a shared system prompt) would otherwise set b to the
        requests' inter-arrival time."""
        last = node.used_at if node.uses else None
        if not node.uses:  # new in the tree: dropped before?
            node.uses, last = self._ghosts.pop(node.hashes[:HASH], (0, None))
        if last is not None:
            pages = len(node.hashes) // HASH
            self.gap_sum += (now - last) * pages
            self.gaps += pages
            self._b = 2.0 * self.gap_sum / self.gaps
        node.uses += 1
        self.refresh(node, now)

    def refresh(self, node: Node, now: float) -> None:
        """As Lru.refresh: recency only (a gap within one request would drag b toward 0)."""
        node.used_at = now
        node.rank = now + self.weight * _LOG2[min(node.uses, 1024)]


class Shadow:
    """An id-only cache of pages replaying what the live tree sees under one ranking: keys are
    page hashes, nothing else is kept. It only answers whether it would still hold a page
    (set dueling's score). Ties (the pages of one request) break deepest first, so a chain
    leaves from its tail, as in the tree."""

    def __init__(self, capacity: int, frequency: bool):
        """`frequency`: rank by last use + b * log2(1 + uses), else by last use (LRU)."""
        self.capacity, self.frequency = capacity, frequency
        # key -> (its heap item, uses). The heap holds (rank, -depth, key) items, stale ones
        # too (a page used again pushes a new item): an item is live while its entry holds
        # that very tuple (an identity test, no comparison of ranks).
        self.entries: dict[bytes, tuple[tuple[float, int, bytes], int]] = {}
        self._heap: list[tuple[float, int, bytes]] = []

    def access(self, key: bytes, depth: int, now: float, weight: float) -> bool:
        """The page (at `depth` in its request) is used now (`weight`: the frequency
        policy's b): whether it was held (if not, it is held from now on)."""
        entries = self.entries
        held = entries.get(key)
        uses = held[1] + 1 if held is not None else 1
        item = (now + weight * _LOG2[uses if uses < 1024 else 1024] if self.frequency else now,
                -depth, key)
        entries[key] = (item, uses)
        heap = self._heap
        heappush(heap, item)
        if len(entries) > self.capacity:
            while True:
                old = heappop(heap)
                entry = entries.get(old[2])
                if entry is not None and entry[0] is old:
                    del entries[old[2]]
                    break  # else stale: used again since
        elif len(heap) > 2 * len(entries) + 64:  # mostly stale entries: keep it O(entries)
            heap[:] = [item for item, _ in entries.values()]
            heapify(heap)
        return held is not None


class LruShadow:
    """Shadow's LRU case without a heap: an insertion-ordered dict, least recent first. A
    request's pages are replayed deepest first, so its chain leaves from its tail here too."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: OrderedDict[bytes, None] = OrderedDict()

    def access(self, key: bytes, depth: int, now: float, weight: float) -> bool:
        entries = self.entries
        held = key in entries
        if held:
            entries.move_to_end(key)
        else:
            entries[key] = None
            if len(entries) > self.capacity:
                entries.popitem(last=False)
        return held


class Adaptive(Frequency):
    """Set dueling between `lru` and `frequency`: two id-only shadow caches (Shadow) of the
    pool's size replay the pages of every request (the runs its match walks, the runs its
    publish inserts or walks), and the live tree ranks by the one that held more of them
    recently (an exponential average over about WINDOW pages; the other takes over only when
    5% ahead). Large pools shadow a sample of the pages (those whose hash's first byte falls
    in 1/sample of its range, found by a byte table over the run's hashes' first bytes: see
    _sampled_pages) in 1/sample of the pages, as sampled set dueling does (sample: the largest power of
    two up to SAMPLE_MAX that leaves each shadow SHADOW_MIN pages), so the shadows cost a
    fraction of the tree's own work. Each page a request passes through is one access, so a
    shadow sees the whole chain the live tree saw, evicted or not. A use that samples no page
    leaves the shadows and the scores alone.

    A switch re-ranks nothing: runs keep the rank their last use gave them until used again
    (no heap rebuild), so the live order moves to the winner's as the runs in use are used."""
    name = "adaptive"
    WINDOW = 4_000
    SAMPLE_MAX = 256  # shadow at least 1 page in this many
    SHADOW_MIN = 400  # pages a sampled shadow holds at least

    def __init__(self, capacity_pages: int = 0) -> None:
        super().__init__()
        sample = 1  # a power of two: 1/sample of the first byte's range
        while sample < self.SAMPLE_MAX and capacity_pages // (2 * sample) >= self.SHADOW_MIN:
            sample *= 2
        capacity = max(1, capacity_pages // sample)
        self.shadows = {"lru": LruShadow(capacity), "frequency": Shadow(capacity, True)}
        self.score = {"lru": 0.0, "frequency": 0.0}
        self.choice = "lru"
        self.superseded = self.superseded_reused = 0  # dead-run candidates, and those used again
        self._decay = 1.0 - 1.0 / self.WINDOW
        # A page is sampled when its hash's first byte is below 256 / sample: this table maps
        # those first bytes to 0 and the others to 1 (bytes.translate), so a run's sampled
        # pages are the zeros of its hashes' first bytes, translated (found by bytes.rfind).
        self._marks = bytes(0 if b < 256 // sample else 1 for b in range(256))

    # Dead runs (a prompt's tail the next turn did not extend): once DEAD_AFTER were seen and
    # fewer than DEAD_BELOW of them used again, such a run ranks below every live one.
    DEAD_AFTER, DEAD_BELOW = 200, 0.1
    DEAD = 1e12  # subtracted from a dead run's last use: below any rank a use gives

    def frequency_weight(self) -> float:
        return self._b

    def inserted(self, node: Node) -> Node | None:
        """The new run branches off beside one leaf (its parent has these two children only):
        that leaf is the tail of a prompt the new one shares all but that tail of (a
        conversation's next turn, its prompt's last partial 512-token block re-hashed or its
        answer re-tokenized), so it is likely dead. Marked, and counted; once such runs are
        seen rarely used again (measured: DEAD_AFTER, DEAD_BELOW), ranked below every live run
        at once (the least recently used of them first). Where they are used again (N samples
        of one prompt) the rule stays off. O(1): a parent with other children is left alone."""
        kids = node.parent.children
        if len(kids) != 2:
            return None
        for leaf in kids.values():
            if leaf is not node:
                break
        if leaf.children or leaf.superseded:
            return None
        leaf.superseded = True
        self.superseded += 1
        if (self.superseded < self.DEAD_AFTER
                or self.superseded_reused >= self.DEAD_BELOW * self.superseded):
            return None
        leaf.rank = leaf.used_at - self.DEAD
        return leaf

    def refresh(self, node: Node, now: float) -> None:
        if node.superseded:  # used again after all
            node.superseded = False
            self.superseded_reused += 1
        super().refresh(node, now)

    @property
    def weight(self) -> float:
        """The live ranking's b: the frequency policy's while it leads, else 0 (LRU)."""
        return self._b if self.choice == "frequency" else 0.0

    def use(self, node: Node, now: float) -> None:
        """A match uses the deepest run, and so every run above it: all are replayed. A new
        run (a publish) is replayed alone: its request's match replayed the runs above."""
        new = not node.uses
        super().use(node, now)
        pages = self._sampled_pages(node, whole_path=not new)
        if pages:  # else nothing sampled: the shadows and scores stay as they are
            self._replay(pages, now)

    def _sampled_pages(self, node: Node, whole_path: bool) -> list[tuple[bytes, int]]:
        """The sampled pages of `node`'s run, and of the runs above it if `whole_path`, deepest
        first, as (hash, depth). Per run, two C calls tell whether it holds any (its hashes'
        first bytes, sliced and translated by the sample's table; then a byte search): most
        runs hold none, and cost no per-page Python work."""
        table = self._marks
        hashes = node.hashes
        marks = hashes[::HASH].translate(table)
        sampled = 0 in marks
        if not sampled and not whole_path:
            return []  # a new run with no sampled page: no need to find its depth
        # The runs holding sampled pages, deepest first: (hashes, marks, pages below its end).
        runs = [(hashes, marks, 0)] if sampled else []
        below = len(marks)  # pages from the top of the run just seen to the path's end
        run = node.parent
        while type(run) is Node:
            hashes = run.hashes
            if whole_path:
                marks = hashes[::HASH].translate(table)
                if 0 in marks:
                    runs.append((hashes, marks, below))
            below += len(hashes) // HASH
            run = run.parent
        pages: list[tuple[bytes, int]] = []
        for hashes, marks, under in runs:
            start = below - under - len(marks)  # the depth of the run's first page
            i = marks.rfind(0)
            while i >= 0:
                pages.append((hashes[i * HASH:(i + 1) * HASH], start + i))
                i = marks.rfind(0, 0, i)
        return pages

    def _replay(self, pages: list[tuple[bytes, int]], now: float) -> None:
        """The pages (hash, depth), deepest first, are accessed in both shadows in turn."""
        score, decay, weight = self.score, self._decay, self._b
        lru, frequency = self.shadows["lru"].access, self.shadows["frequency"].access
        lru_score, frequency_score = score["lru"], score["frequency"]
        for key, depth in pages:
            lru_score = lru_score * decay + lru(key, depth, now, weight)
            frequency_score = frequency_score * decay + frequency(key, depth, now, weight)
        score["lru"], score["frequency"] = lru_score, frequency_score
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
