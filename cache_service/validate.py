"""Validation of every request before anything changes (design.md §8: nothing is half-applied).

`plan_step` checks a whole Step against one pool and resolves it into a `StepPlan` (leases
looked up, tokens converted once); `CacheCore.step` applies a plan only once it exists. Errors
are `CacheError`s whose message names the field.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from cache_service.leases import Lease
from prefixcache.v1 import cache_service_pb2 as pb
from prefixcache_client.errors import invalid
from prefixcache_client.hash import MAX_NAME_BYTES, token_bytes

POOL_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
MAX_PAGE_SIZE = 4096
MAX_PROMPT_TOKENS = 1 << 20
MAX_PAGES_PER_ALLOCATION = 65536
# Seconds fields (design.md §8 "Bad input"): NaN and inf compare false with every bound, so each
# is checked for finiteness first (an inf or NaN lease TTL never expired). A heartbeat faster
# than 20/s floods the subscriber and the server (NaN meant no wait at all), one slower than
# a minute makes a live pool look dead to the gateway. The lease TTL's upper bound is the
# server's --max-lease-ttl-s (cache_service/access.py).
MIN_HEARTBEAT_INTERVAL_S, MAX_HEARTBEAT_INTERVAL_S = 0.05, 60.0


@dataclass(slots=True)
class StepPlan:
    """A validated step: leases resolved, tokens converted once."""
    publishes: list[tuple[Lease, bytes, int]]
    checkpoints: list[tuple[Lease, int, bool]]
    releases: list[Lease]
    renewals: list[Lease]
    matches: list[tuple[pb.MatchOp, bytes, float]]
    allocations: list[tuple[Lease, int]]


@dataclass(slots=True)
class StepOps:
    """A StepRequest's op lists, each read once (every read of a repeated protobuf field
    builds a new container object)."""
    publishes: Sequence[pb.PublishOp]
    checkpoints: Sequence[pb.CheckpointOp]
    releases: Sequence[pb.ReleaseOp]
    renew_lease_ids: Sequence[str]
    matches: Sequence[pb.MatchOp]
    allocations: Sequence[pb.AllocateOp]

    @classmethod
    def of(cls, req: pb.StepRequest) -> StepOps:
        return cls(req.publishes, req.checkpoints, req.releases, req.renew_lease_ids,
                   req.matches, req.allocations)

    def named_leases(self) -> Iterator[str]:
        for ops in (self.publishes, self.checkpoints, self.releases, self.allocations):
            for op in ops:
                yield op.lease_id
        yield from self.renew_lease_ids


def plan_step(pool, req: StepOps, max_ops: int, lease: Callable[[str, str], Lease]) -> StepPlan:
    """`pool`: the step's pool.Pool; `lease(lease_id, field)`: the pool's lease, or raises."""
    n_ops = (len(req.publishes) + len(req.checkpoints) + len(req.releases) + len(req.matches)
             + len(req.allocations) + len(req.renew_lease_ids))
    if n_ops > max_ops:
        raise invalid(f"step: {n_ops} ops exceed the limit of {max_ops} per step")
    plan = StepPlan([], [], [], [], [], [])
    published_pages: dict[str, int] = {}
    for i, op in enumerate(req.publishes):
        where = f"publishes[{i}]"
        held = lease(op.lease_id, where)
        if held.lease_id in published_pages:
            raise invalid(f"{where}.lease_id: lease '{op.lease_id}' is published twice in one step")
        data = tokens_of(op.append_token_ids, op.packed_append_token_ids,
                         f"{where}.append_token_ids")
        full = (len(held.data) + len(data)) // pool.stride
        allocated = len(held.page_table)
        if op.computed_pages > min(full, allocated):
            raise invalid(
                f"{where}.computed_pages: {op.computed_pages} exceeds the lease's {full} full "
                f"pages of tokens or its {allocated} allocated pages")
        published_pages[held.lease_id] = max(op.computed_pages, held.published)
        plan.publishes.append((held, data, op.computed_pages))
    for i, op in enumerate(req.checkpoints):
        where = f"checkpoints[{i}]"
        held = lease(op.lease_id, where)
        if not pool.cfg.mamba_slots:
            raise invalid(f"{where}: pool '{pool.cfg.pool_id}' has no Mamba slots (mamba_slots=0)")
        published = published_pages.get(held.lease_id, held.published)
        if op.page_index >= published:
            raise invalid(f"{where}.page_index: page {op.page_index} is not published "
                          f"(the lease has {published} published pages)")
        plan.checkpoints.append((held, op.page_index, op.detach))
    ended: set[str] = set()
    for i, op in enumerate(req.releases):
        held = lease(op.lease_id, f"releases[{i}]")
        if held.lease_id in ended:
            raise invalid(f"releases[{i}].lease_id: lease '{op.lease_id}' is released twice")
        ended.add(held.lease_id)
        plan.releases.append(held)
    for i, lease_id in enumerate(req.renew_lease_ids):
        where = f"renew_lease_ids[{i}]"
        plan.renewals.append(_live(lease(lease_id, where), ended, where))
    for i, op in enumerate(req.matches):
        where = f"matches[{i}]"
        ns = op.namespace
        if ns.model_id and ns.model_id != pool.cfg.model_id:
            raise invalid(f"{where}.namespace.model_id: '{ns.model_id}' is not the pool's model "
                          f"'{pool.cfg.model_id}'")
        check_name(f"{where}.namespace.adapter", ns.adapter)
        check_name(f"{where}.namespace.salt", ns.salt)
        ids, packed = op.token_ids, op.packed_token_ids  # each read copies: once
        n_tokens = len(ids) + len(packed) // 4
        if n_tokens > MAX_PROMPT_TOKENS:
            raise invalid(f"{where}.token_ids: {n_tokens} tokens exceed the limit of "
                          f"{MAX_PROMPT_TOKENS}")
        check_lease_ttl(f"{where}.lease_ttl_s", op.lease_ttl_s)
        data = tokens_of(ids, packed, f"{where}.token_ids")
        plan.matches.append((op, data, op.lease_ttl_s or pool.cfg.lease_ttl_s))
    for i, op in enumerate(req.allocations):
        where = f"allocations[{i}]"
        held = _live(lease(op.lease_id, where), ended, f"{where}.lease_id")
        if not 1 <= op.num_pages <= MAX_PAGES_PER_ALLOCATION:
            raise invalid(f"{where}.num_pages: must be in [1, {MAX_PAGES_PER_ALLOCATION}], "
                          f"got {op.num_pages}")
        plan.allocations.append((held, op.num_pages))
    return plan


def _live(lease: Lease, ended: set[str], where: str) -> Lease:
    if lease.lease_id in ended:
        raise invalid(f"{where}: lease '{lease.lease_id}' is released earlier in this step")
    return lease


def check_seconds(field: str, value: float, low: float, high: float, zero: str = "") -> None:
    """`value` finite and in [low, high], or 0 when `zero` says what 0 means."""
    if zero and value == 0:
        return
    if not (math.isfinite(value) and low <= value <= high):
        allowed = f"0 ({zero}) or " if zero else ""
        bounds = f">= {low:g}" if high == math.inf else f"in [{low:g}, {high:g}]"
        raise invalid(f"{field}: must be {allowed}a finite number of seconds {bounds}, got "
                      f"{value!r}")


def check_lease_ttl(field: str, value: float) -> None:
    check_seconds(field, value, 0.0, math.inf)


def check_heartbeat_interval(value: float) -> None:
    check_seconds("heartbeat_interval_s", value, MIN_HEARTBEAT_INTERVAL_S,
                  MAX_HEARTBEAT_INTERVAL_S, zero="= 1 s")


def check_load(req: pb.StepRequest) -> None:
    """The worker's load report is relayed to every subscriber (the gateway routes on it)."""
    if req.HasField("load") and not (math.isfinite(req.load.timestamp)
                                     and req.load.timestamp >= 0):
        raise invalid(f"load.timestamp: must be a finite Unix time >= 0, got "
                      f"{req.load.timestamp!r}")


def check_pool_id(pool_id: str) -> None:
    if not POOL_ID.match(pool_id):
        raise invalid(f"pool_id: '{pool_id}' must be 1..128 characters of [A-Za-z0-9._:-]")


def check_name(field: str, value: str, allow_empty: bool = True) -> None:
    size = len(value.encode("utf-8"))
    if size > MAX_NAME_BYTES or (not allow_empty and size == 0):
        raise invalid(f"{field}: must be {0 if allow_empty else 1}..{MAX_NAME_BYTES} UTF-8 bytes, "
                      f"got {size}")


def tokens_of(ids, packed: bytes, field: str) -> bytes:
    """The u32-le bytes of a token list given either as int64 ids or already packed."""
    if packed or not ids:
        if ids:
            raise invalid(f"{field}: set either {field.rsplit('.', 1)[-1]} or its packed_ form, "
                          "not both")
        if len(packed) % 4:
            raise invalid(f"{field}: packed length {len(packed)} is not a multiple of 4 bytes")
        return packed
    try:
        return token_bytes(ids, field)
    except ValueError as exc:
        raise invalid(str(exc)) from None
