"""Load report: the worker's queue, relayed to every subscriber in heartbeats (the gateway routes
on it). Not an op against the limit per step."""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cache_service.leases import LeaseDirectory
from cache_service.step.base import StepCheck, StepOperation
from prefixcache.v1 import cache_service_pb2 as pb, common_pb2
from prefixcache_client.errors import invalid

if TYPE_CHECKING:
    from cache_service.pool import Pool


class LoadReport(StepOperation):
    def read(self, req: pb.StepRequest) -> Sequence[common_pb2.LoadReport]:
        """Checked here, before the step renews or expires any lease (design.md §8 "Bad
        input": a float is checked finite first)."""
        if not req.HasField("load"):
            return ()
        load = req.load
        if not (math.isfinite(load.timestamp) and load.timestamp >= 0):
            raise invalid(f"load.timestamp: must be a finite Unix time >= 0, got "
                          f"{load.timestamp!r}")
        return (load,)

    def size(self, part: Sequence[common_pb2.LoadReport]) -> int:
        return 0

    def plan(self, part: Sequence[common_pb2.LoadReport],
             check: StepCheck) -> list[common_pb2.LoadReport]:
        return list(part)

    def apply(self, planned: list[common_pb2.LoadReport], pool: Pool, directory: LeaseDirectory,
              resp: pb.StepResponse) -> None:
        for load in planned:
            pool.load.CopyFrom(load)
