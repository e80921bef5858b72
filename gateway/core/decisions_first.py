"""Who goes first at `Router.lock`: routing decisions, then the next ingest slice.

A plain `threading.Lock` is not fair: the FeedLoop thread releasing it after a slice usually takes
it again for the next one before a routing decision that was waiting wakes up. Each call on a
request's path counts itself while it waits for or holds the lock (`decision`), and bulk ingest
calls `yield_to_decisions` between two holds: while a decision is counted it sleeps (its GIL
released), so the decision takes the lock first.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from threading import Lock


class DecisionsFirst:
    def __init__(self, lock: Lock) -> None:
        self.lock = lock
        # One entry per decision waiting for or holding the lock (deque: atomic append and pop
        # across threads).
        self._deciding: deque[None] = deque()

    @contextmanager
    def decision(self) -> Iterator[None]:
        """The lock, for a call on a request's path."""
        self._deciding.append(None)
        try:
            with self.lock:
                yield
        finally:
            self._deciding.pop()

    def yield_to_decisions(self, max_wait_s: float = 0.005) -> None:
        """Sleeps while a decision waits for the lock or holds it (at most `max_wait_s`)."""
        deadline = None
        while self._deciding:
            if deadline is None:
                deadline = time.perf_counter() + max_wait_s
            elif time.perf_counter() > deadline:
                return
            time.sleep(0.00005)
