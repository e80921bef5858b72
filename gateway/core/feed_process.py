"""The workers' event streams read in a process of their own (`--feed-process`, design.md "The
index at fleet scale").

At a thousand workers the gateway's process spends most of its feed loop's turns in gRPC: the
completions and callbacks of a thousand streams and the decoding of their messages, all under the
GIL that routing decisions need. With this on, a child process runs every worker's
`follow_events` (subscribe, resume from the last batch after a broken stream, the stall watchdog)
and sends the gateway's process what it read as stream frames (stream_frames.py), at most
`FRAME_ITEMS` items each; the gateway's FeedLoop decodes them with a few numpy calls and queues
them on its applier (`BatchApplier.put_frame`), which applies them as it applies its own feeds.

    gateway process (FeedLoop)                      feed process (asyncio, grpc.aio)
    FeedProcess.follow(worker) --("follow", ...)--> follow_events(worker's cache service)
    applier: RESYNC -----------("resync", point)--> resubscribes from that point,
                 <---------------("resynced")------ after the last item of the old call
    put_frame(frame) <----------- frame ----------- every item read, in order
    Router.set_streaming <------("streaming")------ a call delivers / ended
    worker removed -------------("stop")----------> its stream ends

Both directions are one ordered Unix socket, so an item the gateway's process applies is always
one the feed process sent after every control message before it: items of a feed between a
RESYNC and its "resynced" belong to the old call and are dropped (`RemoteFeed.fenced`).

If the feed process dies, the gateway's process starts another and every feed resumes from its
index point (`Router.resume_point`); what it had queued is dropped (`Feed.generation`), so the
new streams' replays apply once. The feed process exits when the gateway's side of its socket
closes.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gateway.core.feed_streams import Feed, StreamSettings, aio_channel, follow_events
from gateway.core.stall_watchdog import StallWatchdog
from gateway.core.stream_frames import FrameError, decode, encode
from gateway.core.stream_items import item_parts
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import cache_service_pb2_grpc as cpb_grpc
from service_shell import TlsConfig, channel_options, kv
from service_shell.retry import WORKER_RETRY

if TYPE_CHECKING:  # the feed process imports this module, not the router's (feed_streams.py)
    from gateway.core.feeds import BatchApplier

log = logging.getLogger("gateway.feed_process")

# Items a frame holds at most: a frame is queued on the applier at once.
FRAME_ITEMS = 64
# A snapshot batch is sent in parts of at most this many page events: a frame's snapshot batches
# are applied whole (BatchApplier.put_frame), and the applier's slices hold ~1-4k page events.
SNAPSHOT_PART_EVENTS = 4096
# Frame items the gateway's applier queues before it stops reading the socket (the feed process
# and the socket's buffers hold the rest; the in-process feeds' bound is 4,096). ~16 ms of ingest
# at a million page events a second, enough to fill its slices; every queued item is objects the
# garbage collector walks, inside whichever routing decision triggers it. Measured at 1,000 pools
# (scratch pairs, stop 44): decisions' p99 from the due time ~1.0 ms at 128-512 against 1.6-1.7
# ms at 4,096, ingest alike.
MAX_QUEUED_ITEMS = 256
# Follows read before the loop lets the streams they opened start. A restart's follows come all
# at once (1,000), and read back to back every channel opened before any stream ran: the first
# frame 0.6 s after connecting, the gateway's core idle meanwhile. A turn after each one brought
# the first page ~0.45 s sooner but not the warm-up's end (opening channels then interleaved
# with framing the first streams); after every 32, both (fleet_sized/follow_yield/).
FOLLOWS_A_TURN = 32
# How long the gateway's process waits for a new feed process to connect, and how often it
# looks meanwhile whether the process exited.
CONNECT_TIMEOUT_S, CONNECT_POLL_S = 60.0, 0.1
_HEAD = struct.Struct("<cI")  # a message: its kind, its length
FRAME, CONTROL = b"F", b"C"


async def read_message(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    kind, length = _HEAD.unpack(await reader.readexactly(_HEAD.size))
    return kind, await reader.readexactly(length)


def write_message(writer: asyncio.StreamWriter, kind: bytes, payload: bytes) -> None:
    writer.write(_HEAD.pack(kind, len(payload)) + payload)


@dataclass(frozen=True, slots=True)
class StreamTarget:
    """What the feed process needs to follow a worker's cache service."""
    address: str
    settings: StreamSettings
    tls: TlsConfig | None = None
    max_message_mb: int = 64


