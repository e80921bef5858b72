"""Publish: a lease's newly computed full pages enter the tree, hashed at insert (design.md §4,
design.md lessons 1 and 3)."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cache_service.leases import Lease, LeaseDirectory
from cache_service.step.base import StepCheck, StepOperation
from cache_service.validate import tokens_of
from prefixcache.v1 import cache_service_pb2 as pb
from prefixcache_client.errors import invalid

if TYPE_CHECKING:
    from cache_service.pool import Pool


@dataclass(slots=True)
class PlannedPublish:
    lease: Lease
    append: bytes  # tokens appended to the lease's sequence, u32-le
    computed_pages: int


class Publish(StepOperation):
    def read(self, req: pb.StepRequest) -> Sequence[pb.PublishOp]:
        return req.publishes

    def lease_ids(self, part: Sequence[pb.PublishOp]) -> Iterable[str]:
        return (op.lease_id for op in part)

    def plan(self, part: Sequence[pb.PublishOp], check: StepCheck) -> list[PlannedPublish]:
        planned = []
        stride = check.pool.stride
        for i, op in enumerate(part):
            where = f"publishes[{i}]"
            held = check.lease(op.lease_id, where)
            if held.lease_id in check.published_pages:
                raise invalid(f"{where}.lease_id: lease '{op.lease_id}' is published twice in "
                              "one step")
            data = tokens_of(op.append_token_ids, op.packed_append_token_ids,
                             f"{where}.append_token_ids")
            full = (len(held.data) + len(data)) // stride
            allocated = len(held.page_table)
            if op.computed_pages > min(full, allocated):
                raise invalid(
                    f"{where}.computed_pages: {op.computed_pages} exceeds the lease's {full} full "
                    f"pages of tokens or its {allocated} allocated pages")
            check.published_pages[held.lease_id] = max(op.computed_pages, held.published)
            planned.append(PlannedPublish(held, data, op.computed_pages))
        return planned

    def apply(self, planned: list[PlannedPublish], pool: Pool, directory: LeaseDirectory,
              resp: pb.StepResponse) -> None:
        for p in planned:
            done = pool.publish(p.lease, p.append, p.computed_pages)
            out = resp.publishes.add(lease_id=done.lease_id, inserted_pages=done.inserted_pages)
            for index, old, new in done.remaps:
                out.remaps.add(index=index, old_page=old, new_page=new)
            pool.renew(p.lease)
