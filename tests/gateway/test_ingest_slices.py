"""Ingest slices sized by time (gateway/core/ingest_slices.py): the page events a slice takes
follow the apply cost measured, within bounds, and the index ends up exactly as applying every
batch one by one would leave it, whatever the slices."""
from __future__ import annotations

import asyncio
import time

import pytest

from gateway.__main__ import config_from_args, parse_args
from gateway.core.feed_streams import Feed
from gateway.core.feeds import BatchApplier, FeedLoop
from gateway.core.index import ApplyResult, ApplyStatus, IndexConfig, KvIndex
from gateway.core.ingest_slices import (FIRST_SLICE_EVENTS, MAX_SLICE_EVENTS, MIN_SLICE_EVENTS,
                                        SLICE_S, IdleMigration, SliceSize)
from gateway.core.metrics import GatewayMetrics
from gateway.core.policies import make_policy
from gateway.core.router import Router, Worker
from gateway.core.workers import Fleet, WorkerSet
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import compute_service_pb2 as pb
from tests.gateway.gateway_harness import wait_until
from tests.gateway.helpers import DEVICE, HOST, batch, cleared, heartbeat, pages, removed, stored


def test_the_slice_is_the_target_time_over_the_measured_cost():
    size = SliceSize(slice_s=0.002)
    assert size.events == FIRST_SLICE_EVENTS
    size.measured(1000, 0.001)  # 1 us a page event: 2 ms is 2,000 of them
    assert size.events == 2000
    for _ in range(30):  # a slower index (4 us a page event): the slices shrink to 500
        size.measured(size.events, size.events * 4e-6)
    assert 495 <= size.events <= 505


def test_a_small_slice_does_not_count_and_the_bounds_hold():
    size = SliceSize(slice_s=0.002)
    size.measured(10, 0.001)  # ingest keeping up: mostly per-slice cost, not the index's
    assert size.events == FIRST_SLICE_EVENTS and size.seconds_per_event is None
    size.measured(0, 0.001)  # heartbeats only
    assert size.events == FIRST_SLICE_EVENTS
    size.measured(1024, 1.0)
    assert size.events == MIN_SLICE_EVENTS
    fast = SliceSize(slice_s=1.0)
    fast.measured(1024, 1e-6)
    assert fast.events == MAX_SLICE_EVENTS
    fixed = SliceSize(fixed=300)
    fixed.measured(300, 1.0)
    assert fixed.events == 300
    with pytest.raises(ValueError):
        SliceSize(slice_s=0)


def _stream(pool: str, offset: int) -> list[cpb.SubscribeResponse]:
    """A snapshot over both media (big enough to be cut), live batches that store and remove,
    a duplicate and a heartbeat."""
    snap = batch(pool, 0, cleared(), stored(pages(offset, offset + 30_000)),
                 stored(pages(offset + 40_000, offset + 45_000), medium=HOST),
                 snapshot=True, snapshot_end=True)
    items = [cpb.SubscribeResponse(batch=snap)]
    for seq in range(1, 41):
        base = offset + 30_000 + seq * 64
        items.append(cpb.SubscribeResponse(batch=batch(
            pool, seq, stored(pages(base, base + 64)), removed(pages(offset + seq * 64, offset + seq * 64 + 64)),
            removed(pages(offset + 40_000 + seq, offset + 40_001 + seq), medium=HOST))))
    items.insert(20, cpb.SubscribeResponse(batch=items[10].batch))  # a duplicate: ignored
    items.append(cpb.SubscribeResponse(heartbeat=heartbeat(pool, 40)))
    return items


def _one_by_one(streams: dict[str, list[cpb.SubscribeResponse]]) -> KvIndex:
    index = KvIndex(IndexConfig(memory_budget_mb=1e6))
    for items in streams.values():
        for item in items:
            if item.WhichOneof("item") == "batch":
                index.apply(item.batch)
    return index


@pytest.mark.parametrize("slice_s", [0.0001, 0.05])
def test_time_sized_slices_leave_the_index_as_one_by_one_does(slice_s):
    names = ["a", "b", "c"]
    streams = {n: _stream(n, 100_000 * i) for i, n in enumerate(names)}
    router = Router(make_policy("affinity"), GatewayMetrics(), IndexConfig(memory_budget_mb=1e6))
    for n in names:
        router.add(Worker(n, "w", "c", None, pb.GetModelInfoResponse(worker=n)))
    feeds = FeedLoop(router, slice_s=slice_s)
    feed = {n: Feed(n) for n in names}
    try:
        for k in range(max(map(len, streams.values()))):  # the feeds' items interleaved
            for n in names:
                if k < len(streams[n]):
                    feeds.run_sync(feeds.applier.put(feed[n], streams[n][k]), 10)
        wait_until(lambda: all(router.index.info(n).last_seq == 40 for n in names), timeout_s=60)
    finally:
        feeds.close()
    want = _one_by_one(streams)
    for n in names:
        for medium in (DEVICE, HOST):
            assert router.index.pages(n, medium) == want.pages(n, medium)
        got, expected = router.index.info(n), want.info(n)
        assert (got.epoch, got.last_seq, got.in_snapshot, got.needs_resync, got.pages) == (
            expected.epoch, expected.last_seq, expected.in_snapshot, expected.needs_resync,
            expected.pages)
    assert len(router.index) == len(want)
    size = feeds.applier.size
    if slice_s < 0.001:  # a tenth of a millisecond: the smallest slices
        assert size.events < FIRST_SLICE_EVENTS and feeds.applier.slices > 2 * 35_000 * 3 // 1024
    else:  # 50 ms: far more than the first 1,024 page events a slice
        assert size.events > 4 * FIRST_SLICE_EVENTS


