"""The placement policy of one pool: which tier (design.md §2) each page lives on. Which pages
leave the device when it is full (demoted to host, or dropped), host pages loaded back by a
match, and the L3 write policies. (The mechanism that moves the bytes between tiers is the
worker's, compute_service/tiers/.)

Eviction takes the least recently used candidate run (allocator.py) and moves only as many of
its TAIL pages as the allocation still needs, splitting the run there: with a host tier they are
demoted (device -> host copies), otherwise, or when the host tier has no room, a childless run
loses them. Every page move is a `CopyOp` the worker runs in order, and an event.

L3 write policies (`RegisterPool.remote_write_policy`) become `CopyOp`s to REMOTE, each page at
most once per pool and store generation (l3_refill.py lists them again when they did not stay): write-through at publish (flushed after the step's checkpoints so that each
write carries its page's slot), write-back when a page leaves the worker's last local tier
(listed before any copy that reuses its memory), hot once a run has `remote_min_hits` hits.
"""
from __future__ import annotations

from array import array

from cache_service.allocator import Pages, Slots, hand_up
from cache_service.emitter import Emitter
from cache_service.l3_loss import generation
from cache_service.results import RemoteExtension
from cache_service.tree import (DEVICE, HASH, HOST, NO_SLOT, PAGE_CODE, Node, Root, cut_tail,
                                event_parent, remove_child, size, split)
from prefixcache.v1 import cache_service_pb2 as pb, common_pb2
from prefixcache_client.hash import HASH_BYTES

REMOTE = common_pb2.MEDIUM_REMOTE
WRITE_THROUGH = pb.REMOTE_WRITE_POLICY_WRITE_THROUGH
WRITE_BACK = pb.REMOTE_WRITE_POLICY_WRITE_BACK
HOT = pb.REMOTE_WRITE_POLICY_HOT
CopyOp = common_pb2.CopyOp
NO_PAGES = array(PAGE_CODE)  # never changed: callers concatenate, never extend it
NO_EXTENSION = RemoteExtension([], NO_PAGES)  # never changed either


