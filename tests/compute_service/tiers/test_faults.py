"""Redis stopped, paused, slow, flushed or answering errors: every request still succeeds as an
L3 miss, with output identical to a cold run and each engine step bounded by the client's
timeout; the breaker opens, probes half-open and L3 use resumes when Redis is back.

Two kinds of reader: B looks L3 up through its cache service (the probe meets the fault first),
B' has a probe that always reports the pages present (`ProbeAll`, as if the fault began right
after the probe), so the engine's own load meets the fault."""
from __future__ import annotations

import threading
import time

import redis

from compute_service.engine import SamplingParams
from prefixcache_client.hash import prompt_hashes
from tests.compute_service.tiers.helpers import (NEW, PAGE, PROMPT, ProbeAll, generate,
                                                 generate_many, l3_client, prompt_of, reference)

NAME = "tiny-transformer"
STEP_BOUND_S = 1.0  # loose: a step meets at most a probe and a load timeout (0.1 s each)


def timed(eng, prompt: list[int]):
    """(tokens, stats, slowest step in seconds) of one request stepped to completion."""
    outs: list = []
    eng.submit(prompt, SamplingParams(max_tokens=NEW, ignore_eos=True), outs.append)
    worst = 0.0
    while eng.has_work():
        start = time.perf_counter()
        eng.step()
        worst = max(worst, time.perf_counter() - start)
    return [t for o in outs for t in o.token_ids], outs[-1].stats, worst


def write_through(workers, url: str, prompts: list[list[int]]):
    """Worker A computes the prompts with write-through and waits for its writes."""
    a = workers(NAME, l3_client(url), l3_write_policy="write-through")
    generate_many(a, prompts)
    assert a.flush_l3()
    return a


def assert_cold(toks, stats, prompt=PROMPT):
    assert toks == reference(NAME, tuple(prompt))
    assert stats.cached_tokens_remote == 0 and stats.computed_prompt_tokens == len(prompt)


def test_stopped_redis_is_a_miss_for_probes_loads_and_writes(redis_server, workers):
    a = write_through(workers, redis_server.url, [PROMPT])
    redis_server.stop()
    l3 = l3_client(redis_server.url)
    b = workers(NAME, l3, lookup=True)
    toks, s, worst = timed(b, PROMPT)
    assert_cold(toks, s)
    assert worst < STEP_BOUND_S
    b2 = workers(NAME, l3_client(redis_server.url), lookup=True, probe=ProbeAll())
    toks, s, worst = timed(b2, PROMPT)
    assert_cold(toks, s)
    assert worst < STEP_BOUND_S
    m = b2.tier_metrics()
    assert m["l3_load_pages_missing"] == 1 and m["l3_load_pages_skipped"] == 7
    assert m["l3_client_errors"] == 1
    # A keeps serving while its writes fail.
    other = prompt_of(3, 33)
    toks, s, worst = timed(a, other)
    assert toks == reference(NAME, tuple(other)) and worst < STEP_BOUND_S
    assert a.flush_l3()
    m = a.tier_metrics()
    assert m["l3_write_pages_failed"] >= 1 and m["l3_write_pages_ok"] == 9
    assert m["l3_client_errors"] + m["l3_client_skipped_breaker_open"] >= 1


def test_paused_redis_is_a_bounded_miss_and_the_breaker_recovers(redis_server, workers):
    prompts = [prompt_of(10 + i, 33) for i in range(4)]
    write_through(workers, redis_server.url, prompts)
    now = [0.0]  # the breaker's clock: its cool-down passes only when the test says so
    l3 = l3_client(redis_server.url, clock=lambda: now[0])  # failure_threshold 2, reset 0.3 s
    b = workers(NAME, l3, lookup=True)
    redis_server.pause()
    try:
        for prompt in prompts[:3]:
            toks, s, worst = timed(b, prompt)
            assert_cold(toks, s, prompt)
            assert worst < STEP_BOUND_S
        assert l3.breaker.state == "open"
        m = b.tier_metrics()
        assert m["l3_client_timeouts"] == 2 and m["l3_client_skipped_breaker_open"] >= 1
        assert m["l3_breaker_open"] == 2
    finally:
        redis_server.resume()
    now[0] += 0.35  # half-open: the next call is a trial; it succeeds and closes the breaker
    toks, s, _ = timed(b, prompts[3])
    assert toks == reference(NAME, tuple(prompts[3])) and s.cached_tokens_remote == 32
    assert l3.breaker.state == "closed" and b.tier_metrics()["l3_breaker_open"] == 0


