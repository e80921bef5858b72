"""Stateless scans of the KV index's masks and sets (gateway/core/index.py): set bits, runs of
held pages per worker, eviction victims."""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from itertools import islice


def bit_positions(mask: int) -> Iterator[int]:
    """Slot numbers of the set bits of `mask`."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


SET_PROBE_WORKERS = 4


def victims(d: dict[bytes, int], n: int) -> list[bytes]:
    """Up to n keys to drop from the least recently stored 2n: pages one worker holds first, then
    the oldest shared ones (a power of two has one bit set)."""
    window = list(islice(d, 2 * n))
    single = [h for h in window if not d[h] & (d[h] - 1)]
    if len(single) >= n:
        return single[:n]
    shared = [h for h in window if d[h] & (d[h] - 1)]
    return single + shared[:n - len(single)]


def run_in(pages: set[bytes], hashes: Sequence[bytes], i: int) -> int:
    """First position >= i whose hash is not in `pages` (len(hashes) when none)."""
    n, step = len(hashes), 32
    while i < n:
        stop = min(n, i + step)
        if not pages.issuperset(hashes[i:stop]):
            while hashes[i] in pages:
                i += 1
            return i
        i, step = stop, min(step * 2, 1024)
    return n


def runs(hashes: Sequence[bytes], starts: dict[int, int], mask_of: Callable[[bytes], int]) -> dict[int, int]:
    """For each worker slot, the first page at or after starts[slot] whose mask lacks its bit."""
    joining: dict[int, int] = {}
    for slot, pos in starts.items():
        joining[pos] = joining.get(pos, 0) | (1 << slot)
    ends: dict[int, int] = {}
    alive, n = 0, len(hashes)
    for i in range(min(joining), n):
        alive |= joining.pop(i, 0)
        if not alive:
            if not joining:
                return ends
            continue
        m = mask_of(hashes[i])
        if alive & m != alive:
            for slot in bit_positions(alive & ~m):
                ends[slot] = i
            alive &= m
    for pos, mask in joining.items():  # runs that started at the very end
        alive |= mask
    for slot in bit_positions(alive):
        ends[slot] = n
    return ends
