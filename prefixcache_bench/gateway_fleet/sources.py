"""Where the bench's gateway gets its pools' stream items (run.py):

- `GrpcSource` (the default): the load generator's process serves them, and every pool's feed
  reads them through the gateway's real code path (a grpc.aio channel and `follow_events` on the
  FeedLoop, the items decoded by gRPC's deserializer on the loop's thread).
- `DirectSource` (`--no-grpc`): the same recorded items, decoded ahead, put on the FeedLoop's
  `BatchApplier` by one coroutine in the gateway's process, as fast as it takes them; no load
  generator. What is left is the apply path alone (asyncio, the applier's slices, the index):
  what the gateway's process would still run if the feeds' gRPC and decoding moved to a process
  of their own, so a run shows what that move could give routing (issue 31's wake-up latency).
- `FrameSource` (`--no-grpc --frame-items N`): the live items as stream frames of N items
  (gateway/core/stream_frames.py), encoded ahead and decoded on the loop as they are put: what
  the gateway's process runs when a feed process of its own sends it frames.
- `FeedProcessSource` (`--feed-process`): the load generator read by the gateway's feed process
  (gateway/core/feed_process.py, the gateway's `--feed-process`), pinned to the load
  generator's core.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from gateway.core.feed_process import FeedProcess, RemoteFeed, StreamTarget
from gateway.core.feed_streams import Feed, aio_channel
from gateway.core.feeds import FeedLoop
from gateway.core.stream_frames import decode, encode
from gateway.core.workers import WorkerSettings
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import cache_service_pb2_grpc as cpb_grpc
from prefixcache_bench.gateway_fleet import fleet as F
from service_shell import channel_options

# A paced source sleeps once it is this far ahead of its rate (asyncio's timers: ~1 ms).
PACE_S = 0.001
# The bench's stream settings: heartbeats every second, long calls.
SETTINGS = WorkerSettings(heartbeat_interval_s=1.0, rpc_timeout_s=60.0)


async def follow(feeds: FeedLoop, address: str, name: str, settings: WorkerSettings,
                 packed: bool, point: tuple[int, int] | None = None) -> None:
    """What WorkerHandle does for a pool's events: its own grpc.aio channel, one feed (from
    `point` when given, else from a snapshot)."""
    channel = aio_channel(address, channel_options(settings.max_message_mb), None)
    feed = Feed(name) if point is None else Feed(name, point=point)
    try:
        await feeds.follow(cpb_grpc.CacheServiceStub(channel), feed,
                           replace(settings.stream_settings(), packed_hashes=packed))
    finally:
        await channel.close()


class GrpcSource:
    """The load generator (run.LoadGenerator) and a feed per pool reading it."""

    def __init__(self, generator: Any, packed: bool = True) -> None:
        self.generator, self.packed = generator, packed
        self.address, self.pid = generator.address, generator.pid

    def start(self, feeds: FeedLoop, names: Sequence[str]) -> None:
        """Every pool's feed subscribes: its snapshot comes, its live part waits for `go`."""
        for name in names:
            feeds.submit(follow(feeds, self.address, name, SETTINGS, self.packed))

    def go(self, feeds: FeedLoop) -> None:
        self.generator.go.set()

    def last_sent(self) -> float:
        return self.generator.last_sent.value


class FeedProcessSource(GrpcSource):
    """The load generator, each pool's stream read by the gateway's feed process."""

    def __init__(self, generator: Any, frame_items: int, cpu: int | None) -> None:
        super().__init__(generator, packed=True)
        self.frame_items, self.cpu = frame_items, cpu

    def start(self, feeds: FeedLoop, names: Sequence[str]) -> None:
        remote = FeedProcess(feeds.applier, feeds.applier.router.resume_point, self.frame_items,
                             self.cpu)
        feeds.submit(remote.run())  # ended, with the process, by the FeedLoop's close
        target = StreamTarget(self.address, replace(SETTINGS.stream_settings(), packed_hashes=True),
                              max_message_mb=SETTINGS.max_message_mb)
        for name in names:
            feeds.submit(remote.follow(target, RemoteFeed(name)))


class DirectSource:
    """Every pool's recorded items, decoded now; put on the applier by `start` (snapshots) and
    `go` (the live batches, pool by pool for each seq, as the feeds interleave them)."""
    address, pid = "bench", None

    def __init__(self, pools: int, pages_per_pool: int, live_batches: int, packed: bool = True,
                 live_rate: float | None = None):
        streams = [[cpb.SubscribeResponse.FromString(b)
                    for b in F.recorded_stream(i, pages_per_pool, live_batches, packed)]
                   for i in range(pools)]
        self.snapshots = [item for s in streams for item in s[:len(s) - live_batches]]
        self.live = [s[len(s) - live_batches + k] for k in range(live_batches) for s in streams]
        self.live_rate = live_rate
        self._feeds: dict[str, Feed] = {}

    def start(self, feeds: FeedLoop, names: Sequence[str]) -> None:
        self._feeds = {name: Feed(name) for name in names}
        feeds.submit(self._put(feeds, self.snapshots, None))

    def go(self, feeds: FeedLoop) -> None:
        feeds.submit(self._put(feeds, self.live, self.live_rate))

    def last_sent(self) -> float:
        return 0.0  # no sender to time

    async def _put(self, feeds: FeedLoop, items: list[cpb.SubscribeResponse],
                   rate: float | None) -> None:
        pace = Pace(rate)
        for item in items:
            await feeds.applier.put(self._feeds[item.batch.pool_id], item)
            await pace.put(2 * F.LIVE_PAGES)


class Pace:
    """Holds a source to `rate` page events a second (`--live-rate`; None: as fast as the
    applier takes them), so that runs of two item forms compare at one ingest rate."""

    def __init__(self, rate: float | None) -> None:
        if rate is not None and rate <= 0:
            raise ValueError("a live rate is a positive count of page events a second")
        self.rate, self.events, self.began = rate, 0, 0.0

    async def put(self, events: int) -> None:
        if self.rate is None:
            return
        now = time.perf_counter()
        if not self.events:
            self.began = now
        self.events += events
        ahead = self.events / self.rate - (now - self.began)
        if ahead > PACE_S:
            await asyncio.sleep(ahead)


class FrameSource(DirectSource):
    """DirectSource whose live items come as frames of `frame_items` items, decoded as put (the
    snapshots as DirectSource's: the warm-up is not what frames are measured for)."""

    def __init__(self, pools: int, pages_per_pool: int, live_batches: int, packed: bool = True,
                 live_rate: float | None = None, frame_items: int = 64) -> None:
        super().__init__(pools, pages_per_pool, live_batches, packed, live_rate)
        self.frame_items = frame_items
        self.frames = [encode(self.live[i:i + frame_items])
                       for i in range(0, len(self.live), frame_items)]
        self.live = []

    def go(self, feeds: FeedLoop) -> None:
        feeds.submit(self._put_frames(feeds))

    async def _put_frames(self, feeds: FeedLoop) -> None:
        pace = Pace(self.live_rate)
        for frame in self.frames:
            items = decode(frame)
            await feeds.applier.put_frame(self._feeds, items)
            await pace.put(sum(item.events for item in items))
