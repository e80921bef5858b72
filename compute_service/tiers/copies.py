"""Batched page copies between the device (L1) and host (L2) KV pools, and page gathers for L3.

The cache service returns an ordered list of CopyOps per step. Executing them one page and one
layer at a time costs 2 x layers small copies per page; instead consecutive copies in the same
direction form a *run* executed with one gather (index_select) and one scatter (index_copy_) per
layer. Splitting into runs keeps the list's order semantics:

- a run never writes the same destination page twice (a host page demoted into, dropped, and
  reused within one step starts a new run, so the last write wins as in sequential order);
- a run never reads a page that an earlier copy of the same run wrote, because a run has one
  source and one destination medium and the two pools are distinct.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from prefixcache.v1 import common_pb2

DEVICE, HOST, REMOTE = common_pb2.MEDIUM_DEVICE, common_pb2.MEDIUM_HOST, common_pb2.MEDIUM_REMOTE
KVPool = list[tuple[torch.Tensor, torch.Tensor]]  # per attention layer: (k, v) [pages, P, H, D]


@dataclass(slots=True)
class CopyRun:
    """Consecutive copies from `src` to `dst` medium; for REMOTE, `dst_pages` is unused and
    `hashes` / `mamba_slots` name what to write."""
    src: int
    dst: int
    src_pages: list[int] = field(default_factory=list)
    dst_pages: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    mamba_slots: list[int] = field(default_factory=list)


def plan_runs(copies) -> list[CopyRun]:
    """Groups an ordered sequence of CopyOps into runs (see the module docstring)."""
    runs: list[CopyRun] = []
    written: set[int] = set()
    for c in copies:
        run = runs[-1] if runs else None
        if (run is None or (run.src, run.dst) != (c.src_medium, c.dst_medium)
                or (c.dst_medium != REMOTE and c.dst_page in written)):
            run = CopyRun(c.src_medium, c.dst_medium)
            runs.append(run)
            written.clear()
        run.src_pages.append(c.src_page)
        run.dst_pages.append(c.dst_page)
        run.hashes.append(bytes(c.page_hash))
        run.mamba_slots.append(c.mamba_slot)
        written.add(c.dst_page)
    return runs


def gather_pages(pool: KVPool, pages: list[int], page_shape: tuple[int, ...]) -> torch.Tensor:
    """[layers, 2, len(pages), *page_shape] copy of the pages, on the pool's device.
    `page_shape` (page_size, kv heads, head dim) sizes the result of a pool with no layers."""
    if not pool:
        return torch.empty((0, 2, len(pages), *page_shape))
    index = torch.tensor(pages, dtype=torch.int64, device=pool[0][0].device)
    return torch.stack([torch.stack([k.index_select(0, index), v.index_select(0, index)])
                        for k, v in pool])


def scatter_pages(pool: KVPool, pages: list[int], data: torch.Tensor) -> None:
    """Writes data [layers, 2, len(pages), ...] (any device) into the pool's pages, which must be
    distinct."""
    if not pool or not pages:
        return
    device = pool[0][0].device
    data = data.to(device, non_blocking=data.is_pinned())
    index = torch.tensor(pages, dtype=torch.int64, device=device)
    for layer, (k, v) in enumerate(pool):
        k.index_copy_(0, index, data[layer, 0])
        v.index_copy_(0, index, data[layer, 1])


def move_pages(src: KVPool, dst: KVPool, src_pages: list[int], dst_pages: list[int],
               page_shape: tuple[int, ...]) -> None:
    """One run between two pools. A device-to-host move goes through one blocking transfer of
    the gathered pages, so the host pool holds the bytes when this returns (a later CPU read,
    e.g. an L3 write from the host tier, needs no synchronisation)."""
    scatter_pages(dst, dst_pages, gather_pages(src, src_pages, page_shape))


def allocate_host_pool(like: KVPool, num_pages: int, pin: bool) -> KVPool:
    """A zeroed host pool with the pages of `like`; pinned (page-locked) when `pin`, so that
    host-to-device load-backs are true asynchronous DMA transfers."""
    def alloc(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros((num_pages, *t.shape[1:]), dtype=t.dtype, device="cpu", pin_memory=pin)
    return [(alloc(k), alloc(v)) for k, v in like] if num_pages else []
