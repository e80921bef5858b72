"""The routing index shared by many gateway replicas, in Redis (design.md, "Many gateway replicas").

One replica per worker (the INDEXER, under a lease: gateway/core/shared_indexer.py) applies that
worker's event stream here; every replica answers lookups from it with one pipelined round trip
per decision (`SharedIndexView.lookup`, the same answer as `KvIndex.lookup` for the same events).

Layout, under the prefix `pcx:{namespace}:` (nothing leaks across namespaces: every key, lease
and worker table carries it):
- `p:` + the first 8 bytes of a page hash -> a Redis SET of small integers `slot * 3 + tier`
  (tier 0 device, 1 host, 2 remote). Small integers make Redis store the set as an intset
  (2-8 bytes a member, no hashing), and one SMEMBERS per page answers all three media. A set,
  not a bitmap of worker slots: a page is held by few workers, and a bitmap over 1,000 slots
  would cost 125 bytes whoever holds it. 8-byte keys: a collision (two pages sharing a prefix,
  ~n^2/2^65) only makes routing believe a worker holds a page it lacks, a routing miss.
- the control keys, all under the hash tag `{namespace}` (`pcx:NS:{NS}:...`, one Redis Cluster
  slot, so that one script may touch them): `s` -> a HASH pool_id -> "slot epoch last_seq
  last_seen_unix in_snapshot", the worker table and the point the next lease holder resumes the
  stream from; `n` -> the slot counter; `l:` + pool_id -> the indexer's lease.
Page keys carry no hash tag: a Redis Cluster spreads them over its masters, and a lookup (one
SMEMBERS per page of the prompt, whoever holds it) stays one pipelined round trip per master, in
parallel. (One tag per worker would put a worker's pages on one master, but a lookup would then
read every page once per worker.)

Clearing a worker (a snapshot, a new epoch, the worker leaving) is O(1): it takes a fresh slot
from the counter and readers ignore members of any slot that is not a worker's current one. A
snapshot is written under its new slot and becomes the worker's view only at `snapshot_end`
(readers never see a half snapshot). What the old slots left behind goes by TTL: every store
refreshes its page key's expiry (`page_ttl_s`), so a key no live worker stores again expires.
The cost of that choice: a page a worker holds for longer than the TTL without storing it again
is forgotten (a routing miss, not a wrong answer).

Writes, under the worker's lease (a replica that lost it writes nothing more than noted here):
- one Redis (the url redis:// or rediss://): every batch is one Lua script, one round trip, with
  every key it touches declared: it checks that the caller still holds the lease, renews it,
  applies the stores and removals and records the new seq with them, atomically (the next holder
  resumes exactly there).
- a Redis Cluster (redis+cluster://): the page keys of a batch lie on several masters, so no one
  script can hold them and the lease. A batch is a pipeline of the page commands (one round trip
  per master, in order per key), then the lease script of the control slot, which checks and
  renews the lease and records the seq. What stays atomic: the lease check with the seq record.
  Kept by the order: a recorded seq means its batch's pages were written (a holder that dies
  between the two leaves the seq behind, and the next holder writes the batch again: SADD and
  SREM of the same members are idempotent, so the replay ends in the same sets). A writer only
  sends page commands within half a lease of its last renewal (measured from before that renewal
  was sent, so no other replica can hold the lease yet), else it renews first. What is lost: a
  writer stopped (paused, not dead) for longer than the lease between that check and its
  pipeline could still land one batch of page commands after the next holder's; the next write
  it tries is refused (LeaseLost). Its stale members are of the worker's own slot, so the worst
  is routing that believes the worker holds or lacks a few pages: a routing miss, never a wrong
  answer, until they are stored again or expire.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis
from redis.cluster import RedisCluster

from gateway.core.index_redis import IndexRedis
from gateway.core.index_scan import runs
from gateway.core.index_types import Holders, IndexConfig, IndexStats, PrefixMatch, WorkerInfo
from service_shell import kv

log = logging.getLogger("gateway.shared_index")

KEY_BYTES = 8
TIERS = 3

# KEYS: lease, worker table, then the page key of each operation. ARGV: owner, lease_ms, page ttl
# s, pool_id, table row, then per operation: '+' or '-', member.
APPLY_SCRIPT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
local ttl = tonumber(ARGV[3])
for k = 3, #KEYS do
  local i = 6 + (k - 3) * 2
  if ARGV[i] == '+' then
    redis.call('SADD', KEYS[k], ARGV[i + 1])
    redis.call('EXPIRE', KEYS[k], ttl)
  else
    redis.call('SREM', KEYS[k], ARGV[i + 1])
  end
end
if ARGV[5] == '' then redis.call('HDEL', KEYS[2], ARGV[4])
elseif ARGV[5] ~= '-' then redis.call('HSET', KEYS[2], ARGV[4], ARGV[5]) end
return 1
"""

