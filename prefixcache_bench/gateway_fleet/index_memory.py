"""The index's memory a page in the fleet bench (issue 31's goal: 64 bytes an indexed page):
tracemalloc's count of a `KvIndex` fed the pools' snapshots directly, and of a gateway's
`Router` fed them through its `FeedLoop` once idle, with and without the next growth's spare."""
from __future__ import annotations

import time
import tracemalloc

from gateway.core import index_native
from gateway.core.feed_streams import Feed
from gateway.core.feeds import FeedLoop
from gateway.core.index import IndexConfig, KvIndex
from gateway.core.ingest_slices import IDLE_SPARE_DROP_S, IDLE_SPARE_SLOTS
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache_bench.gateway_fleet import fleet as F
from prefixcache_bench.gateway_fleet.run import _fleet_router, _wait


def index_bytes_per_page(pools: int, pages_per_pool: int) -> float:
    """tracemalloc's count of the index's own memory after the pools' snapshots, per page key,
    applied directly to a KvIndex: right after the last batch (a growth's old table may still be
    there: `idle_gateway_bytes_per_page` is the gateway's figure once its feed loop is idle)."""
    msgs = [cpb.SubscribeResponse.FromString(b).batch for i in range(pools)
            for b in F.recorded_stream(i, pages_per_pool, 0)]
    index = KvIndex(IndexConfig(max_entries=1 << 40))
    return traced_apply(index, msgs) / len(index)


def traced_apply(index: KvIndex, batches: list) -> int:
    """The bytes the index allocated applying the batches and still holds (tracemalloc)."""
    index_native.kernel()  # loaded (or built) before tracing: its allocations are not the index's
    tracemalloc.start()
    try:
        for batch in batches:
            index.apply(batch)
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return used


def idle_gateway_bytes_per_page(pools: int, pages_per_pool: int,
                                idle_drop_s: float = IDLE_SPARE_DROP_S) -> dict[str, float]:
    """`index_bytes_per_page` of a gateway's Router fed the same snapshots through its FeedLoop
    (queued on its BatchApplier, no gRPC), once every one is applied and the idle loop has
    finished any growth's migration and written what it may of the spare (`_idle`; `_written`:
    less the spare's part not written, which holds no memory), then once it has freed the spare
    (`idle_drop_s`): tracemalloc's count of what was allocated since the loop started and is
    still held (the index, and whatever else the gateway kept), per page key."""
    items = [cpb.SubscribeResponse.FromString(b) for i in range(pools)
             for b in F.recorded_stream(i, pages_per_pool, 0)]
    router, names = _fleet_router("bench", pools)
    feeds, loop = {n: Feed(n) for n in names}, FeedLoop(router)
    loop.applier.idle_drop_s = idle_drop_s
    index_native.kernel()
    tracemalloc.start()
    try:
        for item in items:
            loop.run_sync(loop.applier.put(feeds[item.batch.pool_id], item), 60.0)
        _wait(router, names, lambda i: i.last_seq >= 0 and not i.in_snapshot)
        while router.migrate_index(0):  # 0 slots: asks whether a migration (or sweep) remains
            time.sleep(0.01)
        while router.prepare_index_growth(IDLE_SPARE_SLOTS):  # as the idle loop, waited for
            time.sleep(0.01)
        used, _ = tracemalloc.get_traced_memory()
        unwritten = sum(t.nbytes() - t.nbytes(written=True) for t in router.index._tables)
        end = time.monotonic() + 3 * idle_drop_s
        while any(t._spare.planned for t in router.index._tables) and time.monotonic() < end:
            time.sleep(0.1)
        dropped, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        loop.close()
    n = len(router.index)
    return {"index_bytes_per_page_idle": used / n,
            "index_bytes_per_page_idle_written": (used - unwritten) / n,
            "index_bytes_per_page_idle_spare_freed": dropped / n}
