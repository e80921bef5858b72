"""Pages, eviction order and Mamba slots of one pool: free pages per medium, the eviction order
over runs (by the policy's rank: cache_service/eviction.py; LRU by default), and the checkpoint
slots.

Accounting invariant per medium: free + (in-tree or lease-held or dead-but-pinned) = total pages,
and a page is in exactly one of those places. Free pages are a u32 array used as a stack: the
lowest page number is handed out first.

The heap orders eviction *candidates*, runs that may leave their medium now: an unpinned device
run without device children (its tail is demoted or dropped) and an unpinned host run without
children (dropped), smallest rank first. A match uses only the deepest run of its path; a run
that leaves its medium hands its rank up to its parent (`hand_up`), so an ancestor becomes a
candidate ranked at least as high as any path through it: the same order as using every run of
every path, at O(1) per match. Each candidate has one heap entry (`Node.queued` says which
heap holds it); an entry whose run was used since is pushed again with its new rank when it
comes up, and one whose run stopped being a candidate is dropped then (the run is offered again
when it becomes one).
"""
from __future__ import annotations

import heapq
import itertools
from array import array

from cache_service.tree import DEVICE, HASH, HOST, NO_SLOT, PAGE_CODE, Node, Root, event_parent

MEDIA = (DEVICE, HOST)


class Pages:
    """Free pages per medium, cached page counts, and the heap of eviction candidates."""

    def __init__(self, device_pages: int, host_pages: int, policy=None):
        """`policy`: the pool's eviction policy (cache_service/eviction.py), told of the pages
        that leave the tree."""
        self.policy = policy
        self.free = {DEVICE: array(PAGE_CODE, range(device_pages - 1, -1, -1)),
                     HOST: array(PAGE_CODE, range(host_pages - 1, -1, -1))}
        self.cached = {DEVICE: 0, HOST: 0}
        self._heaps: dict[int, list] = {DEVICE: [], HOST: []}
        self._tie = itertools.count()

    def take(self, medium: int, n: int) -> array:
        """n free pages (the caller checked there are), lowest first."""
        free = self.free[medium]
        pages = free[-n:]
        del free[-n:]
        pages.reverse()
        return pages

    # ---- the LRU ------------------------------------------------------------------------

    @staticmethod
    def is_candidate(node: Node) -> bool:
        if node.parent is None or node.pins:
            return False
        kids = node.children
        if node.medium == DEVICE:
            return not kids or not any(k.medium == DEVICE for k in kids.values())
        return not kids

    def offer(self, node: Node | Root) -> None:
        """Queues `node` if it is a candidate and not queued on its medium already."""
        if type(node) is Node and node.queued != node.medium and self.is_candidate(node):
            node.queued = node.medium
            heapq.heappush(self._heaps[node.medium], (node.rank, next(self._tie), node))

    def requeue(self, node: Node) -> None:
        """`node`'s rank fell (a dead run): one more entry at the new rank, so it leaves at that
        rank; the old entry is skipped or pushed again when it comes up."""
        if node.queued == node.medium:
            heapq.heappush(self._heaps[node.medium], (node.rank, next(self._tie), node))
        else:
            self.offer(node)

    def pop_victim(self, medium: int) -> Node | None:
        """The candidate on `medium` ranked lowest (the least recently used, with LRU), taken
        off the heap."""
        heap = self._heaps[medium]
        while heap:
            used, _, node = heapq.heappop(heap)
            if node.queued != medium:
                continue  # left this medium while queued: its entry (if any) is elsewhere
            if node.medium != medium or not self.is_candidate(node):
                node.queued = None  # offered again when it becomes a candidate
                continue
            if node.rank != used:
                heapq.heappush(heap, (node.rank, next(self._tie), node))
                continue
            node.queued = None
            return node
        return None

    def heap_entries(self) -> int:
        return sum(len(h) for h in self._heaps.values())


def hand_up(node: Node) -> None:
    """Called as (part of) a run leaves its medium: see the module docstring."""
    parent = node.parent
    if type(parent) is Node:
        if parent.rank < node.rank:
            parent.rank = node.rank
        if parent.used_at < node.used_at:
            parent.used_at = node.used_at
        if parent.uses < node.uses:
            parent.uses = node.uses


class Slots:
    """Mamba checkpoint slots: a slot holds the state after the last page of one run."""

    def __init__(self, total: int, emit=None):
        """`emit`: the pool's `emitter.Emitter`, told of every checkpoint that appears or goes
        (the vLLM-format stream publishes them as its Mamba group's blocks)."""
        self.total = total
        # A u32 array like the pages' (not a list of ints: 4M slots would be ~150 MB of int
        # objects in arenas Python keeps after the pool is gone).
        self.free = array(PAGE_CODE, range(total - 1, -1, -1))
        # Insertion-ordered (not a set) so that rank ties break the same way in every run. The
        # value is the hash of the checkpointed page: a cut run's hashes no longer hold it.
        self.checkpointed: dict[Node, bytes] = {}
        self.evictions = 0
        self.emit = emit

    def take(self) -> int | None:
        """A free slot, evicting the least recently used unpinned checkpoint if needed."""
        if not self.free:
            victims = [n for n in self.checkpointed if not n.pins]
            if not victims:
                return None
            self.release(min(victims, key=lambda n: n.rank))
            self.evictions += 1
        return self.free.pop()

    def attach(self, node: Node, slot: int) -> None:
        node.slot = slot
        page_hash = node.hashes[-HASH:]
        self.checkpointed[node] = page_hash
        if self.emit is not None:
            emit_checkpoint(self.emit, node)

    def forget(self, node: Node) -> None:
        """The node's checkpoint leaves the index now (its namespace was evicted) although a
        lease may still hold its slot: it stays counted as used, and `release` frees the slot
        later without a second drop (an empty hash: already dropped)."""
        page_hash = self.checkpointed.get(node)
        if page_hash:
            self.checkpointed[node] = b""
            if self.emit is not None:
                self.emit.checkpoint_dropped(page_hash)

    def release(self, node: Node) -> None:
        if node.slot != NO_SLOT:
            self.free.append(node.slot)
            node.slot = NO_SLOT
            page_hash = self.checkpointed.pop(node, None)
            if self.emit is not None and page_hash:
                self.emit.checkpoint_dropped(page_hash)


def emit_checkpoint(emit, node: Node) -> None:
    """Tells `emit` (an `emitter.Emitter`) that a checkpoint holds the state after the run's
    last page: that page's hash, parent hash and tokens."""
    hashes = node.hashes
    stride = len(node.tokens) // (len(hashes) // HASH)
    parent = hashes[-2 * HASH:-HASH] if len(hashes) > HASH else event_parent(node)
    emit.checkpointed(hashes[-HASH:], parent, node.tokens[-stride:], node.root.adapter,
                      node.root.hash)
