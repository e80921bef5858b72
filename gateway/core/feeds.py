"""Every worker's gRPC streams on one asyncio loop, and their events applied in bulk (design.md §6).

`FeedLoop` is one thread running an asyncio loop (grpc.aio) for all workers' event feeds and
health checks, plus a small fixed pool for the calls that only exist blocking (GetModelInfo on the
sync `ComputeClient` the proxy also uses, the tokenizer fetch): the gateway's thread count does
not grow with its workers (at 1,000 workers the former model ran 3-4 threads per worker).

Ingest off the routing path: a feed (`follow_events`, feed_streams.py) decodes its stream's items on
the loop and queues them; `BatchApplier` takes everything queued (the items of every feed) and
applies it to the router in slices, each one hold of `Router.lock` that a waiting routing decision
may enter (decisions_first.py), sized from a target hold time and the cost measured on the last
slices (ingest_slices.py: `--ingest-slice-ms`). A snapshot batch bigger than a slice is cut into
snapshot batches (same seq, `snapshot_end` on the last only; the index applies them as one); a live
batch is applied whole (its seq is its identity). Idle, it finishes a growth's migration.
Items may also come as stream frames (`put_frame`; stream_frames.py), which the gateway's feed
process sends when the streams are read there (`--feed-process`, feed_process.py); a frame's
snapshot batches are applied whole.

While a feed's Subscribe call delivers (its first item read, the call not ended), its worker is
`streaming` (`Router.set_streaming`): a routing candidate during its warm-up, before its
snapshot is applied; a call that fails, stalls or is resubscribed ends that.

A feed resumes after a broken stream from the last batch it queued (every queued item is applied
before the resubscription's), so the cache service replays its buffer and falls back to a
snapshot only when the buffer no longer holds that point; a RESYNC result (a gap, a new epoch)
drops what the feed still had queued and resubscribes from where the index says.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from gateway.core.decisions_first import PULSE_S, DecisionsFirst
from gateway.core.feed_streams import Feed, StreamSettings, follow_events
from gateway.core.index import ApplyStatus
from gateway.core.ingest_slices import (IDLE_SPARE_DROP_S, IDLE_SPARE_SLOTS, SLICE_S,
                                        IdleMigration, SliceSize)
from gateway.core.router import Router, log_resync
from gateway.core.stall_watchdog import StallWatchdog
from gateway.core.stream_frames import FrameItem, StreamItem
from gateway.core.stream_items import item_parts, page_events
from gateway.core.thread_priority import lower_thread_priority
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import cache_service_pb2_grpc as cpb_grpc

T = TypeVar("T")

# Items queued and not yet applied before the feeds stop reading (gRPC's flow control then
# holds the cache services back).
MAX_PENDING_ITEMS = 4096
# Turns of the loop the applier lets the feeds read on before a slice (BatchApplier._fill).
FILL_TURNS = 8
# Threads for the blocking calls (identify, tokenizer fetch): fixed, whatever the workers.
BLOCKING_THREADS = 4


class FeedLoop:
    """The loop thread and the blocking pool; `close()` ends both (from any other thread)."""

    def __init__(self, router: Router, slice_s: float = SLICE_S, slice_events: int | None = None,
                 blocking_threads: int = BLOCKING_THREADS, migrate_slots: int | None = None) -> None:
        """`slice_s`: the time one ingest slice (or idle migration step) may hold the router's
        lock; `slice_events` / `migrate_slots`: a fixed size instead (ingest_slices.py)."""
        self.loop, self._decisions = asyncio.new_event_loop(), router.decisions
        self._blocking = concurrent.futures.ThreadPoolExecutor(
            blocking_threads, thread_name_prefix="gateway-blocking")
        self._thread = threading.Thread(target=self._run, name="gateway-feeds", daemon=True)
        self._thread.start()
        slices, idle = SliceSize(slice_s, slice_events), IdleMigration(slice_s, migrate_slots)
        self.applier: BatchApplier = self.run_sync(_make_applier(router, slices, idle), 10.0)
        self.watchdog = StallWatchdog()
        self.submit(self.applier.run())
        self.submit(self.applier.drop_spares_when_idle())
        self.submit(self.watchdog.run())
        self.submit(_pulse(router.decisions))

    def _run(self) -> None:
        lower_thread_priority()
        # The floor under ingest (decisions_first.py) from the loop's first moment: a lowered
        # thread waiting for its first turn behind busy decisions would wait with the floor off
        # (0.2-3 s at 1,000 pools, niced, in the fleet bench; for ever at SCHED_IDLE).
        self._decisions.pulsed()
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Runs `coro` on the loop (from any thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run_sync(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        return self.submit(coro).result(timeout_s)

    async def blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the blocking pool, awaited on the loop."""
        return await self.loop.run_in_executor(self._blocking, fn, *args)

    async def follow(self, stub: cpb_grpc.CacheServiceStub, feed: Feed,
                     settings: StreamSettings) -> None:
        """One pool's event stream into the router, until cancelled (`follow_events`)."""
        await follow_events(self.applier, stub, feed, settings, self.watchdog)

    def close(self, timeout_s: float = 5.0) -> None:
        if not self.loop.is_running():
            return
        try:
            self.run_sync(_cancel_all(), timeout_s)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
        self._blocking.shutdown(wait=False, cancel_futures=True)