@dataclass(slots=True)
class SharedIndexConfig:
    url: str
    # Deployment namespace (e.g. the model served): the key prefix.
    namespace: str = "default"
    # An indexer's lease; renewed by every write (batches, heartbeats at least every 1 s).
    lease_ms: int = 5000
    # A page key no worker stores again expires after this (see the module doc).
    page_ttl_s: int = 24 * 3600
    # Seconds a reader reuses the worker table before re-reading it (in the lookup's pipeline).
    table_refresh_s: float = 0.25
    # How to reach `url` (gateway/core/index_redis.py): ACL password file, TLS files.
    password_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    def connection(self) -> IndexRedis:
        return IndexRedis(self.url, self.password_file, self.tls_ca, self.tls_cert, self.tls_key)


def prefix_of(namespace: str) -> str:
    if not namespace or any(c in namespace for c in ":{}"):
        raise ValueError(f"index namespace {namespace!r}: must be non-empty, without ':', '{{', '}}'")
    return f"pcx:{namespace}:"


def page_suffix(page_hash: bytes) -> bytes:
    return page_hash[:KEY_BYTES]


@dataclass(slots=True)
class TableRow:
    """A worker's row of the table: what readers score and where its stream resumes."""
    slot: int
    epoch: int
    last_seq: int
    last_seen: float
    in_snapshot: bool

    def encode(self) -> str:
        return f"{self.slot} {self.epoch} {self.last_seq} {self.last_seen:.3f} {int(self.in_snapshot)}"

    @staticmethod
    def decode(raw: bytes | str) -> TableRow:
        s, e, q, t, i = (raw.decode() if isinstance(raw, bytes) else raw).split()
        return TableRow(int(s), int(e), int(q), float(t), i == "1")


