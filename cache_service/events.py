"""The KV event log of one pool epoch: numbered batches and a bounded replay buffer.

`seq` starts at 0 in every epoch and grows by one per batch. The buffer keeps the newest batches
holding at most `capacity` page events; a subscriber that needs an older batch gets a snapshot.
"""
from __future__ import annotations

import itertools
import time
from array import array
from collections import deque

from prefixcache.v1 import events_pb2


def stored(hashes: list[bytes], parent: bytes, tokens: bytes, page_size: int, model_id: str,
           adapter: str, medium: int) -> events_pb2.KvEvent:
    """A BlockStored event; `tokens` are the pages' u32-le bytes, `parent` b"" at a namespace root."""
    return events_pb2.KvEvent(stored=events_pb2.BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=array("I", tokens).tolist(),
        block_size=page_size, model_id=model_id, adapter=adapter, medium=medium))


def removed(hashes: list[bytes], medium: int) -> events_pb2.KvEvent:
    return events_pb2.KvEvent(removed=events_pb2.BlockRemoved(block_hashes=hashes, medium=medium))


def cleared() -> events_pb2.KvEvent:
    return events_pb2.KvEvent(cleared=events_pb2.AllBlocksCleared())


def page_count(event: events_pb2.KvEvent) -> int:
    """Page events in one event (AllBlocksCleared counts as one)."""
    kind = event.WhichOneof("event")
    if kind == "stored":
        return len(event.stored.block_hashes)
    if kind == "removed":
        return len(event.removed.block_hashes)
    return 1


class EventLog:
    def __init__(self, pool_id: str, epoch: int, capacity: int):
        self.pool_id = pool_id
        self.epoch = epoch
        self.capacity = max(1, capacity)
        self.head_seq = -1
        self._batches: deque[tuple[events_pb2.EventBatch, int]] = deque()
        self._held = 0

    def append(self, events: list[events_pb2.KvEvent]) -> events_pb2.EventBatch:
        self.head_seq += 1
        batch = events_pb2.EventBatch(pool_id=self.pool_id, epoch=self.epoch, seq=self.head_seq,
                                      timestamp=time.time(), events=events)
        size = sum(page_count(e) for e in events)
        self._batches.append((batch, size))
        self._held += size
        # Keep at least the newest batch so that a live subscriber never needs a snapshot.
        while self._held > self.capacity and len(self._batches) > 1:
            self._held -= self._batches.popleft()[1]
        return batch

    def since(self, after_seq: int) -> list[events_pb2.EventBatch] | None:
        """Batches after `after_seq`, or None when some of them are no longer held."""
        if after_seq >= self.head_seq:
            return [] if after_seq == self.head_seq else None
        first = self._batches[0][0].seq if self._batches else self.head_seq + 1
        if after_seq + 1 < first:
            return None
        skip = after_seq + 1 - first
        return [b for b, _ in itertools.islice(self._batches, skip, None)]
