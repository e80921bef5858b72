"""CacheCore: every pool of one cache service, usable embedded (no network) or behind gRPC.

Each public method takes the request message of the RPC of the same name and returns its
response. Calls are serialised by one lock. Bad input raises `CacheError` before any state
changes: a Step is a loop over its operations (cache_service/step/, one module each), every one
planned (validated) before the first is applied to the pool (pool.py); each builds its own part
of the response.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

from cache_service import events
from cache_service.eviction import make_policy
from cache_service.retention import RetentionConfig
from cache_service.leases import LeaseDirectory
from cache_service.pool import MEDIA, REMOTE, Pool, PoolConfig
from cache_service.step import (Allocate, Checkpoint, LoadReport, Match, Publish, Release,
                                RemoteWriteFailures, Renew, StepCheck, StepOperation,
                                WriteThrough)
from cache_service.tree import DEVICE, HOST
from cache_service.validate import (MAX_PAGE_SIZE, check_heartbeat_interval, check_lease_ttl,
                                    check_name, check_pool_id)
from prefixcache.v1 import cache_service_pb2 as pb, events_pb2
from prefixcache_client.errors import invalid, not_found, precondition

DEFAULT_LEASE_TTL_S = 30.0
SNAPSHOT_BATCH_PAGES = 4096
# A packed subscriber's snapshot batches (SubscribeRequest.packed_hashes) hold pages up to about
# this many bytes of hashes and tokens (52k pages of 16 tokens; never fewer than
# SNAPSHOT_BATCH_PAGES): fewer messages to send and decode (the gateway cuts them into its ingest
# slices by slicing bytes), well under the 64 MiB message limit.
PACKED_SNAPSHOT_BATCH_BYTES = 4 << 20

# The order in which a Step's operations are applied (design.md §4, "One Step per engine step"):
# a release's final publish lands first; the write-through copies follow the checkpoints, so
# each carries its page's slot, and the worker's failed L3 writes, so that the writes listed again
# (l3_refill) go out with them; pages that releases free serve this step's matches and
# allocations; a request matched in this step sees what its siblings published in it. Every
# operation is planned (validated) in this same order before the first one is applied.
STEP_OPERATIONS: tuple[StepOperation, ...] = (
    Publish(), Checkpoint(), RemoteWriteFailures(), WriteThrough(), Release(), Renew(), Match(),
    Allocate(), LoadReport())


class CacheCore:
    def __init__(self, *, replay_events: int = 200_000, max_ops_per_step: int = 4096,
                 clock: Callable[[], float] = time.monotonic, remote=None,
                 eviction: str = "lru", retention: RetentionConfig | None = None):
        """`remote`: an L3 client (pagestore.L3Client) for pools with remote_lookup;
        `eviction`: every pool's eviction policy (cache_service/eviction.py)."""
        make_policy(eviction)  # an unknown name fails here, not at the first RegisterPool
        self.eviction = eviction
        self.retention = retention  # every pool's (cache_service/retention.py)
        self.remote = remote
        self.replay_events = replay_events
        self.max_ops_per_step = max_ops_per_step
        self.clock = clock
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._pools: dict[str, Pool] = {}
        self._leases = LeaseDirectory()
        self._closed = False
        # Called as sink(pool, log entry) for every batch, under the lock, in seq order: the
        # vLLM-format publisher (cache_service/zmq_publisher.py), which must never block.
        self.event_sinks: list[Callable[[Pool, list], None]] = []

    # ---- pools --------------------------------------------------------------------------

    def register_pool(self, req: pb.RegisterPoolRequest) -> pb.RegisterPoolResponse:
        check_pool_id(req.pool_id)
        if req.epoch == 0:
            raise invalid("epoch: must be > 0 (a new value each time the worker starts)")
        if not 1 <= req.page_size <= MAX_PAGE_SIZE:
            raise invalid(f"page_size: must be in [1, {MAX_PAGE_SIZE}], got {req.page_size}")
        if req.device_pages < 1:
            raise invalid("device_pages: must be >= 1")
        check_name("model_id", req.model_id, allow_empty=False)
        check_lease_ttl("lease_ttl_s", req.lease_ttl_s)
        if req.remote_write_policy not in pb.RemoteWritePolicy.values():
            raise invalid(f"remote_write_policy: unknown value {req.remote_write_policy}")
        if req.remote_write_policy == pb.REMOTE_WRITE_POLICY_HOT and req.remote_min_hits < 1:
            raise invalid("remote_min_hits: must be >= 1 with REMOTE_WRITE_POLICY_HOT")
        if req.remote_lookup and self.remote is None:
            raise precondition("remote_lookup: this cache service has no L3 configured "
                               "(start it with --redis-url)")
        cfg = PoolConfig(req.pool_id, req.epoch, req.page_size, req.device_pages, req.host_pages,
                         req.mamba_slots, req.model_id, req.lease_ttl_s or DEFAULT_LEASE_TTL_S,
                         req.remote_write_policy, req.remote_min_hits or 1, req.remote_lookup)
        with self._lock:
            old = self._pools.get(req.pool_id)
            if old is not None and old.cfg.epoch == cfg.epoch:
                if old.cfg.shape() != cfg.shape():
                    raise precondition(
                        f"epoch: pool '{req.pool_id}' epoch {req.epoch} is registered with another "
                        "shape; a worker that changes its pool must use a new epoch")
                return pb.RegisterPoolResponse(reset=False, next_seq=old.log.head_seq + 1)
            if old is not None:
                self._retire(old)
            pool = self._pools[req.pool_id] = Pool(cfg, self.replay_events, self.clock, self.remote,
                                                      self.eviction, self.retention)
            pool.log.keep_records = bool(self.event_sinks)  # replayed in vLLM's format
            self._flush(pool)
            return pb.RegisterPoolResponse(reset=True, next_seq=pool.log.head_seq + 1)

    def unregister_pool(self, req: pb.UnregisterPoolRequest) -> pb.UnregisterPoolResponse:
        with self._lock:
            pool = self._pool(req.pool_id)
            if req.epoch and req.epoch != pool.cfg.epoch:
                raise precondition(f"epoch: pool '{req.pool_id}' is at epoch {pool.cfg.epoch}, not "
                                   f"{req.epoch}: a newer worker registered it")
            self._retire(pool)
            del self._pools[req.pool_id]
            self._changed.notify_all()
        return pb.UnregisterPoolResponse()

    def _retire(self, pool: Pool) -> None:
        """Ends a pool epoch: its leases die and its subscribers see everything cleared."""
        for lease_id in pool.leases:
            self._leases.close(lease_id)
        pool.events.cleared()
        self._flush(pool)
        pool.closed = True

    def list_pools(self, req: pb.ListPoolsRequest) -> pb.ListPoolsResponse:
        with self._lock:
            return pb.ListPoolsResponse(pools=[
                pb.PoolInfo(pool_id=p.cfg.pool_id, epoch=p.cfg.epoch, page_size=p.cfg.page_size,
                            device_pages=p.cfg.device_pages, host_pages=p.cfg.host_pages,
                            mamba_slots=p.cfg.mamba_slots, model_id=p.cfg.model_id,
                            head_seq=p.log.head_seq)
                for p in self._pools.values()])

    def _pool(self, pool_id: str, field: str = "pool_id") -> Pool:
        pool = self._pools.get(pool_id)
        if pool is None:
            raise not_found(f"{field}: unknown pool '{pool_id}'")
        return pool

    # ---- the step -------------------------------------------------------------------------

    def step(self, req: pb.StepRequest) -> pb.StepResponse:
        with self._lock:
            pool = self._pool(req.pool_id)
            if req.epoch != pool.cfg.epoch:
                raise precondition(f"epoch: pool '{req.pool_id}' is at epoch {pool.cfg.epoch}, "
                                   f"not {req.epoch} (the worker restarted: register again)")
            ops = STEP_OPERATIONS
            parts = [op.read(req) for op in ops]
            # A lease this step names is alive (its worker is talking to us), however long the
            # worker's last forward took: renew it before expiring the silent ones.
            for op, part in zip(ops, parts):
                if part:
                    for lease_id in op.lease_ids(part):
                        if (held := pool.leases.get(lease_id)) is not None:
                            pool.renew(held)
            self._expire(pool)
            n_ops = sum(op.size(part) for op, part in zip(ops, parts) if part)
            if n_ops > self.max_ops_per_step:
                raise invalid(f"step: {n_ops} ops exceed the limit of {self.max_ops_per_step} "
                              "per step")
            check = StepCheck(pool, self._leases)
            plans = [op.plan(part, check) if part else part for op, part in zip(ops, parts)]
            resp = pb.StepResponse()
            for op, planned in zip(ops, plans):
                if planned or op.every_step:
                    op.apply(planned, pool, self._leases, resp)
            if pool.copies:
                resp.copies.extend(pool.copies)
                pool.copies.clear()
            if pool.expired:
                resp.expired_lease_ids.extend(pool.expired)
                pool.expired.clear()
            self._flush(pool)
            return resp

    # ---- leases, namespaces, stats --------------------------------------------------------

    def expire_leases(self) -> int:
        with self._lock:
            return sum(self._expire(pool) for pool in self._pools.values())

    def _expire(self, pool: Pool) -> int:
        n = pool.expire()
        if n:
            for lease_id in pool.expired[-n:]:
                self._leases.close(lease_id)
            self._flush(pool)
        return n

    def evict_namespace(self, req: pb.EvictNamespaceRequest) -> pb.EvictNamespaceResponse:
        ns = req.namespace
        with self._lock:
            pools = [self._pool(req.pool_id)] if req.pool_id else list(self._pools.values())
            targets = []
            for pool in pools:
                if ns.model_id and ns.model_id != pool.cfg.model_id:
                    continue
                if req.all_salts:
                    targets += [(pool, r) for (adapter, _), r in pool.roots.items()
                                if adapter == ns.adapter]
                    continue
                root = pool.root(ns.adapter, ns.salt, create=False)
                if root is not None:
                    targets.append((pool, root))
            if not targets:
                raise not_found(f"namespace: no pool holds namespace (model_id='{ns.model_id}', "
                                f"adapter='{ns.adapter}', salt=<{len(ns.salt)} bytes>)")
            resp = pb.EvictNamespaceResponse()
            for pool, root in targets:
                evicted = pool.evict_namespace(root)
                resp.removed_pages += evicted.removed_pages
                resp.deferred_pages += evicted.deferred_pages
                self._flush(pool)
            return resp

    def get_stats(self, req: pb.GetStatsRequest) -> pb.GetStatsResponse:
        with self._lock:
            pools = [self._pool(req.pool_id)] if req.pool_id else list(self._pools.values())
            return pb.GetStatsResponse(pools=[_pool_stats(p) for p in pools])

    # ---- events ---------------------------------------------------------------------------

    def _flush(self, pool: Pool) -> None:
        if pool.events.pending:
            entry = pool.log.append(pool.take_events())
            for sink in self.event_sinks:
                sink(pool, entry)
            self._changed.notify_all()

    def pool_records(self, pool_id: str, after_seq: int) -> tuple[Pool, list] | None:
        """For replaying in vLLM's format: the pool and the (seq, timestamp, records) of its
        batches after `after_seq`, or, when the replay buffer no longer holds them, one
        snapshot batch tagged with the head seq. None when no such pool is registered."""
        with self._lock:
            pool = self._pools.get(pool_id)
            if pool is None:
                return None
            batches = pool.log.records_since(after_seq)
            if batches is None:
                batches = [(pool.log.head_seq, time.time(), pool.snapshot_records())]
            return pool, batches

    def pool_ids(self) -> list[str]:
        with self._lock:
            return list(self._pools)

    def subscribe(self, req: pb.SubscribeRequest,
                  is_active: Callable[[], bool] = lambda: True) -> Iterator[pb.SubscribeResponse]:
        """Batches after (req.epoch, req.after_seq) when the replay buffer still holds them,
        otherwise a snapshot first; then live batches, and heartbeats when quiet."""
        check_heartbeat_interval(req.heartbeat_interval_s)
        interval = req.heartbeat_interval_s or 1.0
        with self._lock:
            pool = self._pool(req.pool_id)
        epoch, after, packed = req.epoch, req.after_seq, req.packed_hashes
        last_sent = time.monotonic()
        while is_active() and not self._closed:
            out: list[events_pb2.EventBatch] | None = None
            beat = None
            ended = False
            with self._lock:
                if pool.closed:
                    # Deliver the end of the retired epoch, then follow its successor, if any.
                    out = (pool.log.since(after, packed) if epoch == pool.cfg.epoch
                           else None) or None
                    successor = self._pools.get(req.pool_id)
                    ended = successor is None
                    pool = successor or pool
                elif epoch == pool.cfg.epoch and after >= 0:
                    out = pool.log.since(after, packed)
                if out is None and not pool.closed:
                    out = self._snapshot(pool, packed)
                if out:
                    epoch, after = out[-1].epoch, out[-1].seq
                elif not ended:
                    wait = interval - (time.monotonic() - last_sent)
                    if wait > 0:
                        self._changed.wait(wait)
                        continue
                    beat = events_pb2.Heartbeat(pool_id=pool.cfg.pool_id, epoch=pool.cfg.epoch,
                                                head_seq=pool.log.head_seq, timestamp=time.time(),
                                                load=pool.load)
            last_sent = time.monotonic()
            if beat is not None:
                yield pb.SubscribeResponse(heartbeat=beat)
            for batch in out or []:
                yield pb.SubscribeResponse(batch=batch)
            if ended:
                return

    def _snapshot(self, pool: Pool, packed: bool = False) -> list[events_pb2.EventBatch]:
        evs = pool.snapshot_events(packed)
        limit = SNAPSHOT_BATCH_PAGES
        if packed:
            page_bytes = 16 + 4 * pool.cfg.page_size
            limit = max(limit, PACKED_SNAPSHOT_BATCH_BYTES // page_bytes)
        batches, chunk, size = [], [], 0
        for ev in evs:
            chunk.append(ev)
            size += events.page_count(ev)
            if size >= limit:
                batches.append(chunk)
                chunk, size = [], 0
        if chunk or not batches:
            batches.append(chunk)
        now = time.time()
        out = [events_pb2.EventBatch(pool_id=pool.cfg.pool_id, epoch=pool.cfg.epoch,
                                     seq=pool.log.head_seq, timestamp=now, events=b,
                                     snapshot=True) for b in batches]
        out[-1].snapshot_end = True
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._changed.notify_all()


def _pool_stats(pool: Pool) -> pb.PoolStats:
    c = pool.counters
    hits = c.hit_tokens[DEVICE] + c.hit_tokens[HOST] + c.hit_tokens[REMOTE]
    totals = {DEVICE: pool.cfg.device_pages, HOST: pool.cfg.host_pages}
    media = []
    pinned = pool.pinned_pages()
    for m in MEDIA:
        free = len(pool.free[m])
        media.append(pb.MediumStats(
            medium=m, total_pages=totals[m], free_pages=free, used_pages=totals[m] - free,
            cached_pages=pool.cached[m], evictable_pages=pool.cached[m] - pinned[m],
            pinned_pages=pinned[m], evictions=c.evictions[m]))
    return pb.PoolStats(
        pool_id=pool.cfg.pool_id, epoch=pool.cfg.epoch, queried_tokens=c.queried_tokens,
        hit_tokens_device=c.hit_tokens[DEVICE], hit_tokens_host=c.hit_tokens[HOST],
        hit_tokens_remote=c.hit_tokens[REMOTE], skipped_prefill_tokens=hits,
        computed_prefill_tokens=c.queried_tokens - hits, media=media,
        mamba_slots_total=pool.cfg.mamba_slots,
        mamba_slots_used=pool.cfg.mamba_slots - len(pool.slots.free),
        mamba_evictions=pool.slots.evictions, active_leases=len(pool.leases),
        lease_expiries=c.lease_expiries, namespaces=len(pool.roots),
        duplicate_pages=c.duplicate_pages, remote_writes=c.remote_writes,
        retained_pages=pool.retention.protected_pages,
        retained_requests=pool.retention.protected_requests,
        retention_ignored=pool.retention.ignored)
