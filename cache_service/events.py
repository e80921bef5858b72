"""The KV events of one pool epoch: the log of numbered batches with its bounded replay buffer,
and the protobuf messages, built from compact records only when someone reads them.

A record is what `emitter.Emitter` collected during one call: `[STORED, medium, parent hash
(b"" at a namespace root), hashes, tokens, adapter, namespace seed]`, `[REMOVED, medium,
hashes]` or `[CLEARED]`, where hashes (16 bytes each) and tokens (u32-le) are lists of chunks to
join; hybrid pools add `[CHECKPOINTED, page hash, parent, tokens, adapter, namespace seed]` and
`[CHECKPOINT_DROPPED, page hash]`, which only the vLLM-format stream publishes
(cache_service/vllm_events.py): a gRPC batch made of them alone has no events. A
batch is appended with its seq and timestamp at once, and encoded into an `EventBatch` once, the
first time a subscriber (or a test) asks for it: pools nobody subscribes to never build a
protobuf event.

`seq` starts at 0 in every epoch and grows by one per batch. The buffer keeps the newest batches
holding at most `capacity` page events; a subscriber that needs an older batch gets a snapshot.
"""
from __future__ import annotations

import itertools
import sys
import time
from array import array
from collections import deque

import numpy as np

from prefixcache.v1 import events_pb2

STORED, REMOVED, CLEARED, CHECKPOINTED, CHECKPOINT_DROPPED = 0, 1, 2, 3, 4
_BIG_ENDIAN = sys.byteorder == "big"


def split_hashes(hashes: bytes) -> list[bytes]:
    """Concatenated 16-byte hashes as a list of bytes (one C loop)."""
    return np.frombuffer(hashes, dtype="V16").tolist() if hashes else []


def token_list(tokens: bytes) -> list[int]:
    ids = array("I")
    ids.frombytes(tokens)
    if _BIG_ENDIAN:
        ids.byteswap()
    return ids.tolist()


def _hash_fields(hashes: list[bytes] | bytes) -> dict:
    """A list of hashes goes in `block_hashes`; bytes (16-byte hashes concatenated) in
    `packed_block_hashes`, for the subscribers that asked for it (SubscribeRequest.packed_hashes)."""
    if isinstance(hashes, bytes):
        return {"packed_block_hashes": hashes}
    return {"block_hashes": hashes}


def stored(hashes: list[bytes] | bytes, parent: bytes, tokens: bytes, page_size: int,
           model_id: str, adapter: str, medium: int) -> events_pb2.KvEvent:
    """A BlockStored event; `tokens` are the pages' u32-le bytes, `parent` b"" at a namespace root."""
    return events_pb2.KvEvent(stored=events_pb2.BlockStored(
        **_hash_fields(hashes), parent_block_hash=parent, token_ids=token_list(tokens),
        block_size=page_size, model_id=model_id, adapter=adapter, medium=medium))


def removed(hashes: list[bytes] | bytes, medium: int) -> events_pb2.KvEvent:
    return events_pb2.KvEvent(removed=events_pb2.BlockRemoved(**_hash_fields(hashes),
                                                              medium=medium))


def cleared() -> events_pb2.KvEvent:
    return events_pb2.KvEvent(cleared=events_pb2.AllBlocksCleared())


def to_event(record: list, page_size: int, model_id: str,
             packed: bool = False) -> events_pb2.KvEvent | None:
    """The record's protobuf event (its hashes packed or a bytes object each); None for the
    checkpoint records, which it does not carry."""
    kind = record[0]
    if kind == STORED:
        _, medium, parent, hashes, tokens, adapter = record[:6]
        joined = b"".join(hashes)
        return stored(joined if packed else split_hashes(joined), parent, b"".join(tokens),
                      page_size, model_id, adapter, medium)
    if kind == REMOVED:
        joined = b"".join(record[2])
        return removed(joined if packed else split_hashes(joined), record[1])
    if kind == CLEARED:
        return cleared()
    return None


def record_pages(record: list) -> int:
    """Page events in one record (AllBlocksCleared and checkpoint records count as one)."""
    if record[0] >= CLEARED:
        return 1
    pages = 0
    for chunk in record[3 if record[0] == STORED else 2]:
        pages += len(chunk)
    return pages >> 4