class Placement:
    def __init__(self, cfg, pages: Pages, slots: Slots, emit: Emitter, counters, remote, chain):
        """`cfg`: pool_config.PoolConfig; `counters`: pool_config.Counters; `remote`: an L3 client for
        cfg.remote_lookup; `chain`: chain_hash.chain_function()."""
        self.cfg = cfg
        self.stride = 4 * cfg.page_size
        self.pages, self.slots, self.emit, self.counters = pages, slots, emit, counters
        self.remote, self.chain = remote, chain
        self.copies: list[common_pb2.CopyOp] = []
        self.host_tier = cfg.host_pages > 0
        self.write_back = cfg.remote_write_policy == WRITE_BACK
        self._write_through: dict[Node, None] = {}  # published this step, in page order

    # ---- making room on the device --------------------------------------------------------

    def take_device(self, n: int) -> array | None:
        """n free device pages, evicting least-recently-used pages if needed; None if impossible
        (pages evicted on the way stay free)."""
        free = self.pages.free[DEVICE]
        while len(free) < n:
            if not self._evict_device(n - len(free)):
                return None
        return self.pages.take(DEVICE, n)

    def _evict_device(self, short: int) -> bool:
        """Frees up to `short` device pages from the LRU candidate; False when none can go."""
        while (node := self.pages.pop_victim(DEVICE)) is not None:
            k = min(short, size(node))
            if self.host_tier:
                host = self._take_host(k)
                if host:
                    self._demote(node, host)
                    return True
            if not node.children:
                self.drop(node, k)
                return True
            # A device run whose host children need it and no host room: keep it. It is offered
            # again when its children are dropped.
        return False

    def _take_host(self, k: int) -> array | None:
        """Up to k free host pages, dropping least recently used host pages for them."""
        free = self.pages.free[HOST]
        while len(free) < k:
            node = self.pages.pop_victim(HOST)
            if node is None:
                break
            self.drop(node, min(k - len(free), size(node)))
        n = min(k, len(free))
        return self.pages.take(HOST, n) if n else None

    def _demote(self, node: Node, host: array) -> None:
        """Moves the last len(host) pages of a device run without device children to host."""
        h = len(host)
        if h < size(node):
            self.split(node, size(node) - h)
        hashes = node.hashes
        self.copies += [CopyOp(src_medium=DEVICE, src_page=src, dst_medium=HOST, dst_page=dst,
                               page_hash=hashes[i * HASH:(i + 1) * HASH])
                        for i, (src, dst) in enumerate(zip(node.pages, host))]
        self.pages.free[DEVICE].extend(node.pages)
        hand_up(node)
        self._move(node, HOST, host)
        self.counters.evictions[DEVICE] += h
        self.pages.offer(node)
        self.pages.offer(node.parent)

    def drop(self, node: Node, k: int) -> None:
        """Drops the last k pages of a childless, unpinned run from the tree."""
        n, medium = size(node), node.medium
        if self.write_back:
            self.write_remote(node, n - k, n)  # listed before any copy that reuses its pages
        if k == n:
            hashes, pages = node.hashes, node.pages
            hand_up(node)
            parent = node.parent
            remove_child(node, self.stride)
            self.slots.release(node)
            self.pages.offer(parent)
        else:
            hashes, pages = cut_tail(node, k, self.stride)
            self.slots.release(node)  # its checkpoint was the state after its last page
            self.pages.offer(node)
        self.emit.removed(medium, hashes)
        if self.pages.policy is not None:
            self.pages.policy.dropped(hashes, node.uses, node.used_at)
        self.pages.free[medium].extend(pages)
        self.pages.cached[medium] -= k
        self.counters.evictions[medium] += k

    # ---- moving runs between media --------------------------------------------------------

    def promote(self, node: Node, device_pages: array) -> None:
        """Loads a (pinned) host run back onto the device (design.md lesson 12)."""
        hashes = node.hashes
        self.copies += [CopyOp(src_medium=HOST, src_page=src, dst_medium=DEVICE, dst_page=dst,
                               page_hash=hashes[i * HASH:(i + 1) * HASH])
                        for i, (src, dst) in enumerate(zip(node.pages, device_pages))]
        self.pages.free[HOST].extend(node.pages)
        self._move(node, DEVICE, device_pages)

    def adopt(self, node: Node, device_pages: array) -> None:
        """A host run a lease computed again: its host copy is redundant, the run takes the
        lease's device pages instead."""
        self.pages.free[HOST].extend(node.pages)
        self._move(node, DEVICE, device_pages)

    def _move(self, node: Node, medium: int, pages: array) -> None:
        self.emit.removed(node.medium, node.hashes)
        n = size(node)
        self.pages.cached[node.medium] -= n
        self.pages.cached[medium] += n
        node.medium = medium
        node.pages = pages
        self.emit.stored(medium, event_parent(node), node.hashes, node.tokens, node.root.adapter,
                         node.root.hash)

    def split(self, node: Node, k: int) -> Node:
        """tree.split, keeping this step's pending write-through in page order."""
        head = split(node, k, self.stride)
        pending = self._write_through
        if node in pending:
            self._write_through = {h: None for n in pending
                                   for h in ((head, n) if n is node else (n,))}
        return head

    # ---- L3 -------------------------------------------------------------------------------

    def write_remote(self, node: Node, start: int = 0, end: int | None = None) -> None:
        """Asks the worker to write pages [start, end) of the run (and the checkpoint of its
        last page) to L3, once per page and store generation (l3_loss: after the store lost its
        data, again): a run is marked written once all of it is."""
        gen = generation(self.remote)
        if node.in_remote == gen:
            return
        n = size(node)
        end = n if end is None else end
        if start == 0 and end == n:
            node.in_remote = gen
        hashes, pages, medium = node.hashes, node.pages, node.medium
        self.copies += [CopyOp(src_medium=medium, src_page=pages[i], dst_medium=REMOTE,
                               page_hash=hashes[i * HASH:(i + 1) * HASH],
                               mamba_slot=node.slot if i == n - 1 else NO_SLOT)
                        for i in range(start, end)]
        self.counters.remote_writes += end - start

    def published(self, node: Node) -> None:
        """A run entered the tree (REMOTE_WRITE_POLICY_WRITE_THROUGH writes it at the flush)."""
        if self.cfg.remote_write_policy == WRITE_THROUGH:
            self._write_through[node] = None

    def matched(self, path: list[Node]) -> None:
        """A match used these runs (REMOTE_WRITE_POLICY_HOT; write-through writes again the
        runs written before the store lost its data: l3_loss)."""
        if self.cfg.remote_write_policy == HOT:
            for node in path:
                node.hits += 1
                if node.hits >= self.cfg.remote_min_hits:
                    self.write_remote(node)
        elif self.cfg.remote_write_policy == WRITE_THROUGH:
            gen = generation(self.remote)
            for node in path:
                if node.in_remote != gen:
                    self.write_remote(node)

    def policy_wrote(self, node: Node) -> bool:
        """Whether the write policy has written this run while it stayed on the worker (what
        l3_refill writes again after the store lost its data)."""
        policy = self.cfg.remote_write_policy
        return policy == WRITE_THROUGH or (policy == HOT and node.hits >= self.cfg.remote_min_hits)

    def flush_write_through(self) -> None:
        """The L3 writes of this step's publishes, once its checkpoints are attached."""
        for node in self._write_through:
            if node.parent is not None:
                self.write_remote(node)
        self._write_through.clear()

    def probe_remote(self, root: Root, path: list[Node], depth: int, data: bytes,
                     n_tokens: int) -> RemoteExtension:
        """The L3 extension after the matched `depth` pages: page hashes found and device pages
        to load them into."""
        if self.remote is None or not self.cfg.remote_lookup:
            return NO_EXTENSION
        limit = max(0, n_tokens - 1) // self.cfg.page_size - depth
        if limit <= 0:
            return NO_EXTENSION
        start = depth * self.stride
        parent = path[-1].hashes[-HASH:] if path else root.hash
        run = self.chain(parent, bytes(data[start:start + limit * self.stride]), self.stride)
        hashes = [run[i:i + HASH_BYTES] for i in range(0, len(run), HASH_BYTES)]
        found = self.remote.probe(self.cfg.model_id, hashes)
        pages = self.take_device(found) if found else None
        if pages is None:
            return NO_EXTENSION
        return RemoteExtension(hashes[:found], pages)
