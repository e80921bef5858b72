"""Shared pages' holders as pairs and triples written in place and ids of sets stored once
(gateway/core/holder_sets.py): a page two or three workers hold names their pair or triple, no set;
pages with the same 4+ holders name one set, a set no page holds is freed and its id reused, the
counts stay those of the arrays through joins, leaves, evictions, clears and growths, and the
answers are those of a dict of sets."""
from __future__ import annotations

import random
import re
import tracemalloc

import pytest

from gateway.core import holder_sets
from gateway.core.holder_sets import PAIR, PAIR_SLOTS, SHARED, TRIPLE, TRIPLE_SLOTS, HolderSets
from gateway.core.index import BYTES_PER_HOLDER_SET
from gateway.core.index_bulk import apply_ops
from gateway.core.index_native import CSRC
from gateway.core.index_table import PageTable
from tests.gateway.helpers import check_holder_sets, page, pages
from tests.gateway.index_impls import table_impl  # noqa: F401  (each test with C, then numpy)

HIGH = 900  # worker slots of a fleet of ~1,000: masks of ~900 bits, ~150 bytes each


def test_pages_with_the_same_holders_name_one_set():
    table = PageTable()
    shared = pages(0, 5000)
    for slot in (HIGH, HIGH + 7, 3, 4):
        table.add_many(shared, slot)
    for slot in (HIGH, HIGH + 9, 3, 4):  # another set of holders
        table.add_many(pages(5000, 6000), slot)
    sets = table.holder_sets
    assert table.shared_pages() == 6000 and len(sets) == 2 and sets.pairs == sets.triples == 0
    assert sorted(m for m in sets.masks if m) == [1 << HIGH | 1 << HIGH + 7 | 24,
                                                  1 << HIGH | 1 << HIGH + 9 | 24]
    table.discard_many(shared[:10], HIGH + 7)  # three holders left: their triple, no set
    assert table.shared_pages() == 6000 and sets.triples == 10
    assert table.masks(shared[:1]) == [1 << HIGH | 24]
    table.add_many(shared[:10], HIGH + 9)  # now held as the second set's pages: its id
    assert len(sets) == 2 and table.masks(shared[:1]) == [1 << HIGH | 1 << HIGH + 9 | 24]
    table.discard_many(shared[10:], HIGH + 7)  # the first set held by no page: its id freed
    assert len(sets) == 1 and sets.masks.count(0) == 1 and sets.triples == 4990
    table.add_many(pages(0, 3), 5)  # a new set takes the freed id
    assert len(sets.masks) == 2 and len(sets) == 2
    check_holder_sets(table)


def test_a_page_two_workers_hold_names_their_pair():
    """Joined by a second worker: the pair, in C's apply as in Python's; a third makes their
    triple, a fourth a set, one leaving it the triple again, then the pair, the other the slot
    alone; a slot of PAIR_SLOTS or more pairs with no one (a set of two)."""
    table = PageTable()
    table.add_many(pages(0, 100), HIGH)
    table.add_many(pages(0, 100), 7)
    holder, sets = table._mem.holder, table.holder_sets
    assert len(sets) == 0 and sets.pairs == 100
    assert sorted(set(holder[holder >= 0].tolist())) == [PAIR + (HIGH << 14) + 7]
    table.add(page(0), 8)
    assert table.mask(page(0)) == 1 << HIGH | 1 << 7 | 1 << 8 and len(sets) == 0
    assert sets.triples == 1 and sets.pairs == 99
    table.add(page(0), 9)
    assert table.mask(page(0)) == 1 << HIGH | 0b1110 << 6 and len(sets) == 1
    table.discard(page(0), HIGH)
    assert table.mask(page(0)) == 0b1110 << 6 and len(sets) == 0 and sets.triples == 1
    table.discard(page(0), 9)
    assert table.mask(page(0)) == 1 << 7 | 1 << 8 and sets.triples == 0
    table.discard_many(pages(0, 50), 7)
    assert table.masks(pages(0, 3)) == [1 << 8, 1 << HIGH, 1 << HIGH]
    assert table.holder_sets.pairs == 50 and table.shared_pages() == 50
    far = PAIR_SLOTS + 5
    table.add_many(pages(50, 60), far)
    assert len(table.holder_sets) == 1 and table.masks(pages(50, 51)) == [1 << far | 1 << 7
                                                                           | 1 << HIGH]
    table.discard_many(pages(50, 60), 7)  # {HIGH, far}: no pair holds a slot past PAIR_SLOTS
    assert len(table.holder_sets) == 1 and table.masks(pages(50, 51)) == [1 << far | 1 << HIGH]
    check_holder_sets(table)
    lost = table.evict(len(table))
    assert lost == {HIGH: 99, 8: 1, far: 10, 7: 40} and table.shared_pages() == 0
    check_holder_sets(table)


