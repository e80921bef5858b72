"""The callers of a model server (`python -m gateway --model-server`): the gateway run beside one
compute worker, serving the OpenAI HTTP API of that worker alone to an InferencePool's data
plane (design.md §6, "Workers as InferencePool model servers").

There the Endpoint Picker has already authenticated the tenant (its bearer token) and routed the
request; Envoy forwards it with the tenant's salt and request-id scope in headers the picker set
(`x-prefixcache-salt`, `x-prefixcache-request-scope`; a client's own are replaced) and adds the
data plane's own service token after the picker. So a model server takes as its caller only the
data plane's identity (role `dataplane`), and as the tenant the one those headers name. Anyone
else, a tenant's bearer token included, is refused: a tenant reaching a model server directly
could otherwise choose any salt, i.e. read another tenant's cache.

Drop-in for `TenantDirectory` where the gateway authenticates callers (`authenticate`), with no
per-tenant limit overrides and no anonymous caller.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

from gateway.core.tenants import AuthError, Tenant
from prefixcache_client.limits import MAX_NAME_BYTES
from service_shell import REQUEST_SCOPE_METADATA_KEY, SALT_METADATA_KEY
from service_shell.auth import DATAPLANE, AuthError as ServiceAuthError, ServiceIdentities

# service_shell.metadata.request_scope: 32 lowercase hex digits.
_SCOPE = re.compile(r"[0-9a-f]{32}")


class DataplaneTenants:
    allow_anonymous = False

    def __init__(self, callers: ServiceIdentities) -> None:
        self.callers = callers
        self.limits: dict[str, dict[str, float | int]] = {}

    def __len__(self) -> int:
        return 0  # no tenant tokens of its own

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Tenant:
        """The tenant the Endpoint Picker named; AuthError unless the data plane sent it."""
        pairs = [(k, v if isinstance(v, str) else v.decode(errors="replace"))
                 for k, v in metadata or ()]
        try:
            identity = self.callers.authenticate(pairs)
        except ServiceAuthError as exc:
            raise AuthError(f"this is a model server: only the data plane calls it ({exc})") from None
        if identity.role != DATAPLANE:
            raise AuthError(f"this is a model server: only the data plane (role {DATAPLANE}) "
                            f"calls it, not {identity.name!r} (role {identity.role})")
        salts = [v for k, v in pairs if k == SALT_METADATA_KEY]
        scopes = [v for k, v in pairs if k == REQUEST_SCOPE_METADATA_KEY]
        if len(salts) > 1 or len(scopes) != 1 or not _SCOPE.fullmatch(scopes[0]):
            raise AuthError(f"the data plane must forward one {REQUEST_SCOPE_METADATA_KEY} "
                            f"(32 hex digits) and at most one {SALT_METADATA_KEY}, as the "
                            "Endpoint Picker sets them")
        salt = salts[0] if salts else ""
        if len(salt.encode()) > MAX_NAME_BYTES:
            raise AuthError(f"{SALT_METADATA_KEY}: over {MAX_NAME_BYTES} bytes")
        # Named by its scope: the limits, logs and running calls of one tenant stay together.
        return Tenant(f"scope-{scopes[0]}", salt, scope=scopes[0])
