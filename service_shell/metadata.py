"""Request metadata keys the services agree on."""
from __future__ import annotations

# Trusted request metadata carrying the tenant salt: the gateway sets it from the caller's
# authenticated identity (design.md §2); it is never a request field.
SALT_METADATA_KEY = "x-prefixcache-salt"
