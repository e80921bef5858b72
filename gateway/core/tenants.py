"""Callers -> tenants: the bearer token of a request's `authorization` metadata names a tenant
and the salt that isolates its cache namespace (design.md §2).

The tenants file (--tenants-file, a mounted Secret in Kubernetes):

    {"tokens": {"TOKEN": {"tenant": "NAME", "salt": "SALT"}, ...}}

An entry may also set the tenant's HTTP limits (gateway/http/limits.py), in place of the
gateway's --http-rate-per-s, --http-burst and --http-max-in-flight: `"rate_per_s": 20,
"burst": 40, "max_in_flight": 8` (0 = no such limit). Tokens of one tenant share its limits,
so two entries of a tenant may not set different ones.

A salt is only ever taken from this file (or derived from it with a request's vLLM `cache_salt`,
`Tenant.with_cache_salt`): a client's own `x-prefixcache-salt` metadata is never
forwarded (the gateway sets that header itself), and GenerateRequest has no salt field.
"""
from __future__ import annotations

import hashlib
import json
import math
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
    # The request-id scope its worker calls carry; "" = request_scope(name). Set only for a
    # tenant the Endpoint Picker named to a model server (gateway/core/dataplane_tenants.py),
    # which knows the scope, not the name.
    scope: str = ""

    def with_cache_salt(self, cache_salt: str | None) -> Tenant:
        """The tenant as one request with vLLM's `cache_salt` runs: its salt joined with the
        request's, so two requests share pages only with equal tenant, adapter and cache_salt
        (the salt is part of the namespace in every page hash). The result is a digest, never
        the client's salt in clear, in the `x-prefixcache-salt` metadata, logs and Redis keys;
        the tenant's own salt goes into it, so tenants never meet by choosing equal salts."""
        if not cache_salt:
            return self
        digest = hashlib.sha256(b"prefixcache cache_salt\0" + self.salt.encode() + b"\0"
                                + cache_salt.encode()).hexdigest()
        return Tenant(self.name, f"cs-{digest[:48]}")


# The limits an entry may set, with their type: requests per second, burst, in flight.
LIMIT_FIELDS = {"rate_per_s": float, "burst": int, "max_in_flight": int}


def _limits_of(entry: dict, where: str) -> dict[str, float | int]:
    out: dict[str, float | int] = {}
    for field, kind in LIMIT_FIELDS.items():
        if field not in entry:
            continue
        value = entry[field]
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or (kind is int and not isinstance(value, int))
                or not math.isfinite(value) or value < 0):
            kind_name = "an integer" if kind is int else "a number"
            raise ValueError(f"{where}: '{field}' must be {kind_name} >= 0, got {value!r}")
        out[field] = kind(value)
    return out


class TenantDirectory:
    """Bearer token -> tenant. `allow_anonymous`: requests without a token are the tenant
    "anonymous" with salt "" (the namespace of unsalted requests to a worker)."""

    def __init__(self, tokens: dict[str, Tenant], allow_anonymous: bool = False,
                 limits: dict[str, dict[str, float | int]] | None = None) -> None:
        self._tenants = {token_digest(t): tenant for t, tenant in tokens.items()}
        self.allow_anonymous = allow_anonymous
        # Tenant name -> its own HTTP limits (LIMIT_FIELDS), from the tenants file.
        self.limits = dict(limits or {})

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
        tokens: dict[str, Tenant] = {}
        limits: dict[str, dict[str, float | int]] = {}
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
            own = _limits_of(entry, where)
            if own and limits.setdefault(name, own) != own:
                raise ValueError(f"{where}: tenant '{name}' has other limits in another entry")
        return cls(tokens, allow_anonymous, limits)

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Tenant:
        """The tenant of a call's metadata; AuthError when it has none or an unknown one.
        With `allow_anonymous` a call without a token, or with a token no tenant holds, is the
        anonymous tenant, as vLLM without --api-key takes any key (the official `openai` client
        refuses to send none, and vLLM's docs have it send "EMPTY"); a tenant's own token still
        selects that tenant."""
        values = [v for k, v in metadata or () if k == AUTH_METADATA_KEY]
        if not values:
            if self.allow_anonymous:
                return Tenant(ANONYMOUS, "")
            raise AuthError(f"{AUTH_METADATA_KEY}: missing; send 'Bearer TOKEN' metadata")
        if len(values) > 1:
            raise AuthError(f"{AUTH_METADATA_KEY}: sent {len(values)} times; send one")
        value = values[0] if isinstance(values[0], str) else values[0].decode(errors="replace")
        if not value.lower().startswith(_BEARER) or not value[len(_BEARER):].strip():
            if self.allow_anonymous:
                return Tenant(ANONYMOUS, "")
            raise AuthError(f"{AUTH_METADATA_KEY}: expected 'Bearer TOKEN'")
        tenant = self._tenants.get(token_digest(value[len(_BEARER):].strip()))
        if tenant is None:
            if self.allow_anonymous:
                return Tenant(ANONYMOUS, "")
            raise AuthError(f"{AUTH_METADATA_KEY}: unknown bearer token")
        return tenant