def test_a_page_three_workers_hold_names_their_triple():
    """Joined by a third worker: their triple (its rank in the combinatorial number system), in
    C's apply as in Python's; one leaving makes the others' pair; a fourth makes a set, one of
    four leaving the triple again; a slot of TRIPLE_SLOTS or more is in no triple (a set of
    three)."""
    table = PageTable()
    for slot in (HIGH, 7, 999):
        table.add_many(pages(0, 100), slot)
    holder, sets = table._mem.holder, table.holder_sets
    assert len(sets) == 0 and sets.triples == 100 and sets.pairs == 0
    rank = 999 * 998 * 997 // 6 + HIGH * (HIGH - 1) // 2 + 7
    assert sorted(set(holder[holder >= 0].tolist())) == [TRIPLE + rank]
    assert table.masks(pages(0, 1)) == [1 << HIGH | 1 << 7 | 1 << 999]
    table.discard_many(pages(0, 40), 999)
    assert sets.pairs == 40 and sets.triples == 60
    assert table.masks(pages(0, 1)) == [1 << HIGH | 1 << 7]
    table.discard_many(pages(0, 20), 7)
    table.add_many(pages(60, 100), 5)  # four holders: a set
    assert len(sets) == 1 and sets.triples == 20 and table.shared_pages() == 80
    table.discard_many(pages(90, 100), HIGH)
    assert len(sets) == 1 and sets.triples == 30
    assert table.masks(pages(90, 91)) == [1 << 999 | 1 << 7 | 1 << 5]
    far = TRIPLE_SLOTS  # past every triple, not past a pair
    table.add_many(pages(0, 10), far)  # held by HIGH alone: their pair
    assert sets.pairs == 30 and table.masks(pages(0, 1)) == [1 << HIGH | 1 << far]
    table.add_many(pages(0, 10), 7)  # three holders, one past TRIPLE_SLOTS: a set
    assert len(sets) == 2 and table.masks(pages(0, 1)) == [1 << HIGH | 1 << far | 1 << 7]
    check_holder_sets(table)
    lost = table.evict(len(table))
    assert lost == {HIGH: 90, 7: 90, 999: 60, 5: 40, far: 10} and table.shared_pages() == 0
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
    slots = [0, 3, 60, 61, 64, 130, 500, HIGH, HIGH + 1, 999, TRIPLE_SLOTS, PAIR_SLOTS + 1]
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
                                       for hv in t._mem.holder.tolist() if hv >= PAIR)


def test_masks_with_one_residue_are_kept_apart(monkeypatch):
    """A prime so small that masks share residues: the second of two is not found by the
    lookup and gets an id of its own; the answers and the counts stay right."""
    monkeypatch.setattr(holder_sets, "_PRIME", 5)
    table, two = PageTable(), 1 << HIGH | 1 << HIGH + 1 | 1 << HIGH + 2
    for i in range(40):
        table.add(page(i), HIGH)
        table.add(page(i), HIGH + 1)
        table.add(page(i), HIGH + 2)
        table.add(page(i), i)
    check_holder_sets(table)
    assert table.masks(pages(0, 40)) == [two | 1 << i for i in range(40)]
    for i in range(0, 40, 2):
        table.discard(page(i), HIGH)
        table.add(page(i), 100 + i)
    check_holder_sets(table)
    assert table.masks(pages(0, 40)) == [(two ^ 1 << HIGH | 1 << 100 + i if i % 2 == 0 else two)
                                         | 1 << i for i in range(40)]


