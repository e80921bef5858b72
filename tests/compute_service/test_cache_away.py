"""An engine whose cache service goes away (killed, restarted) over real gRPC on loopback: it
keeps answering without reuse instead of stalling on retries, and registers its pool again by
itself once the service is back, idle or not (issue 25, finding 8: every request stalled ~6 s,
and an idle worker re-registered only with its next request, 47 s later)."""
from __future__ import annotations

import threading
import time

import pytest

from cache_service.core import CacheCore
from cache_service.server import CacheServer, ServerConfig
from compute_service.engine import Engine, SamplingParams
from gateway.core.index import KvIndex
from prefixcache.v1 import cache_service_pb2 as pb, common_pb2
from prefixcache_client.cache import CacheClient
from tests.compute_service.server_harness import make_engine, prompt, wait_until

pytestmark = pytest.mark.usefixtures("one_torch_thread")

POOL = "away-worker"
WATCH_S = 0.1
REJOIN_BOUND_S = 3.0  # the watch's period, gRPC's reconnect backoff (1 s at first), a register


class Cache:
    """An in-process cache service on a fixed loopback port that a test can kill and restart
    (empty, as a restarted process is)."""

    def __init__(self) -> None:
        self.port = 0
        self.start()

    def start(self) -> None:
        self.core = CacheCore()
        self.server = CacheServer(self.core, ServerConfig(host="127.0.0.1", port=self.port,
                                                          grace_s=0.0)).start()
        self.port = self.server.port

    def kill(self) -> None:
        self.server.drain(0.0)

    def pools(self) -> dict[str, int]:
        return {p.pool_id: p.epoch for p in self.core.list_pools(pb.ListPoolsRequest()).pools}


def generate(engine: Engine, tokens: list[int], timeout_s: float = 20.0):
    """(tokens, stats, seconds) of one greedy request through the running engine."""
    outs, done = [], threading.Event()

    def sink(out) -> None:
        outs.append(out)
        if out.stats is not None:
            done.set()

    started = time.monotonic()
    engine.submit(tokens, SamplingParams(max_tokens=4, ignore_eos=True), sink)
    assert done.wait(timeout_s), "no answer"
    stats = outs[-1].stats
    return [t for o in outs for t in o.token_ids], stats, time.monotonic() - started


@pytest.fixture
def cache():
    c = Cache()
    yield c
    c.kill()


@pytest.fixture
def engine(cache):
    client = CacheClient(f"127.0.0.1:{cache.port}", timeout_s=2.0)
    eng = make_engine(cache=client, pool_id=POOL, cache_watch_s=WATCH_S)
    eng.start()
    yield eng
    eng.close()
    client.close()


def test_an_engine_serves_without_its_cache_service_and_rejoins_by_itself(cache, engine):
    p = prompt(3, 41)
    first, stats, _ = generate(engine, p)
    _, stats, _ = generate(engine, p)
    assert stats.cached_tokens_device > 0 and stats.finish_reason.value == "length"
    epoch = cache.pools()[POOL]

    cache.kill()
    for _ in range(3):  # no stall: each answer as soon as it is computed, without reuse
        toks, stats, seconds = generate(engine, p)
        assert toks == first and stats.finish_reason.value == "length"
        assert stats.cached_tokens_device == 0 and seconds < 1.0
    assert engine.stats.cache_away == 1

    cache.start()  # empty; no request arrives: the engine registers again by itself
    # The engine counts the rejoin once its registration returned, just after the service shows
    # the pool: wait for both (under load the test looked in between).
    wait_until(lambda: POOL in cache.pools() and engine.stats.cache_rejoins == 1, REJOIN_BOUND_S)
    assert cache.pools()[POOL] != epoch
    toks, stats, _ = generate(engine, p)
    toks, stats, _ = generate(engine, p)
    assert toks == first and stats.cached_tokens_device > 0  # reuse again


class Feed:
    """The gateway's view of the pool: its cache service's event stream applied to a
    gateway.core.index.KvIndex, as the gateway's worker feed does (resubscribing across restarts)."""

    def __init__(self, port: int) -> None:
        self.index = KvIndex()
        self.client = CacheClient(f"127.0.0.1:{port}", timeout_s=2.0)
        self.sub = self.client.subscribe(POOL, heartbeat_interval_s=0.1, pool_wait_s=30.0)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            for item in self.sub:
                if item.WhichOneof("item") == "batch":
                    self.index.apply(item.batch)
        except Exception:  # closed
            pass

    def device_pages(self) -> int:
        return len(self.index.pages(POOL, common_pb2.MEDIUM_DEVICE))

    def close(self) -> None:
        self.sub.close()
        self.client.close()


def test_an_idle_engine_registers_again_after_a_quick_cache_service_restart(cache, engine):
    """The pool is back in the restarted cache service without a request, and the gateway's
    index drops the pages the restarted service no longer holds (the new epoch's snapshot)."""
    p = prompt(5, 41)
    generate(engine, p)
    epoch = cache.pools()[POOL]
    feed = Feed(cache.port)
    try:
        wait_until(lambda: feed.device_pages() > 0, 5.0)
        cache.kill()
        cache.start()  # back before any request: the pool is unknown to the new process
        wait_until(lambda: POOL in cache.pools(), REJOIN_BOUND_S)
        assert cache.pools()[POOL] != epoch
        wait_until(lambda: feed.device_pages() == 0, REJOIN_BOUND_S + 2.0)
    finally:
        feed.close()
    toks, stats, seconds = generate(engine, p)
    _, stats, _ = generate(engine, p)
    assert stats.cached_tokens_device > 0
