"""Tombstones cleared in place (gateway/core/index_sweep.py): a swept table holds the same pages,
masks and stamps as before, none of its tombstones, and its used slots equal its live pages; C
and the Python reference leave the same arrays; a table at a steady state (as many pages stored
as removed) swept by its idle steps neither rebuilds nor plans a spare, and without them it
does both."""
from __future__ import annotations

import random

import numpy as np
import pytest

from gateway.core import index_native, index_sweep
from gateway.core.index_bulk import apply_ops
from gateway.core.index_sweep import SWEEP_FROM, sweep_slots
from gateway.core.index_table import EMPTY, TOMB, PageTable, key_of
from prefixcache_bench.gateway_fleet.sweep import NoSweep
from tests.gateway.helpers import check_holder_sets, page, pages_and_stamps
# table_impl: the module fixture that runs each test twice (C and numpy)
from tests.gateway.index_impls import table_impl, use  # noqa: F401

WORKERS = 70  # masks past one machine word


def _churned(seed: int, pages: int, capacity: int = 64) -> PageTable:
    """A table after random slices of stores and removals by many workers (shared pages, pages
    stored again after removal), grown and with its old table migrated away."""
    rng, table = random.Random(seed), PageTable(capacity=capacity)
    for _ in range(60):
        n = rng.choice([1, 20, 200])
        hashes = [page(rng.randrange(pages)) for _ in range(n)]
        slots = [rng.randrange(WORKERS) if rng.random() < 0.5 else rng.randrange(3)
                 for _ in range(n)]
        apply_ops(table, hashes, slots, [rng.random() < 0.55 for _ in range(n)])
    while table._old is not None:
        table.migrate_some(1 << 20)
    return table


def _sweep_round(table: PageTable, rng: random.Random) -> None:
    table.sweep.at = rng.randrange(table.cap)  # a round may begin anywhere: clusters wrap
    table.sweep.left = table.cap
    while index_sweep.sweep_some(table, rng.choice([1, 7, 100, 5000])):
        pass


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_a_swept_table_holds_the_same_pages_masks_and_stamps_and_no_tombstone(seed):
    pages = 3000
    table = _churned(seed, pages)
    before, live = pages_and_stamps(table), len(table)
    tombs = int(np.count_nonzero(table._mem.holder == TOMB))
    assert tombs > 0  # the churn left some
    _sweep_round(table, random.Random(seed))
    assert pages_and_stamps(table) == before
    assert len(table) == live and table._used == live  # live + tombstones, and none are left
    assert not np.count_nonzero(table._mem.holder == TOMB)
    assert table.sweep.cleared == tombs
    check_holder_sets(table)
    for i in range(0, pages, 97):  # and it goes on serving stores and removals
        table.add(page(i), 5)
        table.discard(page(i + 1), 5)
    assert all(table.mask(page(i)) >> 5 & 1 for i in range(0, pages, 97))


@pytest.mark.parametrize("seed", [1, 2])
def test_c_and_the_python_reference_leave_the_same_arrays(seed, table_impl):  # noqa: F811
    use("c")  # both, whichever serves the module's run
    try:
        _same_arrays(seed)
    finally:
        use(table_impl)


@pytest.mark.parametrize("step", [1, 16, 17, 1000, 1 << 20])
def test_c_steps_as_the_reference_passing_blocks_without_a_tombstone(
        step, table_impl):  # noqa: F811 - the fixture's parameter
    """Few tombstones in a big table: C passes 16 slots at a time where none is a tombstone; each
    step must still end at the same empty slot, having passed the same count (a step longer
    than the table included: one round at most)."""
    use("c")
    try:
        _same_arrays(5, pages=30_000, churn=False, step=step)
    finally:
        use(table_impl)


