"""The gateway's connection model and bulk ingest (gateway/core/feeds.py): a fixed number of
threads whatever the workers, and routing decisions that get the lock between the slices of a
large batch instead of waiting for all of it."""
from __future__ import annotations

import asyncio
import os
import sys
import threading
import time

import pytest

from gateway.core.discovery import WorkerAddress
from gateway.core.feed_streams import Feed, aio_channel
from gateway.core.feeds import FeedLoop
from gateway.core.stream_items import split_snapshot
from gateway.core.metrics import GatewayMetrics
from gateway.core.policies import RouteRequest, make_policy
from gateway.core.router import Router, Worker
from gateway.core import index_native, thread_priority
from gateway.core.thread_priority import INGEST_NICE, PRIORITIES
from gateway.core.workers import WorkerSettings
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import cache_service_pb2_grpc as cpb_grpc
from prefixcache.v1 import compute_service_pb2 as pb
from tests.cache_service.grpc_harness import running_server
from service_shell import TlsConfig, channel_options
from tests.gateway.gateway_harness import (FakeWorker, cache_prompt, register_pool, running_gateway,
                                           wait_until)
from tests.service_shell.certs import make_pki
from tests.gateway.helpers import (DEVICE, HOST, batch, cleared, heartbeat, pages, pages_and_stamps,
                                   removed, stored)

# The loop thread, the blocking pool (4) and grpc.aio's own poller, with room to spare; the
# former model ran 3 threads per worker (and a watchdog per subscription).
MAX_GATEWAY_THREADS = 8


def _gateway_threads(before: set[int]) -> list[str]:
    """Threads started since `before`, less the test's servers' (fake workers, cache service)."""
    return [t.name for t in threading.enumerate() if t.ident not in before
            and not t.name.startswith(("fake-", "cache-rpc"))]


def _threads_with(pools: int) -> list[str]:
    # A subscription holds one of the cache service's RPC threads.
    with running_server(max_workers=pools + 16, max_subscriptions=pools + 8) as cache:
        workers = [FakeWorker(f"t{i:02d}") for i in range(pools)]
        try:
            for w in workers:
                register_pool(cache.core, w.name)
            addresses = [WorkerAddress(w.address, f"127.0.0.1:{cache.port}") for w in workers]
            before = {t.ident for t in threading.enumerate()}
            with running_gateway(lambda: addresses) as gw:
                wait_until(lambda: len(gw.router.names()) == pools and all(
                    gw.router.get(w.name).synced for w in workers), timeout_s=60,
                    what="every worker admitted and synced")
                return [n for n in _gateway_threads(before) if not n.startswith("gateway-rpc")]
        finally:
            for w in workers:
                w.stop()


def test_thread_count_does_not_grow_with_workers():
    few, many = _threads_with(5), _threads_with(50)
    assert len(few) <= MAX_GATEWAY_THREADS, few
    assert len(many) <= MAX_GATEWAY_THREADS, many


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priority is Linux's")
@pytest.mark.parametrize("priority", PRIORITIES)
def test_the_feed_loop_runs_below_the_request_threads_priority(priority):
    # Ingest yields the core to routing decisions (design.md §6): the loop thread, and the
    # threads it starts (the blocking pool), run SCHED_IDLE, or INGEST_NICE nicer than the
    # process, as --ingest-priority says; the calling thread keeps its own.
    thread_priority.configure(priority, switch_interval_s=None)
    loop = FeedLoop(_router("p0"))
    try:
        base = _priority_here()
        on_loop = loop.run_sync(_own_priority(), 5.0)
        in_pool = loop.run_sync(loop.blocking(_priority_here), 5.0)
    finally:
        loop.close()
        thread_priority.configure()
    policy, nice = {"idle": (os.SCHED_IDLE, base[1]), "nice": (base[0], base[1] + INGEST_NICE),
                    "normal": base}[priority]
    assert on_loop == (policy, nice) == in_pool
    assert _priority_here() == base


def _priority_here() -> tuple[int, int]:
    return os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


async def _own_priority() -> tuple[int, int]:
    return _priority_here()


def _router(pool: str) -> Router:
    router = Router(make_policy("affinity"), GatewayMetrics())
    router.add(Worker(pool, "w", "c", None, pb.GetModelInfoResponse(worker=pool)))
    return router


