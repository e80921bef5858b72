"""A `PageTable`'s three slot arrays (gateway/core/index_table.py), and a growth's made ready ahead.

    slot i:  key[i]       the page hash's two words folded into one (index_table.key_of)   8 B
             holder[i]    a worker's slot, a pair, a triple, SHARED + a set's id, TOMB... 4 B
             stamp[i]     when last stored or routed (eviction order)                     4 B

    holder:  EMPTY (-3) | TOMB (-2) | PENDING (-1) | 0 .. PAIR-1 | PAIR .. TRIPLE-1 |
             never used | deleted   | C apply only | one worker  | two workers:     |
                                                   | its slot    | PAIR + (high <<  |
                                                   |             | 14) + low slot   |
             TRIPLE .. SHARED-1        | SHARED ..
             three workers: TRIPLE +   | 2+ workers:
             C(high, 3) + C(mid, 2) +  | the set of
             low slot                  | that id
    (PAIR 2^28, TRIPLE 2^29, SHARED 2^30: gateway/core/holder_sets.py)
    A slot is live when its holder is >= 0 (in C, >= PENDING: a page joined within one apply
    call, whose set Python makes before the call returns: gateway/core/index_native.py).

numpy owns the memory (C and numpy calls take it as it is); the table reads and writes single
slots through memoryviews of it, as fast as `array.array` (~45 ns an element).

Why ahead (issue 31): a growth needs arrays of up to ~1.6x the slots, every holder EMPTY, and
the first write to fresh memory costs its page fault (~5 us a 4 KiB page on this VM): ~0.2 s
for the 22M slots of a 10M-page table, all of it under the router's lock and the GIL, so every
routing decision due meanwhile waited that long. A `Spare` is the next growth's arrays, sized
once the table passes 55% from the way it has been filling since its last growth (a fleet
growing: up to 1.6x; pages stored and removed as fast: about the same size, its tombstones
are what fill it), then written a chunk at a time by the ingest thread between its slices,
without the lock (no one else sees them yet) and without the GIL (numpy's fill releases it). A
growth takes them when of a fitting size, and writes what is not yet written; else it
allocates as before.

The cost: their memory before the growth instead of from it, as far as written (an array's
unwritten part is address space only). So they are written no further than keeps the table and
the spare within 62 bytes a live page (issue 31's goal is 64 for the whole index), an idle feed
loop's writes included, or within what the growth will hold anyway when more (the pages it is
for replacing others: as many pages then as now). And none is planned while the table's sweep
keeps its tombstones from filling it (gateway/core/index_sweep.py: the rebuild it would be for
does not come), and an idle feed loop drops a planned one (feeds.py).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import threading
from collections.abc import Callable

import numpy as np

EMPTY, TOMB = -3, -2  # holder values below 0 (the diagram above)
_SLOT_BYTES = 16
_PAGE = mmap.PAGESIZE
# glibc's malloc serves a block this large by mmap always (its dynamic mmap threshold tops out at
# 32 MiB on 64-bit), and its free unmaps it. A smaller array may be heap memory, which free keeps
# resident for the next allocations: given back, its pages would only fault again at their next
# write (the shrink's arrays, written under the router's lock: steps of 5-10 ms, measured).
_GIVE_BACK_MIN_BYTES = 32 << 20
_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    """The C library, for madvise (a ctypes call releases the GIL)."""
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    return _LIBC


class TableArrays:
    """The arrays of `cap` slots; `filled` slots from 0 written empty (the rest not yet)."""

    __slots__ = ("cap", "key", "holder", "stamp", "addresses", "filled")

    def __init__(self, cap: int) -> None:
        self.cap, self.filled = cap, 0
        self.key = np.empty(cap, dtype=np.uint64)
        self.holder, self.stamp = np.empty(cap, dtype=np.int32), np.empty(cap, dtype=np.uint32)
        self.addresses = tuple(a.ctypes.data for a in (self.key, self.holder, self.stamp))

    @classmethod
    def empty(cls, cap: int) -> TableArrays:
        """Arrays of `cap` empty slots, written now."""
        arrays = cls(cap)
        arrays.fill(cap)
        return arrays

    def fill(self, slots: int) -> bool:
        """Writes the next `slots` slots empty; True once every slot is."""
        start, end = self.filled, min(self.cap, self.filled + slots)
        self.key[start:end] = 0
        self.holder[start:end] = EMPTY
        self.stamp[start:end] = 0
        self.filled = end
        return end == self.cap

    def views(self) -> tuple[memoryview, memoryview, memoryview]:
        """key, holder and stamp as memoryviews (single elements, read and written)."""
        return memoryview(self.key), memoryview(self.holder), memoryview(self.stamp)

    def nbytes(self) -> int:
        return self.cap * _SLOT_BYTES

    def give_back(self) -> None:
        """Returns the arrays' whole pages to the system (madvise MADV_DONTNEED, without the
        GIL), so that dropping them later is quick: a table's retired arrays (PageTable.retired),
        whose munmap otherwise took ~1 ms for 236 MB under the router's lock and the GIL (then
        0.03 ms). Their contents are gone (read back as zeros): only for arrays about to go.
        Arrays under `_GIVE_BACK_MIN_BYTES` stay as they are."""
        for array in (self.key, self.holder, self.stamp):
            if array.nbytes < _GIVE_BACK_MIN_BYTES:
                continue
            start = -(-array.ctypes.data // _PAGE) * _PAGE  # whole pages within the array only
            end = (array.ctypes.data + array.nbytes) // _PAGE * _PAGE
            if end > start:
                _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                                mmap.MADV_DONTNEED)


# A growth below this many slots allocates when it comes (a few ms at most): no spare.
SPARE_MIN_SLOTS = 1 << 16
# The spare is sized this much above the prediction. A growth takes it when the pages then fill
# 36-50% of it (its own arrays: 45%): within these factors of the slots it would allocate.
_MARGIN, _TAKE_FROM, _TAKE_UP_TO = 1.05, 0.9, 1.25
# Fill pacing: the spare complete once this share of the room left at its start is used.
_READY_AT = 0.5
# The table's arrays and the spare's written part within this many bytes a live page, unless
# the growth itself will hold more (`Spare.fill_some`): issue 31's goal is 64 for the whole
# index, and shared pages' masks and the rest take ~1-3 (an idle gateway at 100 pools held 64.5
# with 64 here). A growing fleet's spare of ~1.63x the slots, planned at 55% (76.6 bytes a page
# were it written whole), is then complete at ~68%, a growth at 70% (one that comes first
# writes the rest: `take`).
WRITTEN_BYTES_PER_PAGE = 62
_MIN_CHUNK = 4096
# Slots a call writes of a spare for pages expected (a warm-up's fleet): ~30 ms of fresh memory
# on this VM between two ingest slices, without the lock or the GIL.
_EXPECTED_CHUNK = 1 << 20
# The share of the room used between two looks at the spare's planned size.
_RECHECK = 0.1


def _fits(cap: int, need: float) -> bool:
    """Whether a growth that would allocate `need` slots takes a spare of `cap`."""
    return need * _TAKE_FROM <= cap <= need * _TAKE_UP_TO


class Spare:
    """The next growth's arrays: planned under the router's lock (`plan`: a size), allocated and
    written by the ingest thread (`fill_some`; a table no feed loop serves never pays for them),
    taken by the growth (`take`), which writes what is not yet written.

    A spare for pages expected (a warm-up's fleet, expected_pages.py) is planned at that size,
    written as fast as the slices leave time (not paced, not bound by the live pages), and taken
    only written whole: a growth before that grows the usual way and leaves it in place.

    Invariant: a growth's arrays are written by no one else once it took them. `fill_some`
    writes (without the GIL) only while holding `_writing`, and reads the arrays anew under it;
    `take` clears them under it, so it waits for a chunk in flight (one slice's pace at most)
    and then finishes the rest alone."""

    def __init__(self, live: int = 0, total: int = 0) -> None:
        self.arrays: TableArrays | None = None
        self.planned = 0  # slots
        # live and used slots (an old table's pages included) at the growth or the last look
        self._mark = (live, total)
        self._room = 1  # slots the table had left at the plan
        self._grown_live = 1  # the live pages the plan predicts at the growth
        # The pages the planned spare is for when more than how the table fills predicts: the
        # fleet a warm-up is learning (expected_pages.py); 0 when planned from the fill alone.
        # The growth is then sized for them too, and the spare written ahead of their arrival.
        self.expected = 0
        self._waiting = False  # dropped: the next plan waits for a look's worth of room used
        self.shrinking = False  # planned by plan_shrink: arrays for a table that shrinks
        self._writing = threading.Lock()
        # Growths of SPARE_MIN_SLOTS or more since start: that took the spare complete, that
        # took it partly written (and wrote the rest under the router's lock), and that wrote
        # fresh arrays there instead (none fitting: a stall of up to ~0.2 s at 10M pages; a table
        # no feed loop serves always does).
        self.taken = self.finished = self.missed = 0

    def plan(self, live: int, total: int, room: int, grown_load: float, look_only: bool = False,
             expect: Callable[[], int] | None = None) -> None:
        """The table holds `live` pages in `total` used slots and `room` more are allowed before
        it grows (to `grown_load`): sizes the spare from how live grew per slot used (between 0,
        pages replaced, and 1, pages added) since the last look (or the last growth); then again
        each time a tenth of the room is used, planning it anew when the growth so predicted
        would not take it (a fleet that stopped growing). `look_only`: the table is not yet at
        the plan's load; its looks each tenth of the room only move the mark, so that the plan
        reads how the table fills lately: a warm-up's growth that ended just before the plan
        (1,000 pools, 10M pages: the table at 52%) no longer sizes a spare of ~1.5x for the
        pages replaced after it, which the next look dropped with what was written of it.
        `expect`: the pages the table is about to hold (expected_pages.py), asked at each look;
        when more than predicted, the spare is for them (`expected`)."""
        mark_live, mark_total = self._mark
        used = total - mark_total
        if self.planned:  # a look each tenth of the room it was planned with
            if used < _RECHECK * self._room:
                return
        elif (look_only or self._waiting) and used < _RECHECK * room:  # a look each tenth of
            return  # the room left now
        added = 0.0 if used <= 0 else min(1.0, max(0.0, (live - mark_live) / used))
        grown = live + added * room
        expected = expect() if expect is not None else 0
        cap = int(max(grown, expected) / grown_load * _MARGIN) + 1
        self._mark = (live, total)
        if look_only or (self.planned and _fits(self.planned, cap / _MARGIN)):
            return
        self._forget()
        self._waiting = False
        if cap >= SPARE_MIN_SLOTS:
            self.planned, self._room = cap, max(1, room)
            self._grown_live = max(1, int(max(grown, expected)))
            # Only when past what a growth would take anyway (a warm-up's fleet, not a worker
            # or two still syncing beside a steady state's churn): paced and bound as usual else.
            self.expected = expected if expected > grown * _TAKE_UP_TO else 0

    def plan_shrink(self, slots: int) -> bool:
        """Under the router's lock: a table that shrinks to `slots` (index_table.PageTable's
        `_shrink_some`: its live pages fill under a fifth of its slots) has its arrays planned
        (unless a fitting spare is), for the feed loop's idle calls to write without the lock
        (`fill_some` with a chunk: no pacing, no bound of bytes a page). Whether they are written
        whole: the growth may take them."""
        with self._writing:
            if not (self.planned and _fits(self.planned, slots)):
                self.arrays, self.planned, self._waiting = None, slots, False
            self.shrinking, self.expected = True, 0
            arrays = self.arrays
            return arrays is not None and arrays.filled == arrays.cap

    def drop_shrink(self) -> None:
        """The table no longer shrinks (pages came back): its planned arrays go."""
        with self._writing:
            if self.shrinking:
                self._forget()

    def fill_some(self, room: int, live: int, table_slots: int, chunk: int | None = None
                  ) -> bool:
        """Writes the next part of the planned spare (without the lock): `chunk` slots, or as
        many as keep pace to complete it once `_READY_AT` of the room it was planned with is
        used (`room` left now). With `live` pages in tables of `table_slots`, no further than
        `WRITTEN_BYTES_PER_PAGE`, or the bytes a page of the growth it is for (its old and new
        arrays for the pages predicted then) when more. True while some remains that it may
        write now."""
        with self._writing:
            return self._fill_some(room, live, table_slots, chunk)

    def _fill_some(self, room: int, live: int, table_slots: int, chunk: int | None) -> bool:
        arrays = self.arrays
        if arrays is None:
            planned = self.planned
            if not planned or (self.shrinking and chunk is None):
                return False
            arrays = self.arrays = TableArrays(planned)
        if arrays.filled == arrays.cap:
            return False
        if self.shrinking:  # an idle call's chunk (none while ingest is busy); no bound of bytes
            # a page: the arrays are a fraction of the table's
            return chunk is not None and not arrays.fill(max(_MIN_CHUNK, chunk))
        slots_per_page = max(WRITTEN_BYTES_PER_PAGE / _SLOT_BYTES,
                             (table_slots + arrays.cap) / self._grown_live)
        # For the pages expected (a warm-up's fleet): written ahead of them, as they come.
        allowed = int(slots_per_page * max(live, self.expected)) - table_slots - arrays.filled
        if allowed <= 0:
            return False  # more pages first
        if chunk is None and self.expected:  # as fast as the slices leave time: no growth
            chunk = _EXPECTED_CHUNK  # takes it before it is whole (`take`)
        elif chunk is None:
            due = arrays.cap * (self._room - room) / (_READY_AT * self._room)
            chunk = int(due) - arrays.filled
            if chunk <= 0:
                return True
        slots = min(allowed, max(_MIN_CHUNK, chunk))
        return not arrays.fill(slots) and slots < allowed

    def ready_for(self) -> int:
        """The pages a spare for pages expected is for once written whole, else 0: a growth
        sized for them takes it; one that comes first grows the usual way (`take`)."""
        arrays = self.arrays
        return self.expected if arrays is not None and arrays.filled == arrays.cap else 0

    def take(self, need: int) -> TableArrays | None:
        """At a growth that would allocate `need` slots: the spare when of a fitting size and
        some of it written, its rest written now; else None (dropped either way: the next one is
        planned from this growth on). A spare for pages expected not yet written whole is kept
        for the next growth instead: written under the router's lock, the rest of a fleet's
        arrays was a stall of up to ~0.7 s at 10M pages."""
        with self._writing:
            if self.expected and not self.ready_for():
                self.missed += need >= SPARE_MIN_SLOTS
                return None
            arrays = self.arrays
            self._forget()
        fits = arrays is not None and arrays.filled > 0 and _fits(arrays.cap, need)
        if need >= SPARE_MIN_SLOTS:
            complete = fits and arrays.filled == arrays.cap
            self.taken += complete
            self.finished += fits and not complete
            self.missed += not fits
        if not fits:
            return None
        arrays.fill(arrays.cap - arrays.filled)
        return arrays

    def drop(self, live: int, total: int) -> None:
        """No spare: the table's sweep keeps it from growing (index_sweep.py), or ingest has been
        idle (`ingest_slices.IDLE_SPARE_DROP_S`). The next plan reads how the table fills from here,
        once a tenth of the room is used."""
        self._forget()
        self._mark, self._waiting = (live, total), True

    def _forget(self) -> None:
        """No spare planned: none written, none for a shrink or for pages expected."""
        self.arrays, self.planned, self.shrinking, self.expected = None, 0, False, 0

    def grew(self, live: int) -> None:
        """A growth began with `live` pages (all of them still to place in the new table)."""
        self._mark = (live, live)

    def nbytes(self, written: bool = False) -> int:
        """The spare's memory once allocated (written a part at a time), or as far as written."""
        arrays = self.arrays
        if arrays is None:
            return 0
        return arrays.filled * _SLOT_BYTES if written else arrays.nbytes()
