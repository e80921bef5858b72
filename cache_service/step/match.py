"""Match: the longest cached prefix of a prompt, pinned under a new lease (design.md §4,
design.md lessons 6 and 12)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cache_service.events import split_hashes
from cache_service.leases import LeaseDirectory
from cache_service.step.base import StepCheck, StepOperation
from cache_service.validate import check_lease_ttl, check_name, tokens_of
from prefixcache.v1 import cache_service_pb2 as pb
from prefixcache_client.errors import invalid

if TYPE_CHECKING:
    from cache_service.pool import Pool

MAX_PROMPT_TOKENS = 1 << 20


@dataclass(slots=True)
class PlannedMatch:
    op: pb.MatchOp
    tokens: bytes  # the prompt, u32-le
    ttl_s: float  # the new lease's (the pool's default when the op sets none)


class Match(StepOperation):
    def read(self, req: pb.StepRequest) -> Sequence[pb.MatchOp]:
        return req.matches

    def plan(self, part: Sequence[pb.MatchOp], check: StepCheck) -> list[PlannedMatch]:
        planned = []
        cfg = check.pool.cfg
        for i, op in enumerate(part):
            where = f"matches[{i}]"
            ns = op.namespace
            if ns.model_id and ns.model_id != cfg.model_id:
                raise invalid(f"{where}.namespace.model_id: '{ns.model_id}' is not the pool's "
                              f"model '{cfg.model_id}'")
            check_name(f"{where}.namespace.adapter", ns.adapter)
            check_name(f"{where}.namespace.salt", ns.salt)
            ids, packed = op.token_ids, op.packed_token_ids  # each read copies: once
            n_tokens = len(ids) + len(packed) // 4
            if n_tokens > MAX_PROMPT_TOKENS:
                raise invalid(f"{where}.token_ids: {n_tokens} tokens exceed the limit of "
                              f"{MAX_PROMPT_TOKENS}")
            check_lease_ttl(f"{where}.lease_ttl_s", op.lease_ttl_s)
            check_lease_ttl(f"{where}.retain_s", op.retain_s)
            data = tokens_of(ids, packed, f"{where}.token_ids")
            planned.append(PlannedMatch(op, data, op.lease_ttl_s or cfg.lease_ttl_s))
        return planned

    def apply(self, planned: list[PlannedMatch], pool: Pool, directory: LeaseDirectory,
              resp: pb.StepResponse) -> None:
        cfg = pool.cfg
        page = cfg.page_size
        for p in planned:
            op = p.op
            lease_id = directory.open(cfg.pool_id, cfg.epoch)
            m = pool.match(op.request_id, lease_id, op.namespace.adapter, op.namespace.salt,
                           p.tokens, p.ttl_s, op.is_resume, op.skip_host_load,
                           op.omit_page_hashes, op.retain_s)
            cached = len(m.device_pages)
            resp.matches.add(
                request_id=op.request_id, lease_id=lease_id, device_pages=m.device_pages,
                cached_tokens=cached * page,
                device_hit_tokens=(cached - m.host_hit_pages) * page,
                host_hit_tokens=m.host_hit_pages * page, page_hashes=split_hashes(m.hashes),
                mamba_slot=m.mamba_slot, unusable_pages=m.unusable_pages,
                remote_pages=m.remote_pages, remote_page_hashes=m.remote_page_hashes,
                remote_hit_tokens=len(m.remote_pages) * page)
