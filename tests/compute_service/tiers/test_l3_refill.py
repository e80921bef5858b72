"""L3 writes that did not stay in Redis are written again (issue 25, finding 7; the fault drill's
goal: the L3 share in the second turn after a FLUSHALL, a Redis restart or a pause back at
0.8 x its baseline): a write lost while Redis was paused (the worker's breaker open) is reported
in the worker's next Step and listed again once the store answers; after a FLUSHALL, every run
still on a worker goes back to L3 at that worker's next step, whatever it serves, so another
worker's next turn of a conversation loads its history instead of computing it. Real engines,
a real redis-server, real numerics; each test fails where a run stayed marked written."""
from __future__ import annotations

import time

import redis

from cache_service.l3_loss import StoreWatch
from compute_service.tiers import PageLayout, RemoteTier, RemoteTierConfig
from prefixcache_client.hash import prompt_hashes
from tests.compute_service.tiers.helpers import (PAGE, PROMPT, generate, l3_client, model,
                                                 prompt_of, reference)

NAME = "tiny-transformer"
PROMPT_PAGES = (len(PROMPT) - 1) // PAGE  # the pages a request for PROMPT can reuse


def _worker_b_turn(redis_server, workers) -> tuple[list[int], object]:
    """PROMPT on a fresh worker with its own cache service: only L3 can give it a prefix."""
    b = workers(NAME, l3_client(redis_server.url), lookup=True)
    return generate(b, PROMPT)


def _watched_worker(redis_server, workers):
    """Worker A (write-through, quick breaker) and the store watch of its cache service,
    whose client has time to answer on a loaded machine."""
    service_l3 = l3_client(redis_server.url, timeout_s=1.0, connect_timeout_s=1.0)
    watch = StoreWatch(service_l3)
    assert watch.check() is False  # arms the sentinel
    a = workers(NAME, l3_client(redis_server.url), lookup=True, probe=service_l3,
                l3_write_policy="write-through")
    return a, watch


def test_a_write_lost_while_redis_was_paused_is_written_again(redis_server, workers):
    a, watch = _watched_worker(redis_server, workers)
    redis_server.pause()  # SIGSTOP: the writes time out, then the breaker skips them
    try:
        first, _ = generate(a, PROMPT)
        assert a.flush_l3()
    finally:
        redis_server.resume()
    assert a.l3.counters.write_pages_failed >= PROMPT_PAGES
    assert not any(redis.Redis.from_url(redis_server.url).exists(a.l3.client.key(NAME, h))
                   for h in prompt_hashes(PROMPT, PAGE, NAME))
    time.sleep(0.4)  # the worker's breaker lets a trial call through (l3_client: 0.3 s)
    generate(a, prompt_of(5, 9))  # other work: its first step reports the lost writes ...
    assert watch.check() is False  # ... the store answers (its data intact) ...
    generate(a, prompt_of(6, 9))  # ... so the next step lists them again
    assert a.flush_l3()
    toks_b, stats_b = _worker_b_turn(redis_server, workers)
    assert stats_b.cached_tokens_remote == PROMPT_PAGES * PAGE
    assert toks_b == first == reference(NAME, tuple(PROMPT))


def test_after_flushall_resident_pages_are_back_in_l3_before_the_next_turn(redis_server, workers):
    """The conversation's next turn goes to worker B; worker A meanwhile served something else
    (no match of A used the conversation's pages, which is how they came back before)."""
    a, watch = _watched_worker(redis_server, workers)
    first, _ = generate(a, PROMPT)
    assert a.flush_l3()
    redis.Redis.from_url(redis_server.url).flushall()
    assert watch.check() is True
    generate(a, prompt_of(7, 9))  # A's next step lists every resident run's write again
    assert a.flush_l3()
    toks_b, stats_b = _worker_b_turn(redis_server, workers)
    assert stats_b.cached_tokens_remote == PROMPT_PAGES * PAGE
    assert toks_b == first == reference(NAME, tuple(PROMPT))


def test_pages_found_corrupt_in_redis_are_written_again_by_the_worker_that_recomputes_them(
        redis_server, workers):
    """Every page in Redis overwritten with garbage (the fault drill's redis-garbage; a Redis
    that restarts from a damaged dump likewise): the store did not lose its keys, so its watch
    sees nothing and no refill runs. The worker that loads them rejects every page (its MAC),
    deletes the key, computes the pages and, as they are new in its tree, writes them through:
    the next worker loads the whole prefix again."""
    a, watch = _watched_worker(redis_server, workers)
    first, _ = generate(a, PROMPT)
    assert a.flush_l3()
    r = redis.Redis.from_url(redis_server.url)
    keys = [a.l3.client.key(NAME, h) for h in prompt_hashes(PROMPT, PAGE, NAME)[:PROMPT_PAGES]]
    for key in keys:
        r.set(key, bytes(r.strlen(key)))
    assert watch.check() is False  # no loss the sentinel could see
    b = workers(NAME, l3_client(redis_server.url), lookup=True, l3_write_policy="write-through")
    toks_b, stats_b = generate(b, PROMPT)
    assert stats_b.cached_tokens_remote == 0 and sum(b.l3.counters.rejected.values()) >= 1
    assert b.flush_l3()
    toks_c, stats_c = _worker_b_turn(redis_server, workers)
    assert stats_c.cached_tokens_remote == PROMPT_PAGES * PAGE
    assert toks_c == toks_b == first == reference(NAME, tuple(PROMPT))


def _tier(url: str, **cfg) -> RemoteTier:
    layout = PageLayout.of_model(model(NAME).config, PAGE, model(NAME).dtype)
    return RemoteTier(l3_client(url), NAME, layout, RemoteTierConfig(**cfg))


def _kv(tier: RemoteTier, n: int):
    import torch
    return torch.zeros((tier.layout.kv_shape[0], 2, n, *tier.layout.kv_shape[2:]))


def test_the_tier_hands_over_every_write_it_could_not_do_once(redis_server):
    hashes = prompt_hashes(PROMPT, PAGE, NAME)[:3]
    redis_server.stop()
    tier = _tier(redis_server.url)
    try:
        tier.write(hashes, _kv(tier, 3), [None] * 3)
        assert tier.flush()
        assert tier.take_failed(2) == hashes[:2]  # at most `limit`, oldest first
        assert tier.take_failed(10) == hashes[2:] and tier.take_failed(10) == []
    finally:
        tier.close()


def test_a_write_dropped_from_the_full_queue_is_handed_over(redis_server):
    tier = _tier(redis_server.url, write_queue_bytes=1)  # no page fits
    try:
        hashes = prompt_hashes(PROMPT, PAGE, NAME)[:2]
        tier.write(hashes, _kv(tier, 2), [None] * 2)
        assert tier.counters.write_pages_dropped == 2
        assert tier.take_failed(10) == hashes
    finally:
        tier.close()
