"""Key naming: a page is stored under `<prefix>:<model id>:<page hash hex>`. The namespace
(adapter, salt) is inside the page hash (design.md §3), so two tenants or adapters never share a
key; the key is also what a page's MAC binds it to (pagestore.page_format)."""
from __future__ import annotations


def page_key(prefix: str, model_id: str, page_hash: bytes) -> str:
    return f"{prefix}:{model_id}:{page_hash.hex()}"
