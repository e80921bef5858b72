"""Stateless scans of the KV index's masks (gateway/core/index.py): set bits, runs of held pages
per worker."""
from __future__ import annotations

from bisect import bisect_left
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


def run_ends(masks: Sequence[int], starts: dict[int, int], first: int = 0,
             at: Sequence[int] | None = None, end: int | None = None) -> dict[int, int]:
    """`runs` by groups of slots: `starts` maps a start page to the mask of the slots whose run
    starts there (and `first`'s slots start at 0); the answer maps each end page past 0 to the
    mask of the slots whose run ends there, in page order. O(pages) mask operations whatever the
    number of slots: a shared prefix's hundred holders end together, in one entry.

    With `at` (held_native.py's segments), masks[j] is the mask of the pages from at[j] (at[0]
    is 0) up to the next segment's first page, or `end`: O(segments) then. Every start page is
    a segment's first page or `end` (a run ends where its mask changes)."""
    joining = dict(starts)
    if first:
        joining[0] = joining.get(0, 0) | first
    ends: dict[int, int] = {}
    if not joining:
        return ends
    if at is None:
        at, end = range(len(masks)), len(masks)
    alive = 0
    for j in range(bisect_left(at, min(joining)), len(masks)):
        i = at[j]
        alive |= joining.pop(i, 0)
        if not alive:
            if not joining:
                return ends
            continue
        m = masks[j]
        if alive & m != alive:
            if i:
                ends[i] = alive & ~m
            alive &= m
    for mask in joining.values():  # runs that started at the very end
        alive |= mask
    if alive:
        ends[end] = alive
    return ends


def holder_runs(devm: list[int], hostm: list[int] | None, remm: list[int] | None, everyone: int,
                at: Sequence[int] | None = None, end: int | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(slots, device run end, host extension end, remote extension end) of each slot whose run
    on any medium goes past page 0, from the masks of a request's pages (`held_masks`; None for
    an empty medium), or of its segments (`at`, `end`: `run_ends`): REMOTE is shared, so a page
    any worker holds there extends every run. Slots in `run_ends`' order: by end page, then
    slot."""
    dev_end = run_ends(devm, {}, everyone, at, end)
    anym = devm if hostm is None else [d | h for d, h in zip(devm, hostm)]
    host_end = dev_end if hostm is None else run_ends(anym, dev_end, _others(everyone, dev_end),
                                                      at, end)
    rem_end = host_end if remm is None else run_ends(
        [everyone if r else a for r, a in zip(remm, anym)], host_end,
        _others(everyone, host_end), at, end)
    slots, r_end = slots_and_ends(rem_end)
    h_end = r_end if host_end is rem_end else ends_of(host_end, slots)
    d_end = h_end if dev_end is host_end else ends_of(dev_end, slots)
    return slots, d_end, h_end, r_end


def _others(everyone: int, ends: dict[int, int]) -> int:
    """The slots of `everyone` that end nowhere in `ends` (they start the next run at 0)."""
    for mask in ends.values():
        everyone &= ~mask
    return everyone


def slot_array(mask: int) -> np.ndarray:
    """`bit_positions` of the mask as an array (numpy's bit unpacking for many bits)."""
    count = mask.bit_count()
    if count < 16:
        return np.fromiter(bit_positions(mask), np.intp, count)
    bits = np.frombuffer(mask.to_bytes((mask.bit_length() + 7) // 8, "little"), np.uint8)
    return np.flatnonzero(np.unpackbits(bits, bitorder="little"))


def slots_and_ends(ends: dict[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """`run_ends`' answer as (slots, their end pages), group after group."""
    groups = [slot_array(mask) for mask in ends.values()]
    if len(groups) == 1:
        return groups[0], np.full(len(groups[0]), next(iter(ends)), np.int64)
    return (np.concatenate(groups) if groups else np.zeros(0, np.intp),
            np.repeat(np.fromiter(ends, np.int64, len(ends)), [len(g) for g in groups]))


def ends_of(ends: dict[int, int], slots: np.ndarray) -> np.ndarray:
    """The end page in `ends` of each slot (0: none)."""
    found, at = slots_and_ends(ends)
    out = np.zeros(max(int(slots.max(initial=-1)), int(found.max(initial=-1))) + 1, np.int64)
    out[found] = at
    return out[slots]


class _Masks(Protocol):
    def masks(self, hashes: Sequence[bytes], touch_from: int | None = None) -> list[int]: ...


def held_masks(dev: _Masks, host: _Masks | None, rem: _Masks | None, hashes: Sequence[bytes],
               first_chunk: int = 64, touch_from: Sequence[int | None] = (None, None, None)
               ) -> tuple[list[int], list[int] | None, list[int] | None]:
    """The masks of a request's pages on each medium (None for a medium left out: an empty
    table), up to the first page that no medium holds; the pages probed are touched on a
    medium whose `touch_from` is given (the stamp of page 0: `PageTable.touch_stamps`).

    No worker's run, on any medium, goes past a page nobody holds (see `runs`), so the pages
    after it need no probe: a 2,048-page prompt of which 32 pages are cached anywhere costs a
    probe of its first chunk, not of every page. Probed in chunks of `first_chunk` pages, then
    twice as many each time."""
    out_dev: list[int] = []
    out_host: list[int] | None = None if host is None else []
    out_rem: list[int] | None = None if rem is None else []
    start, size, n = 0, first_chunk, len(hashes)
    touch_dev, touch_host, touch_rem = touch_from
    while start < n:
        chunk = hashes[start:start + size]
        d = dev.masks(chunk, None if touch_dev is None else touch_dev - start)
        h = host.masks(chunk, None if touch_host is None else touch_host - start) \
            if host is not None else None
        r = rem.masks(chunk, None if touch_rem is None else touch_rem - start) \
            if rem is not None else None
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
