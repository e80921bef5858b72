"""Simulated page caches and the KV events their changes produce (the same `prefixcache.v1`
messages a cache service emits).

- `PageCache`: one worker's device LRU over pages, with an optional host tier.
- `SharedL3`: the L3 tier every worker shares (Redis with allkeys-lru), an LRU over pages.

Leaf-first LRU: a request touches its pages deepest first and its first page last, so a page is
always more recent than its descendants and eviction takes leaves first. A worker's cached set
then stays prefix-closed, as in a radix tree that evicts unpinned leaves (design.md §4). Pins are
not modelled: a worker commits a request's pages once its prefill is done, serially. The L3 is
not prefix-closed (pages arrive from many workers in eviction order), which is why its hits are
counted as a contiguous extension only.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from prefixcache.v1 import common_pb2, events_pb2

DEVICE, HOST, REMOTE = common_pb2.MEDIUM_DEVICE, common_pb2.MEDIUM_HOST, common_pb2.MEDIUM_REMOTE


def stored_event(hashes: Sequence[bytes], parent: bytes, medium: int, page_size: int,
                 model_id: str) -> events_pb2.KvEvent:
    """BlockStored without token_ids: the gateway index never reads them, and filling them
    would dominate the simulation's run time."""
    return events_pb2.KvEvent(stored=events_pb2.BlockStored(
        block_hashes=hashes, parent_block_hash=parent, block_size=page_size, model_id=model_id,
        medium=medium))


def removed_event(hashes: Sequence[bytes], medium: int) -> events_pb2.KvEvent:
    return events_pb2.KvEvent(removed=events_pb2.BlockRemoved(block_hashes=hashes, medium=medium))


def chain_events(pages: Sequence[tuple[bytes, bytes]], medium: int, page_size: int,
                 model_id: str) -> list[events_pb2.KvEvent]:
    """BlockStored events for (hash, parent) pairs listed child before parent (eviction order),
    one per parent -> child run."""
    events = []
    run: list[bytes] = []
    run_parent = b""
    for h, parent in reversed(pages):
        if run and parent != run[-1]:
            events.append(stored_event(run, run_parent, medium, page_size, model_id))
            run = []
        if not run:
            run_parent = parent
        run.append(h)
    if run:
        events.append(stored_event(run, run_parent, medium, page_size, model_id))
    return events


class PageCache:
    def __init__(self, device_pages: int, host_pages: int = 0, page_size: int = 16,
                 model_id: str = "sim") -> None:
        if device_pages < 1:
            raise ValueError(f"device_pages: must be >= 1, got {device_pages}")
        self.device_pages, self.host_pages = device_pages, host_pages
        self.page_size, self.model_id = page_size, model_id
        # page hash -> its parent's hash (b"" for a first page), in LRU order (oldest first).
        self.device: OrderedDict[bytes, bytes] = OrderedDict()
        self.host: OrderedDict[bytes, bytes] = OrderedDict()
        # (hash, parent) of the pages the last commit dropped from the worker altogether (from
        # device without a host tier, else from host), oldest first: what write-back sends to L3.
        self.spilled: list[tuple[bytes, bytes]] = []

    def match(self, hashes: Sequence[bytes]) -> tuple[int, int]:
        """(leading pages on device, then the contiguous pages after them on host)."""
        device, host, n = self.device, self.host, len(hashes)
        d = 0
        while d < n and hashes[d] in device:
            d += 1
        h = d
        while h < n and hashes[h] in host:
            h += 1
        return d, h - d

    def commit(self, hashes: Sequence[bytes], device_hit: int, host_hit: int,
               emit: bool = True) -> list[events_pb2.KvEvent]:
        """Put every page of a finished prefill on device (loading host hits back, evicting what no
        longer fits) and return the events describing the change (none when emit is False)."""
        device, host, n = self.device, self.host, len(hashes)
        for i in range(n - 1, -1, -1):
            h = hashes[i]
            if h in device:
                device.move_to_end(h)
            else:
                device[h] = hashes[i - 1] if i else b""
        loaded = hashes[device_hit:device_hit + host_hit]
        for h in loaded:
            del host[h]
        evicted: list[bytes] = []
        demoted: list[tuple[bytes, bytes]] = []
        spilled: list[tuple[bytes, bytes]] = []
        while len(device) > self.device_pages:
            h, parent = device.popitem(last=False)
            evicted.append(h)
            if self.host_pages:
                host[h] = parent
                demoted.append((h, parent))
                if len(host) > self.host_pages:
                    spilled.append(host.popitem(last=False))
            else:
                spilled.append((h, parent))
        self.spilled = spilled
        if not emit:
            return []
        size, model = self.page_size, self.model_id
        events = []
        if device_hit < n:
            events.append(stored_event(hashes[device_hit:], hashes[device_hit - 1] if device_hit else b"",
                                       DEVICE, size, model))
        if loaded:
            events.append(removed_event(loaded, HOST))
        if evicted:
            events.append(removed_event(evicted, DEVICE))
        # Leaves are demoted first, so reversed, the demoted pages form parent -> child runs.
        events += chain_events(demoted, HOST, size, model)
        if self.host_pages and spilled:
            events.append(removed_event([h for h, _ in spilled], HOST))
        return events


class SharedL3:
    """The L3 tier shared by every worker: page hash -> parent hash in LRU order (oldest first),
    as Redis with `allkeys-lru` keeps page payloads. A read or a write refreshes a page.

    Its events are the stream a subscriber to the L3 itself would see (Redis keyspace
    notifications for new keys and evictions): BlockStored(REMOTE) when a page enters,
    BlockRemoved(REMOTE) when the LRU drops it. Rewriting a page it holds changes nothing."""

    def __init__(self, capacity_pages: int, page_size: int = 16, model_id: str = "sim") -> None:
        if capacity_pages < 1:
            raise ValueError(f"capacity_pages: must be >= 1, got {capacity_pages}")
        self.capacity_pages, self.page_size, self.model_id = capacity_pages, page_size, model_id
        self.pages: OrderedDict[bytes, bytes] = OrderedDict()
        self.writes = 0  # pages written (new or rewritten)
        self.new_pages = 0  # pages that were not there
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.pages)

    def extend(self, hashes: Sequence[bytes], start: int) -> int:
        """How many pages from position `start` on the L3 holds contiguously."""
        pages, n, i = self.pages, len(hashes), start
        while i < n and hashes[i] in pages:
            i += 1
        return i - start

    def read(self, hashes: Sequence[bytes]) -> None:
        """A load of these pages (all held): deepest first, so the first page ends most recent."""
        pages = self.pages
        for h in reversed(hashes):
            pages.move_to_end(h)

    def write(self, pages: Iterable[tuple[bytes, bytes]], emit: bool = True) -> list[events_pb2.KvEvent]:
        """Write (hash, parent) pairs in the order given, the last one ending most recent: children
        before their parents (eviction order, or a prompt deepest page first) keeps it leaf-first."""
        held = self.pages
        new: list[tuple[bytes, bytes]] = []
        for h, parent in pages:
            self.writes += 1
            if h in held:
                held.move_to_end(h)
            else:
                held[h] = parent
                new.append((h, parent))
        dropped = [held.popitem(last=False)[0] for _ in range(len(held) - self.capacity_pages)]
        self.new_pages += len(new)
        self.evictions += len(dropped)
        if not emit:
            return []
        events = chain_events(new, REMOTE, self.page_size, self.model_id)
        if dropped:
            events.append(removed_event(dropped, REMOTE))
        return events
