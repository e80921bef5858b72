"""The feeds' stall watchdog: one task on the feed loop for every feed (feeds.py).

A Subscribe call that has delivered nothing, not even a heartbeat, for longer than its feed's
stall timeout while the feed waited on it is cancelled, and the feed resumes from its last batch
(a wedged server, a half-open connection that keepalive missed).

Silence is measured on the loop's own clock: time in which the loop itself did not run (its
thread starved of the core at SCHED_IDLE by request threads, the GIL held by a long call) is
when no stream could be read, so it is not counted against the streams. Without that, one
starved stretch longer than the stall timeout reads as every stream stalled at once: every feed
reopened together, and a feed inside its snapshot starts the snapshot over.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from service_shell import kv

log = logging.getLogger("gateway.feeds")


class Watched(Protocol):
    """What the watchdog reads and sets on a feed (feeds.Feed)."""
    name: str
    waiting_since: float | None  # time.monotonic() since when it waits on its stream; None: not
    stall_timeout_s: float
    stalled: bool

    def interrupt(self) -> None: ...


class StallWatchdog:
    def __init__(self, period_s: float = 1.0) -> None:
        self.period_s = period_s
        self.feeds: set[Watched] = set()

    async def run(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.period_s)
            now = time.monotonic()
            self.check(now, late_s=now - last - self.period_s)
            last = now

    def check(self, now: float, late_s: float = 0.0) -> None:
        """One tick at `now`, `late_s` past its period: the loop did not run for that long (less
        a tenth of a period for the timer's own slack), and that time is forgiven to every
        waiting feed; a tick more than a period late is logged."""
        forgive = late_s if late_s > self.period_s / 10 else 0.0
        if late_s > self.period_s:
            log.warning(kv("feed_loop_starved", late_s=round(late_s, 3), feeds=len(self.feeds)))
        for feed in list(self.feeds):
            since = feed.waiting_since
            if since is None:
                continue
            if forgive:
                feed.waiting_since = since = min(since + forgive, now)
            if now - since > feed.stall_timeout_s:
                feed.stalled = True
                feed.interrupt()