def _traced_bytes_a_page(fill) -> float:
    """What filling a table costs a page, as tracemalloc counts it."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        table = PageTable()
        fill(table)
        traced = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert table.shared_pages() == len(table) == 50_000
    check_holder_sets(table)
    return traced / len(table)


def test_a_shared_page_costs_its_slot_where_sets_repeat():
    """Issue 31's ≤ 64 bytes an indexed page at 1,000 workers, for pages held by four workers of
    high slots (masks of ~125 bytes): 200 sets over 50,000 pages. Before the sets (a dict entry
    and often a mask a page), 117 bytes a page where masks repeated."""
    def fill(table: PageTable) -> None:
        for group in range(200):
            held = pages(250 * group, 250 * (group + 1))
            for slot in (990 - group, 999 - group % 7, 700 + group % 3, 500 + group % 11):
                table.add_many(held, slot)
    assert _traced_bytes_a_page(fill) < 64


@pytest.mark.parametrize("holders", [2, 3])
def test_a_page_with_a_pair_or_triple_of_its_own_costs_its_slot(holders):
    """The worst cases of the sets (stop 52: 217.7 bytes a page at 1,000 workers for pairs; stop
    53: 287.8 for triples): every page its own random pair or triple of holders, stored in slices
    through the C loop or the numpy path."""
    rng = random.Random(3)
    held = pages(0, 50_000)
    slots = list(zip(*(rng.sample(range(1000), holders) for _ in held)))

    def fill(table: PageTable) -> None:
        for start in range(0, len(held), 5000):
            chunk = held[start:start + 5000]
            for column in slots:
                apply_ops(table, chunk, list(column[start:start + 5000]), [True] * len(chunk))
    assert _traced_bytes_a_page(fill) < 64


def test_a_checkpoints_sets_restored_counted_and_a_set_of_one_holder_refused():
    restored = HolderSets.restored([0, 15 << 4, 29 << 8], [(SHARED + 1, 2)], pairs=5, triples=3)
    assert restored.refs == [0, 2, 0] and restored.pages == 2 and len(restored) == 1
    assert restored.pairs == 5 and restored.triples == 3
    assert restored.hold(15 << 4) == SHARED + 1 and restored.hold(43) in (SHARED, SHARED + 2)
    assert restored.hold(3 << 4) == PAIR + (5 << 14) + 4 and restored.pairs == 6
    assert restored.hold(7) == TRIPLE and restored.triples == 4
    with pytest.raises(ValueError, match="fewer than 2"):
        HolderSets.restored([1 << 3], [(SHARED, 4)])


def test_a_set_at_1000_workers_costs_what_the_budget_counts():
    """BYTES_PER_HOLDER_SET (gateway/core/index.py): sets of four whose highest slot is 999,
    each held by 300 pages, as `HolderSets.nbytes` counts them."""
    sets, rng = HolderSets(), random.Random(1)
    for _ in range(20_000):
        a, b, c = rng.sample(range(999), 3)
        sets.hold(1 << a | 1 << b | 1 << c | 1 << 999, 300)
    assert 200 < sets.nbytes() / len(sets) <= BYTES_PER_HOLDER_SET


def test_the_c_loop_encodes_holders_with_these_constants():
    """page_table.c's own #defines of a holder's ranges are holder_sets.py's."""
    values: dict[str, int] = {}
    for name, expr in re.findall(r"^#define (\w+) (.+)$", (CSRC / "page_table.c").read_text(),
                                 re.M):
        values[name] = eval(expr.split("/*")[0], {}, dict(values))  # noqa: S307 (our source)
    for name in ("SHARED", "TRIPLE", "PAIR", "PAIR_BITS", "PAIR_SLOTS", "TRIPLE_SLOTS"):
        assert values[name] == getattr(holder_sets, name), name
