"""CacheCore: every pool of one cache service, usable embedded (no network) or behind gRPC.

Each public method takes the request message of the RPC of the same name and returns its
response. Calls are serialised by one lock. Bad input raises `CacheError` before any state
changes: a whole step is validated before its first op is applied.

Longer than 400 lines: validation of every op kind lives beside the step it guards; it is split
together with `pool.py` by the cache-core rewrite (issue "The cache core at SGLang's speed").
"""
from __future__ import annotations

import itertools
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from cache_service import events
from cache_service.pool import MEDIA, REMOTE, Lease, Pool, PoolConfig
from cache_service.tree import DEVICE, HOST
from prefixcache.v1 import cache_service_pb2 as pb, events_pb2
from prefixcache_client.errors import invalid, not_found, precondition
from prefixcache_client.hash import MAX_NAME_BYTES, token_bytes

POOL_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
MAX_PAGE_SIZE = 4096
MAX_PROMPT_TOKENS = 1 << 20
MAX_PAGES_PER_ALLOCATION = 65536
DEFAULT_LEASE_TTL_S = 30.0
SNAPSHOT_BATCH_PAGES = 4096


@dataclass(slots=True)
class _StepPlan:
    """A validated step: leases resolved, tokens converted once."""
    publishes: list[tuple[Lease, bytes, int]]
    checkpoints: list[tuple[Lease, int, bool]]
    releases: list[Lease]
    renewals: list[Lease]
    matches: list[tuple[pb.MatchOp, bytes, float]]
    allocations: list[tuple[Lease, int]]


