"""prefixcache_client/pages.py: `common_pages` agrees with a page-by-page comparison."""
from __future__ import annotations

import random
import struct

from prefixcache_client.pages import common_pages


def naive(a: bytes, b: bytes, stride: int, limit: int) -> int:
    n = 0
    while n < limit and a[n * stride:(n + 1) * stride] == b[n * stride:(n + 1) * stride] \
            and len(a) >= (n + 1) * stride and len(b) >= (n + 1) * stride:
        n += 1
    return n


def test_common_pages_matches_a_page_by_page_comparison():
    rng = random.Random(0)
    stride = 4 * 4
    for _ in range(500):
        tokens = [rng.randrange(5) for _ in range(rng.randrange(40))]
        other = list(tokens[:rng.randrange(len(tokens) + 1)])
        other += [rng.randrange(5) for _ in range(rng.randrange(20))]
        a, b = (struct.pack(f"<{len(t)}I", *t) for t in (tokens, other))
        limit = rng.randrange(12)
        assert common_pages(a, b, stride, limit) == naive(a, b, stride, limit)
        assert common_pages(bytearray(a), memoryview(b), stride, limit) == naive(a, b, stride, limit)
