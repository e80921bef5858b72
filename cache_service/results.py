"""The plain data of one pool: its configuration, its counters, and what its operations return
(the core turns the results into the RPC's messages)."""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from cache_service.tree import DEVICE, HOST, NO_SLOT
from prefixcache.v1 import common_pb2

REMOTE = common_pb2.MEDIUM_REMOTE


@dataclass(slots=True)
class PoolConfig:
    pool_id: str
    epoch: int
    page_size: int
    device_pages: int
    host_pages: int
    mamba_slots: int
    model_id: str
    lease_ttl_s: float
    remote_write_policy: int = 0
    remote_min_hits: int = 1
    remote_lookup: bool = False

    def shape(self) -> tuple:
        return (self.page_size, self.device_pages, self.host_pages, self.mamba_slots,
                self.model_id, self.lease_ttl_s, self.remote_write_policy, self.remote_min_hits,
                self.remote_lookup)


@dataclass(slots=True)
class Counters:
    queried_tokens: int = 0
    hit_tokens: dict[int, int] = field(default_factory=lambda: {DEVICE: 0, HOST: 0, REMOTE: 0})
    evictions: dict[int, int] = field(default_factory=lambda: {DEVICE: 0, HOST: 0})
    remote_writes: int = 0
    lease_expiries: int = 0
    duplicate_pages: int = 0


@dataclass(slots=True)
class Matched:
    """A match: the lease's cached pages (device pages, then any remote extension)."""
    lease_id: str
    device_pages: array
    hashes: bytes  # the device pages' hashes, 16 bytes each (b"" when left out)
    host_hit_pages: int
    unusable_pages: int
    mamba_slot: int
    remote_pages: array
    remote_page_hashes: list[bytes]


@dataclass(slots=True)
class Published:
    lease_id: str
    inserted_pages: int = 0
    remaps: list[tuple[int, int, int]] = field(default_factory=list)  # (index, old, new page)


@dataclass(slots=True)
class Allocated:
    lease_id: str
    ok: bool
    device_pages: array | tuple = ()
    reason: str = ""


@dataclass(slots=True)
class Checkpointed:
    lease_id: str
    page_index: int
    ok: bool = False
    slot: int = NO_SLOT
    already_present: bool = False
    reason: str = ""
