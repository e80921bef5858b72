"""The routing index's bound: sized from a memory budget, never silent when full."""
from __future__ import annotations

import logging

import prometheus_client
import pytest

from gateway.core.index import BYTES_PER_ENTRY, BYTES_PER_HOLDER_SET, IndexConfig, KvIndex
from gateway.core.index_table import page_keys
from gateway.core.metrics import GatewayMetrics
from gateway.core.policies import make_policy
from gateway.core.router import Router
from tests.gateway.helpers import FakeClock, batch, pages, stored
from tests.gateway.index_impls import table_impl  # noqa: F401  (each test with C, then numpy)


def test_capacity_comes_from_the_memory_budget_unless_set():
    assert KvIndex(IndexConfig(memory_budget_mb=1.0)).capacity() == 2**20 // BYTES_PER_ENTRY
    assert KvIndex(IndexConfig(memory_budget_mb=1.0, max_entries=7)).capacity() == 7
    with pytest.raises(ValueError, match="memory_budget_mb=5e-05"):
        KvIndex(IndexConfig(memory_budget_mb=0.00005))  # 52 bytes


def test_the_sets_of_holders_take_their_share_of_the_budget():
    """Each distinct set of holders of shared pages is counted in the memory estimate and
    taken from the budget's room for keys: pages each with its own holders cannot outgrow it."""
    index = KvIndex(IndexConfig(memory_budget_mb=1.0))
    for w in range(40):
        index.apply(batch(f"w{w}", 0, stored(pages(0, 40))))  # one set: all 40
    for w in ("w0", "w1", "w2"):
        index.apply(batch(w, 1, stored(pages(100, 120))))  # triples: no set
    for i in range(10):  # ten sets: w0, w1, w2 and one other
        index.apply(batch(f"w{i + 3}", 1, stored(pages(100 + i, 101 + i))))
    st = index.stats()
    assert st.shared_pages == 60 and st.holder_sets == 11
    assert st.memory_bytes == st.entries * BYTES_PER_ENTRY + 11 * BYTES_PER_HOLDER_SET
    assert st.capacity == (2**20 - 11 * BYTES_PER_HOLDER_SET) // BYTES_PER_ENTRY


def test_a_full_index_says_so_in_stats_and_a_rate_limited_warning(caplog):
    clock = FakeClock()
    index = KvIndex(IndexConfig(max_entries=100, evict_fraction=0.1), clock=clock)
    index.apply(batch("a", 0, stored(pages(0, 100))))
    assert index.stats().evicted_entries == 0 and not caplog.records
    with caplog.at_level(logging.WARNING, logger="gateway.index"):
        index.apply(batch("a", 1, stored(pages(100, 120))))
        index.apply(batch("a", 2, stored(pages(120, 140))))  # within the minute: no new line
        clock.now += 61
        index.apply(batch("a", 3, stored(pages(140, 160))))
    st = index.stats()
    assert st.entries == len(index) <= 100 and st.capacity == 100
    assert st.evicted_entries == 160 - st.entries
    assert st.memory_bytes == st.entries * BYTES_PER_ENTRY
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and all("event=kv_index_full" in w and "capacity=100" in w
                                      for w in warnings)


def test_eviction_keeps_pages_several_workers_hold():
    index = KvIndex(IndexConfig(max_entries=100, evict_fraction=0.2))
    shared = pages(0, 10)
    index.apply(batch("a", 0, stored(shared)))
    index.apply(batch("b", 0, stored(shared)))  # the oldest keys, held by two workers
    index.apply(batch("a", 1, stored(pages(100, 191))))  # 101 keys: evict down to 80
    assert page_keys(shared) <= index.pages("a", 1) and page_keys(shared) <= index.pages("b", 1)
    assert len(index) == 80
    assert index.lookup(shared)["b"].device_pages == 10


def test_index_metrics_report_entries_capacity_memory_and_evictions():
    metrics = GatewayMetrics()
    router = Router(make_policy("affinity"), metrics, IndexConfig(max_entries=50,
                                                                  evict_fraction=0.5))
    router.index.apply(batch("w", 0, stored(pages(0, 60))))
    text = prometheus_client.generate_latest(metrics.registry).decode()
    assert "prefixcache_gateway_index_capacity 50.0" in text
    assert "prefixcache_gateway_index_entries 25.0" in text
    assert f"prefixcache_gateway_index_memory_bytes {25.0 * BYTES_PER_ENTRY}" in text
    assert "prefixcache_gateway_index_evictions_total 35.0" in text
    tables = sum(t.nbytes() for t in router.index._tables)  # the arrays, allocated
    assert f"prefixcache_gateway_index_table_bytes {float(tables)}" in text and tables > 0
    assert "prefixcache_gateway_index_tombstones_swept_total 0.0" in text
    assert "prefixcache_gateway_index_shared_pages 0.0" in text
    router.index.apply(batch("v", 0, stored(pages(55, 60))))  # 5 of w's also held by v
    router.index.apply(batch("u", 0, stored(pages(57, 60))))  # and 3 by u too: a triple
    router.index.apply(batch("t", 0, stored(pages(58, 60))))  # and 2 by t too: a set
    text = prometheus_client.generate_latest(metrics.registry).decode()
    assert "prefixcache_gateway_index_shared_pages 5.0" in text
    assert "prefixcache_gateway_index_holder_sets 1.0" in text
    for arrays in ("ready", "partial", "unready"):  # tables of 64 slots: no growth worth a spare
        assert f'prefixcache_gateway_index_growths_total{{arrays="{arrays}"}} 0.0' in text
    table = router.index._tables[0]
    table.sweep.left = table.cap  # a round over the evicted pages' tombstones
    while router.migrate_index(1 << 16):
        pass
    text = prometheus_client.generate_latest(metrics.registry).decode()
    assert "prefixcache_gateway_index_tombstones_swept_total 35.0" in text
    # as two growths with a spare written whole, three with one partly written and one without
    table._spare.taken, table._spare.finished, table._spare.missed = 2, 3, 1
    text = prometheus_client.generate_latest(metrics.registry).decode()
    assert 'prefixcache_gateway_index_growths_total{arrays="ready"} 2.0' in text
    assert 'prefixcache_gateway_index_growths_total{arrays="partial"} 3.0' in text
    assert 'prefixcache_gateway_index_growths_total{arrays="unready"} 1.0' in text