class SharedIndexStore:
    """The Redis keys of one namespace: the lease and write primitives indexers use."""

    def __init__(self, config: SharedIndexConfig, client: redis.Redis | RedisCluster | None = None
                 ) -> None:
        self.config = config
        self.prefix = prefix_of(config.namespace)
        self.page_prefix = (self.prefix + "p:").encode()
        # The control keys share one cluster slot (the module doc).
        self.control = f"{self.prefix}{{{config.namespace}}}:"
        self.redis = client or config.connection().connect()
        self.cluster = isinstance(self.redis, RedisCluster)
        self._apply = self.redis.register_script(APPLY_SCRIPT)
        self.table_key = self.control + "s"
        # When this process last sent a renewal that Redis accepted, per lease (the cluster's
        # writes: module doc).
        self._renewed: dict[str, float] = {}

    def lease_key(self, pool_id: str) -> str:
        return f"{self.control}l:{pool_id}"

    def page_key(self, suffix: bytes) -> bytes:
        return self.page_prefix + suffix

    def try_lease(self, pool_id: str, owner: str) -> bool:
        """SET NX PX: true when `owner` now holds (or already held) the worker's lease."""
        key = self.lease_key(pool_id)
        sent = time.monotonic()
        if self.redis.set(key, owner, nx=True, px=self.config.lease_ms) \
                or self.redis.get(key) == owner.encode():
            self._renewed[pool_id] = sent
            return True
        return False

    def release(self, pool_id: str, owner: str) -> None:
        key = self.lease_key(pool_id)
        self._renewed.pop(pool_id, None)
        if self.redis.get(key) == owner.encode():
            self.redis.delete(key)

    def holder(self, pool_id: str) -> str | None:
        raw = self.redis.get(self.lease_key(pool_id))
        return raw.decode() if raw else None

    def row(self, pool_id: str) -> TableRow | None:
        raw = self.redis.hget(self.table_key, pool_id)
        return TableRow.decode(raw) if raw else None

    def new_slot(self) -> int:
        return int(self.redis.incr(self.control + "n"))

    def write(self, owner: str, pool_id: str, row: TableRow | None,
              ops: Sequence[tuple[str, bytes, int]]) -> bool:
        """Ops ('+'/'-', page key suffix, member) and the worker's row (None: the worker is
        gone), if `owner` still holds the lease. False when it does not. One round trip to one
        Redis; a pipeline and the lease script on a Redis Cluster (the module doc)."""
        if not self.cluster:
            return self._script(owner, pool_id, row.encode() if row else "", ops)
        if ops:
            if time.monotonic() - self._renewed.get(pool_id, float("-inf")) \
                    >= self.config.lease_ms / 2000 and not self._script(owner, pool_id, "-", []):
                return False
            pipe = self.redis.pipeline(transaction=False)
            ttl = self.config.page_ttl_s
            for op, suffix, member in ops:
                key = self.page_key(suffix)
                if op == "+":
                    pipe.sadd(key, member)
                    pipe.expire(key, ttl)
                else:
                    pipe.srem(key, member)
            pipe.execute()
        return self._script(owner, pool_id, row.encode() if row else "", [])

    def _script(self, owner: str, pool_id: str, row: str,
                ops: Sequence[tuple[str, bytes, int]]) -> bool:
        """The lease script: check and renew the lease, the page ops (one Redis only), then the
        row ('' deletes it, '-' leaves it)."""
        keys: list[bytes | str] = [self.lease_key(pool_id), self.table_key]
        args: list[bytes | str | int] = [owner, self.config.lease_ms, self.config.page_ttl_s,
                                         pool_id, row]
        for op, suffix, member in ops:
            keys.append(self.page_key(suffix))
            args += (op, member)
        sent = time.monotonic()
        if not self._apply(keys=keys, args=args):
            self._renewed.pop(pool_id, None)
            return False
        self._renewed[pool_id] = sent
        return True


@dataclass(slots=True)
class SharedIndexStats:
    lookups: int = 0
    lookup_failures: int = 0
    # 1 while the last round trip to Redis failed: routing is by load only.
    redis_down: bool = False
    last_lookup_s: float = 0.0


