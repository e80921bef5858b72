"""One pool's settings (from its RegisterPool) and its counters (read by GetStats)."""
from __future__ import annotations

from dataclasses import dataclass, field

from cache_service.tree import DEVICE, HOST
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
