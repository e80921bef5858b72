"""The ends and renewals of leases: Release unpins a lease's path and frees its pages that never
entered the tree; Renew keeps a lease alive without any other op (design.md §2 "lease", §4)."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from cache_service.leases import Lease, LeaseDirectory
from cache_service.step.base import StepCheck, StepOperation
from prefixcache.v1 import cache_service_pb2 as pb
from prefixcache_client.errors import invalid

if TYPE_CHECKING:
    from cache_service.pool import Pool


class Release(StepOperation):
    def read(self, req: pb.StepRequest) -> Sequence[pb.ReleaseOp]:
        return req.releases

    def lease_ids(self, part: Sequence[pb.ReleaseOp]) -> Iterable[str]:
        return (op.lease_id for op in part)

    def plan(self, part: Sequence[pb.ReleaseOp], check: StepCheck) -> list[Lease]:
        planned = []
        for i, op in enumerate(part):
            held = check.lease(op.lease_id, f"releases[{i}]")
            if held.lease_id in check.ended:
                raise invalid(f"releases[{i}].lease_id: lease '{op.lease_id}' is released twice")
            check.ended.add(held.lease_id)
            planned.append(held)
        return planned

    def apply(self, planned: list[Lease], pool: Pool, directory: LeaseDirectory,
              resp: pb.StepResponse) -> None:
        for lease in planned:
            pool.release(lease)
            directory.close(lease.lease_id)


class Renew(StepOperation):
    def read(self, req: pb.StepRequest) -> Sequence[str]:
        return req.renew_lease_ids

    def lease_ids(self, part: Sequence[str]) -> Iterable[str]:
        return part

    def plan(self, part: Sequence[str], check: StepCheck) -> list[Lease]:
        planned = []
        for i, lease_id in enumerate(part):
            where = f"renew_lease_ids[{i}]"
            planned.append(check.live_lease(lease_id, where, where))
        return planned

    def apply(self, planned: list[Lease], pool: Pool, directory: LeaseDirectory,
              resp: pb.StepResponse) -> None:
        for lease in planned:
            pool.renew(lease)