class CacheCore:
    def __init__(self, *, replay_events: int = 200_000, max_ops_per_step: int = 4096,
                 clock: Callable[[], float] = time.monotonic, remote=None):
        """`remote`: an L3 client (cache_service.l3.L3Client) for pools with remote_lookup."""
        self.remote = remote
        self.replay_events = replay_events
        self.max_ops_per_step = max_ops_per_step
        self.clock = clock
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._pools: dict[str, Pool] = {}
        self._lease_pool: dict[str, str] = {}
        self._lease_ids = itertools.count(1)
        self._closed = False

    # ---- pools --------------------------------------------------------------------------

    def register_pool(self, req: pb.RegisterPoolRequest) -> pb.RegisterPoolResponse:
        _check_pool_id(req.pool_id)
        if req.epoch == 0:
            raise invalid("epoch: must be > 0 (a new value each time the worker starts)")
        if not 1 <= req.page_size <= MAX_PAGE_SIZE:
            raise invalid(f"page_size: must be in [1, {MAX_PAGE_SIZE}], got {req.page_size}")
        if req.device_pages < 1:
            raise invalid("device_pages: must be >= 1")
        _check_name("model_id", req.model_id, allow_empty=False)
        if req.lease_ttl_s < 0:
            raise invalid(f"lease_ttl_s: must be >= 0, got {req.lease_ttl_s}")
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
            pool = self._pools[req.pool_id] = Pool(cfg, self.replay_events, self.clock, self.remote)
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
            self._lease_pool.pop(lease_id, None)
        pool.pending.append(["cleared"])
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
            # A lease this step names is alive (its worker is talking to us), however long the
            # worker's last forward took: renew it before expiring the silent ones.
            for lease_id in _named_leases(req):
                if (held := pool.leases.get(lease_id)) is not None:
                    pool.renew(held)
            self._expire(pool)
            plan = self._validate(pool, req)
            resp = pb.StepResponse()
            for lease, data, pages in plan.publishes:
                resp.publishes.append(pool.publish(lease, data, pages))
                pool.renew(lease)
            for lease, index, detach in plan.checkpoints:
                resp.checkpoints.append(pool.checkpoint(lease, index, detach))
            pool.flush_write_through()  # after checkpoints, so the copies carry their slots
            for lease in plan.releases:
                pool.release(lease)
                del self._lease_pool[lease.lease_id]
            for lease in plan.renewals:
                pool.renew(lease)
            pool.last_match = None  # reused only between the matches of this step
            for op, data, ttl in plan.matches:
                lease_id = f"{pool.cfg.pool_id}/{pool.cfg.epoch}/{next(self._lease_ids)}"
                self._lease_pool[lease_id] = pool.cfg.pool_id
                resp.matches.append(pool.match(op.request_id, lease_id, op.namespace.adapter,
                                               op.namespace.salt, data, ttl, op.is_resume,
                                               op.skip_host_load, op.omit_page_hashes))
            pool.last_match = None
            for lease, n in plan.allocations:
                resp.allocations.append(pool.allocate(lease, n))
                pool.renew(lease)
            if req.HasField("load"):
                pool.load.CopyFrom(req.load)
            resp.copies.extend(pool.copies)
            pool.copies.clear()
            resp.expired_lease_ids.extend(pool.expired)
            pool.expired.clear()
            self._flush(pool)
            return resp

    def _validate(self, pool: Pool, req: pb.StepRequest) -> _StepPlan:
        n_ops = (len(req.publishes) + len(req.checkpoints) + len(req.releases) + len(req.matches)
                 + len(req.allocations) + len(req.renew_lease_ids))
        if n_ops > self.max_ops_per_step:
            raise invalid(f"step: {n_ops} ops exceed the limit of {self.max_ops_per_step} per step")
        lease = lambda lease_id, where: self._lease(pool, lease_id, where)  # noqa: E731
        plan = _StepPlan([], [], [], [], [], [])
        published_pages: dict[str, int] = {}
        for i, op in enumerate(req.publishes):
            where = f"publishes[{i}]"
            held = lease(op.lease_id, where)
            if held.lease_id in published_pages:
                raise invalid(f"{where}.lease_id: lease '{op.lease_id}' is published twice in one step")
            data = _tokens_of(op.append_token_ids, op.packed_append_token_ids,
                              f"{where}.append_token_ids")
            full = (len(held.data) + len(data)) // pool.stride
            if op.computed_pages > min(full, len(held.pages)):
                raise invalid(
                    f"{where}.computed_pages: {op.computed_pages} exceeds the lease's {full} full "
                    f"pages of tokens or its {len(held.pages)} allocated pages")
            published_pages[held.lease_id] = max(op.computed_pages, len(held.nodes))
            plan.publishes.append((held, data, op.computed_pages))
        for i, op in enumerate(req.checkpoints):
            where = f"checkpoints[{i}]"
            held = lease(op.lease_id, where)
            if not pool.cfg.mamba_slots:
                raise invalid(f"{where}: pool '{pool.cfg.pool_id}' has no Mamba slots (mamba_slots=0)")
            published = published_pages.get(held.lease_id, len(held.nodes))
            if op.page_index >= published:
                raise invalid(f"{where}.page_index: page {op.page_index} is not published "
                              f"(the lease has {published} published pages)")
            plan.checkpoints.append((held, op.page_index, op.detach))
        ended: set[str] = set()
        for i, op in enumerate(req.releases):
            held = lease(op.lease_id, f"releases[{i}]")
            if held.lease_id in ended:
                raise invalid(f"releases[{i}].lease_id: lease '{op.lease_id}' is released twice")
            ended.add(held.lease_id)
            plan.releases.append(held)
        for i, lease_id in enumerate(req.renew_lease_ids):
            plan.renewals.append(self._live(lease(lease_id, f"renew_lease_ids[{i}]"), ended,
                                            f"renew_lease_ids[{i}]"))
        for i, op in enumerate(req.matches):
            where = f"matches[{i}]"
            ns = op.namespace
            if ns.model_id and ns.model_id != pool.cfg.model_id:
                raise invalid(f"{where}.namespace.model_id: '{ns.model_id}' is not the pool's model "
                              f"'{pool.cfg.model_id}'")
            _check_name(f"{where}.namespace.adapter", ns.adapter)
            _check_name(f"{where}.namespace.salt", ns.salt)
            n_tokens = len(op.token_ids) + len(op.packed_token_ids) // 4
            if n_tokens > MAX_PROMPT_TOKENS:
                raise invalid(f"{where}.token_ids: {n_tokens} tokens exceed the limit of "
                              f"{MAX_PROMPT_TOKENS}")
            if op.lease_ttl_s < 0:
                raise invalid(f"{where}.lease_ttl_s: must be >= 0")
            data = _tokens_of(op.token_ids, op.packed_token_ids, f"{where}.token_ids")
            plan.matches.append((op, data, op.lease_ttl_s or pool.cfg.lease_ttl_s))
        for i, op in enumerate(req.allocations):
            where = f"allocations[{i}]"
            held = self._live(lease(op.lease_id, where), ended, f"{where}.lease_id")
            if not 1 <= op.num_pages <= MAX_PAGES_PER_ALLOCATION:
                raise invalid(f"{where}.num_pages: must be in [1, {MAX_PAGES_PER_ALLOCATION}], "
                              f"got {op.num_pages}")
            plan.allocations.append((held, op.num_pages))
        return plan

    def _lease(self, pool: Pool, lease_id: str, where: str) -> Lease:
        held = pool.leases.get(lease_id)
        if held is not None:
            return held
        owner = self._lease_pool.get(lease_id)
        if owner is not None:
            raise invalid(f"{where}: lease '{lease_id}' belongs to pool '{owner}', "
                          f"not '{pool.cfg.pool_id}'")
        raise not_found(f"{where}: unknown or expired lease '{lease_id}'")

    @staticmethod
    def _live(lease: Lease, ended: set[str], where: str) -> Lease:
        if lease.lease_id in ended:
            raise invalid(f"{where}: lease '{lease.lease_id}' is released earlier in this step")
        return lease

    # ---- leases, namespaces, stats --------------------------------------------------------

    def expire_leases(self) -> int:
        with self._lock:
            return sum(self._expire(pool) for pool in self._pools.values())

    def _expire(self, pool: Pool) -> int:
        n = pool.expire()
        if n:
            for lease_id in pool.expired[-n:]:
                self._lease_pool.pop(lease_id, None)
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
                removed, deferred = pool.evict_namespace(root)
                resp.removed_pages += removed
                resp.deferred_pages += deferred
                self._flush(pool)
            return resp

    def get_stats(self, req: pb.GetStatsRequest) -> pb.GetStatsResponse:
        with self._lock:
            pools = [self._pool(req.pool_id)] if req.pool_id else list(self._pools.values())
            return pb.GetStatsResponse(pools=[_pool_stats(p) for p in pools])

    # ---- events ---------------------------------------------------------------------------

    def _flush(self, pool: Pool) -> None:
        if pool.pending:
            pool.log.append(pool.take_events())
            self._changed.notify_all()

    def subscribe(self, req: pb.SubscribeRequest,
                  is_active: Callable[[], bool] = lambda: True) -> Iterator[pb.SubscribeResponse]:
        """Batches after (req.epoch, req.after_seq) when the replay buffer still holds them,
        otherwise a snapshot first; then live batches, and heartbeats when quiet."""
        interval = req.heartbeat_interval_s or 1.0
        if interval < 0.05:
            raise invalid("heartbeat_interval_s: must be >= 0.05")
        with self._lock:
            pool = self._pool(req.pool_id)
        epoch, after = req.epoch, req.after_seq
        last_sent = time.monotonic()
        while is_active() and not self._closed:
            out: list[events_pb2.EventBatch] | None = None
            beat = None
            ended = False
            with self._lock:
                if pool.closed:
                    # Deliver the end of the retired epoch, then follow its successor, if any.
                    out = (pool.log.since(after) if epoch == pool.cfg.epoch else None) or None
                    successor = self._pools.get(req.pool_id)
                    ended = successor is None
                    pool = successor or pool
                elif epoch == pool.cfg.epoch and after >= 0:
                    out = pool.log.since(after)
                if out is None and not pool.closed:
                    out = self._snapshot(pool)
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

    def _snapshot(self, pool: Pool) -> list[events_pb2.EventBatch]:
        evs = pool.snapshot_events()
        batches, chunk, size = [], [], 0
        for ev in evs:
            chunk.append(ev)
            size += events.page_count(ev)
            if size >= SNAPSHOT_BATCH_PAGES:
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