def _sparse(seed: int, pages: int) -> PageTable:
    """A table of `pages` stored pages, 1% of them removed again (its tombstones)."""
    rng, table = random.Random(seed), PageTable(capacity=64)
    table.add_many([page(i) for i in range(pages)], 1)
    table.discard_many([page(i) for i in rng.sample(range(pages), pages // 100)], 1)
    while table._old is not None:
        table.migrate_some(1 << 20)
    return table


def _same_arrays(seed: int, pages: int = 2000, churn: bool = True, step: int = 300) -> None:
    tables = [_churned(seed, pages) if churn else _sparse(seed, pages) for _ in range(2)]
    start = random.Random(seed).randrange(tables[0].cap)
    out = []
    for impl, table in zip(("c", "python"), tables):
        at, results = start, []
        for _ in range(min(table.cap // step + 2, 400)):
            if impl == "c":
                result = index_sweep._sweep_c(table, at, step)
            else:
                result = sweep_slots(table, at, step)
            results.append(result)
            at = result[2]
        mem = table._mem
        out.append((results, [a.copy() for a in (mem.key, mem.holder, mem.stamp)]))
    (c_results, c_arrays), (py_results, py_arrays) = out
    assert c_results == py_results
    for a, b in zip(c_arrays, py_arrays):
        assert np.array_equal(a, b)


def test_a_cluster_that_wraps_past_the_tables_end_is_swept_whole():
    table = PageTable(capacity=64)
    cap = table.cap
    # keys whose home is the table's last slot: a cluster from cap-1 over slot 0 on
    at_end = [h for h in (page(i) for i in range(200_000))
              if table._probe(key_of(h))[1] == cap - 1][:4]
    for h in at_end:
        table.add(h, 1)
    table.discard(at_end[0], 1)  # a tombstone at the end, the others after it over the wrap
    holder = table._mem.holder
    assert holder[cap - 1] == TOMB and holder[0] != EMPTY
    table.sweep.left = cap
    while index_sweep.sweep_some(table, 3):
        pass
    assert [table.mask(h) for h in at_end] == [0, 2, 2, 2]
    assert not np.count_nonzero(holder == TOMB) and holder[cap - 1] != EMPTY  # moved back


def _steady(table: PageTable, rounds: int, pages: int = 45_000) -> tuple[int, int]:
    """A table grown to `pages` (48% of its slots, and past the smallest spare), then as many
    stored as removed (the oldest first) in live batches, the idle steps run after each batch
    as the feed loop does (`migrate_some`); the growths (rebuilds) and the largest spare planned
    during the churn."""
    batch, stored = 64, 0
    for i in range(0, pages, batch):
        table.add_many(b"".join(page(j) for j in range(i, i + batch)), i % 8)
    stored = pages
    while table._old is not None:
        table.migrate_some(1 << 20)
    caps, spare = {table.cap}, 0
    for _ in range(rounds * pages // batch):
        new = [page(j) for j in range(stored, stored + batch)]
        gone = [page(j) for j in range(stored - pages, stored - pages + batch)]
        apply_ops(table, new + gone, [stored % 8] * batch + [(stored - pages) % 8] * batch,
                  [True] * batch + [False] * batch)
        stored += batch
        while table.migrate_some(4096):
            pass
        caps.add(table.cap)
        spare = max(spare, table._spare.planned)
    assert len(table) == pages
    return len(caps) - 1, spare


def test_a_steady_state_swept_neither_rebuilds_nor_plans_a_spare():
    grown, spare = _steady(PageTable(), rounds=4)
    assert (grown, spare) == (0, 0)
    unswept = PageTable()
    unswept.sweep = NoSweep()  # the idle steps as before the sweep: migration only
    grown, spare = _steady(unswept, rounds=4)
    assert grown >= 1 and spare > 0  # what the sweep saves


def test_no_sweep_until_the_tombstones_pass_their_share():
    table = PageTable()
    for i in range(0, 4000, 50):
        table.add_many(b"".join(page(j) for j in range(i, i + 50)), 1)
    few = int(SWEEP_FROM * table.cap) - 1
    table.discard_many(b"".join(page(j) for j in range(few)), 1)
    assert not table.migrate_some(1 << 20) and table.sweep.rounds == 0
    table.discard_many(page(few) + page(few + 1), 1)
    table.migrate_some(1 << 20)
    assert table.sweep.rounds == 1 and table._used == len(table)


def test_the_feed_loops_idle_steps_sweep(table_impl):  # noqa: F811 - the fixture's parameter
    """Through the index as the feed loop calls it (KvIndex.migrate_some)."""
    from gateway.core.index import KvIndex

    index = KvIndex()
    index.add_worker("w")
    table = index._tables[0]
    for i in range(0, 6000, 60):
        table.add_many(b"".join(page(j) for j in range(i, i + 60)), 0)
    table.discard_many(b"".join(page(j) for j in range(0, 6000, 2)), 0)
    while index.migrate_some(1000):
        pass
    assert table._used == len(table) == 3000
    assert index_native.implementation() == table_impl


def test_a_sweep_that_falls_behind_lets_the_spare_be_planned_again():
    """Tombstones past twice the share a round waits for (a feed loop that never idles): the
    sweep no longer holds the table, and a rebuild's spare is planned as before."""
    table = PageTable()
    for i in range(0, 45_000, 64):
        table.add_many(b"".join(page(j) for j in range(i, i + 64)), 1)
    table.sweep.rounds = 1  # swept before
    assert table.sweep.holds(table, 0.7)
    stored = 45_000
    while table._used - table.live < 2 * SWEEP_FROM * table.cap:  # churn, no idle step
        gone = b"".join(page(j) for j in range(stored - 45_000, stored - 45_000 + 64))
        table.add_many(b"".join(page(j) for j in range(stored, stored + 64)), 1)
        table.discard_many(gone, 1)
        stored += 64
    assert not table.sweep.holds(table, 0.7)
    cap = table.cap
    while not table._spare.planned and table.cap == cap:
        gone = b"".join(page(j) for j in range(stored - 45_000, stored - 45_000 + 64))
        table.add_many(b"".join(page(j) for j in range(stored, stored + 64)), 1)
        table.discard_many(gone, 1)
        stored += 64
    assert table._spare.planned and table.cap == cap  # planned before the rebuild