@dataclass(eq=False, slots=True)
class RemoteFeed(Feed):
    """A worker's feed whose stream the feed process reads: `interrupt()` (a RESYNC, the worker
    gone) becomes a message to it."""
    target: StreamTarget | None = None
    process: FeedProcess | None = None
    fenced: bool = False  # a RESYNC was sent and not yet answered: its items are the old call's
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def interrupt(self) -> None:
        if self.process is None:
            return
        if self.ended:
            self.process.send(("stop", self.name))
            self.done.set()
        elif self.resync is not None and not self.fenced:
            self.fenced = True
            self.process.send(("resync", self.name, self.resync))


class FeedProcess:
    """The gateway's side, on its FeedLoop: `run()` keeps a feed process running, `follow()`
    hands it a worker's stream."""

    def __init__(self, applier: BatchApplier, resume_point: Callable[[str], tuple[int, int]],
                 frame_items: int = FRAME_ITEMS, cpu: int | None = None) -> None:
        self.applier, self.resume_point = applier, resume_point
        applier.max_pending = MAX_QUEUED_ITEMS
        self.frame_items, self.cpu = frame_items, cpu
        self.feeds: dict[str, RemoteFeed] = {}
        self.restarts = 0
        self.pid: int | None = None  # the feed process's
        self._writer: asyncio.StreamWriter | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="gateway-feeds-")

    async def follow(self, target: StreamTarget, feed: RemoteFeed) -> None:
        """Until the worker leaves (cancelled) or the router stops routing to it (`ended`)."""
        feed.target, feed.process = target, self
        self.feeds[feed.name] = feed
        self.send(("follow", feed.name, target, feed.point))
        try:
            await feed.done.wait()
        finally:
            if self.feeds.get(feed.name) is feed:
                del self.feeds[feed.name]
                if not feed.ended:
                    self.send(("stop", feed.name))
                self.applier.set_streaming(feed.name, False)

    def send(self, message: tuple) -> None:
        """To the feed process; dropped while none runs (`run` re-sends every feed's follow)."""
        if self._writer is not None and not self._writer.is_closing():
            write_message(self._writer, CONTROL, pickle.dumps(message))

    async def run(self) -> None:
        """Starts the feed process, and another when it dies."""
        path = os.path.join(self._dir.name, "feeds.sock")
        connected: asyncio.Queue = asyncio.Queue()
        server = await asyncio.start_unix_server(
            lambda r, w: connected.put_nowait((r, w)), path)
        failures = 0
        try:
            while True:
                process = start_process(path, self.frame_items, self.cpu)
                self.pid = process.pid
                try:
                    reader, self._writer = await _connection(connected, process)
                    self._resume_all()
                    failures = 0
                    await self._read(reader)
                except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError,
                        FrameError) as err:
                    log.warning(kv("feed_process_lost", reason=type(err).__name__,
                                   error=str(err)))
                finally:
                    if self._writer is not None:
                        self._writer.close()
                    self._writer = None
                    await asyncio.get_running_loop().run_in_executor(None, _end, process)
                for feed in self.feeds.values():
                    self.applier.set_streaming(feed.name, False)
                failures += 1
                self.restarts += 1
                self.applier.router.metrics.feed_process_restarts.inc()
                log.warning(kv("feed_process_exited", exitcode=process.returncode,
                               feeds=len(self.feeds), attempts=failures))
                await asyncio.sleep(WORKER_RETRY.delay(failures))
        finally:
            server.close()
            self._dir.cleanup()

    def _resume_all(self) -> None:
        """A new feed process: every feed from where the index is (what was queued for the old
        one is dropped, so nothing applies twice)."""
        for feed in self.feeds.values():
            if self.restarts:
                feed.generation += 1
                feed.point, feed.resync, feed.fenced = self.resume_point(feed.name), None, False
            self.send(("follow", feed.name, feed.target, feed.point))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while True:
            kind, payload = await read_message(reader)
            if kind == FRAME:
                items = [i for i in decode(payload)
                         if (f := self.feeds.get(i.pool_id)) is not None and not f.fenced]
                if items:
                    await self.applier.put_frame(self.feeds, items)
                continue
            message = pickle.loads(payload)
            feed = self.feeds.get(message[1])
            if feed is None:
                continue
            if message[0] == "streaming":
                self.applier.set_streaming(feed.name, message[2])
            elif message[0] == "resynced":
                feed.fenced, feed.resync = False, None


