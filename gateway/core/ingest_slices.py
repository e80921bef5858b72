"""How many page events one ingest slice applies under `Router.lock` (design.md §6, issue 31).

A routing decision that arrives while a slice holds the lock waits for the rest of it, but for
the C loop that applies its page events, which steps aside for it (gateway/core/decisions_first.py).
So the bound that matters is the time of the rest of the slice, not its count of page events:
`SliceSize` turns a target for that time into page events from the cost it measured on the last
full slices (`BatchApplier` leaves the interruptible time out). A faster
index then applies more per hold (fewer holds: less per-slice Python, asyncio and lock hand-off,
and larger numpy runs) for the same wait of a decision; a slower one (a big table, a loaded core)
applies fewer. `IdleMigration` sizes the steps that finish a page table's growth while ingest is
idle the same way, in old slots.
"""
from __future__ import annotations

import time
from collections.abc import Callable

# The default hold: a decision waits for the rest of the slice it lands in, less the C loop that
# it interrupts (decisions_first.py), so the hold is traded against ingest throughput. At 1,000
# pools, 1M pages, 5.12M live page events, a request due every millisecond, on the quiet 2-core
# machine (docs/results/gateway/fleet/ingest_p99/, the feed loop at SCHED_IDLE as deploy/k8s
# runs it; niced, the gateway's default, in brackets): 0.25 ms slices apply 1.43M live page
# events/s with decisions p99 0.50 ms (1.17M/s, 0.80 ms), 0.5 ms 1.20M/s and 0.70 ms (1.21M/s,
# 0.85 ms), 1 ms 1.35M/s and 0.84 ms (1.24M/s, 1.01 ms).
SLICE_S = 0.00025
FIRST_SLICE_EVENTS = 1024  # until a cost was measured
# At least a live batch of 64 stored + 64 removed pages; at most a few 4 MiB snapshot batches.
MIN_SLICE_EVENTS = 128
MAX_SLICE_EVENTS = 1 << 17
# Slots of the next growth's arrays one idle step writes (table_arrays.Spare): 1.5 MiB, ~0.3-2 ms
# without the lock or the GIL (what fresh memory's page faults cost).
IDLE_SPARE_SLOTS = 1 << 16
# Ingest idle this long (nothing applied): the next growth's arrays are freed
# (table_arrays.Spare; a warm-up that ended past 55% planned one for a growth that may not come:
# ~92 bytes a page held at 1,000 pools, ~36 once freed). A fleet's feeds deliver every few
# milliseconds, so only an idle fleet waits this long; a growth after it plans them again from
# its first look.
IDLE_SPARE_DROP_S = 10.0
# Weight of the newest full slice in the moving average of seconds per page event.
_NEWEST = 0.3


class SliceSize:
    """`events`: the page events the next slice may take. `fixed`: always that many (tests, and
    the bench's comparison with the former fixed slices); else `slice_s` over the measured cost."""

    def __init__(self, slice_s: float = SLICE_S, fixed: int | None = None) -> None:
        if slice_s <= 0 or (fixed is not None and fixed < 1):
            raise ValueError("a slice needs a positive time and at least one page event")
        self.slice_s, self.fixed = slice_s, fixed
        self.events = fixed or FIRST_SLICE_EVENTS
        self.seconds_per_event: float | None = None

    def measured(self, events: int, seconds: float) -> None:
        """A slice of `events` page events held the lock `seconds`. Only a slice at least half
        full counts: a small one (ingest keeping up) is mostly per-slice cost, and would shrink
        the next full slices for nothing."""
        if self.fixed is not None or events < self.events // 2 or events <= 0:
            return
        cost = max(seconds, 1e-9) / events
        old = self.seconds_per_event
        self.seconds_per_event = cost if old is None else old + _NEWEST * (cost - old)
        self.events = int(min(MAX_SLICE_EVENTS,
                              max(MIN_SLICE_EVENTS, self.slice_s / self.seconds_per_event)))


class IdleMigration:
    """The steps that finish a growth's migration while nothing is queued (feeds.BatchApplier):
    each one hold of the router's lock for `size.events` old slots, sized by the same target time
    as the ingest slices from the cost measured on the last steps (`fixed`: that many instead)."""

    def __init__(self, slice_s: float = SLICE_S, fixed: int | None = None) -> None:
        self.size = SliceSize(slice_s, fixed)
        self.steps = 0

    def step(self, migrate: Callable[[int], bool]) -> bool:
        """One step through `migrate(max_slots)` (`Router.migrate_index`); True while more."""
        slots, start = self.size.events, time.perf_counter()
        more = migrate(slots)
        if more:  # a whole step (the last one may be short: no measure of the cost)
            self.size.measured(slots, time.perf_counter() - start)
        self.steps += 1
        return more
