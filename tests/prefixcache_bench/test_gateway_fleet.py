"""The fleet benchmark's load generator and measurement, at a tiny size: what it streams is what
the gateway's index ends up holding, and its figures are the ones it says."""
from __future__ import annotations

import pytest

from gateway.core.index import IndexConfig, KvIndex
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache_bench.gateway_fleet import fleet as F
from prefixcache_bench.gateway_fleet.__main__ import main
from prefixcache_bench.gateway_fleet.run import index_bytes_per_page, run_config
from prefixcache_bench.harness import REPO


def test_a_recorded_stream_is_a_snapshot_then_live_batches_the_index_accepts():
    index = KvIndex(IndexConfig(max_entries=1 << 20))
    stream = [cpb.SubscribeResponse.FromString(b).batch for b in F.recorded_stream(3, 5000, 4)]
    assert [b.snapshot for b in stream] == [True, True, False, False, False, False]
    assert stream[1].snapshot_end and [b.seq for b in stream[2:]] == [1, 2, 3, 4]
    for b in stream:
        assert index.apply(b).status.value == "applied"
    held = index.pages(F.pool_name(3), 1)
    assert len(held) == len(F.snapshot_pages(3, 5000))  # 4 x 64 stored, 4 x 64 removed
    assert F.private_page(3, 0) not in held and F.private_page(3, 5000 + 4 * 64 - 1) in held


def test_a_tiny_fleet_run_indexes_every_page_and_routes_to_holders():
    r = run_config(pools=4, pages_per_pool=400, live_batches=3, idle_s=0.5, cpus=None)
    want = sum(len(F.snapshot_pages(i, 400)) for i in range(4))
    assert r["indexed_pages"] == r["snapshot_page_events"] == want
    assert r["live_page_events"] == 4 * 3 * 2 * F.LIVE_PAGES
    assert r["restart_to_warm_s"] > 0 and r["index_evictions"] == 0
    assert r["routing_idle"]["decisions"] > 0 and r["routed_to_holder"] > 0.5
    assert 50 < index_bytes_per_page(4, 400) < 1000


def test_the_summary_tabulates_the_committed_runs(capsys):
    assert main(["--summary", str(REPO / "docs" / "results" / "gateway" / "fleet")]) == 0
    out = capsys.readouterr().out
    assert "restart_to_warm_s" in out and "10,000,512" in out


def test_help():
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
