"""Stateless scans of the KV index's masks (gateway/core/index.py): set bits, runs of held pages
per worker."""
from __future__ import annotations

from collections.abc import Iterator, Sequence


def bit_positions(mask: int) -> Iterator[int]:
    """Slot numbers of the set bits of `mask`."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def runs(masks: Sequence[int], starts: dict[int, int], first: int = 0) -> dict[int, int]:
    """For each worker slot, the first page at or after its start whose mask (the slots
    holding it: masks[i] for page i) lacks its bit.

    Slots start at starts[slot], and the slots of the mask `first` at 0. Only ends past 0 are
    returned (a slot missing from the answer ends at 0), so a request whose first page few
    workers hold costs O(pages + those workers), not O(all workers)."""
    joining: dict[int, int] = {0: first} if first else {}
    for slot, pos in starts.items():
        joining[pos] = joining.get(pos, 0) | (1 << slot)
    ends: dict[int, int] = {}
    if not joining:
        return ends
    alive, n = 0, len(masks)
    for i in range(min(joining), n):
        alive |= joining.pop(i, 0)
        if not alive:
            if not joining:
                return ends
            continue
        m = masks[i]
        if alive & m != alive:
            if i:
                for slot in bit_positions(alive & ~m):
                    ends[slot] = i
            alive &= m
    for pos, mask in joining.items():  # runs that started at the very end
        alive |= mask
    for slot in bit_positions(alive):
        ends[slot] = n
    return ends
