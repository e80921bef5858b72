"""A worker's stream items as the gateway's feeds handle them (gateway/core/feeds.py): the page
events an item counts for the applier's slices, a snapshot batch cut into slices, and the point a
broken stream resumes from."""
from __future__ import annotations

from collections.abc import Iterator, Sequence

from gateway.core.index_types import BatchHead, Run
from gateway.core.packed import HASH_BYTES, Body, packed_hashes, page_count
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import common_pb2, events_pb2

# Medium enum value -> the index's position in its per-medium tables (KvIndex).
MEDIUM_TIER = {common_pb2.MEDIUM_DEVICE: 0, common_pb2.MEDIUM_HOST: 1, common_pb2.MEDIUM_REMOTE: 2}


def page_events(item: cpb.SubscribeResponse) -> int:
    """The page events of a batch, at least 1 (a batch of none still costs a turn); 0 for a
    heartbeat."""
    if item.WhichOneof("item") != "batch":
        return 0
    return max(1, sum(map(_page_count, item.batch.events)))


def _page_count(event: events_pb2.KvEvent) -> int:
    kind = event.WhichOneof("event")
    if kind == "stored":
        return page_count(event.stored)
    return page_count(event.removed) if kind == "removed" else 0


def _with_hashes(template: events_pb2.KvEvent, kind: str,
                 hashes: list[bytes] | bytes) -> events_pb2.KvEvent:
    piece = events_pb2.KvEvent()
    piece.CopyFrom(template)
    if isinstance(hashes, bytes):
        getattr(piece, kind).packed_block_hashes = hashes
    else:
        getattr(piece, kind).block_hashes.extend(hashes)
    return piece


def _hashes_of(body: Body) -> tuple[list[bytes] | bytes, int]:
    """The event's hashes as it carries them, and the length of one page in that form (a
    packed event is cut by slicing its bytes: no bytes object a page)."""
    if body.packed_block_hashes:
        return body.packed_block_hashes, HASH_BYTES
    return list(body.block_hashes), 1


def split_snapshot(batch: events_pb2.EventBatch, limit: int) -> list[events_pb2.EventBatch]:
    """A snapshot batch as snapshot batches of at most `limit` page events each (a live batch,
    or a small one, as is)."""
    if not batch.snapshot or sum(map(_page_count, batch.events)) <= limit:
        return [batch]
    parts: list[list[events_pb2.KvEvent]] = []
    current: list[events_pb2.KvEvent] = []
    room = limit
    for event in batch.events:
        kind = event.WhichOneof("event")
        if kind not in ("stored", "removed"):
            current.append(event)
            continue
        hashes, unit = _hashes_of(getattr(event, kind))
        template = events_pb2.KvEvent()
        template.CopyFrom(event)
        getattr(template, kind).ClearField("block_hashes")
        getattr(template, kind).ClearField("packed_block_hashes")
        i = 0
        while i < len(hashes):
            if room == 0:
                parts.append(current)
                current, room = [], limit
            chunk = hashes[i:i + room * unit]
            current.append(_with_hashes(template, kind, chunk))
            room -= len(chunk) // unit
            i += len(chunk)
    parts.append(current)
    return [events_pb2.EventBatch(pool_id=batch.pool_id, epoch=batch.epoch, seq=batch.seq,
                                  snapshot=True, snapshot_end=batch.snapshot_end and k == len(parts) - 1,
                                  events=p) for k, p in enumerate(parts)]


def item_parts(item: cpb.SubscribeResponse, limit: int) -> list[cpb.SubscribeResponse]:
    """An item as the applier queues it: a snapshot batch cut into items of at most `limit` page
    events (`split_snapshot`), anything else as is."""
    if item.WhichOneof("item") != "batch" or not item.batch.snapshot:
        return [item]
    return [item if part is item.batch else cpb.SubscribeResponse(batch=part)
            for part in split_snapshot(item.batch, limit)]


def resume_after(item: cpb.SubscribeResponse, point: tuple[int, int]) -> tuple[int, int]:
    """Where a broken stream resumes once `item` is applied (Subscription._advance's rule: inside
    an unfinished snapshot, a new snapshot)."""
    if item.WhichOneof("item") != "batch":
        return point
    batch = item.batch
    return (batch.epoch, -1) if batch.snapshot and not batch.snapshot_end else (batch.epoch, batch.seq)


def batch_head(batch: events_pb2.EventBatch) -> BatchHead:
    """What the stream rules read of a message batch (a stream frame's item record holds the
    same)."""
    events = batch.events
    clears = len(events) > 0 and events[0].WhichOneof("event") == "cleared"
    return BatchHead(batch.pool_id, batch.epoch, batch.seq, batch.snapshot, batch.snapshot_end,
                     clears)


def message_runs(events: Sequence[events_pb2.KvEvent]) -> Iterator[Run]:
    """A batch's events as runs: (kind, tier, packed hashes) each; events of a medium the index
    does not keep, or of a kind it does not know, left out."""
    for ev in events:
        kind = ev.WhichOneof("event")
        if kind == "cleared":
            yield kind, 0, b""
            continue
        body = ev.stored if kind == "stored" else ev.removed if kind == "removed" else None
        tier = None if body is None else MEDIUM_TIER.get(body.medium)
        if tier is not None:
            yield kind, tier, packed_hashes(body)
