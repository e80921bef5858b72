"""What the engine does with the tiers inside one step: the cache service's copies (L1 <-> L2
moves, L3 writes) and the loads of matched L3 extensions into device pages.

Invariants:
- copies run in the order the cache service listed them (see copies.plan_runs); an L3 write
  reads its page's bytes (and its Mamba checkpoint slot) at its position in that order, so a
  page whose memory a later copy of the same step reuses is written with its own bytes;
- an L3 write that was not done (failed, skipped by the breaker, dropped) is reported back to
  the cache service in a later Step (`failed_remote_writes`), which lists it again;
- a loaded L3 extension is written into its device pages before the step's forward, and only
  the part that the request will resume over: for models with Mamba layers that ends at the
  deepest loaded page that carries a checkpoint (the state there is needed to go on).
"""
from __future__ import annotations

import torch

from compute_service.tiers.copies import DEVICE, HOST, REMOTE, KVPool, gather_pages, move_pages, \
    plan_runs, scatter_pages
from compute_service.tiers.payload import MambaStates, PageData, PageLayout
from compute_service.tiers.remote import RemoteTier
from prefixcache.v1 import cache_service_pb2 as pb

StatePool = list[tuple[torch.Tensor, torch.Tensor]]  # per Mamba layer: (ssm, conv) [slots, ...]


class TierMover:
    def __init__(self, kv: KVPool, host_kv: KVPool, states: StatePool, checkpoint_base: int,
                 layout: PageLayout, remote: RemoteTier | None):
        """`checkpoint_base`: index of checkpoint slot 0 in `states` (the running slots come
        first)."""
        self.pools = {DEVICE: kv, HOST: host_kv}
        self.states, self.checkpoint_base = states, checkpoint_base
        self.layout, self.remote = layout, remote
        self.page_shape = layout.kv_shape[2:]

    def run_copies(self, copies) -> None:
        """Executes a step's copies in order (a REMOTE copy carries its page's checkpoint slot)."""
        for run in plan_runs(copies):
            if run.dst != REMOTE:
                move_pages(self.pools[run.src], self.pools[run.dst], run.src_pages, run.dst_pages,
                           self.page_shape)
            elif self.remote is not None:
                self._write(run.src, run.src_pages, run.hashes, list(run.mamba_slots))

    def _write(self, medium: int, pages: list[int], hashes: list[bytes], slots: list[int]) -> None:
        kv = gather_pages(self.pools[medium], pages, self.page_shape).cpu()
        mamba: list[MambaStates | None] = [None] * len(pages)
        with_ckpt = [i for i, s in enumerate(slots) if s >= 0 and self.states]
        if with_ckpt:
            index = torch.tensor([self.checkpoint_base + slots[i] for i in with_ckpt],
                                 device=self.states[0][0].device)
            gathered = [(ssm.index_select(0, index).cpu(), conv.index_select(0, index).cpu())
                        for ssm, conv in self.states]
            for k, i in enumerate(with_ckpt):
                mamba[i] = [(ssm[k], conv[k]) for ssm, conv in gathered]
        self.remote.write(hashes, kv, mamba)

    def failed_writes(self, limit: int) -> bytes:
        """Up to `limit` page hashes (concatenated) of L3 writes not done since the last call:
        the next Step's `failed_remote_writes`."""
        return b"".join(self.remote.take_failed(limit)) if self.remote is not None else b""

    def load_extensions(self, matches: list[pb.MatchResult]) -> list[list[PageData]]:
        """Loads every match's L3 extension (one batched load), writes the usable pages into the
        match's remote_pages and returns them per match (see the module invariant)."""
        wanted = [list(m.remote_page_hashes) for m in matches]
        if self.remote is None or not any(wanted):
            return [[] for _ in matches]
        usable = []
        for pages in self.remote.load(wanted):
            if self.layout.mamba_layers:
                pages = pages[:next((i + 1 for i in range(len(pages) - 1, -1, -1)
                                     if pages[i].mamba is not None), 0)]
            usable.append(pages)
        dst = [p for m, pages in zip(matches, usable, strict=True)
               for p in m.remote_pages[:len(pages)]]
        if dst and self.layout.attention_layers:
            data = torch.stack([page.kv for pages in usable for page in pages], dim=2)
            scatter_pages(self.pools[DEVICE], dst, data)
        return usable
