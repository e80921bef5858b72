"""Who goes first at `Router.lock`: routing decisions, then ingest.

A plain `threading.Lock` is not fair: the FeedLoop thread releasing it after a slice usually takes
it again for the next one before a routing decision that was waiting wakes up. Each call on a
request's path counts itself while it waits for or holds the lock (`decision`), and bulk ingest
calls `yield_to_decisions` between two holds: while a decision is counted it sleeps (its GIL
released), so the decision takes the lock first.

Inside a hold too: the C loop that applies a slice's page events runs without the GIL and reads
`flag` (nonzero while a decision is counted) every few dozen events; seeing it, it returns
between two events and the slice calls `pause`, which lets the decisions in and takes the lock
back. A decision then waits for ~64 page events, not for the rest of the slice. Only decisions
get in: every other holder of the lock that changes the index also holds `Router.writing`,
which a paused slice keeps.

And a floor under ingest. At `--ingest-priority idle` (SCHED_IDLE) the feed loop runs only when
no other thread wants its core: request threads that keep the core busy stop ingest outright,
the index goes stale and its streams read as silent (niced, many busy request threads come
close to that too: the floor holds whatever the priority). Seen on a slow day at 1,000 pools: the
bench's routing thread took 92% of the core and the warm-up took 221 s against 12 s niced. The
feed loop marks a pulse every PULSE_S (`pulsed`: the time, and its thread's CPU time); a
decision that finds the last one older than STARVED_S, and the loop's thread on the CPU for
less than STARVED_SHARE of the time since, sleeps FLOOR_SLEEP_S first, leaving the core and the
GIL to ingest: about a tenth of a saturated core, what `nice` keeps, at the price of that sleep
for one decision in ten or so, and only while the loop is starved. A stale pulse alone is not
enough: a loop that is busy, in a long turn of its own (a thousand feeds' messages decoded, a
slice), also misses its pulse, and on a machine at its usual speed decisions that slept then
raised the fleet bench's route() p99 during ingest to 0.87-2.6 ms, against 0.58-0.75 ms without
the floor (docs/results/gateway/fleet/usual_speed/). Nor is a loop that waits for decisions
(`yield_to_decisions`: a slice paused for them, or between two slices) starved: off the CPU
because it gives way, not for want of it. A slice that pauses again and again while decisions
come back to back misses its pulse that way, and decisions then slept 2 ms for nothing (seen in
the fleet bench); the loop is not starved while it yields, and its pulse is new when it goes on.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from threading import Event, Lock, get_ident

import numpy as np

# The floor under ingest (above): the loop's pulse, how stale a decision finds it and how little
# of the time since the loop's thread ran before the decision sleeps, and that sleep.
PULSE_S, STARVED_S, STARVED_SHARE, FLOOR_SLEEP_S = 0.01, 0.02, 0.25, 0.002


class DecisionsFirst:
    def __init__(self, lock: Lock, on_floor_sleep: Callable[[], None] = lambda: None) -> None:
        """`on_floor_sleep`: called for each decision that sleeps for ingest (a metric)."""
        self.lock, self._on_floor_sleep = lock, on_floor_sleep
        # One entry per decision waiting for or holding the lock (deque: atomic append and pop
        # across threads).
        self._deciding: deque[None] = deque()
        # Its length, where C reads it without the GIL (index_native.Preemption). Two threads
        # may write it in either order: a stale value only costs one needless pause (the C
        # loop always makes progress) or one wait for the rest of a slice, and `pause` and the
        # next decision write it afresh.
        self.flag = np.zeros(1, dtype=np.int64)
        # Decisions done, ever (`+=` from several threads may lose one: a yield then waits its
        # `max_wait_s`).
        self.done = 0
        self._progress = Event()  # set when a decision is done: a yield waits on it, not polls
        # Seconds ingest held the lock in the C loop that `flag` interrupts, and in its pauses:
        # a decision never waits for those (ingest_slices.SliceSize leaves them out).
        self.preemptible_s = 0.0
        # The feed loop's last pulse: (time.monotonic(), its thread's CPU time, that thread's
        # CPU clock); None: no loop runs (the floor is off). `_pulse_thread`: that thread.
        self.pulse: tuple[float, float, int | None] | None = None
        self._pulse_thread: int | None = None
        self._yielding = 0  # yields under way (`yield_to_decisions`): no one is starved then

    def pulsed(self, running: bool = True) -> None:
        """The feed loop ran (called on its thread every PULSE_S; `running` False: it
        stopped)."""
        if not running:
            self.pulse = None
            return
        self._pulse_thread = thread = get_ident()
        self.pulse = (time.monotonic(), time.thread_time(), _cpu_clock(thread))

    def starved(self) -> bool:
        """Whether the feed loop missed its pulse for want of the CPU (or the GIL), not because
        it was busy."""
        pulse = self.pulse
        if pulse is None or self._yielding:
            return False
        at, ran_then, clock = pulse
        late = time.monotonic() - at
        if late <= STARVED_S:
            return False
        if clock is None:  # no per-thread CPU clock here: a stale pulse is all there is
            return True
        try:
            ran = time.clock_gettime(clock) - ran_then
        except OSError:  # the loop's thread ended meanwhile
            return False
        return ran < STARVED_SHARE * late

    @contextmanager
    def decision(self) -> Iterator[None]:
        """The lock, for a call on a request's path (after the floor's sleep, when ingest is
        starved)."""
        if self.starved():
            self._on_floor_sleep()
            time.sleep(FLOOR_SLEEP_S)
        self._deciding.append(None)
        self.flag[0] = len(self._deciding)
        try:
            with self.lock:
                yield
        finally:
            self._deciding.pop()
            self.flag[0] = len(self._deciding)
            self.done += 1
            self._progress.set()

    def pause(self) -> None:
        """Called by an ingest slice that holds the lock, between two page events, when it saw
        `flag`: the decisions waiting take the lock, then the slice takes it back."""
        self.lock.release()
        try:
            self.yield_to_decisions()
        finally:
            self.lock.acquire()
            self.flag[0] = len(self._deciding)

    def yield_to_decisions(self, max_wait_s: float = 0.005) -> None:
        """Sleeps until the decisions counted now are done (at most `max_wait_s`): those that
        come meanwhile wait for the next yield, so that back-to-back decisions cannot stall
        ingest."""
        waiting = len(self._deciding)
        if not waiting:
            return
        until, deadline = self.done + waiting, time.perf_counter() + max_wait_s
        self._yielding += 1
        try:
            while self.done < until:
                self._progress.clear()
                left = deadline - time.perf_counter()
                if self.done >= until or left <= 0:
                    return
                self._progress.wait(left)
        finally:
            self._yielding -= 1
            if self.pulse is not None and self._pulse_thread == get_ident():
                self.pulsed()  # the loop goes on now: its time off the CPU was its own choice


def _cpu_clock(thread_id: int) -> int | None:
    """The CPU-time clock of a thread of this process, which another thread can read."""
    get = getattr(time, "pthread_getcpuclockid", None)
    try:
        return get(thread_id) if get is not None else None
    except OSError:
        return None