async def _pulse(decisions: DecisionsFirst) -> None:
    """The loop's pulse, which the floor under ingest reads (decisions_first.py)."""
    try:
        while True:
            decisions.pulsed()
            await asyncio.sleep(PULSE_S)
    finally:
        decisions.pulsed(running=False)


async def _make_applier(router: Router, size: SliceSize, idle: IdleMigration) -> BatchApplier:
    return BatchApplier(router, size, idle)  # its asyncio events belong to the loop


async def _cancel_all() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class BatchApplier:
    """The queue of decoded stream items of every feed, applied in bounded slices."""

    def __init__(self, router: Router, size: SliceSize, idle: IdleMigration) -> None:
        self.router, self.size, self.idle = router, size, idle
        # (feed, its generation then, item, the item's page events)
        self._pending: deque[tuple[Feed, int, StreamItem, int]] = deque()
        self._queued_events = 0
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        # Items queued before `put` / `put_frame` wait (a feed process lowers it: feed_process.py).
        self.max_pending = MAX_PENDING_ITEMS
        self.applied_items = 0
        self.slices = 0
        self.idle_drop_s = IDLE_SPARE_DROP_S
        self._applied_at, self._spares_dropped = time.monotonic(), False

    def set_streaming(self, name: str, streaming: bool) -> None:
        """A feed's Subscribe call delivers (True) or ended (`Router.set_streaming`)."""
        self.router.set_streaming(name, streaming)

    async def put(self, feed: Feed, item: cpb.SubscribeResponse) -> None:
        for part in item_parts(item, self.size.events):
            self._queue(feed, part, page_events(part))
        await self._queued()

    async def put_frame(self, feeds: Mapping[str, Feed], items: Sequence[FrameItem]) -> None:
        """A stream frame's items (stream_frames.py), each to its pool's feed; a snapshot batch
        is applied whole (the frame's sender sizes them)."""
        for item in items:
            self._queue(feeds[item.pool_id], item, item.events)
        await self._queued()

    async def _queued(self) -> None:
        self._wake.set()
        if len(self._pending) >= self.max_pending:
            self._room.clear()
            await self._room.wait()

    def _queue(self, feed: Feed, item: StreamItem, events: int) -> None:
        self._pending.append((feed, feed.generation, item, events))
        self._queued_events += events

    async def _fill(self) -> None:
        """A feed reads one message a turn of the loop: with few feeds, one turn queues less than
        a slice. Lets them read on while each turn brings more, up to a slice's page events."""
        for _ in range(FILL_TURNS):
            queued = len(self._pending)
            if self._queued_events >= self.size.events:
                return
            await asyncio.sleep(0)
            if len(self._pending) == queued:
                return

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                await self._fill()
                self._apply_slice(self._take_slice())
                self.router.prepare_index_growth()  # paced by the room the slice used
                if self.router.index_sweep_due():  # ingest that never idles sweeps too
                    self.idle.step(self.router.migrate_index)
                self.router.yield_to_routing()
                if len(self._pending) < self.max_pending // 2:
                    self._room.set()
                await asyncio.sleep(0)  # let the feeds read what arrived meanwhile
            self._room.set()
            while not self._pending and (self.idle.step(self.router.migrate_index)
                                         or self.router.prepare_index_growth(IDLE_SPARE_SLOTS)):
                self.router.yield_to_routing()
                await asyncio.sleep(0)  # the feeds read on: an item queued ends the migration

    async def drop_spares_when_idle(self) -> None:
        """Frees the index's next growths' arrays once nothing was applied for `idle_drop_s`:
        no growth to be ready for (table_arrays.Spare). A check a quarter of that apart, so that
        the slices pay nothing for it but a clock read."""
        while True:
            await asyncio.sleep(self.idle_drop_s / 4)
            idle_s = time.monotonic() - self._applied_at
            if not self._pending and not self._spares_dropped and idle_s >= self.idle_drop_s:
                self.router.drop_index_spares()
                self._spares_dropped = True

    def _take_slice(self) -> tuple[list[tuple[Feed, StreamItem]], int]:
        """The next items, up to the slice's page events; and their page events."""
        out, budget = [], self.size.events
        events = 0
        while self._pending and events < budget:
            feed, generation, item, n = self._pending.popleft()
            self._queued_events -= n
            if feed.ended or generation != feed.generation:
                continue
            out.append((feed, item))
            events += n
        return out, events

    def _apply_slice(self, taken: tuple[list[tuple[Feed, StreamItem]], int]) -> None:
        items, events = taken
        if not items:
            return
        start, preemptible = time.perf_counter(), self.router.preemptible_seconds()
        self._applied_at, self._spares_dropped = time.monotonic(), False
        results = self.router.apply_stream_items([(f.name, item) for f, item in items])
        self.size.measured(events, time.perf_counter() - start  # less what decisions interrupt
                           - (self.router.preemptible_seconds() - preemptible))
        self.applied_items += len(items)
        self.slices += 1
        for (feed, _), result in zip(items, results):
            if feed.ended or feed.resync is not None:
                continue
            if result is None:
                feed.ended = True
                feed.interrupt()
            elif result.status is ApplyStatus.RESYNC:
                log_resync(feed.name, result)
                feed.generation += 1
                feed.resync = (result.resume_epoch, result.resume_after_seq)
                feed.interrupt()
