"""The circuit breaker of the L3 client, one per Redis node: a Redis that keeps failing is not
called (a miss, at no cost) until a cool-down has passed, then one trial call finds out whether
it is back."""
from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("prefixcache.l3")


class CircuitBreaker:
    """closed: calls go through; open: calls are skipped (a miss) until `reset_after_s` passed;
    half-open: one call goes through; success closes the breaker, failure opens it again."""

    def __init__(self, failure_threshold: int, reset_after_s: float, clock=time.monotonic,
                 name: str = ""):
        self.failure_threshold, self.reset_after_s, self.clock = failure_threshold, reset_after_s, clock
        self.name = name
        self.failures = 0
        self.opened_at: float | None = None
        self.trial_running = False
        self._lock = threading.Lock()

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "half-open" if self.clock() - self.opened_at >= self.reset_after_s else "open"

    def allow(self) -> bool:
        with self._lock:
            state = self.state
            if state == "closed":
                return True
            if state == "half-open" and not self.trial_running:
                self.trial_running = True
                return True
            return False

    def record(self, ok: bool) -> bool:
        """Records a call's outcome; True when this outcome opened the breaker."""
        with self._lock:
            self.trial_running = False
            if ok:
                if self.opened_at is not None:
                    log.info("event=l3_breaker_closed node=%s", self.name or "-")
                self.failures, self.opened_at = 0, None
                return False
            self.failures += 1
            if self.opened_at is not None or self.failures >= self.failure_threshold:
                opened = self.opened_at is None
                if opened:
                    log.warning("event=l3_breaker_open node=%s failures=%d", self.name or "-",
                                self.failures)
                self.opened_at = self.clock()
                return opened
            return False
