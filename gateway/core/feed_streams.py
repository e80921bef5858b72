"""One worker's event stream followed: subscribe, resume after a broken stream from the last
batch queued, hand each item to a sink (gateway/core/feeds.py's `BatchApplier` in the gateway's
process, or the feed process's frame sender: feed_process.py).

Kept apart from the applier, which needs the router: the feed process imports this module and
not the router's, so that it starts in ~0.2 s instead of ~0.5 (its start is on a restarted
gateway's way to warm: design.md, "The index at fleet scale")."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from gateway.core.stall_watchdog import StallWatchdog
from gateway.core.stream_items import resume_after
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import cache_service_pb2_grpc as cpb_grpc
from service_shell import TlsConfig, kv
from service_shell.retry import RetryPolicy
from service_shell.service_token import SERVICE_TOKEN_METADATA_KEY

log = logging.getLogger("gateway.feeds")


def aio_channel(target: str, options: list[tuple[str, int | str]],
                tls: TlsConfig | None) -> grpc.aio.Channel:
    """grpc.aio's channel to `target`, TLS from `tls` as `service_shell.open_channel` does it."""
    if tls is None:
        return grpc.aio.insecure_channel(target, options)
    return grpc.aio.secure_channel(target, tls.channel_credentials(),
                                   [*options, *tls.channel_options()])


def token_metadata(service_token: str | None) -> tuple[tuple[str, str], ...]:
    return ((SERVICE_TOKEN_METADATA_KEY, service_token),) if service_token else ()


@dataclass(eq=False, slots=True)
class Feed:
    """One worker's event stream as the applier sees it."""
    name: str
    generation: int = 0  # bumped on a RESYNC: items queued under an older one are dropped
    resync: tuple[int, int] | None = None  # where to resubscribe after a RESYNC result
    ended: bool = False  # the router no longer routes to the worker: the feed ends
    call: Any = None  # the current grpc.aio Subscribe call
    # Since when the feed waits on its stream (None: not waiting): stall_watchdog.py reads it.
    waiting_since: float | None = None
    # (epoch, after_seq) the next Subscribe asks for: after the last batch queued.
    point: tuple[int, int] = (0, -1)
    failures: int = 0  # stream failures since the last item
    stall_timeout_s: float = 10.0
    stalled: bool = False

    def interrupt(self) -> None:
        if self.call is not None:
            self.call.cancel()


class FeedSink(Protocol):
    """Where a feed's items go: the gateway's `BatchApplier`, or a feed process's frame sender
    (feed_process.py)."""

    async def put(self, feed: Feed, item: cpb.SubscribeResponse) -> None: ...

    def set_streaming(self, name: str, streaming: bool) -> None: ...


@dataclass(frozen=True, slots=True)
class StreamSettings:
    heartbeat_interval_s: float
    backoff: RetryPolicy
    metadata: tuple[tuple[str, str], ...] = ()
    # Ask for the packed encoding (SubscribeRequest.packed_hashes; the index takes either).
    packed_hashes: bool = True

    @property
    def stall_timeout_s(self) -> float:
        """A stream that sent nothing, not even a heartbeat, for this long is reopened (a wedged
        server, a half-open connection keepalive missed): five heartbeats, at least 10 s."""
        return max(10.0, 5 * (self.heartbeat_interval_s or 1.0))


async def follow_events(sink: FeedSink, stub: cpb_grpc.CacheServiceStub, feed: Feed,
                        settings: StreamSettings, watchdog: StallWatchdog) -> None:
    """Follows one pool's event stream into `sink` until cancelled, or until the router no
    longer routes to the worker (`feed.ended`)."""
    feed.stall_timeout_s = settings.stall_timeout_s
    watchdog.feeds.add(feed)
    try:
        while not feed.ended:
            feed.resync, feed.stalled = None, False
            feed.call = call = stub.Subscribe(cpb.SubscribeRequest(
                pool_id=feed.name, epoch=feed.point[0], after_seq=feed.point[1],
                heartbeat_interval_s=settings.heartbeat_interval_s,
                packed_hashes=settings.packed_hashes), metadata=settings.metadata)
            why: str | None
            try:
                why = await _read(sink, feed, call)
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling() or not (feed.ended or feed.resync
                                                                or feed.stalled):
                    raise
                why = "stalled" if feed.stalled and not feed.resync else None
            except grpc.aio.AioRpcError as err:
                why = f"{err.code().name}: {err.details()}"
            finally:
                feed.waiting_since = None
                call.cancel()
                sink.set_streaming(feed.name, False)
            if feed.resync is not None:
                feed.point, feed.failures = feed.resync, 0
            elif why is not None and not feed.ended:
                feed.failures += 1
                log.warning(kv("stream_failed", worker=feed.name, reason=why,
                               attempts=feed.failures, resume_epoch=feed.point[0],
                               resume_after_seq=feed.point[1]))
                await asyncio.sleep(settings.backoff.delay(feed.failures))
    finally:
        watchdog.feeds.discard(feed)
        feed.call = None


async def _read(sink: FeedSink, feed: Feed, call: Any) -> str | None:
    """Reads one Subscribe call to its end, moving `feed.point` past each batch; returns why the
    stream ended (None: a RESYNC or the worker's removal asked for it, see `feed`)."""
    first = True
    while True:
        feed.waiting_since = time.monotonic()
        item = await call.read()
        feed.waiting_since = None
        if first and item is not grpc.aio.EOF:
            # The stream is live: the worker is a candidate before its snapshot is applied
            # (`Worker.streaming`), until this call ends (`follow_events`).
            sink.set_streaming(feed.name, True)
            first = False
        if item is grpc.aio.EOF:
            # The cache service ended the stream: the pool was unregistered (its worker
            # restarts, or its cache service did); the next registration starts a new epoch.
            log.info(kv("stream_ended", worker=feed.name, reason="pool unregistered"))
            feed.point = (0, -1)
            return "pool unregistered"
        feed.point, feed.failures = resume_after(item, feed.point), 0
        await sink.put(feed, item)
        if feed.resync is not None or feed.ended:
            return None
