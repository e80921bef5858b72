"""`--feed-process`: the pools' streams read in a process of their own and handed to the gateway's
process as stream frames (gateway/core/stream_frames.py) over a Unix socket.

A prototype of design.md's next step, in the bench, to measure what moving the feeds' gRPC and
decoding out of the gateway's process gives routing before the gateway is built that way. The
feed process subscribes to every pool of the load generator (a grpc.aio channel and a Subscribe
call each, as the gateway's feeds do) and, each time its loop has read what arrived, sends what
it read as frames of at most `frame_items` items, each prefixed by its length. The gateway's side
(`FeedProcessSource`) reads them on its FeedLoop and puts them on its applier (`put_frame`).

Not here, and needed in the gateway: results going back (a RESYNC's resume point, a worker
gone), resubscription after a broken stream, the stall watchdog and health; the bench's
recorded streams never gap.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import struct
import tempfile
from collections.abc import Sequence
from typing import Any

from gateway.core.feeds import Feed, FeedLoop, aio_channel
from gateway.core.stream_frames import decode, encode
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import cache_service_pb2_grpc as cpb_grpc
from prefixcache_bench.gateway_fleet.sources import SETTINGS, GrpcSource
from service_shell import channel_options

LENGTH = struct.Struct("<I")


def serve(address: str, names: Sequence[str], path: str, frame_items: int,
          cpu: int | None) -> None:
    """The feed process (a spawn target): pinned to `cpu` when given."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    asyncio.run(_serve(address, list(names), path, frame_items))


async def _serve(address: str, names: list[str], path: str, frame_items: int) -> None:
    _, writer = await asyncio.open_unix_connection(path)
    read: list[cpb.SubscribeResponse] = []
    arrived = asyncio.Event()

    async def follow(name: str) -> None:
        channel = aio_channel(address, channel_options(SETTINGS.max_message_mb), None)
        call = cpb_grpc.CacheServiceStub(channel).Subscribe(cpb.SubscribeRequest(
            pool_id=name, epoch=0, after_seq=-1,
            heartbeat_interval_s=SETTINGS.heartbeat_interval_s, packed_hashes=True))
        async for item in call:
            read.append(item)
            arrived.set()

    tasks = [asyncio.create_task(follow(name)) for name in names]
    while True:
        await arrived.wait()
        arrived.clear()
        await asyncio.sleep(0)  # every stream with a message waiting reads it first
        items = read[:]
        read.clear()
        for i in range(0, len(items), frame_items):
            frame = encode(items[i:i + frame_items])
            writer.write(LENGTH.pack(len(frame)) + frame)
        await writer.drain()
        if any(t.done() for t in tasks):
            for t in tasks:
                if t.done() and t.exception():
                    raise t.exception()


class FeedProcessSource(GrpcSource):
    """The load generator, read by a feed process (on the load generator's core) that sends the
    gateway's process frames."""

    def __init__(self, generator: Any, frame_items: int, cpu: int | None) -> None:
        super().__init__(generator, packed=True)
        self.frame_items, self.cpu = frame_items, cpu
        self._dir = tempfile.TemporaryDirectory(prefix="feed-process-")
        self._process: multiprocessing.Process | None = None
        self._feeds: dict[str, Feed] = {}

    def start(self, feeds: FeedLoop, names: Sequence[str]) -> None:
        self._feeds = {name: Feed(name) for name in names}
        path = os.path.join(self._dir.name, "frames.sock")
        feeds.run_sync(asyncio.start_unix_server(
            lambda reader, _writer: self._read(feeds, reader), path), 10)
        ctx = multiprocessing.get_context("spawn")
        self._process = ctx.Process(target=serve, daemon=True, args=(
            self.address, list(names), path, self.frame_items, self.cpu))
        self._process.start()

    async def _read(self, feeds: FeedLoop, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                (length,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
                frame = await reader.readexactly(length)
                await feeds.applier.put_frame(self._feeds, decode(frame))
        except (asyncio.CancelledError, asyncio.IncompleteReadError):
            return  # the run is over: the loop closes, or the feed process was killed

    def close(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join(10)
        self._dir.cleanup()
