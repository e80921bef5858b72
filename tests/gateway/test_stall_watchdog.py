"""The feeds' stall watchdog (gateway/core/stall_watchdog.py): a stream silent past its stall
timeout is reopened and resumes from its last batch; time in which the feed loop itself did not
run is not counted as the streams' silence. The cache side is the real CacheCore.subscribe behind
a servicer that can hold a stream open and silent."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from cache_service.core import CacheCore
from gateway.core.feed_streams import Feed, StreamSettings, aio_channel
from gateway.core.feeds import FeedLoop
from gateway.core.metrics import GatewayMetrics
from gateway.core.policies import make_policy
from gateway.core.router import Router, Worker
from gateway.core.stall_watchdog import StallWatchdog
from gateway.core.workers import WorkerSettings
from prefixcache.v1 import cache_service_pb2_grpc as cpb_grpc
from prefixcache.v1 import compute_service_pb2 as pb
from service_shell import channel_options, new_server
from tests.gateway.gateway_harness import cache_prompt, register_pool, wait_until
from tests.gateway.helpers import DEVICE

STALL_S = 0.6  # the feeds' stall timeout here (the gateway's is at least 10 s)


class QuickStall(StreamSettings):
    stall_timeout_s = STALL_S  # shadows the property: a test need not wait 10 s


class MutableCache(cpb_grpc.CacheServiceServicer):
    """Serves CacheCore.subscribe; while `mute` is set, a stream sends nothing more after its
    snapshot (not even heartbeats) but stays open: a wedged server."""

    def __init__(self, core: CacheCore):
        self.core, self.requests, self.mute = core, [], threading.Event()
        self.server = new_server(8, "mutable-cache", [])
        cpb_grpc.add_CacheServiceServicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def Subscribe(self, request, context):
        self.requests.append((request.epoch, request.after_seq))
        for item in self.core.subscribe(request, context.is_active):
            if self.mute.is_set() and item.WhichOneof("item") == "heartbeat":
                while context.is_active():
                    time.sleep(0.02)
                return
            yield item


def _following(cache: MutableCache, pool: str, heartbeat_s: float) -> tuple[Router, FeedLoop]:
    router = Router(make_policy("affinity"), GatewayMetrics())
    router.add(Worker(pool, "w", cache.address, None, pb.GetModelInfoResponse(worker=pool)))
    feeds = FeedLoop(router)
    base = WorkerSettings(heartbeat_interval_s=heartbeat_s).stream_settings()
    settings = QuickStall(base.heartbeat_interval_s, base.backoff, base.metadata)

    async def follow():
        channel = aio_channel(cache.address, channel_options(4), None)
        try:
            await feeds.follow(cpb_grpc.CacheServiceStub(channel), Feed(pool), settings)
        finally:
            await channel.close()

    feeds.submit(follow())
    return router, feeds


def test_a_silent_stream_is_reopened_and_resumes_from_its_last_batch():
    core = CacheCore()
    register_pool(core, "s")
    cache_prompt(core, "s", list(range(9)))
    cache = MutableCache(core)
    cache.mute.set()
    router, feeds = _following(cache, "s", heartbeat_s=0.05)
    try:
        wait_until(lambda: len(cache.requests) >= 2, timeout_s=10, what="the silent stream reopened")
        cache.mute.clear()
        # Resumed after the snapshot's seq (the pool's head then), not from a new snapshot.
        assert cache.requests[:2] == [(0, -1), (1, router.index.info("s").last_seq)]
        assert cache.requests[1][1] >= 0
        assert len(router.index.pages("s", DEVICE)) == 2
        cache_prompt(core, "s", list(range(100, 109)))  # live again on the reopened stream
        wait_until(lambda: len(router.index.pages("s", DEVICE)) == 4, what="live pages indexed")
    finally:
        feeds.close()
        cache.server.stop(0)


def test_a_starved_feed_loop_does_not_read_as_stalled_streams():
    """The loop blocked for three stall timeouts (its thread starved, the GIL held) while the
    stream heartbeats: no stream is reopened."""
    core = CacheCore()
    register_pool(core, "h")
    cache = MutableCache(core)
    router, feeds = _following(cache, "h", heartbeat_s=0.05)
    try:
        wait_until(lambda: router.index.info("h").last_seq == 0, what="snapshot applied")
        feeds.loop.call_soon_threadsafe(time.sleep, 3 * STALL_S)
        time.sleep(3 * STALL_S + 2 * feeds.watchdog.period_s)
        assert cache.requests == [(0, -1)]
    finally:
        feeds.close()
        cache.server.stop(0)


@dataclass(eq=False)
class _Waiting:
    name: str = "w"
    waiting_since: float | None = 0.0
    stall_timeout_s: float = 10.0
    stalled: bool = False

    def interrupt(self) -> None:
        self.stalled = True


def test_a_tick_forgives_the_time_the_loop_did_not_run():
    dog = StallWatchdog(period_s=1.0)
    late, on_time, idle = _Waiting(), _Waiting(), _Waiting(waiting_since=None)
    dog.feeds |= {late, on_time, idle}
    dog.check(now=12.0, late_s=0.0)  # 12 s of silence with the loop running: a stall
    assert on_time.stalled and late.stalled and not idle.stalled
    late.stalled, late.waiting_since = False, 0.0
    dog.check(now=12.0, late_s=11.0)  # the loop ran once in 12 s: 1 s of silence counted
    assert not late.stalled and late.waiting_since == 11.0
    dog.check(now=21.5, late_s=0.0)  # then 10.5 s with the loop running: a stall
    assert late.stalled
    slow = _Waiting()  # a loop that runs, but each tick half a period late (starved in part)
    dog.feeds = {slow}
    for tick in range(1, 9):
        dog.check(now=1.5 * tick, late_s=0.5)
    assert not slow.stalled and slow.waiting_since == 8 * 0.5  # 8 s counted of 12
    dog.check(now=12.0 + 7.0, late_s=0.05)  # within the timer's slack: counted
    assert slow.stalled
