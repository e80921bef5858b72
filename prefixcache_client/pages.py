"""Token pages as bytes: a prompt's tokens as u32 little-endian, the bytes the page hash
(prefixcache_client.hash) is computed over, cut into pages of `stride` bytes (4 x page size).

Shared by both services: the cache service's radix tree compares a prompt with a cached run
(cache_service.tree.walk), the compute service's scheduler a request with an in-flight sibling
(compute_service.engine.scheduler). Here rather than in either service because neither may
import the other's internals, and this is the torch-free layer both already import.
"""
from __future__ import annotations


def common_pages(a: bytes, b: bytes, stride: int, limit: int) -> int:
    """Leading whole pages (of `stride` bytes) equal in a and b (bytes or bytearray), at most
    `limit`: a binary search of C-speed comparisons instead of a page-by-page loop, each probe
    comparing only the pages after those already known equal, in place (no copies)."""
    if not isinstance(a, bytes | bytearray):
        a = bytes(a)
    lo, hi = 0, min(len(a) // stride, len(b) // stride, limit)
    if a.startswith(memoryview(b)[:hi * stride]):
        return hi
    hi -= 1  # page hi - 1 differs somewhere
    view = memoryview(b)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a.startswith(view[lo * stride:mid * stride], lo * stride):
            lo = mid
        else:
            hi = mid - 1
    return lo
