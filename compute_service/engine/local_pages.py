"""`LocalPages`: the page allocator of an engine with prefix caching off
(`EngineConfig.prefix_cache=False`). It speaks the cache service's `register_pool` / `step`
interface, so the engine runs the same code either way, but it only hands out and takes back
device pages: no tree, no matches (every match is a miss), no publishes, no checkpoints, no
events, no leases that expire. In process and trivial, it is what "no prefix caching" costs:
the baseline the prefix cache's overhead is measured against (prefixcache_bench.compute,
`prefix_cache_overhead`).

Its contract with the engine (the step planner sends it only these ops):
- a match opens an empty lease (`cached_tokens` 0, no pages, `mamba_slot` -1);
- an allocation gives a lease `num_pages` free pages, all or nothing, and says why when it
  cannot (the engine then preempts, as with the cache service);
- a release frees every page of the lease;
- anything else (publishes, checkpoints, renewals) is a programming error: it raises.
"""
from __future__ import annotations

import itertools

from prefixcache.v1 import cache_service_pb2 as pb


class LocalPages:
    """Not thread-safe: the engine thread alone calls it (between steps: `evict_namespace`,
    which changes nothing here)."""

    def __init__(self) -> None:
        self.free: list[int] = []
        self.leases: dict[str, list[int]] = {}
        self.page_size = 0
        self._ids = itertools.count()

    def register_pool(self, req: pb.RegisterPoolRequest) -> pb.RegisterPoolResponse:
        """A new epoch: every page is free again and no lease is left."""
        self.page_size = req.page_size
        # Popped from the end: the lowest pages first, as the cache service hands them out.
        self.free = list(range(req.device_pages - 1, -1, -1))
        self.leases.clear()
        return pb.RegisterPoolResponse(reset=True)

    def step(self, req: pb.StepRequest) -> pb.StepResponse:
        if req.publishes or req.checkpoints or req.renew_lease_ids:
            raise ValueError("LocalPages: publishes, checkpoints and renewals need a prefix cache")
        resp = pb.StepResponse()
        for op in req.releases:
            self.free.extend(reversed(self.leases.pop(op.lease_id)))
        for op in req.matches:
            lease_id = f"local/{next(self._ids)}"
            self.leases[lease_id] = []
            resp.matches.add(request_id=op.request_id, lease_id=lease_id, mamba_slot=-1)
        for op in req.allocations:
            n = op.num_pages
            if n > len(self.free):
                resp.allocations.add(lease_id=op.lease_id, ok=False, reason=(
                    f"need {n} device pages: {len(self.free)} free (no prefix cache: nothing "
                    f"to evict)"))
                continue
            pages = self.free[-n:][::-1]
            del self.free[-n:]
            self.leases[op.lease_id] += pages
            resp.allocations.add(lease_id=op.lease_id, ok=True, device_pages=pages)
        return resp

    def evict_namespace(self, req: pb.EvictNamespaceRequest) -> pb.EvictNamespaceResponse:
        """Nothing is cached: nothing to evict (an adapter unload asks)."""
        return pb.EvictNamespaceResponse()