def test_routing_decisions_run_between_the_slices_of_a_large_batch():
    """A 200k-page snapshot is applied in slices of 1,024 page events: routing decisions taken
    meanwhile see it partly applied (with one hold of the lock for the batch, they would see none
    or all of it). Requests come 0.2 ms apart (a thread deciding back to back, never releasing
    the GIL but to take the lock again, would starve ingest: no lock or GIL of Python is fair)."""
    pool, total = "big", 200_000
    router = _router(pool)
    feeds = FeedLoop(router, slice_events=1024)
    seen: list[int] = []  # pages indexed when a routing decision got the lock
    applying, done = threading.Event(), threading.Event()

    def route() -> None:
        applying.wait(10)
        n = 0
        while not done.is_set():
            n += 1
            router.route(RouteRequest(f"r{n}", pages(0, 8), 33, 4))
            router.finish(f"r{n}")
            with router.lock:
                seen.append(len(router.index))
            time.sleep(0.0002)

    thread = threading.Thread(target=route)
    thread.start()
    item = cpb.SubscribeResponse(batch=batch(pool, 0, cleared(), stored(pages(0, total)),
                                             snapshot=True, snapshot_end=True))
    try:
        applying.set()
        feeds.run_sync(feeds.applier.put(Feed(pool), item), 10)
        wait_until(lambda: (router.index.info(pool).last_seq == 0
                            and not router.index.info(pool).in_snapshot), timeout_s=60)
    finally:
        done.set()
        thread.join(10)
        feeds.close()
    assert len(router.index) == total
    assert feeds.applier.slices >= total // 1024
    assert any(0 < n < total for n in seen), "no routing decision ran while the batch applied"


def test_a_decision_gets_into_a_slice_and_a_change_of_the_index_waits_for_its_end():
    """Inside one slice, between two page events (the C loop stopped for a waiting decision): a
    routing decision takes the lock and sees the table partly applied; removing a worker (a
    change of the index) waits until the whole slice is applied, so no page of the slice is
    left to a freed worker slot."""
    assert index_native.kernel() is not None, "slices stop for decisions in the C loop only"
    pool, total = "big", 5000
    router, other = _router(pool), "other"
    router.add(Worker(other, "w2", "c", None, pb.GetModelInfoResponse(worker=other)))
    seen: dict[str, object] = {}
    first_pause = router.decisions.pause

    def decide() -> None:
        seen["decided"] = router.route(RouteRequest("r", pages(0, 8), 33, 4))
        with router.decisions.decision():  # as a decision: it may read the paused slice's table
            seen["indexed"] = len(router.index)

    def pause() -> None:
        if seen:
            return first_pause()
        decision, remove = threading.Thread(target=decide), threading.Thread(
            target=router.remove, args=(pool,))
        seen["remove"] = remove
        decision.start()
        remove.start()
        wait_until(lambda: len(router.decisions._deciding) == 1, timeout_s=10)
        first_pause()  # lets the counted decision in; its second part waits for the next pause
        seen["removed_during_slice"] = not remove.is_alive()

    router.decisions.pause = pause
    router.decisions.flag[0] = 1  # as if a decision waited: the C loop stops after 64 events
    item = cpb.SubscribeResponse(batch=batch(pool, 0, cleared(), stored(pages(0, total)),
                                             snapshot=True, snapshot_end=True))
    router.on_stream_item(pool, item)
    seen["remove"].join(10)
    assert seen["decided"] is not None and "indexed" in seen
    assert 0 < seen["indexed"] < total
    assert seen["removed_during_slice"] is False
    assert router.index.info(pool) is None and len(router.index) == 0


