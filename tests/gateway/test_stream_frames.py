"""Stream frames (gateway/core/stream_frames.py): the items of many workers' streams in the form
the index applies without a message object a batch. A frame must give exactly what its items
give as messages: the same results (RESYNC points, duplicates), the same index state, the same
feed resubscriptions; and a frame that is not one is refused, never half applied."""
from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import numpy as np
import pytest

from gateway.core.feed_streams import Feed
from gateway.core.feeds import FeedLoop
from gateway.core.index import KvIndex
from gateway.core.index_table import key_of
from gateway.core.metrics import GatewayMetrics
from gateway.core.policies import make_policy
from gateway.core.router import Router, Worker
from gateway.core.stream_frames import ITEM, RUN, FrameError, decode, encode
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import common_pb2
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache.v1 import events_pb2
from tests.gateway.helpers import (DEVICE, HOST, REMOTE, batch, cleared, heartbeat, page, pages,
                                   removed, stored)

POOLS = ("p0", "p1", "p2")
MEDIA = (DEVICE, HOST, REMOTE)
UNKNOWN_MEDIUM = 99  # a medium the index does not keep: left out by both forms


def _packed(event: events_pb2.KvEvent) -> events_pb2.KvEvent:
    """The event with its hashes in the packed field (what a packed subscriber gets)."""
    out = events_pb2.KvEvent()
    out.CopyFrom(event)
    body = getattr(out, event.WhichOneof("event"))
    body.packed_block_hashes = b"".join(body.block_hashes)
    body.ClearField("block_hashes")
    return out


def _stream(rng: random.Random) -> list[cpb.SubscribeResponse]:
    """Three pools' items interleaved: snapshots in several batches, live stores and removals on
    every medium (packed and per-page), a clear inside a live batch, events of an unknown medium,
    heartbeats, a duplicate, a gap (RESYNC) and the snapshot that follows it, a new epoch."""
    items: list[cpb.SubscribeResponse] = []
    for n, pool in enumerate(POOLS):
        base = 1000 * n
        items.append(cpb.SubscribeResponse(batch=batch(
            pool, 0, cleared(), stored(pages(base, base + 40)), snapshot=True)))
        items.append(cpb.SubscribeResponse(batch=batch(
            pool, 0, stored(pages(base + 40, base + 60), HOST), snapshot=True, snapshot_end=True)))
    seq = {pool: 0 for pool in POOLS}
    for step in range(60):
        pool = rng.choice(POOLS)
        seq[pool] += 1
        base = 1000 * POOLS.index(pool)
        lo = base + rng.randrange(0, 120)
        events = [stored(pages(lo, lo + rng.randrange(1, 8)), rng.choice(MEDIA)),
                  removed(pages(base + rng.randrange(0, 120), base + rng.randrange(120, 130)),
                          rng.choice(MEDIA)),
                  stored([page(7)], UNKNOWN_MEDIUM),
                  stored(pages(lo + 200, lo + 203), rng.choice(MEDIA))]
        if step == 30:
            events.insert(2, cleared())
        if rng.random() < 0.5:
            events = [_packed(e) if e.WhichOneof("event") != "cleared" else e for e in events]
        items.append(cpb.SubscribeResponse(batch=batch(pool, seq[pool], *events)))
        if step % 7 == 0:
            items.append(cpb.SubscribeResponse(heartbeat=heartbeat(pool, seq[pool])))
    items.append(cpb.SubscribeResponse(batch=batch("p1", seq["p1"], stored([page(5)]))))  # dup
    items.append(cpb.SubscribeResponse(batch=batch("p2", seq["p2"] + 5, stored([page(6)]))))  # gap
    items.append(cpb.SubscribeResponse(heartbeat=heartbeat("p0", seq["p0"] + 3)))  # missed
    items.append(cpb.SubscribeResponse(batch=batch(
        "p2", 0, cleared(), stored(pages(5000, 5010), REMOTE), epoch=1, snapshot=True,
        snapshot_end=True)))
    items.append(cpb.SubscribeResponse(batch=batch("p1", 0, stored(pages(7000, 7004)), epoch=2)))
    return items


def _router() -> Router:
    router = Router(make_policy("affinity"), GatewayMetrics())
    for pool in POOLS:
        router.add(Worker(pool, "w", "c", None, pb.GetModelInfoResponse(worker=pool)))
    return router


def _state(index: KvIndex) -> tuple:
    """Each pool's stream position and pages (not when it was last heard from: a clock)."""
    return tuple((pool, replace(index.info(pool), last_seen=0.0),
                  tuple(index.pages(pool, m) for m in MEDIA)) for pool in POOLS)


def _outcome(results) -> list:
    return [(r.status, r.pool_id, r.resume_epoch, r.resume_after_seq, r.page_events)
            for r in results]


