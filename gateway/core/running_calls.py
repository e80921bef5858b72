"""The Generate calls in progress at the gateway: whom each runs on, how to cancel it from any
thread, and the registry Abort and the drain look calls up in."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from gateway.core.router import Worker
from gateway.core.tenants import Tenant
from prefixcache_client.compute import GenerateStream
from service_shell.metadata import request_scope


@dataclass(eq=False)
class ProxiedCall:
    """One Generate call at the gateway: whom it runs on, and how to cancel it from any thread."""
    tenant: Tenant
    request_id: str
    worker: Worker | None = None
    stream: GenerateStream | None = None
    cancelled: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def scope(self) -> str:
        """The request-id scope the worker keys this call by (ids are unique per tenant only,
        so the worker must not key them globally): the tenant's."""
        return self.tenant.scope or request_scope(self.tenant.name)

    def attach(self, worker: Worker, stream: GenerateStream) -> None:
        with self._lock:
            self.worker, self.stream = worker, stream
            if self.cancelled:  # the client left while the call was being routed
                stream.cancel()

    def cancel(self) -> None:
        """The client left: cancelling the worker call aborts the request on the worker."""
        with self._lock:
            self.cancelled = True
            if self.stream is not None:
                self.stream.cancel()


class RunningCalls:
    """Calls in progress by (tenant, request id): ids are unique per tenant, Abort and the drain
    find calls here."""

    def __init__(self) -> None:
        self._calls: dict[tuple[str, str], ProxiedCall] = {}
        self._changed = threading.Condition()

    def add(self, call: ProxiedCall) -> bool:
        with self._changed:
            key = (call.tenant.name, call.request_id)
            if key in self._calls:
                return False
            self._calls[key] = call
            return True

    def remove(self, call: ProxiedCall) -> None:
        with self._changed:
            self._calls.pop((call.tenant.name, call.request_id), None)
            self._changed.notify_all()

    def get(self, tenant: Tenant, request_id: str) -> ProxiedCall | None:
        with self._changed:
            return self._calls.get((tenant.name, request_id))

    def snapshot(self) -> list[ProxiedCall]:
        with self._changed:
            return list(self._calls.values())

    def wait_empty(self, timeout_s: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: not self._calls, timeout_s)

    def __len__(self) -> int:
        return len(self._calls)
