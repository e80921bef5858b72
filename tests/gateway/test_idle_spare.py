"""The next growth's arrays (table_arrays.Spare) are freed once ingest has been idle for
`BatchApplier.idle_drop_s`: a warm-up that ended past 55% planned them for a growth that may
not come. Through a real FeedLoop, its applier and a router; a store after it plans them again
only once a tenth of the room is used."""
from __future__ import annotations

from gateway.core.feed_streams import Feed
from gateway.core.feeds import FeedLoop
from gateway.core.stream_items import MEDIUM_TIER
from gateway.core.metrics import GatewayMetrics
from gateway.core.policies import make_policy
from gateway.core.router import Router, Worker
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import compute_service_pb2 as pb
from tests.gateway.gateway_harness import wait_until
from tests.gateway.helpers import DEVICE, batch, cleared, pages, removed, stored

PAGES = 40_000  # 66% of the table it grows to: past the spare's 55%, and past its smallest size


def test_an_idle_feed_loop_frees_the_spare_and_a_growth_plans_it_again():
    router = Router(make_policy("affinity"), GatewayMetrics())
    router.add(Worker("f", "w", "c", None, pb.GetModelInfoResponse(worker="f")))
    table = router.index._tables[MEDIUM_TIER[DEVICE]]
    # Fixed slices: the snapshot's last ones start past 55%, where the spare is planned (sized by
    # time, a loaded machine's slices may end the snapshot in one call from below it).
    loop = FeedLoop(router, slice_events=1024)
    loop.applier.idle_drop_s = 1.0
    feed = Feed("f")
    try:
        item = cpb.SubscribeResponse(batch=batch("f", 0, cleared(), stored(pages(0, PAGES)),
                                                 snapshot=True, snapshot_end=True))
        loop.run_sync(loop.applier.put(feed, item), 10.0)
        wait_until(lambda: len(table) == PAGES, 20.0)
        wait_until(lambda: table._spare.nbytes() > 0, 20.0)  # planned, and written while idle
        with_spare = table.nbytes()
        wait_until(lambda: table._spare.nbytes() == 0, 20.0)  # idle for 1 s: freed
        assert table.nbytes() < 0.5 * with_spare and table._spare.planned == 0
        loop.applier.idle_drop_s = 3600.0  # no second drop during the rest
        room = int(0.7 * table.cap) - table._used
        few = max(1, room // 20)  # half a look: no plan yet
        item = cpb.SubscribeResponse(batch=batch("f", 1, stored(pages(PAGES, PAGES + few))))
        loop.run_sync(loop.applier.put(feed, item), 10.0)
        wait_until(lambda: len(table) == PAGES + few, 20.0)
        assert table._spare.planned == 0
        more = room // 5  # past a look
        item = cpb.SubscribeResponse(batch=batch("f", 2, stored(pages(PAGES + few,
                                                                      PAGES + few + more))))
        loop.run_sync(loop.applier.put(feed, item), 10.0)
        wait_until(lambda: len(table) == PAGES + few + more, 20.0)
        assert table._spare.planned == 0  # a plan is made before a call's pages: the next one's
        item = cpb.SubscribeResponse(batch=batch("f", 3, stored(pages(0, 1))))
        loop.run_sync(loop.applier.put(feed, item), 10.0)
        # a growth's spare, sized from the fill since the drop
        wait_until(lambda: table._spare.planned > table.cap, 20.0)
    finally:
        loop.close()


def test_a_feed_loop_that_never_idles_sweeps_between_its_slices():
    """Items queued back to back (ingest saturated: no idle step): once the tombstones call for
    a round, the loop takes a sweep step after each slice, while items still wait."""
    router = Router(make_policy("affinity"), GatewayMetrics())
    router.add(Worker("f", "w", "c", None, pb.GetModelInfoResponse(worker="f")))
    table = router.index._tables[MEDIUM_TIER[DEVICE]]
    loop = FeedLoop(router, slice_events=256, migrate_slots=4096)
    feed, waiting = Feed("f"), []
    migrate = router.migrate_index

    def recorded(max_slots: int) -> bool:
        waiting.append(len(loop.applier._pending))
        return migrate(max_slots)

    router.migrate_index = recorded
    try:
        item = cpb.SubscribeResponse(batch=batch("f", 0, cleared(), stored(pages(0, 20_000)),
                                                 snapshot=True, snapshot_end=True))
        loop.run_sync(loop.applier.put(feed, item), 10.0)
        wait_until(lambda: len(table) == 20_000, 20.0)
        items = [cpb.SubscribeResponse(batch=batch("f", 1 + i, removed(pages(i * 64, i * 64 + 64))))
                 for i in range(200)]  # 12,800 tombstones, 256 page events a slice

        async def put_all() -> None:
            for it in items:
                await loop.applier.put(feed, it)

        loop.run_sync(put_all(), 10.0)
        wait_until(lambda: len(table) == 20_000 - 12_800, 20.0)
        assert table.sweep.cleared > 0 and any(n > 0 for n in waiting)  # swept with items queued
    finally:
        loop.close()
