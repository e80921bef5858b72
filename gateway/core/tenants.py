"""Callers -> tenants: the bearer token of a request's `authorization` metadata names a tenant
and the salt that isolates its cache namespace (design.md §2).

The tenants file (--tenants-file, a mounted Secret in Kubernetes):

    {"tokens": {"TOKEN": {"tenant": "NAME", "salt": "SALT"}, ...}}

A salt is only ever taken from this file: a client's own `x-prefixcache-salt` metadata is never
forwarded (the gateway sets that header itself), and GenerateRequest has no salt field.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from prefixcache_client.hash import MAX_NAME_BYTES
from service_shell.auth import token_digest

AUTH_METADATA_KEY = "authorization"
ANONYMOUS = "anonymous"
_BEARER = "bearer "


class AuthError(Exception):
    """The caller is not authenticated; the message names the header and what is wrong."""


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    salt: str


class TenantDirectory:
    """Bearer token -> tenant. `allow_anonymous`: requests without a token are the tenant
    "anonymous" with salt "" (the namespace of unsalted requests to a worker)."""

    def __init__(self, tokens: dict[str, Tenant], allow_anonymous: bool = False) -> None:
        self._tenants = {token_digest(t): tenant for t, tenant in tokens.items()}
        self.allow_anonymous = allow_anonymous

    def __len__(self) -> int:
        return len(self._tenants)

    @classmethod
    def from_file(cls, path: str | Path | None, allow_anonymous: bool = False) -> TenantDirectory:
        """Reads and validates the tenants file (None: no tokens). ValueError says what is wrong
        and where."""
        if path is None:
            return cls({}, allow_anonymous)
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--tenants-file {path}: {exc}") from None
        entries = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(entries, dict):
            raise ValueError(f"--tenants-file {path}: expected {{\"tokens\": {{TOKEN: "
                             "{\"tenant\": NAME, \"salt\": SALT}}}}")
        tokens = {}
        for i, (token, entry) in enumerate(entries.items()):
            where = f"--tenants-file {path}: tokens entry {i}"  # never print the token itself
            if not token or not isinstance(entry, dict):
                raise ValueError(f"{where}: needs a non-empty token and an object")
            name, salt = entry.get("tenant"), entry.get("salt", "")
            if not isinstance(name, str) or not name or not isinstance(salt, str):
                raise ValueError(f"{where}: 'tenant' must be a non-empty string and 'salt' a string")
            if len(salt.encode()) > MAX_NAME_BYTES:
                raise ValueError(f"{where}: 'salt' is over {MAX_NAME_BYTES} bytes")
            tokens[token] = Tenant(name, salt)
        return cls(tokens, allow_anonymous)

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Tenant:
        """The tenant of a call's metadata; AuthError when it has none or an unknown one."""
        values = [v for k, v in metadata or () if k == AUTH_METADATA_KEY]
        if not values:
            if self.allow_anonymous:
                return Tenant(ANONYMOUS, "")
            raise AuthError(f"{AUTH_METADATA_KEY}: missing; send 'Bearer TOKEN' metadata")
        if len(values) > 1:
            raise AuthError(f"{AUTH_METADATA_KEY}: sent {len(values)} times; send one")
        value = values[0] if isinstance(values[0], str) else values[0].decode(errors="replace")
        if not value.lower().startswith(_BEARER) or not value[len(_BEARER):].strip():
            raise AuthError(f"{AUTH_METADATA_KEY}: expected 'Bearer TOKEN'")
        tenant = self._tenants.get(token_digest(value[len(_BEARER):].strip()))
        if tenant is None:
            raise AuthError(f"{AUTH_METADATA_KEY}: unknown bearer token")
        return tenant