def start_process(path: str, frame_items: int, cpu: int | None) -> subprocess.Popen:
    """A plain interpreter running `serve`: it imports only the feeds' modules (a multiprocessing
    spawn would import the gateway's main module again first), with the parent's import path.
    Its core is set from here at once, so that even its imports run there and not on the core of
    the thread that starts it (the FeedLoop's, niced under routing decisions: a spawned child
    took 2.8 and 4.2 s to reach `serve` at 1,000 pools, stop 45)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    process = subprocess.Popen([sys.executable, "-c", _MAIN, path, str(frame_items)], env=env)
    if cpu is not None:
        with contextlib.suppress(OSError):  # it exited already: the gateway's side sees that
            os.sched_setaffinity(process.pid, {cpu})
    return process


_MAIN = ("import sys; from gateway.core.feed_process import serve; "
         "serve(sys.argv[1], int(sys.argv[2]))")


async def _connection(connected: asyncio.Queue, process: subprocess.Popen
                      ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """The new feed process's connection; ConnectionError as soon as it exits without one (one
    that cannot start, its imports failing: retried after the backoff, not after the timeout)."""
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while process.poll() is None:
        try:
            return await asyncio.wait_for(connected.get(), CONNECT_POLL_S)
        except asyncio.TimeoutError:
            if time.monotonic() > deadline:
                raise
    raise ConnectionError(f"the feed process exited ({process.returncode}) before it connected")


def _end(process: subprocess.Popen) -> None:
    process.kill()
    process.wait(10)


# ----- the feed process -------------------------------------------------------------------------


def serve(path: str, frame_items: int) -> None:
    """The feed process (`start_process`)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        asyncio.run(_serve(path, frame_items))
    except (OSError, asyncio.IncompleteReadError):
        pass  # the gateway's process is gone (its socket closed, or removed before we connected)


class FrameSender:
    """The feed process's sink: what its feeds read, as frames, in order with its messages."""

    def __init__(self, writer: asyncio.StreamWriter, frame_items: int) -> None:
        self.writer, self.frame_items = writer, frame_items
        self.items: list[cpb.SubscribeResponse] = []
        self.arrived = asyncio.Event()

    async def put(self, feed: Feed, item: cpb.SubscribeResponse) -> None:
        self.items.extend(item_parts(item, SNAPSHOT_PART_EVENTS))
        self.arrived.set()
        if len(self.items) >= self.frame_items:
            self.flush()
            await self.writer.drain()  # the gateway's process is behind: gRPC's flow control

    def set_streaming(self, name: str, streaming: bool) -> None:
        self.control(("streaming", name, streaming))

    def control(self, message: tuple) -> None:
        self.flush()  # after every item read before it
        write_message(self.writer, CONTROL, pickle.dumps(message))

    def flush(self) -> None:
        items, self.items = self.items, []
        for i in range(0, len(items), self.frame_items):
            write_message(self.writer, FRAME, encode(items[i:i + self.frame_items]))

    async def run(self) -> None:
        """Each turn of the loop, what the feeds read in it goes out (every stream with a
        message waiting reads it first)."""
        while True:
            await self.arrived.wait()
            self.arrived.clear()
            await asyncio.sleep(0)
            self.flush()
            await self.writer.drain()


@dataclass(slots=True)
class _Following:
    feed: Feed
    task: asyncio.Task


async def _serve(path: str, frame_items: int) -> None:
    reader, writer = await asyncio.open_unix_connection(path)
    sender, watchdog = FrameSender(writer, frame_items), StallWatchdog()
    background = [asyncio.create_task(sender.run()), asyncio.create_task(watchdog.run())]
    following: dict[str, _Following] = {}

    async def follow(feed: Feed, target: StreamTarget, channel: Any) -> None:
        try:
            await follow_events(sender, cpb_grpc.CacheServiceStub(channel), feed,
                                target.settings, watchdog)
        finally:
            await channel.close()

    try:
        while True:
            _, payload = await read_message(reader)
            message = pickle.loads(payload)
            if message[0] == "follow":
                _, name, target, point = message
                if (old := following.pop(name, None)) is not None:
                    old.task.cancel()
                channel = aio_channel(target.address, channel_options(target.max_message_mb),
                                      target.tls)
                feed = Feed(name, point=point)
                following[name] = _Following(feed, asyncio.create_task(
                    follow(feed, target, channel)))
                if len(following) % FOLLOWS_A_TURN == 0:
                    await asyncio.sleep(0)  # the streams opened so far send their Subscribe
            elif message[0] == "resync" and (f := following.get(message[1])) is not None:
                f.feed.resync = message[2]
                f.feed.interrupt()
                sender.control(("resynced", f.feed.name))
            elif message[0] == "stop" and (f := following.pop(message[1], None)) is not None:
                f.feed.ended = True
                f.task.cancel()
    finally:
        for task in [*background, *(f.task for f in following.values())]:
            task.cancel()
