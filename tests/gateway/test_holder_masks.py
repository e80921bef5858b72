"""Holder masks of shared pages stored once per distinct set of holders
(gateway/core/holder_masks.py): pages with the same holders keep one mask object, masks no page
holds are forgotten, and the table's answers are those of a dict of sets either way."""
from __future__ import annotations

from gateway.core import holder_masks
from gateway.core.holder_masks import HolderMasks
from gateway.core.index_table import PageTable
from tests.gateway.helpers import pages, pages_and_stamps
from tests.gateway.index_impls import table_impl  # noqa: F401  (each test with C, then numpy)

HIGH = 900  # worker slots of a fleet of ~1,000: masks of ~900 bits, ~150 bytes each


def test_pages_with_the_same_holders_keep_one_mask_object():
    table = PageTable()
    shared = pages(0, 5000)
    for slot in (HIGH, HIGH + 7):
        table.add_many(shared, slot)
    for slot in (HIGH, HIGH + 9):  # another set of holders
        table.add_many(pages(5000, 6000), slot)
    masks = list(table.multi.values())
    assert len(masks) == 6000 and len({id(m) for m in masks}) == 2
    assert set(masks) == {1 << HIGH | 1 << HIGH + 7, 1 << HIGH | 1 << HIGH + 9}
    table.discard_many(shared[:10], HIGH + 7)  # alone again: no mask
    table.add_many(shared[:10], HIGH + 9)  # now held as the second set's pages: its mask
    assert len({id(m) for m in table.multi.values()}) == 2
    assert table.masks(shared[:1]) == [1 << HIGH | 1 << HIGH + 9]


def test_masks_no_page_holds_are_forgotten_and_answers_stay(monkeypatch):
    monkeypatch.setattr(holder_masks, "_CLEAN_FROM", 64)
    table, model = PageTable(), PageTable()
    model.holder_masks = lambda m: m  # every mask its own object: the table before this change
    table.holder_masks = HolderMasks()  # made after the monkeypatch: cleans from 64 masks
    for table_ in (table, model):
        for i in range(200):  # 200 distinct sets of holders, two pages each
            table_.add_many(pages(2 * i, 2 * i + 2), HIGH)
            table_.add_many(pages(2 * i, 2 * i + 2), i)
        for i in range(150):  # most of them gone: their pages single-held again
            table_.discard_many(pages(2 * i, 2 * i + 2), i)
    assert len(table.holder_masks) == 200  # no new mask since: no clean yet
    for i in range(300, 360):  # new sets: the 56th brings the masks to 256, a clean

        for table_ in (table, model):
            table_.add_many(pages(2 * i, 2 * i + 2), HIGH)
            table_.add_many(pages(2 * i, 2 * i + 2), i)
    assert len(table.holder_masks) < 120  # the 50 still held and the 60 new ones
    assert pages_and_stamps(table) == pages_and_stamps(model)
    assert table.multi == model.multi
