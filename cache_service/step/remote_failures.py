"""Failed L3 writes: the worker's report of the writes (CopyOps to REMOTE) it could not do since
its last step (`StepRequest.failed_remote_writes`), so that the pool writes them again once the
store answers (cache_service/l3_refill.py; issue 25, finding 7). Not an op against the limit per
step: it has a bound of its own."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from cache_service.leases import LeaseDirectory
from cache_service.step.base import StepCheck, StepOperation
from prefixcache.v1 import cache_service_pb2 as pb
from prefixcache_client.errors import invalid
from prefixcache_client.hash import HASH_BYTES

if TYPE_CHECKING:
    from cache_service.pool import Pool

MAX_FAILED_PER_STEP = 65536  # page hashes (1 MiB); the worker sends at most this many a step


class RemoteWriteFailures(StepOperation):
    def read(self, req: pb.StepRequest) -> Sequence[bytes]:
        data = req.failed_remote_writes
        if not data:
            return ()
        if len(data) % HASH_BYTES:
            raise invalid(f"failed_remote_writes: {len(data)} bytes is not a whole number of "
                          f"{HASH_BYTES}-byte page hashes")
        if len(data) > MAX_FAILED_PER_STEP * HASH_BYTES:
            raise invalid(f"failed_remote_writes: {len(data) // HASH_BYTES} page hashes exceed "
                          f"the limit of {MAX_FAILED_PER_STEP} per step")
        return (data,)

    def size(self, part: Sequence[bytes]) -> int:
        return 0

    def plan(self, part: Sequence[bytes], check: StepCheck) -> list[bytes]:
        return list(part)

    def apply(self, planned: list[bytes], pool: Pool, directory: LeaseDirectory,
              resp: pb.StepResponse) -> None:
        for data in planned:
            pool.remote_writes_failed(data)