def page_count(event: events_pb2.KvEvent) -> int:
    """Page events in one event (AllBlocksCleared counts as one)."""
    kind = event.WhichOneof("event")
    if kind in ("stored", "removed"):
        body = getattr(event, kind)
        return len(body.block_hashes) or len(body.packed_block_hashes) >> 4
    return 1


def recoded(batch: events_pb2.EventBatch, packed: bool) -> events_pb2.EventBatch:
    """The batch with its hashes in the other encoding (packed <-> a bytes object each): for a
    log entry whose records were dropped once it was encoded the first time."""
    out = events_pb2.EventBatch()
    out.CopyFrom(batch)
    for event in out.events:
        kind = event.WhichOneof("event")
        if kind not in ("stored", "removed"):
            continue
        body = getattr(event, kind)
        if packed and body.block_hashes:
            body.packed_block_hashes = b"".join(body.block_hashes)
            body.ClearField("block_hashes")
        elif not packed and body.packed_block_hashes:
            body.block_hashes.extend(split_hashes(body.packed_block_hashes))
            body.ClearField("packed_block_hashes")
    return out


class EventLog:
    def __init__(self, pool_id: str, epoch: int, capacity: int, page_size: int, model_id: str):
        self.pool_id = pool_id
        self.epoch = epoch
        self.capacity = max(1, capacity)
        self.page_size = page_size
        self.model_id = model_id
        self.head_seq = -1
        # True while a vLLM-format publisher may replay from this log: records stay after the
        # batch is encoded (they share the tree's bytes, so they cost little on top).
        self.keep_records = False
        # [seq, timestamp, records or None, size, EventBatch or None, packed EventBatch or None]
        self._batches: deque[list] = deque()
        self._held = 0

    def append(self, records: list[list]) -> list:
        """Appends one batch; returns its entry (`[seq, timestamp, records, ...]`)."""
        self.head_seq += 1
        size = 0
        for r in records:
            size += record_pages(r)
        entry = [self.head_seq, time.time(), records, size, None, None]
        self._batches.append(entry)
        self._held += size
        # Keep at least the newest batch so that a live subscriber never needs a snapshot.
        while self._held > self.capacity and len(self._batches) > 1:
            self._held -= self._batches.popleft()[3]
        return entry

    def _encoded(self, entry: list, packed: bool = False) -> events_pb2.EventBatch:
        """The entry's batch in the asked encoding, built once (from the records, or from the
        other encoding when the records are gone)."""
        at = 5 if packed else 4
        if entry[at] is None:
            if entry[2] is None:
                entry[at] = recoded(entry[9 - at], packed)
                return entry[at]
            events = [e for e in (to_event(r, self.page_size, self.model_id, packed)
                                  for r in entry[2]) if e is not None]
            entry[at] = events_pb2.EventBatch(pool_id=self.pool_id, epoch=self.epoch,
                                              seq=entry[0], timestamp=entry[1], events=events)
            if not self.keep_records:
                entry[2] = None  # encoded once; the records are no longer needed
        return entry[at]

    def records_since(self, after_seq: int) -> list[tuple[int, float, list[list]]] | None:
        """(seq, timestamp, records) of the batches after `after_seq`, or None when some of them
        are no longer held (or were held without their records: `keep_records` was off)."""
        if after_seq >= self.head_seq:
            return []
        first = self._batches[0][0] if self._batches else self.head_seq + 1
        if after_seq + 1 < first:
            return None
        out = [(e[0], e[1], e[2]) for e in
               itertools.islice(self._batches, max(0, after_seq + 1 - first), None)]
        return None if any(r is None for _, _, r in out) else out

    def since(self, after_seq: int, packed: bool = False) -> list[events_pb2.EventBatch] | None:
        """Batches after `after_seq` (hashes packed or not), or None when some of them are no
        longer held."""
        if after_seq >= self.head_seq:
            return [] if after_seq == self.head_seq else None
        first = self._batches[0][0] if self._batches else self.head_seq + 1
        if after_seq + 1 < first:
            return None
        skip = after_seq + 1 - first
        return [self._encoded(e, packed) for e in itertools.islice(self._batches, skip, None)]
