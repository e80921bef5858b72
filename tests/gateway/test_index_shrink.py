"""A fleet scaled down (gateway/core/index_table.py `_shrink_some`): a table whose live pages
fill under a fifth of its slots moves, in the feed loop's idle steps, into arrays sized for them
(written a step at a time, then migrated into), holding the same pages, holders and stamps, and
within issue 31's 64 bytes a page again."""
from __future__ import annotations

import prometheus_client

from gateway.core.index import IndexConfig, KvIndex
from gateway.core.metrics import GatewayMetrics
from gateway.core.policies import make_policy
from gateway.core.router import Router
from tests.gateway.helpers import batch, check_holder_sets, pages, pages_and_stamps, stored
from tests.gateway.index_impls import table_impl  # noqa: F401  (each test with C, then numpy)

WORKERS = 20
STEP = 4096


def _idle_steps(index: KvIndex) -> int:
    """The feed loop's idle steps until nothing remains; how many."""
    steps = 0
    while index.migrate_some(STEP):
        steps += 1
        assert steps < 10_000
    return steps


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
    while router.migrate_index(STEP):
        pass
    cap = router.index._tables[0].cap
    for w in range(10, WORKERS):  # half the fleet leaves: the pages still fill over a fifth
        router.index.remove_worker(f"w{w}")
    while router.migrate_index(STEP):
        pass
    assert router.index._tables[0].cap == cap and router.index.stats().shrinks == 0
    for w in range(1, 10):
        router.index.remove_worker(f"w{w}")
    while router.migrate_index(STEP):
        pass
    text = prometheus_client.generate_latest(metrics.registry).decode()
    assert "prefixcache_gateway_index_shrinks_total 1.0" in text