def test_a_paused_redis_during_the_load_itself(redis_server, workers):
    write_through(workers, redis_server.url, [PROMPT])
    b2 = workers(NAME, l3_client(redis_server.url), lookup=True, probe=ProbeAll())
    redis_server.pause()
    try:
        toks, s, worst = timed(b2, PROMPT)
    finally:
        redis_server.resume()
    assert_cold(toks, s)
    assert 0.1 <= worst < STEP_BOUND_S  # the load waited for its timeout, no longer
    assert b2.tier_metrics()["l3_client_timeouts"] == 1


def test_a_slow_redis_within_the_timeout_still_serves_the_pages(redis_server, workers):
    write_through(workers, redis_server.url, [PROMPT])
    b = workers(NAME, l3_client(redis_server.url, timeout_s=0.5), lookup=True)
    redis_server.pause()
    threading.Timer(0.2, redis_server.resume).start()  # Redis answers up to 200 ms late
    toks, s, worst = timed(b, PROMPT)
    assert toks == reference(NAME, tuple(PROMPT)) and s.cached_tokens_remote == 32
    assert 0.05 <= worst < STEP_BOUND_S
    assert b.tier_metrics()["l3_client_timeouts"] == 0


def test_flushall_between_write_and_read(redis_server, workers):
    write_through(workers, redis_server.url, [PROMPT])
    redis.Redis.from_url(redis_server.url).flushall()
    b = workers(NAME, l3_client(redis_server.url), lookup=True)
    assert_cold(*generate(b, PROMPT))
    b2 = workers(NAME, l3_client(redis_server.url), lookup=True, probe=ProbeAll())
    assert_cold(*generate(b2, PROMPT))
    m = b2.tier_metrics()
    assert m["l3_load_pages_missing"] == 1 and m["l3_load_pages_ok"] == 0
    assert m["l3_client_errors"] == 0  # a flushed key is a plain miss, not a failure


def test_a_key_of_the_wrong_type_is_a_miss(redis_server, workers):
    write_through(workers, redis_server.url, [PROMPT])
    admin = redis.Redis.from_url(redis_server.url)
    l3 = l3_client(redis_server.url)
    bad = l3.key(NAME, prompt_hashes(PROMPT, PAGE, NAME)[3])
    admin.delete(bad)
    admin.rpush(bad, b"not a page")
    b = workers(NAME, l3, lookup=True)  # EXISTS finds the key; the load gets no string for it
    toks, s = generate(b, PROMPT)
    assert toks == reference(NAME, tuple(PROMPT))
    assert s.cached_tokens_remote == 12 and s.computed_prompt_tokens == len(PROMPT) - 12
    assert b.tier_metrics()["l3_load_pages_missing"] == 1


def test_redis_error_replies_are_misses_for_loads_and_failures_for_writes(redis_server, workers):
    write_through(workers, redis_server.url, [PROMPT])
    admin = redis.Redis.from_url(redis_server.url)
    admin.acl_setuser("default", enabled=True, nopass=True, commands=["-mget"], reset=False)
    try:  # NOPERM on every read
        b = workers(NAME, l3_client(redis_server.url), lookup=True)
        assert_cold(*generate(b, PROMPT))
        assert b.tier_metrics()["l3_client_errors"] == 1
    finally:
        admin.acl_setuser("default", enabled=True, nopass=True, commands=["+@all"], reset=False)
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", "1")
    try:  # OOM on every write
        a = workers(NAME, l3_client(redis_server.url), l3_write_policy="write-through")
        other = prompt_of(4, 33)
        assert generate(a, other)[0] == reference(NAME, tuple(other))
        assert a.flush_l3()
        m = a.tier_metrics()
        assert m["l3_write_pages_failed"] == m["l3_write_pages_queued"] > 0
        assert m["l3_write_pages_ok"] == 0 and m["l3_client_errors"] >= 1
    finally:
        admin.config_set("maxmemory", "256mb")
        admin.config_set("maxmemory-policy", "allkeys-lru")


def test_a_full_write_queue_drops_writes_instead_of_waiting(redis_server, workers):
    l3 = l3_client(redis_server.url, failure_threshold=100)  # keep every write trying
    a = workers(NAME, l3, l3_write_policy="write-through", l3_batch_pages=1)
    page_bytes = a.l3.layout.kv_bytes()
    a.l3.cfg.write_queue_bytes = 2 * page_bytes
    redis_server.pause()
    try:
        toks, _, worst = timed(a, PROMPT)
    finally:
        redis_server.resume()
    assert toks == reference(NAME, tuple(PROMPT)) and worst < STEP_BOUND_S
    assert a.flush_l3()
    m = a.tier_metrics()
    assert m["l3_write_pages_dropped"] > 0
    assert m["l3_write_pages_dropped"] + m["l3_write_pages_queued"] == 9
