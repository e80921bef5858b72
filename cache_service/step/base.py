"""What every Step operation is (design.md §4, "One Step per engine step").

An operation owns one part of `StepRequest` and the matching part of `StepResponse`, and does
three things with them, each in one place:

- `read` takes its part of the request, once (every read of a repeated protobuf field builds a
  new container object), with the checks the request alone settles;
- `plan` validates that part against the pool and resolves it (leases looked up, tokens
  converted once) into typed planned ops, changing nothing: `CacheCore.step` plans every
  operation before it applies the first (design.md §8: nothing is half-applied);
- `apply` runs the planned ops on the pool and builds its part of the response.

Adding an operation is a module here, its fields in cache_service.proto, and its place in
`CacheCore.step`'s order.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from cache_service.leases import Lease, LeaseDirectory
from prefixcache.v1 import cache_service_pb2 as pb
from prefixcache_client.errors import invalid

if TYPE_CHECKING:
    from cache_service.pool import Pool


class StepCheck:
    """What the operations of one step learn about each other while they are planned, in order:
    a checkpoint may name a page published earlier in the step, and nothing may name a lease
    released earlier in it."""
    __slots__ = ("pool", "directory", "published_pages", "ended")

    def __init__(self, pool: Pool, directory: LeaseDirectory) -> None:
        self.pool = pool
        self.directory = directory
        self.published_pages: dict[str, int] = {}  # lease id -> pages published once applied
        self.ended: set[str] = set()  # lease ids released by this step

    def lease(self, lease_id: str, where: str) -> Lease:
        """The pool's lease, or the error naming `where`."""
        pool = self.pool
        return self.directory.find(pool.leases, pool.cfg.pool_id, lease_id, where)

    def live_lease(self, lease_id: str, where: str, field: str) -> Lease:
        """`lease` when no release earlier in this step ends it (the error names `field`)."""
        lease = self.lease(lease_id, where)
        if lease.lease_id in self.ended:
            raise invalid(f"{field}: lease '{lease.lease_id}' is released earlier in this step")
        return lease


class StepOperation(Protocol):
    """One operation family of a Step. The defaults fit an operation with no request part.
    The core calls `lease_ids`, `size`, `plan` and `apply` only for a part with ops in it (a
    Step carries few of its families), and `apply` on every step when `every_step` is set."""

    every_step: ClassVar[bool] = False

    def read(self, req: pb.StepRequest) -> Sequence[Any]:
        """This operation's part of the request (its ops), read once."""
        return ()

    def size(self, part: Sequence[Any]) -> int:
        """How many ops `part` holds, against the server's limit per step."""
        return len(part)

    def lease_ids(self, part: Sequence[Any]) -> Iterable[str]:
        """The leases `part` names: alive, as their worker is talking to us (renewed before the
        silent ones expire)."""
        return ()

    def plan(self, part: Sequence[Any], check: StepCheck) -> list[Any]:
        """`part` validated and resolved; raises a CacheError naming the field; changes
        nothing."""
        return []

    def apply(self, planned: list[Any], pool: Pool, directory: LeaseDirectory,
              resp: pb.StepResponse) -> None:
        """Runs the planned ops on the pool, in order, and adds their results to `resp`."""
        ...
