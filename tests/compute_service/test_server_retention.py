"""prompt_cache_retention through a worker (tiny-transformer, in-process cache core): "24h"
reaches the cache service as MatchOp.retain_s and protects the request's prefix there; the
default protects nothing; another value is INVALID_ARGUMENT naming the field."""
from __future__ import annotations

import pytest

from cache_service.core import CacheCore
from cache_service.retention import RetentionConfig
from prefixcache.v1 import cache_service_pb2 as cpb
from tests.compute_service.server_harness import (INVALID, fails, greedy, make_engine, prompt,
                                                  running, wait_until)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


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
