"""The INDEXER role of the shared index (gateway/core/shared_index.py): a replica that holds a
worker's Redis lease consumes that worker's event stream and writes it to Redis, one round trip
per event batch; every other replica only reads.

`StreamWriter` keeps the stream rules of `KvIndex.apply` (events.proto: seq order within an
epoch, a snapshot starts with AllBlocksCleared and ends at snapshot_end, a gap or an unannounced
epoch means re-subscribing) and turns each batch into set operations on the worker's slots.
It starts from the worker's row in Redis: a new lease holder resumes the stream from the seq
its predecessor wrote last (the cache service replays its buffer; no snapshot unless the buffer
no longer holds that point or the predecessor died inside a snapshot).

`Indexer` is one thread per worker that tries the lease (SET NX PX) every `retry_s`, and while it
holds it follows the worker's Subscribe stream, on a channel from `connect`: the gateway's own
to the cache services (`WorkerSettings.cache_channel`: its TLS and service token). It writes at
least once a heartbeat interval (heartbeats renew the lease and the worker's last_seen); a write
refused because the lease moved on ends its turn, and the replica goes back to trying. A
failed stream (refused credentials, an unreachable service) releases the lease and waits two
retries, so that another replica, one whose token, TLS or route works, takes the worker.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import redis

from gateway.core.shared_index import TIERS, SharedIndexStore, TableRow, page_suffix
from gateway.core.stream_items import MEDIUM_TIER
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import cache_service_pb2_grpc as cpb_grpc
from prefixcache.v1 import events_pb2
from service_shell import kv

log = logging.getLogger("gateway.shared_indexer")


class LeaseLost(Exception):
    """A write was refused: another replica holds the worker's lease now."""


class Resubscribe(Exception):
    """The stream broke its rules (a gap, an epoch joined midway): subscribe again from
    (epoch, after_seq)."""

    def __init__(self, reason: str, epoch: int, after_seq: int) -> None:
        super().__init__(reason)
        self.epoch, self.after_seq = epoch, after_seq


@dataclass(slots=True)
class IndexerCounters:
    batches: int = 0
    page_events: int = 0
    snapshots: int = 0
    resubscribes: int = 0
    leases_taken: int = 0


class StreamWriter:
    """Applies one worker's batches to the shared index as the lease holder `owner`."""

    def __init__(self, store: SharedIndexStore, pool_id: str, owner: str,
                 wall: Callable[[], float] = time.time) -> None:
        self.store, self.pool_id, self.owner, self._wall = store, pool_id, owner, wall
        row = store.row(pool_id)
        self.row = row or TableRow(store.new_slot(), 0, -1, wall(), False)
        self.started = row is not None and not row.in_snapshot and row.last_seq >= 0
        # A snapshot is built under its own slot and becomes the row's at snapshot_end.
        self._building: int | None = None
        self.counters = IndexerCounters()

    def resume_point(self) -> tuple[int, int]:
        """SubscribeRequest(epoch, after_seq): right after the last batch written, -1 (a
        snapshot) when none was or a snapshot was cut short."""
        if not self.started or self.row.in_snapshot or self._building is not None:
            return self.row.epoch, -1
        return self.row.epoch, self.row.last_seq

    def apply(self, batch: events_pb2.EventBatch) -> int:
        """Writes one batch; the page events written. Raises Resubscribe or LeaseLost."""
        row = self.row
        events = batch.events
        if batch.snapshot and events and events[0].WhichOneof("event") == "cleared":
            self._building = self.store.new_slot()
            row.epoch, row.in_snapshot = batch.epoch, True
            self.counters.snapshots += 1
        elif batch.epoch != row.epoch or not self.started:
            if batch.epoch != row.epoch:
                row.slot, row.epoch, row.last_seq, self.started = self.store.new_slot(), batch.epoch, -1, False
            if batch.snapshot or batch.seq != 0:
                raise Resubscribe(f"epoch {batch.epoch} joined at seq {batch.seq}", batch.epoch, -1)
            self.started = True
        elif batch.snapshot:
            if self._building is None:
                raise Resubscribe(f"snapshot batch seq {batch.seq} without its start", row.epoch, -1)
        elif self._building is not None:
            raise Resubscribe(f"live batch seq {batch.seq} inside a snapshot", row.epoch, -1)
        elif batch.seq <= row.last_seq:
            return 0  # a duplicate: already written
        elif batch.seq != row.last_seq + 1:
            raise Resubscribe(f"gap: seq {batch.seq} after {row.last_seq}", row.epoch, row.last_seq)
        ops: list[tuple[str, bytes, int]] = []
        n = self._ops(events, ops)
        if batch.snapshot:
            if batch.snapshot_end:
                row.slot, self._building = self._building, None
                row.in_snapshot, row.last_seq, self.started = False, batch.seq, True
        else:
            row.last_seq = batch.seq
        self._write(ops)
        self.counters.batches += 1
        self.counters.page_events += n
        return n

    def heartbeat(self, hb: events_pb2.Heartbeat) -> None:
        """Freshness and a lease renewal; a missed batch (head_seq beyond) means resubscribing."""
        if hb.epoch == self.row.epoch and self.started and self._building is None \
                and hb.head_seq > self.row.last_seq:
            raise Resubscribe(f"heartbeat head seq {hb.head_seq} > written {self.row.last_seq}",
                              self.row.epoch, self.row.last_seq)
        self._write([])

    def leave(self) -> None:
        """The worker is gone: its row is deleted (its pages expire by TTL)."""
        if not self.store.write(self.owner, self.pool_id, None, []):
            raise LeaseLost(self.pool_id)

    def _ops(self, events, ops: list[tuple[str, bytes, int]]) -> int:
        n = 0
        for ev in events:
            kind = ev.WhichOneof("event")
            if kind == "cleared":
                if self._building is not None:
                    continue  # the snapshot's own start: its slot is already fresh
                ops.clear()  # what came before in this batch is cleared anyway
                self.row.slot = self.store.new_slot()
                continue
            body = ev.stored if kind == "stored" else ev.removed if kind == "removed" else None
            tier = None if body is None else MEDIUM_TIER.get(body.medium)
            if tier is None:
                continue
            slot = self._building if self._building is not None else self.row.slot
            op, member = ("+" if kind == "stored" else "-"), slot * TIERS + tier
            ops.extend((op, page_suffix(h), member) for h in body.block_hashes)
            n += len(body.block_hashes)
        return n

    def _write(self, ops: list[tuple[str, bytes, int]]) -> None:
        self.row.last_seen = self._wall()
        if not self.store.write(self.owner, self.pool_id, self.row, ops):
            raise LeaseLost(self.pool_id)


