"""The L3 client: page calls on the Redis page store shared by every worker (no torch here;
payloads are opaque bytes: pagestore.page_format says what is in them).

Keys are `<prefix>:<model id>:<page hash hex>` (pagestore.keys); the namespace (adapter, salt)
is inside the hash.
Redis being slow, down, flushed or wrong never fails a request: every call has a bounded timeout,
any failure is a miss, and a circuit breaker stops calling a Redis that keeps failing, then lets
one call through after a cool-down (half-open) to find out whether it is back.

Standalone or Redis Cluster (design.md §4, "L3 on a Redis Cluster"): on a cluster, every call
groups its keys by the master that serves their hash slot and sends one pipeline per master
(concurrently), never a multi-key command (which fails with CROSSSLOT across slots). Each master
has its own breaker: a dead master's pages miss while the others' still hit.

Reachability (design.md §4): `check()` PINGs at start and logs `event=l3_unreachable` with the
redacted URL and the cause; `up` (the services' `..._l3_up` gauge and the "l3" health name) is
False until a call or a re-check succeeds; `watch()` re-checks in the background while down, so
the state recovers without traffic.

Recommended server settings: `maxmemory <size>` and `maxmemory-policy allkeys-lru` (L3 is a
cache: Redis evicts the least recently used pages when full), no persistence; on a cluster also
`cluster-require-full-coverage no` (a dead master must not stop the others).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from pagestore.breaker import CircuitBreaker
from pagestore.keys import page_key
from pagestore.settings import RedisSettings

log = logging.getLogger("prefixcache.l3")

__all__ = ["REDIS_ERRORS", "UNAVAILABLE", "L3Client", "L3Config", "L3Counters"]


# What a Redis call may raise: redis-py's errors, its cluster client's (RedisClusterException
# is no RedisError: "no node could be reached", an uncovered slot), and socket errors.
REDIS_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException, OSError)


class _Unavailable:
    """A page whose master could not be asked (down, breaker open, moved): not known missing."""

    def __repr__(self) -> str:
        return "UNAVAILABLE"


UNAVAILABLE = _Unavailable()


@dataclass(slots=True)
class L3Config:
    url: str  # redis://[user[:password]@]host:port/db, rediss:// for TLS, redis+cluster://
    prefix: str = "pc"
    ttl_s: int = 24 * 3600  # 0 = keys never expire (allkeys-lru still evicts them)
    timeout_s: float = 0.1  # per call, socket read/write
    connect_timeout_s: float = 0.2
    max_connections: int = 16  # per Redis node
    failure_threshold: int = 3  # consecutive failures that open the breaker
    reset_after_s: float = 2.0  # open -> half-open after this long
    # How to reach it beyond the URL (pagestore.settings.RedisSettings: cluster, ACL password
    # file, TLS files); None = the URL alone.
    redis: RedisSettings | None = None
    # The key of the page MAC (pagestore.page_format): pages are written and accepted
    # only with it. None = an unkeyed checksum (catches corruption, not forgery).
    mac_key: bytes | None = field(default=None, repr=False)

    def settings(self) -> RedisSettings:
        return self.redis if self.redis is not None else RedisSettings(self.url)


_STATE_RANK = {"closed": 0, "half-open": 1, "open": 2}


@dataclass(slots=True)
class L3Counters:
    """Monotonic counters (exported as metrics by the services)."""
    calls: collections.Counter = field(default_factory=collections.Counter)

    def add(self, name: str, n: int = 1) -> None:
        self.calls[name] += n


class L3Client:
    """Bounded, breaker-guarded page calls on a standalone Redis or a Redis Cluster."""

    STANDALONE = ""  # the breaker name of a standalone Redis

    def __init__(self, cfg: L3Config, clock=time.monotonic):
        self.cfg = cfg
        self.settings = cfg.settings()
        self.clock = clock
        self.counters = L3Counters()
        self.breakers: dict[str, CircuitBreaker] = {}
        self._lock = threading.Lock()
        self._standalone: redis.Redis | None = None
        self._cluster: RedisCluster | None = None
        self._topology_refresh_at = 0.0
        if self.settings.cluster:
            # Nodes are asked concurrently: a call costs the slowest master's round trip.
            self._pool = ThreadPoolExecutor(8, thread_name_prefix="l3-node")
        else:
            self._standalone = self._connect()  # redis.Redis connects lazily: never raises here
        # None: not known yet (no check, no call); False: the last check or call failed.
        self.up: bool | None = None
        self.down_cause = ""
        self._listeners: list[Callable[[bool], None]] = []
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def _connect(self):
        return self.settings.connect(socket_timeout=self.cfg.timeout_s,
                                     connect_timeout=self.cfg.connect_timeout_s,
                                     max_connections=self.cfg.max_connections)

    # ---- topology and breakers ---------------------------------------------------------------

    @property
    def redis(self) -> redis.Redis | RedisCluster:
        """The redis-py client (for tests and admin; page calls go through the methods)."""
        if self._standalone is not None:
            return self._standalone
        client = self._cluster_client()
        if client is None:
            raise redis.ConnectionError(f"no node of {self.settings.redacted()} answered")
        return client

    @property
    def breaker(self) -> CircuitBreaker:
        """Standalone: the breaker; cluster: the breaker of the slot map (reaching any node)."""
        return self._breaker(self.STANDALONE if self._standalone is not None else "topology")

    def _breaker(self, name: str) -> CircuitBreaker:
        with self._lock:
            if name not in self.breakers:
                self.breakers[name] = CircuitBreaker(self.cfg.failure_threshold,
                                                     self.cfg.reset_after_s, self.clock, name)
            return self.breakers[name]

    def breaker_state(self) -> str:
        """The worst state of any node's breaker."""
        with self._lock:
            states = [b.state for b in self.breakers.values()] or ["closed"]
        return max(states, key=_STATE_RANK.__getitem__)

    def _cluster_client(self) -> RedisCluster | None:
        """The cluster client, made on first use (making it asks a node for the slot map);
        None while no node answers (through the "topology" breaker)."""
        if self._cluster is not None:
            return self._cluster
        breaker = self._breaker("topology")
        if not breaker.allow():
            self.counters.add("skipped_breaker_open")
            return None
        try:
            client = self._connect()
        except REDIS_ERRORS as exc:
            self.counters.add("errors")
            self._failed(breaker, exc)
            return None
        self._succeeded(breaker)
        with self._lock:
            if self._cluster is None:
                self._cluster = client
            else:
                client.close()
        return self._cluster

    def _refresh_topology(self) -> None:
        """Re-reads the slot map after a MOVED/ASK (resharding) or a node failure (failover),
        at most once a second; the pages asked meanwhile are misses."""
        with self._lock:  # one refresh at a time: node calls run on several threads
            now = self.clock()
            if self._cluster is None or now - self._topology_refresh_at < 1.0:
                return
            self._topology_refresh_at = now
        self.counters.add("topology_refreshes")
        try:
            self._cluster.nodes_manager.initialize()
        except REDIS_ERRORS as exc:
            log.warning("event=l3_topology_refresh_failed error=%r", exc)

    def _groups(self, keys: list[str]) -> list[tuple[str, redis.Redis, list[int]]] | None:
        """(node name, its client, indices of `keys` it serves) per node; None when the node
        map is unknown (no node answers). Keys of an uncovered slot are in no group."""
        if self._standalone is not None:
            return [(self.STANDALONE, self._standalone, list(range(len(keys))))]
        rc = self._cluster_client()
        if rc is None:
            return None
        groups: dict[str, tuple[redis.Redis, list[int]]] = {}
        for i, k in enumerate(keys):
            try:
                node = rc.nodes_manager.get_node_from_slot(key_slot(k.encode()))
            except redis.exceptions.SlotNotCoveredError:
                continue
            if node.name not in groups:
                groups[node.name] = (rc.get_redis_connection(node), [])
            groups[node.name][1].append(i)
        return [(name, conn, idx) for name, (conn, idx) in groups.items()]

    # ---- calls -------------------------------------------------------------------------------

    def _call(self, node: str, fn, default):
        """Runs fn() through the node's breaker; any Redis failure is counted and returns
        `default`."""
        breaker = self._breaker(node)
        if not breaker.allow():
            self.counters.add("skipped_breaker_open")
            return default
        try:
            result = fn()
        except redis.TimeoutError as exc:
            self.counters.add("timeouts")
            self._failed(breaker, exc)
            return default
        except REDIS_ERRORS as exc:
            self.counters.add("errors")
            log.debug("event=l3_error node=%s error=%r", node or "-", exc)
            self._failed(breaker, exc)
            return default
        self._succeeded(breaker)
        return result

    def _per_node(self, keys: list[str], run: Callable[[redis.Redis, list[int]], list],
                  failed) -> list | None:
        """run(client, indices) on every node's share of `keys` (concurrently on a cluster),
        merged in key order; a failed node's entries are `failed`. None when every node
        failed (or no node map is known)."""
        groups = self._groups(keys)
        if groups is None:
            return None
        out: list = [failed] * len(keys)
        calls = [(name, lambda c=conn, i=idx: run(c, i), idx) for name, conn, idx in groups]
        if len(calls) == 1:
            results = [self._call(calls[0][0], calls[0][1], None)]
        else:
            results = list(self._pool.map(lambda c: self._call(c[0], c[1], None), calls))
        ok = False
        for (_, _, idx), got in zip(calls, results, strict=True):
            if got is None:
                continue
            ok = True
            for i, value in zip(idx, got, strict=True):
                out[i] = value
        return out if ok or not keys else None

    def _pipeline(self, conn: redis.Redis, build) -> list:
        """One pipelined round trip; a MOVED/ASK reply (the slot map changed) makes that entry
        unavailable and refreshes the map."""
        pipe = conn.pipeline(transaction=False)
        build(pipe)
        replies = pipe.execute(raise_on_error=False)
        out = []
        for r in replies:
            if isinstance(r, redis.ResponseError):
                if str(r).startswith(("MOVED", "ASK")):
                    self.counters.add("moved")
                    self._refresh_topology()
                    out.append(UNAVAILABLE)
                    continue
                raise r
            out.append(r)
        return out

    def key(self, model_id: str, page_hash: bytes) -> str:
        return page_key(self.cfg.prefix, model_id, page_hash)

    def probe(self, model_id: str, hashes: list[bytes]) -> int:
        """How many leading pages of `hashes` L3 holds (one round trip per node); a page on a
        node that cannot be asked ends the prefix, as a missing one does."""
        if not hashes:
            return 0
        keys = [self.key(model_id, h) for h in hashes]

        def run(conn: redis.Redis, idx: list[int]) -> list:
            return self._pipeline(conn, lambda pipe: [pipe.exists(keys[i]) for i in idx])

        found = self._per_node(keys, run, 0) or []
        n = next((i for i, ok in enumerate(found) if ok is UNAVAILABLE or not ok), len(found))
        self.counters.add("probes")
        self.counters.add("probe_hit_pages", n)
        return n

    def get_many(self, model_id: str, hashes: list[bytes]) -> list | None:
        """Payloads in order: bytes, None for a key Redis has no string value for, UNAVAILABLE
        for a page on a node that could not be asked; None when no node could be asked at all
        (timeout, error, breaker open). The caller must not treat UNAVAILABLE or None as "these
        keys are gone"."""
        if not hashes:
            return []
        keys = [self.key(model_id, h) for h in hashes]
        if self._standalone is not None:
            got = self._call(self.STANDALONE, lambda: self._standalone.mget(keys), None)
        else:  # per node: pipelined GETs (an MGET across slots is CROSSSLOT on a cluster)
            got = self._per_node(keys, lambda conn, idx: self._pipeline(
                conn, lambda pipe: [pipe.get(keys[i]) for i in idx]), UNAVAILABLE)
        self.counters.add("get_pages", len(hashes))
        return got

    def set_many(self, model_id: str, items: list[tuple[bytes, bytes]]) -> int:
        """Writes (hash, payload) pairs, one pipelined round trip per node; returns how many
        were written (0 on failure). Each payload is one value, so no half-written pair of page
        and metadata can exist."""
        return sum(self.set_pages(model_id, items))

    def set_pages(self, model_id: str, items: list[tuple[bytes, bytes]]) -> list[bool]:
        """set_many, saying for each pair whether it was written (False: failed, or skipped
        while its node's breaker was open)."""
        if not items:
            return []
        keys = [self.key(model_id, h) for h, _ in items]
        ex = self.cfg.ttl_s or None

        def run(conn: redis.Redis, idx: list[int]) -> list:
            return self._pipeline(conn, lambda pipe: [pipe.set(keys[i], items[i][1], ex=ex)
                                                      for i in idx])

        done = self._per_node(keys, run, UNAVAILABLE) or [UNAVAILABLE] * len(items)
        ok = [r is not UNAVAILABLE and bool(r) for r in done]
        written = sum(ok)
        self.counters.add("set_pages", written)
        self.counters.add("set_failed_pages", len(items) - written)
        return ok

    def delete(self, model_id: str, page_hash: bytes) -> None:
        key = self.key(model_id, page_hash)
        self._per_node([key], lambda conn, idx: [conn.delete(key)], None)
        self.counters.add("deleted")

    # ---- reachability --------------------------------------------------------------------------

    def check(self, timeout_s: float | None = None) -> bool:
        """PINGs Redis (every master of a cluster) within `timeout_s` (default: the connect
        timeout), logs the outcome when it changes and updates `up`. An answer closes every
        breaker: the Redis that made them open is back, and waiting out their cool-down would
        make every page miss for up to `reset_after_s` more (after a pause, the turns that
        followed computed what L3 held: issue 25, finding 7)."""
        cause = self.settings.check(timeout_s or self.cfg.connect_timeout_s)
        if cause is None:
            if self.settings.cluster:
                self._cluster_client()  # the slot map now, not on the first request's path
            for breaker in list(self.breakers.values()):
                breaker.record(True)
            self._set_up(True, "")
        else:
            self._set_up(False, cause)
        return cause is None

    def on_change(self, listener: Callable[[bool], None]) -> None:
        """Calls listener(up) now (when known) and whenever `up` changes."""
        self._listeners.append(listener)
        if self.up is not None:
            listener(self.up)

    def watch(self, interval_s: float = 0.5) -> None:
        """Re-checks in the background every `interval_s` while down (a Redis that comes up
        without traffic to notice it is seen as up); stops at `close()`."""
        if self._watcher is not None:
            return

        def loop() -> None:
            while not self._watch_stop.wait(interval_s):
                if self.up is not True:
                    self.check()

        self._watcher = threading.Thread(target=loop, name="l3-watch", daemon=True)
        self._watcher.start()

    def close(self) -> None:
        self._watch_stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=1.0)

    def _succeeded(self, breaker: CircuitBreaker) -> None:
        breaker.record(True)
        if self.up is not True and not any(
                b.opened_at is not None for b in list(self.breakers.values())):
            self._set_up(True, "")

    def _failed(self, breaker: CircuitBreaker, exc: BaseException) -> None:
        if self._cluster is not None and breaker.name != "topology":
            # A master that stopped answering may have been replaced (a replica promoted
            # elsewhere): the slot map says where its slots are now.
            self._refresh_topology()
        if breaker.record(False) or self.up is None:
            self._set_up(False, f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300],
                         node=breaker.name)

    def _set_up(self, up: bool, cause: str, node: str = "") -> None:
        with self._lock:
            changed = up != self.up
            self.up, self.down_cause = up, cause
        if not changed:
            return
        url = self.settings.redacted()
        if up:
            log.info("event=l3_reachable url=%s", url)
        else:
            log.warning("event=l3_unreachable url=%s%s cause=%r (its pages miss until it "
                        "answers)", url, f" node={node}" if node else "", cause)
        for listener in list(self._listeners):
            listener(up)
