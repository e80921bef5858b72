"""Where the bench's gateway gets its pools' stream items (run.py):

- `GrpcSource` (the default): the load generator's process serves them, and every pool's feed
  reads them through the gateway's real code path (a grpc.aio channel and `follow_events` on the
  FeedLoop, the items decoded by gRPC's deserializer on the loop's thread).
- `DirectSource` (`--no-grpc`): the same recorded items, decoded ahead, put on the FeedLoop's
  `BatchApplier` by one coroutine in the gateway's process, as fast as it takes them; no load
  generator. What is left is the apply path alone (asyncio, the applier's slices, the index):
  what the gateway's process would still run if the feeds' gRPC and decoding moved to a process
  of their own, so a run shows what that move could give routing (issue 31's wake-up latency).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from gateway.core.feeds import Feed, FeedLoop, aio_channel
from gateway.core.workers import WorkerSettings
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import cache_service_pb2_grpc as cpb_grpc
from prefixcache_bench.gateway_fleet import fleet as F
from service_shell import channel_options

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


class DirectSource:
    """Every pool's recorded items, decoded now; put on the applier by `start` (snapshots) and
    `go` (the live batches, pool by pool for each seq, as the feeds interleave them)."""
    address, pid = "bench", None

    def __init__(self, pools: int, pages_per_pool: int, live_batches: int, packed: bool = True):
        streams = [[cpb.SubscribeResponse.FromString(b)
                    for b in F.recorded_stream(i, pages_per_pool, live_batches, packed)]
                   for i in range(pools)]
        self.snapshots = [item for s in streams for item in s[:len(s) - live_batches]]
        self.live = [s[len(s) - live_batches + k] for k in range(live_batches) for s in streams]
        self._feeds: dict[str, Feed] = {}

    def start(self, feeds: FeedLoop, names: Sequence[str]) -> None:
        self._feeds = {name: Feed(name) for name in names}
        feeds.submit(self._put(feeds, self.snapshots))

    def go(self, feeds: FeedLoop) -> None:
        feeds.submit(self._put(feeds, self.live))

    def last_sent(self) -> float:
        return 0.0  # no sender to time

    async def _put(self, feeds: FeedLoop, items: list[cpb.SubscribeResponse]) -> None:
        for item in items:
            await feeds.applier.put(self._feeds[item.batch.pool_id], item)