def _named_leases(req: pb.StepRequest) -> Iterator[str]:
    for ops in (req.publishes, req.checkpoints, req.releases, req.allocations):
        for op in ops:
            yield op.lease_id
    yield from req.renew_lease_ids


def _check_pool_id(pool_id: str) -> None:
    if not POOL_ID.match(pool_id):
        raise invalid(f"pool_id: '{pool_id}' must be 1..128 characters of [A-Za-z0-9._:-]")


def _check_name(field: str, value: str, allow_empty: bool = True) -> None:
    size = len(value.encode("utf-8"))
    if size > MAX_NAME_BYTES or (not allow_empty and size == 0):
        raise invalid(f"{field}: must be {0 if allow_empty else 1}..{MAX_NAME_BYTES} UTF-8 bytes, "
                      f"got {size}")


def _tokens_of(ids, packed: bytes, field: str) -> bytes:
    """The u32-le bytes of a token list given either as int64 ids or already packed."""
    if packed:
        if ids:
            raise invalid(f"{field}: set either {field.rsplit('.', 1)[-1]} or its packed_ form, not both")
        if len(packed) % 4:
            raise invalid(f"{field}: packed length {len(packed)} is not a multiple of 4 bytes")
        return packed
    try:
        return token_bytes(ids, field)
    except ValueError as exc:
        raise invalid(str(exc)) from None


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
        mamba_slots_used=pool.cfg.mamba_slots - len(pool.free_slots),
        mamba_evictions=c.mamba_evictions, active_leases=len(pool.leases),
        lease_expiries=c.lease_expiries, namespaces=len(pool.roots),
        duplicate_pages=c.duplicate_pages, remote_writes=c.remote_writes)
