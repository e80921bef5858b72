"""Write-through: the L3 copies of the pages this step published (REMOTE_WRITE_POLICY_
WRITE_THROUGH), listed once the step's checkpoints are attached so that each copy carries its
page's slot (design.md §4, "L3 write policies"). No part of the request: it always runs."""
from __future__ import annotations

from typing import TYPE_CHECKING

from cache_service.leases import LeaseDirectory
from cache_service.step.base import StepOperation
from prefixcache.v1 import cache_service_pb2 as pb

if TYPE_CHECKING:
    from cache_service.pool import Pool


class WriteThrough(StepOperation):
    every_step = True

    def apply(self, planned: list, pool: Pool, directory: LeaseDirectory,
              resp: pb.StepResponse) -> None:
        pool.flush_write_through()  # its copies reach resp.copies with the step's others