class Indexer:
    """One worker's indexer role on this replica: take the lease when free, follow the stream."""

    def __init__(self, store: SharedIndexStore, pool_id: str, cache_address: str, owner: str,
                 *, connect: Callable[[str], grpc.Channel], retry_s: float = 0.5,
                 heartbeat_s: float = 0.25) -> None:
        if heartbeat_s * 2 * 1000 >= store.config.lease_ms:
            raise ValueError(f"heartbeat {heartbeat_s}s must be under half the lease "
                             f"({store.config.lease_ms} ms)")
        self.store, self.pool_id, self.cache_address, self.owner = store, pool_id, cache_address, owner
        self.retry_s, self.heartbeat_s, self._connect = retry_s, heartbeat_s, connect
        self.writer: StreamWriter | None = None
        self.counters = IndexerCounters()
        self._stop = threading.Event()
        self._call: grpc.Future | None = None
        self._thread = threading.Thread(target=self._run, name=f"indexer-{pool_id}", daemon=True)

    def start(self) -> Indexer:
        self._thread.start()
        return self

    @property
    def holding(self) -> bool:
        return self.writer is not None

    def stop(self, release: bool = True) -> None:
        """Ends the role; `release=False` leaves the lease to expire (as a crash would)."""
        self._stop.set()
        if self._call is not None:
            self._call.cancel()
        self._thread.join(10)
        if release:
            try:
                self.store.release(self.pool_id, self.owner)
            except redis.RedisError:
                pass

    def _run(self) -> None:
        with self._connect(self.cache_address) as channel:
            stub = cpb_grpc.CacheServiceStub(channel)
            while not self._stop.is_set():
                try:
                    if self.store.try_lease(self.pool_id, self.owner):
                        self.counters.leases_taken += 1
                        log.info(kv("indexer_lease_taken", pool=self.pool_id, owner=self.owner))
                        self._follow(stub)
                except (redis.RedisError, grpc.RpcError, LeaseLost) as exc:
                    code = exc.code().name if isinstance(exc, grpc.RpcError) else None
                    log.warning(kv("indexer_turn_ended", pool=self.pool_id, owner=self.owner,
                                   error=type(exc).__name__, code=code, detail=str(exc)[:200]))
                    if code is not None:  # the stream failed here: let another replica try
                        self._step_aside()
                        continue
                finally:
                    self.writer = None
                self._stop.wait(self.retry_s)

    def _step_aside(self) -> None:
        """After a failed stream: releases the lease and waits two retries before trying again,
        so that another replica (one whose token, TLS or route works; they try every retry) takes
        the worker first; alone, this replica is back after 2 x retry_s. Without it a replica
        refused turn after turn kept its lease until it expired, then raced for it again."""
        try:
            self.store.release(self.pool_id, self.owner)
        except redis.RedisError:
            pass
        self._stop.wait(2 * self.retry_s)

    def _follow(self, stub: cpb_grpc.CacheServiceStub) -> None:
        writer = self.writer = StreamWriter(self.store, self.pool_id, self.owner)
        writer.counters = self.counters
        while not self._stop.is_set():
            epoch, after = writer.resume_point()
            self._call = stub.Subscribe(cpb.SubscribeRequest(
                pool_id=self.pool_id, epoch=epoch, after_seq=after,
                heartbeat_interval_s=self.heartbeat_s))
            try:
                for item in self._call:
                    if item.WhichOneof("item") == "batch":
                        writer.apply(item.batch)
                    else:
                        writer.heartbeat(item.heartbeat)
                return  # the stream ended (the worker unregistered)
            except Resubscribe as exc:
                self.counters.resubscribes += 1
                log.info(kv("indexer_resubscribe", pool=self.pool_id, reason=str(exc)))
                self._call.cancel()
            except grpc.RpcError as exc:
                if self._stop.is_set() or exc.code() == grpc.StatusCode.CANCELLED:
                    return
                raise
