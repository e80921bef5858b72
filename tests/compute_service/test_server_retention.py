"""prompt_cache_retention through a worker (tiny-transformer, in-process cache core): "24h"
reaches the cache service as MatchOp.retain_s and protects the request's prefix there; the
default protects nothing; another value is INVALID_ARGUMENT naming the field. With L3, the
retained path is written to Redis at once, under the worker's L3 TTL (24 h by default)."""
from __future__ import annotations

import pytest
import redis

from cache_service.core import CacheCore
from cache_service.retention import RetentionConfig
from pagestore.client import L3Client, L3Config
from prefixcache.v1 import cache_service_pb2 as cpb
from tests.compute_service.server_harness import (INVALID, fails, greedy, make_engine, prompt,
                                                  running, wait_until)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
DAY = 86400


def test_a_24h_request_is_protected_by_the_cache_service_and_others_are_not():
    core = CacheCore(retention=RetentionConfig(pages_per_namespace=64, max_protect_s=600.0))
    with running(make_engine(cache=core)) as (_, client):
        def stats() -> cpb.PoolStats:
            return core.get_stats(cpb.GetStatsRequest()).pools[0]

        client.generate(prompt(3), greedy(4), prompt_cache_retention="in_memory").result()
        client.generate(prompt(5), greedy(4)).result()
        client.generate(prompt(9), greedy(4), prompt_cache_retention="24h").result()
        # Its lease is released with the engine's next step: one more request makes one.
        client.generate(prompt(11), greedy(1)).result()
        wait_until(lambda: stats().retained_requests == 1)
        # 21 prompt + 4 output tokens, 4 per page: its 6 full pages (the last one published).
        assert stats().retained_pages >= 5 and stats().retention_ignored == 0
        message = fails(client.generate(prompt(13), greedy(2), prompt_cache_retention="1h"),
                        INVALID)
        assert message.startswith("prompt_cache_retention:")


def test_a_24h_prefix_is_written_to_redis_with_a_24h_ttl(redis_server):
    """Real Redis, "hot" L3 policy that would write a page only at its third hit: the retained
    request's path is written at once, each key expiring in 24 h; the plain request's is not."""
    url = redis_server.url
    l3 = L3Client(L3Config(url, prefix="ret", timeout_s=1.0, mac_key=b"m" * 16))
    assert l3.check(1.0)
    core = CacheCore(remote=l3, retention=RetentionConfig(pages_per_namespace=64))
    engine = make_engine(pool_id="ret", cache=core, l3=l3, l3_write_policy="hot", l3_min_hits=3)
    with running(engine) as (server, client):
        client.generate(prompt(21), greedy(4)).result()
        client.generate(prompt(23), greedy(4), prompt_cache_retention="24h").result()
        client.generate(prompt(25), greedy(1)).result()  # a step that releases the lease
        retained = core.get_stats(cpb.GetStatsRequest()).pools[0].retained_pages
        client.generate(prompt(27), greedy(1)).result()  # the step that runs its L3 copies
        assert server.engine.l3.flush(10.0)
    store = redis.Redis.from_url(url)
    keys = list(store.scan_iter("ret:*"))
    assert retained >= 5 and len(keys) == retained
    assert all(DAY - 120 < store.ttl(k) <= DAY for k in keys)
