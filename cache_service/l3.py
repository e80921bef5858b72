"""L3: the Redis page store shared by every worker (no torch here; payloads are opaque bytes).

Keys are `<prefix>:<model id>:<page hash hex>`; the namespace (adapter, salt) is inside the hash.
Redis being slow, down, flushed or wrong never fails a request: every call has a bounded timeout,
any failure is a miss, and a circuit breaker stops calling a Redis that keeps failing, then lets
one call through after a cool-down (half-open) to find out whether it is back.

Recommended server settings: `maxmemory <size>` and `maxmemory-policy allkeys-lru` (L3 is a
cache: Redis evicts the least recently used pages when full), no persistence.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field

import redis

log = logging.getLogger("prefixcache.l3")


@dataclass(slots=True)
class L3Config:
    url: str  # redis://[:password@]host:port/db, or rediss:// for TLS
    prefix: str = "pc"
    ttl_s: int = 24 * 3600  # 0 = keys never expire (allkeys-lru still evicts them)
    timeout_s: float = 0.1  # per call, socket read/write
    connect_timeout_s: float = 0.2
    max_connections: int = 16
    failure_threshold: int = 3  # consecutive failures that open the breaker
    reset_after_s: float = 2.0  # open -> half-open after this long


def page_key(prefix: str, model_id: str, page_hash: bytes) -> str:
    return f"{prefix}:{model_id}:{page_hash.hex()}"


class CircuitBreaker:
    """closed: calls go through; open: calls are skipped (a miss) until `reset_after_s` passed;
    half-open: one call goes through; success closes the breaker, failure opens it again."""

    def __init__(self, failure_threshold: int, reset_after_s: float, clock=time.monotonic):
        self.failure_threshold, self.reset_after_s, self.clock = failure_threshold, reset_after_s, clock
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

    def record(self, ok: bool) -> None:
        with self._lock:
            self.trial_running = False
            if ok:
                if self.opened_at is not None:
                    log.info("event=l3_breaker_closed")
                self.failures, self.opened_at = 0, None
                return
            self.failures += 1
            if self.opened_at is not None or self.failures >= self.failure_threshold:
                if self.opened_at is None:
                    log.warning("event=l3_breaker_open failures=%d", self.failures)
                self.opened_at = self.clock()


@dataclass(slots=True)
class L3Counters:
    """Monotonic counters (exported as metrics by the services)."""
    calls: collections.Counter = field(default_factory=collections.Counter)

    def add(self, name: str, n: int = 1) -> None:
        self.calls[name] += n


class L3Client:
    def __init__(self, cfg: L3Config, clock=time.monotonic):
        self.cfg = cfg
        self.redis = redis.Redis.from_url(
            cfg.url, socket_timeout=cfg.timeout_s, socket_connect_timeout=cfg.connect_timeout_s,
            max_connections=cfg.max_connections, retry_on_timeout=False)
        self.breaker = CircuitBreaker(cfg.failure_threshold, cfg.reset_after_s, clock)
        self.counters = L3Counters()

    def key(self, model_id: str, page_hash: bytes) -> str:
        return page_key(self.cfg.prefix, model_id, page_hash)

    def _call(self, what: str, fn, default):
        """Runs fn() through the breaker; any Redis failure is counted and returns `default`."""
        if not self.breaker.allow():
            self.counters.add("skipped_breaker_open")
            return default
        try:
            result = fn()
        except redis.TimeoutError:
            self.counters.add("timeouts")
            self.breaker.record(False)
            return default
        except (redis.RedisError, OSError) as exc:
            self.counters.add("errors")
            log.debug("event=l3_error call=%s error=%r", what, exc)
            self.breaker.record(False)
            return default
        self.breaker.record(True)
        return result

    def probe(self, model_id: str, hashes: list[bytes]) -> int:
        """How many leading pages of `hashes` L3 holds (one round trip); 0 on any failure."""
        if not hashes:
            return 0

        def run() -> int:
            pipe = self.redis.pipeline(transaction=False)
            for h in hashes:
                pipe.exists(self.key(model_id, h))
            found = pipe.execute()
            n = next((i for i, ok in enumerate(found) if not ok), len(found))
            return n

        n = self._call("probe", run, 0)
        self.counters.add("probes")
        self.counters.add("probe_hit_pages", n)
        return n

    def get_many(self, model_id: str, hashes: list[bytes]) -> list[bytes | None] | None:
        """Payloads in order (None for a key Redis has no string value for), or None when the
        call itself failed (timeout, error, breaker open): the caller must not treat that as
        "these keys are gone"."""
        if not hashes:
            return []
        got = self._call("get", lambda: self.redis.mget([self.key(model_id, h) for h in hashes]),
                         None)
        self.counters.add("get_pages", len(hashes))
        return got

    def set_many(self, model_id: str, items: list[tuple[bytes, bytes]]) -> bool:
        """Writes (hash, payload) pairs in one pipelined round trip; False on failure. Each
        payload is one value, so no half-written pair of page and metadata can exist."""
        if not items:
            return True

        def run() -> bool:
            pipe = self.redis.pipeline(transaction=False)
            for h, payload in items:
                pipe.set(self.key(model_id, h), payload, ex=self.cfg.ttl_s or None)
            pipe.execute()
            return True

        ok = self._call("set", run, False)
        self.counters.add("set_pages" if ok else "set_failed_pages", len(items))
        return ok

    def delete(self, model_id: str, page_hash: bytes) -> None:
        self._call("delete", lambda: self.redis.delete(self.key(model_id, page_hash)), None)
        self.counters.add("deleted")
