"""Allocate: new device pages for a lease, all or nothing, evicting (or demoting) LRU pages
that no request pins (design.md §4, design.md lesson 13)."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cache_service.leases import Lease, LeaseDirectory
from cache_service.step.base import StepCheck, StepOperation
from prefixcache.v1 import cache_service_pb2 as pb
from prefixcache_client.errors import invalid

if TYPE_CHECKING:
    from cache_service.pool import Pool

MAX_PAGES_PER_ALLOCATION = 65536


@dataclass(slots=True)
class PlannedAllocation:
    lease: Lease
    num_pages: int


class Allocate(StepOperation):
    def read(self, req: pb.StepRequest) -> Sequence[pb.AllocateOp]:
        return req.allocations

    def lease_ids(self, part: Sequence[pb.AllocateOp]) -> Iterable[str]:
        return (op.lease_id for op in part)

    def plan(self, part: Sequence[pb.AllocateOp], check: StepCheck) -> list[PlannedAllocation]:
        planned = []
        for i, op in enumerate(part):
            where = f"allocations[{i}]"
            held = check.live_lease(op.lease_id, where, f"{where}.lease_id")
            if not 1 <= op.num_pages <= MAX_PAGES_PER_ALLOCATION:
                raise invalid(f"{where}.num_pages: must be in [1, {MAX_PAGES_PER_ALLOCATION}], "
                              f"got {op.num_pages}")
            planned.append(PlannedAllocation(held, op.num_pages))
        return planned

    def apply(self, planned: list[PlannedAllocation], pool: Pool, directory: LeaseDirectory,
              resp: pb.StepResponse) -> None:
        for p in planned:
            a = pool.allocate(p.lease, p.num_pages)
            resp.allocations.add(lease_id=a.lease_id, ok=a.ok, device_pages=a.device_pages,
                                 reason=a.reason)
            pool.renew(p.lease)