def test_the_gateway_flag_sets_the_feed_loops_slice_time():
    default = config_from_args(parse_args(["--workers", "localhost:1", "--allow-anonymous"]))
    short = config_from_args(parse_args(["--workers", "localhost:1", "--allow-anonymous",
                                         "--ingest-slice-ms", "0.5"]))
    assert default.worker.ingest_slice_s == SLICE_S and short.worker.ingest_slice_s == 0.0005
    with pytest.raises(SystemExit):
        parse_args(["--workers", "localhost:1", "--allow-anonymous", "--ingest-slice-ms", "0"])
    router = Router(make_policy("affinity"), GatewayMetrics())
    workers = WorkerSet(lambda: [], router, Fleet(None, None), short.worker)
    try:
        assert workers.feeds.applier.size.slice_s == 0.0005
    finally:
        workers.close()


def test_a_slice_waits_for_what_a_few_feeds_read_turn_by_turn():
    """A feed reads one message a turn of the loop: with two feeds, one turn queues 256 page
    events. The applier lets them read on until a slice's worth is queued instead of applying
    each turn's few batches as a slice of their own."""
    router = Router(make_policy("affinity"), GatewayMetrics(), IndexConfig(memory_budget_mb=1e6))
    names = ["a", "b"]
    for n in names:
        router.add(Worker(n, "w", "c", None, pb.GetModelInfoResponse(worker=n)))
    feeds = FeedLoop(router, slice_events=1024)
    streams = {n: _stream(n, 100_000 * i) for i, n in enumerate(names)}

    async def read(name: str) -> None:  # as `_read` does: one item, then the loop's next turn
        for item in streams[name]:
            await feeds.applier.put(feed[name], item)
            await asyncio.sleep(0)

    feed = {n: Feed(n) for n in names}
    try:
        for n in names:
            feeds.run_sync(feeds.applier.put(feed[n], streams[n][0]), 10)  # the snapshots
        wait_until(lambda: all(not router.index.info(n).in_snapshot for n in names), timeout_s=60)
        before = feeds.applier.slices
        for n in names:
            streams[n] = streams[n][1:]
        for n in names:
            feeds.submit(read(n))
        wait_until(lambda: all(router.index.info(n).last_seq == 40 for n in names), timeout_s=60)
        live_slices = feeds.applier.slices - before
    finally:
        feeds.close()
    # 2 x 41 live items (40 batches, a duplicate) and a heartbeat each, 128 page events a batch:
    # ~11 slices of 1,024 page events; a slice a turn would be ~42.
    assert live_slices <= 16, live_slices


def test_the_slice_size_leaves_out_the_hold_that_decisions_interrupt():
    """A slice's time in the C loop (and its pauses for decisions) is not what a decision waits
    for: the applier sizes the next slice by the rest of the hold only."""

    class Interruptible:  # three quarters of each hold in the interruptible C loop
        preemptible = held = 0.0

        def preemptible_seconds(self) -> float:
            return self.preemptible

        def apply_stream_items(self, items):
            start = time.perf_counter()
            time.sleep(0.004)
            self.held = time.perf_counter() - start
            self.preemptible += 0.75 * self.held
            return [ApplyResult(ApplyStatus.APPLIED, "a") for _ in items]

    router = Interruptible()
    applier = BatchApplier(router, SliceSize(slice_s=0.001), IdleMigration())
    item = cpb.SubscribeResponse(heartbeat=heartbeat("a", 0))
    applier._apply_slice(([(Feed("a"), item)], FIRST_SLICE_EVENTS))
    whole = router.held / FIRST_SLICE_EVENTS
    assert 0.25 * whole <= applier.size.seconds_per_event < 0.5 * whole


def test_idle_migration_steps_are_sized_by_the_slice_time():
    """The steps that finish a growth while ingest is idle (feeds.BatchApplier) start at
    FIRST_SLICE_EVENTS old slots, then take the slice time over the measured cost of a slot,
    within the slices' bounds, until the old table is gone."""
    index, seq = KvIndex(IndexConfig(max_entries=1 << 30)), 0
    table = index._tables[0]
    while table._old is None or table._old.cap - table._cursor < 200_000:
        index.apply(batch("w", seq, stored(pages(seq * 1024, seq * 1024 + 1024))))
        seq += 1
    idle, sizes = IdleMigration(SLICE_S), []
    while True:
        sizes.append(idle.size.events)
        if not idle.step(index.migrate_some):
            break
    assert table._old is None and idle.steps == len(sizes) > 1
    assert sizes[0] == FIRST_SLICE_EVENTS and idle.size.seconds_per_event is not None
    assert all(MIN_SLICE_EVENTS <= n <= MAX_SLICE_EVENTS for n in sizes)
    assert len(set(sizes)) > 1  # sized from the measured cost, not fixed
