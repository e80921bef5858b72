"""Shared pages' holders as ids of sets stored once (gateway/core/holder_sets.py): pages with the
same holders name one set, a set no page holds is freed and its id reused, the counts stay those
of the arrays through joins, leaves, evictions, clears and growths, and the answers are those of
a dict of sets."""
from __future__ import annotations

import random
import tracemalloc

import pytest

from gateway.core import holder_sets
from gateway.core.holder_sets import SHARED, HolderSets
from gateway.core.index import BYTES_PER_HOLDER_SET
from gateway.core.index_bulk import apply_ops
from gateway.core.index_table import PageTable
from tests.gateway.helpers import check_holder_sets, page, pages
from tests.gateway.index_impls import table_impl  # noqa: F401  (each test with C, then numpy)

HIGH = 900  # worker slots of a fleet of ~1,000: masks of ~900 bits, ~150 bytes each


def test_pages_with_the_same_holders_name_one_set():
    table = PageTable()
    shared = pages(0, 5000)
    for slot in (HIGH, HIGH + 7):
        table.add_many(shared, slot)
    for slot in (HIGH, HIGH + 9):  # another set of holders
        table.add_many(pages(5000, 6000), slot)
    sets = table.holder_sets
    assert table.shared_pages() == 6000 and len(sets) == 2
    assert sorted(m for m in sets.masks if m) == [1 << HIGH | 1 << HIGH + 7,
                                                  1 << HIGH | 1 << HIGH + 9]
    table.discard_many(shared[:10], HIGH + 7)  # alone again: a worker's slot, no set
    assert table.shared_pages() == 5990 and table.masks(shared[:1]) == [1 << HIGH]
    table.add_many(shared[:10], HIGH + 9)  # now held as the second set's pages: its id
    assert len(sets) == 2 and table.masks(shared[:1]) == [1 << HIGH | 1 << HIGH + 9]
    table.discard_many(shared[10:], HIGH + 7)  # the first set held by no page: its id freed
    assert len(sets) == 1 and sets.masks.count(0) == 1
    table.add_many(pages(0, 3), 5)  # a new set takes the freed id
    assert len(sets.masks) == 2 and len(sets) == 2
    check_holder_sets(table)


def _model_apply(model: dict[bytes, set[int]], h: bytes, slot: int, store: bool) -> None:
    held = model.setdefault(h, set())
    (held.add if store else held.discard)(slot)
    if not held:
        del model[h]


def test_sets_stay_counted_through_churn_growths_evictions_and_clears():
    """Random stores and removals of a few hundred pages by ~10 of 1,000 workers' slots, in
    slices (the C loop's records) and one by one, with growths; each step's holders equal a dict
    of sets', and the sets' counts equal the arrays'."""
    rng = random.Random(5)
    table, model = PageTable(capacity=64, migrate_step=8), {}
    slots = [0, 3, 60, 61, 64, 130, 500, HIGH, HIGH + 1, 999]
    universe = pages(0, 400)
    for step in range(120):
        n = rng.choice((1, 5, 60))
        ops = [(rng.choice(universe), rng.choice(slots), rng.random() < 0.6) for _ in range(n)]
        if n == 1:
            h, s, store = ops[0]
            (table.add if store else table.discard)(h, s)
        else:
            apply_ops(table, *map(list, zip(*ops)))
        for h, s, store in ops:
            _model_apply(model, h, s, store)
        if step % 40 == 39:  # a worker leaves
            gone = rng.choice(slots)
            table.clear_slot(gone)
            for h in list(model):
                _model_apply(model, h, gone, False)
        check_holder_sets(table)
        want = [sum(1 << s for s in model.get(h, ())) for h in universe]
        assert table.masks(universe) == want, step
    lost = table.evict(len(table) // 2)  # the oldest half, shared pages among them
    check_holder_sets(table)
    assert sum(lost.values()) >= len(model) // 2
    assert table.shared_pages() == sum(1 for t in table._tables()
                                       for hv in t._mem.holder.tolist() if hv >= SHARED)


def test_masks_with_one_residue_are_kept_apart(monkeypatch):
    """A prime so small that masks share residues: the second of two is not found by the
    lookup and gets an id of its own; the answers and the counts stay right."""
    monkeypatch.setattr(holder_sets, "_PRIME", 5)
    table = PageTable()
    for i in range(40):
        table.add(page(i), HIGH)
        table.add(page(i), i)
    check_holder_sets(table)
    assert table.masks(pages(0, 40)) == [1 << HIGH | 1 << i for i in range(40)]
    for i in range(0, 40, 2):
        table.discard(page(i), HIGH)
    check_holder_sets(table)
    assert table.masks(pages(0, 40)) == [1 << i if i % 2 == 0 else 1 << HIGH | 1 << i
                                         for i in range(40)]


def test_a_shared_page_costs_its_slot_where_sets_repeat():
    """Issue 31's ≤ 64 bytes an indexed page at 1,000 workers, for pages held by pairs of high
    slots (masks of ~125 bytes): 200 pairs over 50,000 pages. Before the sets (a dict entry and
    often a mask a page), 117 bytes a page where masks repeated."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        table = PageTable()
        for pair in range(200):
            held = pages(250 * pair, 250 * (pair + 1))
            table.add_many(held, 990 - pair)
            table.add_many(held, 999 - pair % 7)
        traced = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert table.shared_pages() == 50_000 and len(table.holder_sets) <= 200
    assert traced / len(table) < 64


def test_a_checkpoints_sets_restored_counted_and_a_set_of_one_holder_refused():
    restored = HolderSets.restored([0, 3 << 4, 5 << 8], [(SHARED + 1, 2)])
    assert restored.refs == [0, 2, 0] and restored.pages == 2 and len(restored) == 1
    assert restored.hold(3 << 4) == SHARED + 1 and restored.hold(9) in (SHARED, SHARED + 2)
    with pytest.raises(ValueError, match="fewer than 2"):
        HolderSets.restored([1 << 3], [(SHARED, 4)])


def test_a_set_at_1000_workers_costs_what_the_budget_counts():
    """BYTES_PER_HOLDER_SET (gateway/core/index.py): sets whose highest slot is 999, each held by
    300 pages, as `HolderSets.nbytes` counts them."""
    sets, rng = HolderSets(), random.Random(1)
    for _ in range(20_000):
        a, b = rng.sample(range(999), 2)
        sets.hold(1 << a | 1 << b | 1 << 999, 300)
    assert 200 < sets.nbytes() / len(sets) <= BYTES_PER_HOLDER_SET
