"""Tombstones cleared in place: a `PageTable` (gateway/core/index_table.py) at a steady state
keeps its slots for the pages it holds, not for the pages it once held.

Why (issue 31): a removed page leaves a tombstone (its slot keeps the keys after it reachable),
a store takes the first tombstone on its path, and so a fleet that stores and removes as fast
(its steady state) fills the table with tombstones until it passes 70% and rebuilds at the same
size. Past 55% the feed loop writes that rebuild's arrays ahead (table_arrays.Spare): an idle
gateway at 1,000 pools then held ~92 bytes a page instead of ~47, and the spare's writes took
ingest from ~1.8M to ~1.2-1.4M page events/s at 10M pages. Swept, the used slots stay near the
live ones: no rebuild and no spare unless the fleet really grows.

How: once the tombstones pass `SWEEP_FROM` of the slots (and no growth migrates), the feed loop
sweeps the table around once, a step at a time under the router's lock: while ingest is idle
(`PageTable.migrate_some`, as a growth's migration), and after each ingest slice while a round
goes on (a loop that never idles would otherwise let them pile up). A step takes whole
clusters (runs of used slots between two empty ones) and writes each one that holds tombstones
anew from its first tombstone: its live keys in their order, each at the first empty slot from
its home. Every key of a cluster has its home in it, so it lands in it, at or before its old
slot, and stays reachable; a shared page's holder (its set's id) moves with it. Lookups
see the same pages, masks and stamps before and after (tests/gateway/test_index_sweep.py). In
C (csrc/page_table.c's `pt_sweep`) when the kernel is loaded; the Python loop below is the
reference and the fallback, with the same result.
"""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

from gateway.core import index_native
from gateway.core.table_arrays import EMPTY, TOMB

if TYPE_CHECKING:
    from gateway.core.index_table import PageTable

# A sweep starts once tombstones fill this share of the slots: the used slots stay within ~6%
# of the live ones (a round over 3.9M slots ~25 ms in C, docs/results/gateway/fleet/sweep/),
# below the 55% at which a spare is planned for a table grown to 45%.
SWEEP_FROM = 0.05


class Sweep:
    """Where a table's sweep is: its cursor, and the slots still to pass in this round."""

    __slots__ = ("at", "left", "rounds", "cleared", "scanned")

    def __init__(self) -> None:
        self.at, self.left = 0, 0
        self.rounds = 0  # rounds begun, ever
        self.cleared = 0  # tombstones cleared, ever
        self.scanned = 0  # slots passed, ever (a step's share of the feed loop's idle budget)

    def holds(self, table: PageTable, max_load: float) -> bool:
        """Whether the sweep keeps the table below `max_load` (its growth) with room to spare:
        it has swept it (a feed loop serves it), it keeps up (fewer than twice the tombstones
        a round waits for: a feed loop that never idles takes no step), and the live pages and
        that many tombstones fit. The table then plans no spare for a rebuild that will not
        come."""
        most = 2 * SWEEP_FROM * table.cap
        return self.rounds > 0 and table._used - table.live < most \
            and table.live + most < max_load * table.cap

    def due(self, table: PageTable) -> bool:
        """Whether a round goes on or should begin (begins it)."""
        if self.left <= 0 and table._used - table.live >= SWEEP_FROM * table.cap:
            self.left, self.rounds = table.cap, self.rounds + 1
        return self.left > 0


def sweep_some(table: PageTable, max_slots: int) -> bool:
    """A step of the table's sweep (the caller holds the router's lock, and no old table is
    being migrated): about `max_slots` slots, whole clusters; True while the round goes on."""
    state = table.sweep
    if not state.due(table):
        return False
    if index_native.kernel() is not None:
        cleared, scanned, end = _sweep_c(table, state.at, max_slots)
    else:
        cleared, scanned, end = sweep_slots(table, state.at, max_slots)
    table._used -= cleared
    state.cleared += cleared
    state.at, state.left, state.scanned = end, state.left - scanned, state.scanned + scanned
    return state.left > 0


def _sweep_c(table: PageTable, start: int, max_slots: int) -> tuple[int, int, int]:
    end, scanned = ctypes.c_int64(), ctypes.c_int64()
    cleared = index_native.kernel().pt_sweep(
        *table._mem.addresses, table.cap, start, max_slots, ctypes.byref(end),
        ctypes.byref(scanned))
    return cleared, scanned.value, end.value


def sweep_slots(table: PageTable, start: int, max_slots: int) -> tuple[int, int, int]:
    """`pt_sweep` in Python: (tombstones cleared, slots passed, the empty slot it stopped at).
    A shared page's holder (its set's id) moves with it."""
    keys, holder, stamp = table._key, table._holder, table._stamp
    cap = table.cap
    a, seen, cleared = start % cap, 0, 0
    while holder[a] != EMPTY and seen <= cap:
        a, seen = (a + 1) % cap, seen + 1
    while seen < max_slots and seen <= cap:
        first = q = (a + 1) % cap
        cluster: list[int] = []
        while holder[q] != EMPTY:
            cluster.append(q)
            q = (q + 1) % cap
        if any(holder[q] == TOMB for q in cluster):
            for q in cluster:
                hv = holder[q]
                holder[q] = EMPTY
                if hv == TOMB:
                    cleared += 1
                    continue
                p = table.home(keys[q])
                while holder[p] != EMPTY:
                    p = (p + 1) % cap
                holder[p] = hv
                if p != q:
                    keys[p], stamp[p] = keys[q], stamp[q]
        seen += len(cluster) + 1
        a = (first + len(cluster)) % cap
    return cleared, seen, a
