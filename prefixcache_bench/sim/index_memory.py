"""The gateway index's own memory, measured at the end of a simulator replay (issue 31)."""
from __future__ import annotations

import sys

from gateway.core.index import KvIndex


def index_bytes(index: KvIndex) -> int:
    """Its tables' flat arrays plus the masks of pages several workers hold (the dict, its keys
    and mask ints, as sys.getsizeof counts them); the per-worker records, a few hundred bytes
    each, are left out. Reads KvIndex's private tables: a benchmark's view, not an API."""
    total = 0
    for table in index._tables:  # noqa: SLF001
        multi = table.multi
        total += table.nbytes() + sys.getsizeof(multi) + sum(
            sys.getsizeof(k) + sys.getsizeof(v) for k, v in multi.items())
    return total
