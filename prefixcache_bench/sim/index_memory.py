"""The gateway index's own memory, measured at the end of a simulator replay (issue 31)."""
from __future__ import annotations

from gateway.core.index import KvIndex


def index_bytes(index: KvIndex) -> int:
    """Its tables' flat arrays plus the sets of holders of pages several workers hold
    (`HolderSets.nbytes`); the per-worker records, a few hundred bytes each, are left out.
    Reads KvIndex's private tables: a benchmark's view, not an API."""
    return sum(t.nbytes() + t.holder_sets.nbytes() for t in index._tables)  # noqa: SLF001
