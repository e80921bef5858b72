"""This replica's indexer roles under `--index-backend redis` (design.md, "Many gateway replicas"):
one `Indexer` (gateway/core/shared_indexer.py) per worker the replica admitted. Each tries the
worker's Redis lease; the holder writes the worker's event stream into the shared index, every
other replica only reads it. A worker that leaves this replica's routing has its indexer stopped
and its lease released, so that a replica still routing to it takes over at once. The indexers
reach the cache services as the gateway's feeds do (`connect`: `WorkerSettings.cache_channel`,
with the gateway's TLS and service token).
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable

import grpc

from gateway.core.shared_index import SharedIndexStore
from gateway.core.shared_indexer import Indexer
from service_shell import kv

log = logging.getLogger("gateway.indexer_roles")


def replica_owner() -> str:
    """A lease owner unique to this process: host, pid and a random tag (a restarted replica
    with a reused pid must not believe it holds its predecessor's leases)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class IndexerRoles:
    """`join(worker, cache address)` when a worker is admitted, `leave(worker)` when it is
    removed, `close()` at shutdown; thread-safe."""

    def __init__(self, store: SharedIndexStore, connect: Callable[[str], grpc.Channel],
                 owner: str | None = None) -> None:
        self.store, self._connect = store, connect
        self.owner = owner or replica_owner()
        self._indexers: dict[str, Indexer] = {}
        self._lock = threading.Lock()

    def join(self, worker: str, cache_address: str) -> None:
        indexer = Indexer(self.store, worker, cache_address, self.owner, connect=self._connect)
        with self._lock:
            previous = self._indexers.pop(worker, None)
            self._indexers[worker] = indexer
        if previous is not None:  # re-admitted (a new address): follow the new one
            previous.stop()
        indexer.start()
        log.info(kv("indexer_started", worker=worker, cache=cache_address, owner=self.owner))

    def leave(self, worker: str) -> None:
        with self._lock:
            indexer = self._indexers.pop(worker, None)
        if indexer is not None:
            indexer.stop()  # releases the lease if held: another replica takes it at once
            log.info(kv("indexer_stopped", worker=worker, owner=self.owner))

    def held(self) -> int:
        """Workers whose lease this replica holds now (it writes their events)."""
        with self._lock:
            return sum(ix.holding for ix in self._indexers.values())

    def close(self) -> None:
        with self._lock:
            names = list(self._indexers)
        for name in names:
            self.leave(name)
