"""What the pool's operations return, as plain data: the typed results at the tree's boundary
that the Step operations (cache_service/step/) turn into the response's messages."""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from cache_service.tree import NO_SLOT


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


@dataclass(slots=True, frozen=True)
class RemoteExtension:
    """The L3 pages a match extends its device prefix with: their page hashes, and the device
    pages allocated to the lease for the worker to load them into."""
    page_hashes: list[bytes]
    pages: array


@dataclass(slots=True)
class NamespaceEvicted:
    removed_pages: int  # freed now
    deferred_pages: int  # freed when the leases that pin them end (design.md lesson 5)
