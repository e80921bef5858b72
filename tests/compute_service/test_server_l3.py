"""The compute service's L3 tier against a real Redis, in process, and its metrics."""
from __future__ import annotations

import urllib.request

import pytest

from cache_service.core import CacheCore
from compute_service.engine import Engine
from pagestore.client import L3Client, L3Config
from tests.compute_service.server_harness import (NOT_SERVING, SERVING, greedy, health,
                                                  make_engine, prompt, running, sample)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- L3 (Redis) ----------------------------------------------------------------------------------

@pytest.mark.parametrize("store", ["redis_server", "redis_cluster"])
def test_l3_pages_shared_through_redis_and_writer_closed_on_drain(request, store):
    """In-process: worker 1 writes through, worker 2 (another pool, same Redis: one node, or a
    3-master Redis Cluster) loads them; the L3 counters are exported, and drain closes the
    engine (the writer has flushed)."""
    url = request.getfixturevalue(store).url

    def worker(pool_id: str) -> Engine:
        l3 = L3Client(L3Config(url, prefix="t1", timeout_s=1.0, mac_key=b"m" * 16))
        assert l3.check(1.0)
        return make_engine(pool_id=pool_id, cache=CacheCore(remote=l3), l3=l3,
                           l3_write_policy="write-through", l3_lookup=True)

    p = prompt(43, 33)
    with running(worker("l3-one"), metrics_port=0) as (one, client):
        first = client.generate(p, greedy(4)).result()
        assert first.stats.cached_tokens_remote == 0
    assert not one.engine.l3._thread.is_alive()  # closed on drain, after its queue
    assert sample(one, "prefixcache_compute_l3_write_pages_ok_total") >= 8
    assert sample(one, "prefixcache_compute_l3_breaker_open") == 0
    assert sample(one, "prefixcache_compute_l3_up") == 1
    with running(worker("l3-two")) as (two, client):
        second = client.generate(p, greedy(4)).result()
        assert second.stats.cached_tokens_remote == 32  # 8 whole pages; the last token computed
        assert second.token_ids == first.token_ids
        assert sample(two, "prefixcache_compute_cached_prompt_tokens_total", medium="remote") == 32
        assert sample(two, "prefixcache_compute_engine_remote_loaded_tokens_total") == 32
        assert sample(two, "prefixcache_compute_l3_load_pages_ok_total") == 8
        assert sample(two, "prefixcache_compute_l3_rejected_total", reason="bad_mac") == 0
        assert health(f"127.0.0.1:{two.port}", "l3") == SERVING


def test_a_worker_with_an_unreachable_redis_serves_and_reports_it(redis_server):
    """A wrong --redis-url: the worker is ready and serves cold, health "l3" is NOT_SERVING and
    prefixcache_compute_l3_up 0 (the start check failed); not an error on any request."""
    redis_server.stop()
    l3 = L3Client(L3Config(redis_server.url, timeout_s=0.2))
    assert not l3.check(0.5)
    engine = make_engine(pool_id="l3-down", cache=CacheCore(remote=l3), l3=l3,
                         l3_write_policy="write-through", l3_lookup=True)
    with running(engine, metrics_port=0) as (server, client):
        target = f"127.0.0.1:{server.port}"
        assert health(target, "readiness") == SERVING and health(target, "l3") == NOT_SERVING
        p = prompt(7, 33)
        out = client.generate(p, greedy(4)).result()
        assert out.stats.cached_tokens_remote == 0 and len(out.token_ids) == 4
        assert sample(server, "prefixcache_compute_l3_up") == 0
        redis_server.start()
        assert l3.check(0.5)  # what the background re-check does every 2 s
        assert health(target, "l3") == SERVING and sample(server, "prefixcache_compute_l3_up") == 1


def test_no_l3_metrics_without_l3(shared):
    server, _ = shared
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                  timeout=5).read().decode()
    assert "prefixcache_compute_l3_" not in text
    assert "prefixcache_compute_adapters_loaded 0.0" in text
