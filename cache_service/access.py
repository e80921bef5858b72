"""What an authenticated caller may do to the pools of one cache service, beyond its role
(service_shell/auth.py decides the role part), and the limits every caller is held to
(design.md §8, "Service identities").

Pool ownership: a worker identity owns the pools it registered. Only it may Step, re-register
(a restart: new epoch), unregister or EvictNamespace in such a pool; another worker identity is
PERMISSION_DENIED, and so is a worker stepping a pool nobody registered as it. An identity's
`pools` patterns (the identities file) narrow which pool ids it may register at all. The owner
is forgotten when the pool is unregistered; an operator may register, unregister or evict any
pool (a pool an operator registered is owned by no worker until one registers it anew).
In Kubernetes each cache service is its worker's sidecar, so a pool has one owner by topology
too; ownership is what stops a worker token used elsewhere from driving another worker's pool.

Limits (flags of `python -m cache_service`), with or without auth:
- `max_pool_pages`: device_pages, host_pages and mamba_slots of RegisterPool, each (every page
  costs the service memory for its bookkeeping whether or not it is ever used);
- `max_lease_ttl_s`: RegisterPool.lease_ttl_s and MatchOp.lease_ttl_s (a lease pins pages until
  it ends: a long TTL lets a caller that vanishes keep them from everyone else);
- `max_subscriptions_per_identity`: concurrent Subscribe streams of one identity (auth on), so
  that one identity's flood cannot take the slots the gateway needs;
- `max_pools_per_identity`: pools one worker identity may own at once (auth on): a wildcard
  `pools` pattern (`compute-*`) names unboundedly many pool ids, each a RegisterPool away;
- `max_total_pages`: device_pages + host_pages + mamba_slots summed over every registered pool,
  whoever registered them (with or without auth): the service's whole bookkeeping budget
  (default 4 x max_pool_pages).
Past either, RegisterPool is RESOURCE_EXHAUSTED naming the flag; a re-registration of a pool
counts its new size in place of its old one. UnregisterPool gives the memory back to the
operating system (`release_memory`).
Step allocations are bounded by the pool itself (a lease gets pages only from the pool's free
ones, MAX_PAGES_PER_ALLOCATION per op; design.md §3).
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import gc
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from prefixcache.v1 import cache_service_pb2 as pb
from service_shell.auth import OPERATOR, WORKER, AuthError, Identity, Refusals, identity_of


@dataclass(frozen=True, slots=True)
class CacheLimits:
    max_pool_pages: int = 1 << 22
    max_lease_ttl_s: float = 600.0
    max_subscriptions_per_identity: int = 16
    max_pools_per_identity: int = 4
    # None: 4 x max_pool_pages (four pools at the per-pool cap, all three sizes).
    max_total_pages: int | None = None

    def __post_init__(self) -> None:
        if self.max_total_pages is None:
            object.__setattr__(self, "max_total_pages", 4 * self.max_pool_pages)
        if self.max_pools_per_identity < 1:
            raise ValueError("max_pools_per_identity must be >= 1, got "
                             f"{self.max_pools_per_identity}")
        if self.max_total_pages < 1:
            raise ValueError(f"max_total_pages must be >= 1, got {self.max_total_pages}")
        if self.max_pool_pages < 1:
            raise ValueError(f"max_pool_pages must be >= 1, got {self.max_pool_pages}")
        if not self.max_lease_ttl_s >= 1:
            raise ValueError(f"max_lease_ttl_s must be >= 1, got {self.max_lease_ttl_s}")
        if self.max_subscriptions_per_identity < 1:
            raise ValueError("max_subscriptions_per_identity must be >= 1, got "
                             f"{self.max_subscriptions_per_identity}")


def _denied(message: str, reason: str = "pool_owner") -> AuthError:
    return AuthError(grpc.StatusCode.PERMISSION_DENIED, reason, message)


def _too_big(message: str) -> AuthError:
    return AuthError(grpc.StatusCode.INVALID_ARGUMENT, "limit", message)


def _exhausted(reason: str, message: str) -> AuthError:
    return AuthError(grpc.StatusCode.RESOURCE_EXHAUSTED, reason, message)


def pool_pages(request: pb.RegisterPoolRequest) -> int:
    """What a pool counts against `max_total_pages`."""
    return request.device_pages + request.host_pages + request.mamba_slots


def release_memory() -> None:
    """Hands memory freed by a retired pool back to the operating system: collects the cycles
    a pool's objects form, then (glibc) trims the malloc heap, whose freed top and arenas glibc
    otherwise keeps for the process."""
    gc.collect()
    if _malloc_trim is not None:
        _malloc_trim(0)


def _load_malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_malloc_trim = _load_malloc_trim()


class CacheAccess:
    """Pool owners, limits and per-identity subscription counts of one server."""

    def __init__(self, limits: CacheLimits, refusals: Refusals) -> None:
        self.limits = limits
        self._refusals = refusals
        self._owners: dict[str, str] = {}  # pool id -> the worker identity that registered it
        self._pages: dict[str, int] = {}  # pool id -> its pool_pages, every registered pool
        self._subscriptions: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def pool_call(self, rpc: str, request, context: grpc.ServicerContext) -> Iterator[None]:
        """Around RegisterPool / UnregisterPool / Step / EvictNamespace: refuses (aborts) what
        the caller may not do; after a call that succeeded, records the pool's new owner."""
        identity = identity_of(context)
        try:
            self._check_limits(rpc, request)
        except AuthError as exc:
            self._refusals.refuse(context, rpc, exc, identity)
        if identity is None or identity.role == OPERATOR:
            # Auth off, or an operator: no ownership checks; an operator's registration (or
            # unregistration) leaves the pool to whichever worker registers it next.
            with self._serialized(rpc):
                try:
                    self._check_budget(rpc, request, None)
                except AuthError as exc:
                    self._refusals.refuse(context, rpc, exc, identity)
                yield
                if rpc in ("RegisterPool", "UnregisterPool"):
                    self._owners.pop(request.pool_id, None)
                self._registered(rpc, request)
            self._after(rpc)
            return
        with self._serialized(rpc):
            try:
                self._check_owner(rpc, request, identity)
                self._check_budget(rpc, request, identity)
            except AuthError as exc:
                self._refusals.refuse(context, rpc, exc, identity)
            yield
            if rpc == "RegisterPool":
                self._owners[request.pool_id] = identity.name
            elif rpc == "UnregisterPool":
                self._owners.pop(request.pool_id, None)
            self._registered(rpc, request)
        self._after(rpc)

    def _registered(self, rpc: str, request) -> None:
        """After a RegisterPool / UnregisterPool that succeeded: the pool's pages."""
        if rpc == "RegisterPool":
            self._pages[request.pool_id] = pool_pages(request)
        elif rpc == "UnregisterPool":
            self._pages.pop(request.pool_id, None)

    @staticmethod
    def _after(rpc: str) -> None:
        if rpc == "UnregisterPool":
            release_memory()  # outside the lock: a registration need not wait for it

    def _check_budget(self, rpc: str, request, identity: Identity | None) -> None:
        """RegisterPool: the identity's pool count and the service's page total, this pool
        counted at its new size (a re-registration replaces the old one)."""
        if rpc != "RegisterPool":
            return
        lim, pool_id = self.limits, request.pool_id
        if identity is not None and self._owners.get(pool_id) != identity.name:
            owned = sum(1 for owner in self._owners.values() if owner == identity.name)
            if owned >= lim.max_pools_per_identity:
                raise _exhausted("identity_pools", (
                    f"pool_id: identity '{identity.name}' owns {owned} pools, its limit (the "
                    f"cache service's --max-pools-per-identity {lim.max_pools_per_identity}); "
                    "unregister one first"))
        held = sum(self._pages.values()) - self._pages.get(pool_id, 0)
        wanted = pool_pages(request)
        if held + wanted > lim.max_total_pages:
            raise _exhausted("total_pages", (
                f"device_pages + host_pages + mamba_slots: {wanted} more would make "
                f"{held + wanted} pages across this cache service's pools, past its "
                f"--max-total-pages {lim.max_total_pages} ({held} held)"))

    @contextlib.contextmanager
    def _serialized(self, rpc: str) -> Iterator[None]:
        # Registration changes owners: check, call and record under one lock, so that two
        # identities racing for a new pool cannot both pass the check. Steps (every engine step)
        # only read the owner and never wait for that lock.
        if rpc in ("RegisterPool", "UnregisterPool"):
            with self._lock:
                yield
        else:
            yield

    def _check_owner(self, rpc: str, request, identity: Identity) -> None:
        assert identity.role == WORKER  # the role table admits no other role to these RPCs
        pool_id = request.pool_id
        if not pool_id:  # EvictNamespace without a pool: every pool
            raise _denied(f"pool_id: identity '{identity.name}' (role worker) may evict only in "
                          "its own pool; name it")
        if not identity.may_use_pool(pool_id):
            raise _denied(f"pool_id: identity '{identity.name}' may not use pool '{pool_id}' "
                          f"(its pools: {', '.join(identity.pools or ())})")
        owner = self._owners.get(pool_id)
        if rpc == "RegisterPool":
            if owner is not None and owner != identity.name:
                raise _denied(f"pool_id: pool '{pool_id}' belongs to identity '{owner}'")
        elif owner is None:
            raise _denied(f"pool_id: no worker registered pool '{pool_id}' with this cache "
                          "service (a restarted cache service knows no pool until its worker "
                          "registers it again)")
        elif owner != identity.name:
            raise _denied(f"pool_id: pool '{pool_id}' belongs to identity '{owner}', not to "
                          f"'{identity.name}'")

    def _check_limits(self, rpc: str, request) -> None:
        lim = self.limits
        if rpc == "RegisterPool":
            for field in ("device_pages", "host_pages", "mamba_slots"):
                if getattr(request, field) > lim.max_pool_pages:
                    raise _too_big(f"{field}: must be <= {lim.max_pool_pages} (the cache "
                                   f"service's --max-pool-pages), got {getattr(request, field)}")
            if request.lease_ttl_s > lim.max_lease_ttl_s:
                raise _too_big(f"lease_ttl_s: must be <= {lim.max_lease_ttl_s:g} (the cache "
                               f"service's --max-lease-ttl-s), got {request.lease_ttl_s:g}")
        elif rpc == "Step":
            for i, op in enumerate(request.matches):
                if op.lease_ttl_s > lim.max_lease_ttl_s:
                    raise _too_big(f"matches[{i}].lease_ttl_s: must be <= "
                                   f"{lim.max_lease_ttl_s:g} (the cache service's "
                                   f"--max-lease-ttl-s), got {op.lease_ttl_s:g}")

    @contextlib.contextmanager
    def subscription(self, request: pb.SubscribeRequest,
                     context: grpc.ServicerContext) -> Iterator[None]:
        """One of the caller's `max_subscriptions_per_identity` Subscribe slots (RESOURCE_EXHAUSTED
        when it holds them all), held for the stream's life. No per-identity count without auth:
        every caller is then the same anonymous one."""
        identity = identity_of(context)
        if identity is None:
            yield
            return
        cap = self.limits.max_subscriptions_per_identity
        with self._lock:
            held = self._subscriptions[identity.name]
            if held < cap:
                self._subscriptions[identity.name] = held + 1
        if held >= cap:
            self._refusals.refuse(context, "Subscribe", AuthError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "identity_subscriptions",
                f"identity '{identity.name}' holds {held} Subscribe streams, its limit (the cache "
                f"service's --max-subscriptions-per-identity {cap}); close one first"), identity)
        try:
            yield
        finally:
            with self._lock:
                self._subscriptions[identity.name] -= 1
                if not self._subscriptions[identity.name]:
                    del self._subscriptions[identity.name]
