"""Checkpoint: a Mamba state slot attached to (or detached from) a published page
(design.md §4, design.md lesson 8)."""
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


@dataclass(slots=True)
class PlannedCheckpoint:
    lease: Lease
    page_index: int
    detach: bool


class Checkpoint(StepOperation):
    def read(self, req: pb.StepRequest) -> Sequence[pb.CheckpointOp]:
        return req.checkpoints

    def lease_ids(self, part: Sequence[pb.CheckpointOp]) -> Iterable[str]:
        return (op.lease_id for op in part)

    def plan(self, part: Sequence[pb.CheckpointOp], check: StepCheck) -> list[PlannedCheckpoint]:
        planned = []
        pool = check.pool
        for i, op in enumerate(part):
            where = f"checkpoints[{i}]"
            held = check.lease(op.lease_id, where)
            if not pool.cfg.mamba_slots:
                raise invalid(f"{where}: pool '{pool.cfg.pool_id}' has no Mamba slots "
                              "(mamba_slots=0)")
            published = check.published_pages.get(held.lease_id, held.published)
            if op.page_index >= published:
                raise invalid(f"{where}.page_index: page {op.page_index} is not published "
                              f"(the lease has {published} published pages)")
            planned.append(PlannedCheckpoint(held, op.page_index, op.detach))
        return planned

    def apply(self, planned: list[PlannedCheckpoint], pool: Pool, directory: LeaseDirectory,
              resp: pb.StepResponse) -> None:
        for p in planned:
            c = pool.checkpoint(p.lease, p.page_index, p.detach)
            resp.checkpoints.add(lease_id=c.lease_id, page_index=c.page_index, ok=c.ok,
                                 slot=c.slot, already_present=c.already_present, reason=c.reason)