def test_a_snapshot_batch_is_split_into_snapshot_batches_of_the_slice_size():
    big = batch("p", 0, cleared(), stored(pages(0, 2500)), removed(pages(0, 10)),
                stored(pages(3000, 3100), medium=DEVICE), snapshot=True, snapshot_end=True)
    parts = split_snapshot(big, 1000)
    assert [p.snapshot for p in parts] == [True] * len(parts)
    assert [p.snapshot_end for p in parts] == [False] * (len(parts) - 1) + [True]
    assert all(p.seq == 0 and p.epoch == 1 and p.pool_id == "p" for p in parts)
    assert parts[0].events[0].WhichOneof("event") == "cleared"
    sizes = [sum(len(getattr(e, e.WhichOneof("event")).block_hashes) for e in p.events
                 if e.WhichOneof("event") != "cleared") for p in parts]
    assert sizes == [1000, 1000, 610]
    flat = [(e.WhichOneof("event"), h) for p in parts for e in p.events
            if e.WhichOneof("event") != "cleared" for h in getattr(e, e.WhichOneof("event")).block_hashes]
    want = [(e.WhichOneof("event"), h) for e in big.events if e.WhichOneof("event") != "cleared"
            for h in getattr(e, e.WhichOneof("event")).block_hashes]
    assert flat == want
    live = batch("p", 7, stored(pages(0, 5000)))
    assert split_snapshot(live, 1000) == [live]  # a live batch's seq is its identity: whole


def test_a_feed_loop_closes_with_its_tasks():
    router = _router("x")
    feeds = FeedLoop(router)
    feeds.submit(asyncio.sleep(3600))
    feeds.close(5)
    assert not any(t.name == "gateway-feeds" and t.is_alive() for t in threading.enumerate())


def test_a_feed_over_mtls_fills_the_index(tmp_path):
    """The grpc.aio channels take the same TLS settings as the sync ones: a cache service that
    requires client certificates streams its pool into the router; without them, nothing."""
    pki = make_pki(tmp_path)
    server_tls = TlsConfig(cert=pki.server.cert, key=pki.server.key, ca=pki.ca)
    client_tls = TlsConfig(cert=pki.client.cert, key=pki.client.key, ca=pki.ca)
    with running_server(tls=server_tls) as cache:
        register_pool(cache.core, "m")
        cache_prompt(cache.core, "m", list(range(9)))
        router, target = _router("m"), f"localhost:{cache.port}"
        feeds = FeedLoop(router)
        settings = WorkerSettings(heartbeat_interval_s=0.1).stream_settings()

        async def follow(tls):
            channel = aio_channel(target, channel_options(4), tls)
            try:
                await feeds.follow(cpb_grpc.CacheServiceStub(channel), Feed("m"), settings)
            finally:
                await channel.close()

        try:
            plain = feeds.submit(follow(None))
            time.sleep(1.0)  # a plaintext client gets no handshake, so no event
            assert router.index.info("m").last_seq < 0
            feeds.loop.call_soon_threadsafe(plain.cancel)
            feeds.submit(follow(client_tls))
            wait_until(lambda: router.index.info("m") is not None
                       and len(router.index.pages("m", DEVICE)) == 2, what="pages over mTLS")
        finally:
            feeds.close()


def test_an_idle_feed_loop_finishes_a_growths_migration_in_short_steps():
    """Issue 31: a growth right before ingest goes quiet leaves the old table (~0.65x the new
    one's bytes) allocated until more events come. With nothing queued, the applier migrates it
    in steps of at most `migrate_slots` slots, each one hold of the router's lock, and every page
    keeps its holders and stamp."""
    pool = "grown"
    router = _router(pool)
    table, seq = router.index._tables[0], 0
    while table._old is None or table._old.cap - table._cursor < 100_000:
        router.apply_stream_items([(pool, cpb.SubscribeResponse(batch=batch(
            pool, seq, stored(pages(seq * 512, seq * 512 + 512)),
            stored(pages(seq * 512, seq * 512 + 64), medium=HOST))))])
        seq += 1
    before = [pages_and_stamps(t) for t in router.index._tables]
    left = table._old.cap - table._cursor
    feeds = FeedLoop(router, migrate_slots=4096)
    try:
        item = cpb.SubscribeResponse(heartbeat=heartbeat(pool, seq - 1))  # no page event
        feeds.run_sync(feeds.applier.put(Feed(pool), item), 10)
        wait_until(lambda: router.migrate_index(0) is False, timeout_s=30, what="migration done")
    finally:
        feeds.close()
    assert all(t._old is None for t in router.index._tables)
    assert [pages_and_stamps(t) for t in router.index._tables] == before
    assert feeds.applier.idle.steps >= left // 4096
    assert router.index.info(pool).pages[0] == len(table) == seq * 512
