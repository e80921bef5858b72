"""The live phase's clock, taken on the gateway's side: when the first slice holding a live batch
began to be applied and when the last one was applied (not when the bench let the load generator
go and a poll noticed the end, which quantized a short phase to the poll's period), the FeedLoop
thread's CPU time over that span, and the load generator's own CPU time and last send, so that a
run says which side was the bottleneck."""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from gateway.core.router import Router
from gateway.core.stream_frames import FrameItem, StreamItem
from prefixcache_bench.harness import percentile

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def _is_live(item: StreamItem) -> bool:
    if isinstance(item, FrameItem):
        return item.head is not None and not item.head.snapshot
    return item.WhichOneof("item") == "batch" and not item.batch.snapshot


class LiveClock:
    """Wraps `router.apply_stream_items` (the applier calls it once a slice, on the FeedLoop
    thread) to note the live batches' first and last slice; `start()` marks the moment the load
    generator is let go (its CPU time counted from there)."""

    def __init__(self, router: Router, generator_pid: int | None, live_items: int) -> None:
        self._apply = router.apply_stream_items
        # Set once `live_items` live batches were applied: the bench waits on it instead of
        # polling the index (a poll reads every worker under the router's lock).
        self.expected, self.done = live_items, threading.Event()
        router.apply_stream_items = self  # type: ignore[method-assign]
        self.generator_pid = generator_pid
        self.first: float | None = None  # time.perf_counter before the first live slice
        self.last: float | None = None  # after the last live slice
        self.feed_cpu = [0.0, 0.0]  # the FeedLoop thread's thread_time at first, last
        self.live_items = 0
        self.holds: list[float] = []  # seconds each live slice took
        self.released = 0.0
        self.generator_cpu = [0.0, 0.0]  # at start(), at stop()

    def start(self) -> None:
        self.released = time.perf_counter()
        if self.generator_pid is not None:
            self.generator_cpu[0] = process_cpu_s(self.generator_pid)

    def stop(self) -> None:
        """Once every live batch is applied: the load generator's CPU time up to now."""
        if self.generator_pid is not None:
            self.generator_cpu[1] = process_cpu_s(self.generator_pid)

    def __call__(self, items: Sequence[tuple[str, StreamItem]]) -> list[Any]:
        began, cpu = time.perf_counter(), time.thread_time()
        results = self._apply(items)
        live = sum(1 for _, item in items if _is_live(item))
        if live:
            if self.first is None:
                self.first, self.feed_cpu[0] = began, cpu
            self.last, self.feed_cpu[1] = time.perf_counter(), time.thread_time()
            self.holds.append(self.last - began)
            self.live_items += live
            if self.live_items >= self.expected:
                self.done.set()
        return results

    def summary(self, live_page_events: int, last_sent: float) -> dict:
        """The phase's figures; `last_sent`: the load generator's last live send (time.perf_counter, CLOCK_MONOTONIC: one clock for both processes)."""
        if self.first is None or self.last is None:
            return {"live_items_applied": 0}
        span = max(self.last - self.first, 1e-9)
        out = {
            "live_page_events_per_s": live_page_events / span,
            "live_apply_span_s": span,
            "live_items_applied": self.live_items,
            "live_start_delay_s": self.first - self.released,
            "feed_loop_cpu_share_live": (self.feed_cpu[1] - self.feed_cpu[0]) / span,
            "live_slice_p50_ms": percentile(self.holds, 0.5) * 1e3,
            "live_slice_p99_ms": percentile(self.holds, 0.99) * 1e3,
        }
        if last_sent > 0:
            sent_span = max(last_sent - self.released, 1e-9)
            out["generator_send_page_events_per_s"] = live_page_events / sent_span
            out["generator_send_span_s"] = sent_span
        if self.generator_pid is not None:
            used = self.generator_cpu[1] - self.generator_cpu[0]
            out["generator_cpu_share_live"] = used / max(self.last - self.released, 1e-9)
        return out