@pytest.mark.parametrize("frame_items", [1, 7, 1000])
def test_a_frame_applies_as_its_items_do(frame_items):
    """The same stream through the router as messages and as frames of `frame_items` items,
    in slices of 5 items: equal results, equal index state."""
    items = _stream(random.Random(frame_items))
    by_message, by_frame = _router(), _router()
    frames = [decode(encode(items[i:i + frame_items])) for i in range(0, len(items), frame_items)]
    decoded = [x for f in frames for x in f]
    assert len(decoded) == len(items)
    got_message, got_frame = [], []
    for i in range(0, len(items), 5):
        got_message += by_message.apply_stream_items([(x.batch.pool_id or x.heartbeat.pool_id, x)
                                                      for x in items[i:i + 5]])
        got_frame += by_frame.apply_stream_items([(x.pool_id, x) for x in decoded[i:i + 5]])
    assert _outcome(got_frame) == _outcome(got_message)
    statuses = {r.status.name for r in got_message}
    assert statuses == {"APPLIED", "DUPLICATE", "RESYNC"}  # the stream exercises every rule
    assert _state(by_frame.index) == _state(by_message.index)
    assert len(by_frame.index) == len(by_message.index) > 0
    assert by_frame.index.info("p1").epoch == 2


def test_heartbeats_carry_their_load_report():
    load = common_pb2.LoadReport(running_requests=3, waiting_requests=4, queued_prefill_tokens=5)
    hb = events_pb2.Heartbeat(pool_id="p0", epoch=1, head_seq=-1, load=load)
    (item,) = decode(encode([cpb.SubscribeResponse(heartbeat=hb)]))
    assert item.heartbeat == hb and item.head is None and item.events == 0


def test_a_frame_of_no_items_and_hashes_that_are_views_of_it():
    assert decode(encode([])) == []
    frame = encode([cpb.SubscribeResponse(batch=batch("p0", 0, stored(pages(0, 3))))])
    (item,) = decode(frame)
    (kind, tier, packed), = item.runs
    assert (kind, tier, bytes(packed)) == ("stored", 0, b"".join(pages(0, 3)))
    assert isinstance(packed, memoryview) and packed.obj is not None  # no copy of the hashes


def test_what_is_not_a_frame_is_refused():
    frame = encode([cpb.SubscribeResponse(batch=batch("p0", 0, stored(pages(0, 3)))),
                    cpb.SubscribeResponse(heartbeat=heartbeat("p0", 0))])
    with pytest.raises(FrameError, match="shorter than its header"):
        decode(frame[:10])
    with pytest.raises(FrameError, match="magic"):
        decode(b"XXXX" + frame[4:])
    for cut in (len(frame) - 1, len(frame) - 40):
        with pytest.raises(FrameError, match="header says"):
            decode(frame[:cut])
    with pytest.raises(FrameError, match="header says"):
        decode(frame + b"\0")
    # A run pointing past the hashes (its page count raised): refused, not read short.
    header, names = 24, len(b"p0\0")
    runs_at = header + names + 2 * ITEM.itemsize
    bad = bytearray(frame)
    run = np.frombuffer(bad, RUN, 1, runs_at).copy()
    run["count"] = 4
    bad[runs_at:runs_at + RUN.itemsize] = run.tobytes()
    with pytest.raises(FrameError, match="past the frame's hashes"):
        decode(bytes(bad))


def test_the_applier_takes_frames_and_a_resync_reopens_that_feed_only():
    """Frames put on a real FeedLoop's applier: applied in slices like messages; a gap in one
    pool's items sets that feed's resync point (the index's) and drops what it still had
    queued, the other pools' items still apply."""
    router = _router()
    loop = FeedLoop(router, slice_events=16)
    try:
        feeds = {pool: Feed(pool) for pool in POOLS}
        items = [cpb.SubscribeResponse(batch=batch(pool, 0, cleared(), stored(pages(100 * n, 100 * n + 50)),
                                                   snapshot=True, snapshot_end=True))
                 for n, pool in enumerate(POOLS)]
        items += [cpb.SubscribeResponse(batch=batch(pool, s, stored([page(100 * n + 50 + s)])))
                  for s in range(1, 4) for n, pool in enumerate(POOLS)]
        items.append(cpb.SubscribeResponse(batch=batch("p1", 9, stored([page(999)]))))  # gap
        items.append(cpb.SubscribeResponse(batch=batch("p1", 10, stored([page(998)]))))
        items.append(cpb.SubscribeResponse(batch=batch("p0", 4, stored([page(54)]))))
        loop.run_sync(loop.applier.put_frame(feeds, decode(encode(items))), 10)
        loop.run_sync(_drained(loop), 10)
    finally:
        loop.close()
    assert feeds["p1"].resync == (1, 3) and feeds["p0"].resync is None
    assert router.index.info("p0").last_seq == 4 and router.index.info("p2").last_seq == 3
    assert router.index.info("p1").last_seq == 3 and key_of(page(998)) not in router.index.pages("p1", DEVICE)
    assert loop.applier.slices >= 4  # each 50-page snapshot batch whole in a slice of its own


async def _drained(loop: FeedLoop) -> None:
    while loop.applier._pending:
        await asyncio.sleep(0.01)
