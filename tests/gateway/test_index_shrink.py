"""A fleet scaled down (gateway/core/index_table.py `_shrink_some`): a table whose live pages
fill under a fifth of its slots moves, in the feed loop's idle steps, into arrays sized for them
(written by its idle `prepare_growth` calls without the router's lock, then migrated into a step
at a time), holding the same pages, holders and stamps, and within issue 31's 64 bytes a page
again."""
from __future__ import annotations

import prometheus_client

from gateway.core.index import IndexConfig, KvIndex
from gateway.core.ingest_slices import IDLE_SPARE_SLOTS
from gateway.core.metrics import GatewayMetrics
from gateway.core.policies import make_policy
from gateway.core.router import Router
from tests.gateway.helpers import batch, check_holder_sets, pages, pages_and_stamps, stored
from tests.gateway.index_impls import table_impl  # noqa: F401  (each test with C, then numpy)

WORKERS = 20
STEP = 4096


def _idle_steps(index: KvIndex) -> int:
    """The feed loop's idle steps (each one hold of the lock) and, when they are done, its
    writes without the lock, until nothing remains (feeds.BatchApplier); how many steps."""
    steps = writes = 0
    while True:
        if index.migrate_some(STEP):
            steps += 1
        elif index.prepare_growth(IDLE_SPARE_SLOTS):
            writes += 1
        else:
            return steps
        assert steps + writes < 10_000


def _fleet() -> KvIndex:
    """20 workers of 6,000 pages each; workers 0 and 1 also hold 500 pages together."""
    index = KvIndex(IndexConfig(max_entries=1 << 30))
    for w in range(WORKERS):
        index.apply(batch(f"w{w}", 0, stored(pages(6000 * w, 6000 * (w + 1)))))
    index.apply(batch("w0", 1, stored(pages(200_000, 200_500))))
    index.apply(batch("w1", 1, stored(pages(200_000, 200_500))))
    _idle_steps(index)
    return index


def test_a_fleet_scaled_down_shrinks_its_table_in_idle_steps():
    index = _fleet()
    table = index._tables[0]
    big = table.cap
    assert big >= 2 * 65536 and table.nbytes() / len(table) < 64
    for w in range(2, WORKERS):  # 18 of 20 workers leave: 12,500 pages of ~121k
        index.remove_worker(f"w{w}")
    before = pages_and_stamps(table)
    assert table.nbytes() / len(table) > 100  # the table never shrank: 16 bytes a slot
    steps = _idle_steps(index)
    assert table.cap < big / 4 and table._old is None and index.stats().shrinks == 1
    assert pages_and_stamps(table) == before and len(table) == 12_500
    check_holder_sets(table)
    assert table.nbytes(written=True) / len(table) < 64
    # each step a bounded hold: the arrays written and the old slots migrated a step at a time
    assert steps > big // STEP
    # and it goes on serving: stores, removals, a growth again
    index.apply(batch("w0", 2, stored(pages(300_000, 340_000))))
    assert index.lookup(pages(300_000, 300_010))["w0"].device_pages == 10
    assert index.lookup(pages(200_000, 200_001))["w1"].device_pages == 1


def test_a_table_with_room_in_use_does_not_shrink_and_the_metric_counts_shrinks():
    metrics = GatewayMetrics()
    router = Router(make_policy("affinity"), metrics, IndexConfig(max_entries=1 << 30))
    for w in range(WORKERS):
        router.index.apply(batch(f"w{w}", 0, stored(pages(6000 * w, 6000 * (w + 1)))))
    _idle_steps(router.index)
    cap = router.index._tables[0].cap
    for w in range(10, WORKERS):  # half the fleet leaves: the pages still fill over a fifth
        router.index.remove_worker(f"w{w}")
    while router.migrate_index(STEP) or router.prepare_index_growth(IDLE_SPARE_SLOTS):
        pass
    assert router.index._tables[0].cap == cap and router.index.stats().shrinks == 0
    for w in range(1, 10):
        router.index.remove_worker(f"w{w}")
    while router.migrate_index(STEP) or router.prepare_index_growth(IDLE_SPARE_SLOTS):
        pass
    text = prometheus_client.generate_latest(metrics.registry).decode()
    assert "prefixcache_gateway_index_shrinks_total 1.0" in text


def test_the_shrinks_arrays_are_written_without_the_lock_and_dropped_when_pages_come_back():
    """The idle steps (each one hold of the lock) only plan the smaller arrays; the feed loop's
    `prepare_growth` calls write them, without the lock. Pages stored again before the growth
    (the table over a fifth full) drop the plan and what was written of it."""
    index = _fleet()
    table = index._tables[0]
    cap = table.cap
    for w in range(2, WORKERS):
        index.remove_worker(f"w{w}")
    while index.migrate_some(STEP):  # the steps alone: the sweep, then the plan
        pass
    spare = table._spare
    assert spare.shrinking and spare.planned and spare.arrays is None
    assert table.cap == cap and index.stats().shrinks == 0
    assert not index.prepare_growth()  # ingest busy (no chunk): nothing written
    assert spare.arrays is None
    # an idle call writes them (12,500 pages: one chunk), then asks for the step that grows
    assert index.prepare_growth(IDLE_SPARE_SLOTS) and spare.arrays.filled == spare.planned
    assert index.prepare_growth(IDLE_SPARE_SLOTS) and table.cap == cap
    index.apply(batch("w0", 2, stored(pages(300_000, 360_000))))  # 72,500 pages: over a fifth
    assert not index.migrate_some(STEP)
    assert not spare.shrinking and spare.arrays is None
    _idle_steps(index)
    assert table.cap == cap and index.stats().shrinks == 0