class SharedIndexView:
    """What a replica's router asks: `lookup`, `last_seen`, `info`, `workers`; from Redis.

    Redis unreachable: `lookup` answers {} (no prefix knowledge: routing by load only),
    `health.redis_down` says so and a warning is logged once per outage; nothing raises."""

    # KvIndex's flag (a routed request's lookups touch the pages they find); the shared
    # index's keys expire by their own ttl, which only stores refresh: the router leaves it off.
    touch_lookups = False

    def __init__(self, store: SharedIndexStore, index_config: IndexConfig | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time,
                 on_round_trip: Callable[[float], None] | None = None) -> None:
        self.store = store
        # Each successful round trip's seconds (the gateway's latency histogram).
        self._on_round_trip = on_round_trip
        self.config = index_config or IndexConfig()
        self._clock, self._wall = clock, wall
        self._rows: dict[str, TableRow] = {}
        self._rows_at = float("-inf")
        self.health = SharedIndexStats()

    def _pages(self, hashes: Sequence[bytes]) -> list[bytes]:
        return [self.store.page_key(page_suffix(h)) for h in hashes]

    def refresh(self) -> None:
        """Re-reads the worker table if it is older than `table_refresh_s`; safe beside the
        other calls (the table is replaced whole), so callers need not hold a lock."""
        self._round_trip([])

    def _round_trip(self, hashes: Sequence[bytes]) -> list[set[bytes]] | None:
        refresh = self._clock() - self._rows_at >= self.store.config.table_refresh_s
        started = time.perf_counter()
        try:
            pipe = self.store.redis.pipeline(transaction=False)
            for key in self._pages(hashes):
                pipe.smembers(key)
            if refresh:
                pipe.hgetall(self.store.table_key)
            replies = pipe.execute()
        except redis.RedisError as exc:
            self.health.lookup_failures += 1
            if not self.health.redis_down:
                log.warning(kv("shared_index_unreachable", url=self.store.config.connection().redacted(), error=str(exc),
                               hint="routing by load only until Redis answers"))
            self.health.redis_down = True
            return None
        self.health.redis_down = False
        self.health.last_lookup_s = time.perf_counter() - started
        if self._on_round_trip is not None:
            self._on_round_trip(self.health.last_lookup_s)
        if refresh:
            table = replies.pop()
            self._rows = {k.decode(): TableRow.decode(v) for k, v in table.items()}
            self._rows_at = self._clock()
        return replies

    def workers(self) -> list[str]:
        return list(self._rows)

    # The router's calls for its own index: the indexers own the workers' entries here.
    def add_worker(self, pool_id: str) -> None:
        pass

    def remove_worker(self, pool_id: str) -> bool:
        return False

    def stats(self) -> IndexStats:
        """The entries live in Redis (its INFO and DBSIZE count them): none in this process."""
        return IndexStats(0, 0, 0, 0, 0)

    def info(self, pool_id: str) -> WorkerInfo | None:
        r = self._rows.get(pool_id)
        if r is None:
            return None
        return WorkerInfo(pool_id, r.epoch, r.last_seq, False, r.in_snapshot,
                          self._to_clock(r.last_seen), (0, 0, 0))

    def _to_clock(self, wall_seen: float) -> float:
        return self._clock() - max(0.0, self._wall() - wall_seen)

    def last_seen(self, pool_id: str) -> float | None:
        """When the worker's indexer last heard from it, on this replica's clock. While Redis
        is down every worker counts as just seen (routing by load, not by nobody)."""
        if self.health.redis_down:
            return self._clock()
        r = self._rows.get(pool_id)
        return None if r is None else self._to_clock(r.last_seen)

    def confidence(self, pool_id: str, now: float | None = None) -> float:
        r = self._rows.get(pool_id)
        return 0.0 if r is None else self._confidence(r, self._clock() if now is None else now)

    def _confidence(self, r: TableRow, now: float) -> float:
        return self.config.confidence(now - self._to_clock(r.last_seen), r.in_snapshot)

    def holders(self, hashes: Sequence[bytes], now: float | None = None) -> Holders:
        """`KvIndex.holders`: `lookup`'s answer as arrays (the round trip dominates here)."""
        return Holders.from_matches(self.lookup(hashes, now))

    def lookup(self, hashes: Sequence[bytes], now: float | None = None) -> dict[str, PrefixMatch]:
        """`KvIndex.lookup`'s answer (the same runs over the same masks), from one round trip."""
        if not hashes:
            return {}
        replies = self._round_trip(hashes)
        self.health.lookups += 1
        rows = self._rows  # one table throughout: a refresh from another thread replaces it
        if replies is None or not rows:
            return {}
        # Local bit per current worker slot; members of old slots (cleared views) are ignored.
        names = list(rows)
        bit_of = {rows[n].slot: i for i, n in enumerate(names)}
        masks = ([0] * len(hashes), [0] * len(hashes), [0] * len(hashes))
        for i, members in enumerate(replies):
            for m in members:
                slot, tier = divmod(int(m), TIERS)
                b = bit_of.get(slot)
                if b is not None:
                    masks[tier][i] |= 1 << b
        everyone = (1 << len(names)) - 1
        devm, hostm, remm = masks
        dev_end = runs(devm, {}, first=everyone)
        anym = [d | h for d, h in zip(devm, hostm)]
        host_end = runs(anym, dev_end, first=_others(everyone, dev_end))
        rem_end = runs([everyone if r else a for r, a in zip(remm, anym)], host_end,
                       first=_others(everyone, host_end))
        now = self._clock() if now is None else now
        out: dict[str, PrefixMatch] = {}
        for b, r_end in rem_end.items():
            if r_end:
                d_end, h_end = dev_end.get(b, 0), host_end.get(b, 0)
                row = rows[names[b]]
                out[names[b]] = PrefixMatch(d_end, h_end - d_end, r_end - h_end,
                                            self._confidence(row, now))
        return out


def _others(everyone: int, ends: dict[int, int]) -> int:
    for b in ends:
        everyone &= ~(1 << b)
    return everyone
