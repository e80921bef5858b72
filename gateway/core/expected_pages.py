"""The pages a medium's table is about to hold during a warm-up: its growths sized for the fleet,
not for the pages that arrived so far (issue 31).

A restarted gateway learns the fleet's pages from the workers' snapshots, one worker after
another: its feeds apply them in turn (1,000 pools, 10M pages: the first is whole after ~20k
pages, 10 after ~100k, 25 after 250k). Growing by its usual ~1.6x, the table grew 11 times over
that warm-up: 52M slots of fresh arrays written (~30 ns a slot on this VM, its first touch of
the memory: 1.6 s) and every page migrated once or twice (~0.8 s), a third of the warm-up's
time on the gateway's core. Now, once 10 pools are in, the feed loop writes arrays for the
fleet between its slices (table_arrays.Spare, `expected`), and the growth after that moves the
~100k pages there: one or two growths of the usual size may come first, while they are written.

The estimate, per medium, once enough workers hold their whole snapshot (`MIN_SYNCED`, 1%):

    expected = live + r * sum over the other workers of max(0, typical - held)
    typical  = the mean pages the synced workers hold (a pool's workers hold about as many: each
               cache is full in a steady state, which is what a restarted gateway finds)
    r        = live pages / pages held over all workers (<= 1: a shared page is one key)

How it can miss: a fleet whose first synced workers hold more than the rest, or whose pages are
shared more than the first ones show (each page held by two random workers of 1,000: the first
to sync share almost none, so r reads ~1 for a final 0.5), gets a table sized for more: bounded
by the memory budget, and shrunk once ingest idles if its pages then fill under 30% of it
(index_table.PageTable._shrink_some). One whose first workers hold fewer grows as before after
it. A worker that never syncs (its stream down) counts as `typical` until it is removed. Below
MIN_EXPECTED_PAGES the table grows as it fills.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

# Workers whose snapshot is whole before the estimate is made, at least MIN_SYNCED and
# SYNCED_SHARE of them: a few may be outliers (a fresh one, nearly empty), and pages shared by
# groups of workers make `r` swing until several groups are in. The shared-masks bench's
# holdings at 1,000 workers, estimate / the fleet's pages after 10, 50, 200 synced: groups of 8
# 1.6, 1.12, 1.0; each page held by 2 random workers 2.0, 1.95, 1.8 (by 3: 3.0, 2.9, 2.4).
# Waiting for more costs the warm-up its head start: at 1,000 pools and 10M pages, restart to
# warm 4.05-4.1 s after 10 synced, 4.5-4.7 s after 50 (the fleet's arrays are written while the
# feed process still opens its streams, or later, in the slices' way).
MIN_SYNCED, SYNCED_SHARE = 4, 0.01
# Below this many pages expected, the table grows as it fills: its growths cost a tenth of a
# 10M-page fleet's (~0.2 s in all), and an estimate that is too high would cost memory for
# nothing (the shared-masks bench's 40k pages, shared by design, would be sized 2x over).
MIN_EXPECTED_PAGES = 500_000


class _WorkerState(Protocol):
    last_seq: int
    in_snapshot: bool
    needs_resync: bool
    held: list[int]


def synced(worker: _WorkerState) -> bool:
    """Whether the worker's stream has delivered its whole state: a snapshot (or its stream
    from seq 0) applied and no resync pending."""
    return worker.last_seq >= 0 and not worker.in_snapshot and not worker.needs_resync


def expected_pages(workers: Iterable[_WorkerState], tier: int, live: int) -> int:
    """The pages the medium `tier`'s table holds once every worker's snapshot is in (`live`: it
    holds that many now); `live` itself while too few workers are synced."""
    synced_held = synced_n = held_all = 0
    waiting: list[int] = []
    for worker in workers:
        held = worker.held[tier]
        held_all += held
        if synced(worker):
            synced_n += 1
            synced_held += held
        else:
            waiting.append(held)
    if synced_n < max(MIN_SYNCED, SYNCED_SHARE * (synced_n + len(waiting))) or not waiting \
            or not held_all:
        return live
    typical = synced_held / synced_n
    remaining = sum(typical - held for held in waiting if held < typical)
    expected = live + int(remaining * min(1.0, live / held_all))
    return expected if expected >= MIN_EXPECTED_PAGES else live
