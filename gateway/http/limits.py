"""Per-tenant limits of the HTTP API (issue 25, finding 10): a token bucket of requests (a rate
per second with a burst) and a cap on requests in flight, each tenant its own. A request past
either is answered 429 with `Retry-After` (seconds) and the OpenAI error JSON
(`type: "rate_limit_error"`, `code: "rate_limit_exceeded"` or `"too_many_in_flight"`), counted in
`prefixcache_gateway_http_throttled_total{tenant, reason}` (reason `rate` or `in_flight`).

The defaults are the gateway's flags (--http-rate-per-s, --http-burst, --http-max-in-flight;
0 = no such limit); a tenant's entries in the tenants file override them for that tenant
(`rate_per_s`, `burst`, `max_in_flight`; gateway/core/tenants.py). The tenant is the one the
routes authenticate (the bearer token); a request whose token names no tenant is limited as the
tenant `unauthenticated` (it is answered 401 unless it is over that tenant's limits), so a flood
of bad tokens is throttled too without touching the tenants' own budgets.

Pure ASGI around the app, for paths under /v1/ (not /health): a request holds its in-flight slot
until its response, streamed or not, has been sent in full or the client has gone."""
from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import prometheus_client
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.core.tenants import AuthError, TenantDirectory

UNAUTHENTICATED = "unauthenticated"


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """0 = no such limit. `burst` 0 with a rate: one second's worth (at least 1)."""
    rate_per_s: float = 0.0
    burst: int = 0
    max_in_flight: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate_per_s) and self.rate_per_s >= 0):
            raise ValueError(f"rate_per_s must be a finite number >= 0, got {self.rate_per_s}")
        if self.burst < 0 or self.max_in_flight < 0:
            raise ValueError("burst and max_in_flight must be >= 0")

    @property
    def capacity(self) -> float:
        return float(self.burst or max(1, math.ceil(self.rate_per_s)))

    def overridden(self, fields: Mapping[str, float | int]) -> TenantLimits:
        return replace(self, **fields) if fields else self


class _Bucket:
    __slots__ = ("tokens", "stamp", "in_flight")

    def __init__(self, tokens: float, stamp: float) -> None:
        self.tokens, self.stamp, self.in_flight = tokens, stamp, 0


class TenantLimiter:
    """The buckets and in-flight counts, tenant by tenant. Thread-safe (the app runs on one
    event loop, but a test may call it from anywhere)."""

    def __init__(self, defaults: TenantLimits, overrides: Mapping[str, Mapping] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.defaults = defaults
        self._limits = {name: defaults.overridden(fields)
                        for name, fields in (overrides or {}).items()}
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()

    def limits(self, tenant: str) -> TenantLimits:
        return self._limits.get(tenant, self.defaults)

    def acquire(self, tenant: str) -> tuple[str, int] | None:
        """None: admitted, holding one in-flight slot (give it back with `release`); else
        (reason, Retry-After seconds)."""
        lim = self.limits(tenant)
        now = self._clock()
        with self._lock:
            bucket = self._buckets.get(tenant)
            if bucket is None:
                bucket = self._buckets[tenant] = _Bucket(lim.capacity, now)
            if lim.max_in_flight and bucket.in_flight >= lim.max_in_flight:
                return "in_flight", 1
            if lim.rate_per_s:
                bucket.tokens = min(lim.capacity,
                                    bucket.tokens + (now - bucket.stamp) * lim.rate_per_s)
                bucket.stamp = now
                if bucket.tokens < 1.0:
                    return "rate", max(1, math.ceil((1.0 - bucket.tokens) / lim.rate_per_s))
                bucket.tokens -= 1.0
            bucket.in_flight += 1
            return None

    def release(self, tenant: str) -> None:
        with self._lock:
            bucket = self._buckets.get(tenant)
            if bucket is not None:
                bucket.in_flight -= 1
                lim = self.limits(tenant)
                # A bucket that is full again and idle holds nothing: forget it (bounded memory).
                if not bucket.in_flight and (not lim.rate_per_s or bucket.tokens >= lim.capacity):
                    del self._buckets[tenant]


_MESSAGES = {
    "rate": ("rate_limit_exceeded", "tenant '{tenant}': more than {rate:g} requests per second "
             "(burst {burst:g}); retry after {retry} s"),
    "in_flight": ("too_many_in_flight", "tenant '{tenant}': {max_in_flight} requests already in "
                  "flight, its limit; retry when one has finished"),
}


class RateLimit:
    """The ASGI middleware: `limiter` per tenant of `tenants`, counted in `throttled`."""

    def __init__(self, app: ASGIApp, tenants: TenantDirectory, limiter: TenantLimiter,
                 throttled: prometheus_client.Counter) -> None:
        self.app, self.tenants, self.limiter, self.throttled = app, tenants, limiter, throttled

    def tenant_of(self, scope: Scope) -> str:
        # Every header: a model server's tenants read the data plane's (dataplane_tenants.py).
        values = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope.get("headers", ())]
        try:
            return self.tenants.authenticate(values).name
        except AuthError:
            return UNAUTHENTICATED

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        tenant = self.tenant_of(scope)
        refused = self.limiter.acquire(tenant)
        if refused is not None:
            await self._refuse(tenant, *refused, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.limiter.release(tenant)

    async def _refuse(self, tenant: str, reason: str, retry: int, send: Send) -> None:
        self.throttled.labels(tenant, reason).inc()
        lim = self.limiter.limits(tenant)
        code, text = _MESSAGES[reason]
        message = text.format(tenant=tenant, rate=lim.rate_per_s, burst=lim.capacity,
                              retry=retry, max_in_flight=lim.max_in_flight)
        body = json.dumps({"error": {"message": message, "type": "rate_limit_error",
                                     "param": None, "code": code}}).encode()
        await send({"type": "http.response.start", "status": 429,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"retry-after", str(retry).encode())]})
        await send({"type": "http.response.body", "body": body})


def throttled_counter(registry: prometheus_client.CollectorRegistry | None
                      ) -> prometheus_client.Counter:
    return prometheus_client.Counter(
        "prefixcache_gateway_http_throttled", "HTTP requests refused 429 by a tenant's limits, "
        "by tenant and reason (rate, in_flight).", ["tenant", "reason"],
        registry=registry)
