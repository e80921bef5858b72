"""Request metadata keys the services agree on."""
from __future__ import annotations

import hashlib

# Trusted request metadata carrying the tenant salt: the gateway sets it from the caller's
# authenticated identity (design.md §2); it is never a request field.
SALT_METADATA_KEY = "x-prefixcache-salt"

# Trusted request metadata scoping request ids: the gateway (and its Endpoint Picker, through the
# data plane) sets it to the caller's tenant scope, so that a worker keys running requests by
# (scope, id) and one tenant's id never collides with, or aborts, another's (issue 25). Workers
# answer with the client's id unchanged.
REQUEST_SCOPE_METADATA_KEY = "x-prefixcache-request-scope"
MAX_REQUEST_SCOPE_BYTES = 64


def request_scope(tenant: str) -> str:
    """The request-id scope of a tenant (by name): a fixed-length hex digest, header-safe
    whatever the name, and the same on every gateway replica."""
    return hashlib.sha256(b"prefixcache-request-scope\0" + tenant.encode()).hexdigest()[:32]
