"""Stateless scans of the KV index's masks (gateway/core/index.py): set bits, runs of held pages
per worker."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np


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
    workers hold costs O(pages + those workers), not O(all workers). `run_ends`, slot by slot."""
    joining: dict[int, int] = {}
    for slot, pos in starts.items():
        joining[pos] = joining.get(pos, 0) | (1 << slot)
    return {slot: end for end, mask in run_ends(masks, joining, first).items()
            for slot in bit_positions(mask)}


def run_ends(masks: Sequence[int], starts: dict[int, int], first: int = 0) -> dict[int, int]:
    """`runs` by groups of slots: `starts` maps a start page to the mask of the slots whose run
    starts there (and `first`'s slots start at 0); the answer maps each end page past 0 to the
    mask of the slots whose run ends there, in page order. O(pages) mask operations whatever the
    number of slots: a shared prefix's hundred holders end together, in one entry."""
    joining = dict(starts)
    if first:
        joining[0] = joining.get(0, 0) | first
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
                ends[i] = alive & ~m
            alive &= m
    for mask in joining.values():  # runs that started at the very end
        alive |= mask
    if alive:
        ends[n] = alive
    return ends


def slot_array(mask: int) -> np.ndarray:
    """`bit_positions` of the mask as an array (numpy's bit unpacking for many bits)."""
    count = mask.bit_count()
    if count < 16:
        return np.fromiter(bit_positions(mask), np.intp, count)
    bits = np.frombuffer(mask.to_bytes((mask.bit_length() + 7) // 8, "little"), np.uint8)
    return np.flatnonzero(np.unpackbits(bits, bitorder="little"))


class _Masks(Protocol):
    def masks(self, hashes: Sequence[bytes]) -> list[int]: ...


def held_masks(dev: _Masks, host: _Masks | None, rem: _Masks | None, hashes: Sequence[bytes],
               first_chunk: int = 64) -> tuple[list[int], list[int] | None, list[int] | None]:
    """The masks of a request's pages on each medium (None for a medium left out: an empty
    table), up to the first page that no medium holds.

    No worker's run, on any medium, goes past a page nobody holds (see `runs`), so the pages
    after it need no probe: a 2,048-page prompt of which 32 pages are cached anywhere costs a
    probe of its first chunk, not of every page. Probed in chunks of `first_chunk` pages, then
    twice as many each time."""
    out_dev: list[int] = []
    out_host: list[int] | None = None if host is None else []
    out_rem: list[int] | None = None if rem is None else []
    start, size, n = 0, first_chunk, len(hashes)
    while start < n:
        chunk = hashes[start:start + size]
        d = dev.masks(chunk)
        h = host.masks(chunk) if host is not None else None
        r = rem.masks(chunk) if rem is not None else None
        held = d if h is None else [a | b for a, b in zip(d, h)]
        if r is not None:
            held = [a | b for a, b in zip(held, r)]
        end = next((i for i, m in enumerate(held) if not m), len(chunk))
        out_dev += d[:end]
        if out_host is not None:
            out_host += h[:end]
        if out_rem is not None:
            out_rem += r[:end]
        if end < len(chunk):
            break
        start, size = start + size, size * 2
    return out_dev, out_host, out_rem
