"""The L3 client's reachability (design.md §4): `check()` logs `event=l3_unreachable` with the URL
(password redacted) and the cause, every call to a Redis that does not answer is a miss, and
`watch()` sees it come up without traffic. The services' side (health "l3", the l3_up gauge) is
in tests/cache_service/test_l3_reachability.py."""
from __future__ import annotations

import logging
import time

from pagestore.client import L3Client, L3Config


def wait_for(predicate, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_check_names_the_redacted_url_and_the_cause_and_recovers(redis_server, caplog):
    redis_server.stop()  # nobody listens on its port now
    url = f"redis://:s3cret@127.0.0.1:{redis_server.port}/0"
    with caplog.at_level(logging.INFO, logger="prefixcache.l3"):
        l3 = L3Client(L3Config(url))
        seen: list[bool] = []
        l3.on_change(seen.append)
        assert not l3.check(0.5) and l3.up is False and seen == [False]
    line = next(r.getMessage() for r in caplog.records if "event=l3_unreachable" in r.getMessage())
    assert f"url=redis://:***@127.0.0.1:{redis_server.port}/0" in line and "s3cret" not in line
    assert "ConnectionError" in line and "refused" in line
    assert l3.probe("m", [b"x" * 16]) == 0  # a miss, not an error
    plain = L3Client(L3Config(redis_server.url))
    assert not plain.check(0.5)
    plain.watch(interval_s=0.05)
    try:
        redis_server.start()
        assert wait_for(lambda: plain.up is True, 5.0)
    finally:
        plain.close()


def test_an_unreachable_cluster_is_a_miss_everywhere(redis_server, caplog):
    """redis+cluster:// to a port nobody listens on: the cluster client cannot even learn the
    slot map; every call is a miss (no exception escapes), and the start check says why."""
    redis_server.stop()
    l3 = L3Client(L3Config(f"redis+cluster://127.0.0.1:{redis_server.port}", failure_threshold=2))
    with caplog.at_level(logging.WARNING, logger="prefixcache.l3"):
        assert not l3.check(0.5)
    assert "event=l3_unreachable" in caplog.text and "redis+cluster://127.0.0.1" in caplog.text
    pages = [b"p" * 16]
    assert l3.probe("m", pages) == 0 and l3.get_many("m", pages) is None
    assert l3.set_many("m", [(pages[0], b"x")]) == 0
    l3.delete("m", pages[0])
    assert l3.breaker.state == "open" and l3.counters.calls["errors"] >= 2


def test_a_check_that_gets_an_answer_closes_the_breaker(redis_server):
    """Redis back before the breaker's cool-down ended: the re-check's answer ends the misses
    at once instead of `reset_after_s` later."""
    l3 = L3Client(L3Config(redis_server.url, failure_threshold=1, reset_after_s=60.0,
                           timeout_s=0.3, connect_timeout_s=0.3))
    l3.set_many("m", [(b"p" * 16, b"x")])
    redis_server.pause()
    try:
        assert l3.probe("m", [b"p" * 16]) == 0 and l3.breaker.state == "open"
    finally:
        redis_server.resume()
    assert l3.probe("m", [b"p" * 16]) == 0  # still open: skipped
    assert l3.check() and l3.breaker.state == "closed"
    assert l3.probe("m", [b"p" * 16]) == 1
