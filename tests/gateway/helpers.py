"""Builders of prefixcache.v1 event messages for the gateway tests; a page table's contents; a
worker client for router tests; a watch on the router's settle calls."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from gateway.core.holder_sets import PAIR, PAIR_SLOTS, SHARED, TRIPLE, TRIPLE_SLOTS
from gateway.core.index_table import PageTable
from prefixcache.v1 import common_pb2, events_pb2

DEVICE, HOST, REMOTE = common_pb2.MEDIUM_DEVICE, common_pb2.MEDIUM_HOST, common_pb2.MEDIUM_REMOTE


def stored(hashes: list[bytes], medium: int = DEVICE, parent: bytes = b"") -> events_pb2.KvEvent:
    return events_pb2.KvEvent(stored=events_pb2.BlockStored(block_hashes=hashes, parent_block_hash=parent,
                                                            block_size=16, model_id="m", medium=medium))


def removed(hashes: list[bytes], medium: int = DEVICE) -> events_pb2.KvEvent:
    return events_pb2.KvEvent(removed=events_pb2.BlockRemoved(block_hashes=hashes, medium=medium))


def cleared() -> events_pb2.KvEvent:
    return events_pb2.KvEvent(cleared=events_pb2.AllBlocksCleared())


def batch(pool: str, seq: int, *events: events_pb2.KvEvent, epoch: int = 1, snapshot: bool = False,
          snapshot_end: bool = False) -> events_pb2.EventBatch:
    return events_pb2.EventBatch(pool_id=pool, epoch=epoch, seq=seq, events=list(events), snapshot=snapshot,
                                 snapshot_end=snapshot_end)


def heartbeat(pool: str, head_seq: int, epoch: int = 1) -> events_pb2.Heartbeat:
    return events_pb2.Heartbeat(pool_id=pool, epoch=epoch, head_seq=head_seq)


def page(i: int) -> bytes:
    """A distinct 16-byte stand-in page hash."""
    return i.to_bytes(16, "little")


def pages(start: int, stop: int) -> list[bytes]:
    return [page(i) for i in range(start, stop)]


class NoClient:
    """A worker's compute client in router tests: the router only closes it (when it leaves)."""

    def close(self) -> None:
        pass


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def pages_and_stamps(table: PageTable) -> dict[int, tuple[int, int]]:
    """Every live key of both tables -> (its holders' mask, its stamp)."""
    out = {}
    for t in table._tables():
        holder, stamp = t._mem.holder, np.frombuffer(t._stamp, dtype=np.uint32)
        for p in np.flatnonzero(holder >= 0).tolist():
            out[t._key[p]] = (t.holder_sets.mask(int(holder[p])), int(stamp[p]))
    return out


def check_holder_sets(table: PageTable) -> None:
    """The table's sets of holders are what its pages hold: each set's count is the pages (of
    both tables while a growth migrates) whose holder names it, every set held is one no pair
    or triple could be (4+ holders, 3 of which one is past TRIPLE_SLOTS, or 2 of which one is
    past PAIR_SLOTS), an id no page holds is free, and the pages held by pairs and by triples
    are counted."""
    sets = table.holder_sets
    assert all(t.holder_sets is sets for t in table._tables())
    shared = np.concatenate([t._mem.holder[t._mem.holder >= PAIR] for t in table._tables()])
    held = shared[shared >= SHARED]
    counts = np.bincount(held - SHARED, minlength=len(sets.masks)).tolist()
    assert counts == sets.refs and sets.pages == len(held)
    assert sets.pairs == np.count_nonzero(shared < TRIPLE)
    assert sets.triples == len(shared) - len(held) - sets.pairs
    for mask, refs in zip(sets.masks, sets.refs):
        bits, width = mask.bit_count(), mask.bit_length()
        compact = bits == 2 and width <= PAIR_SLOTS or bits == 3 and width <= TRIPLE_SLOTS
        assert bits > 1 and not compact if refs else mask == 0


@contextmanager
def settles(router) -> Iterator[list[int]]:
    """Watches `router.settle` (what a request's path calls once its decision is on its way):
    the list gets, at each call, the records of routed pages still queued just after it."""
    queued_after, settle = [], router.settle

    def counted() -> None:
        settle()
        queued_after.append(router.policy.recent.queued())
    router.settle = counted
    try:
        yield queued_after
    finally:
        del router.settle
