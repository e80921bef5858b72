"""A warm-up's growths sized for the fleet (gateway/core/expected_pages.py): the estimate from the
synced workers, one growth to the fleet's size once enough of them are (its arrays written ahead
by the feed loop's calls, as it applies), and no shrink below the pages still expected."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from gateway.core import expected_pages as expected_module
from gateway.core.expected_pages import MIN_SYNCED, SYNCED_SHARE, expected_pages
from gateway.core.index import KvIndex
from gateway.core.index_checkpoint import capture, load, write
from gateway.core.index_types import IndexConfig
from gateway.core.table_arrays import TableArrays
from tests.gateway.helpers import batch, cleared, pages, pages_and_stamps, stored
from tests.gateway.index_impls import table_impl  # noqa: F401  (each test with C, then numpy)

WORKERS, PAGES, PART = 40, 4000, 500


@pytest.fixture(autouse=True)
def small_fleets(monkeypatch):
    """Estimates from a page on (500k by default: MIN_EXPECTED_PAGES), for fleets of test size."""
    monkeypatch.setattr(expected_module, "MIN_EXPECTED_PAGES", 1)


def _worker(held: int, last_seq: int = 0, in_snapshot: bool = False, needs_resync: bool = False):
    return SimpleNamespace(held=[held, 0, 0], last_seq=last_seq, in_snapshot=in_snapshot,
                           needs_resync=needs_resync)


def test_the_estimate_extrapolates_the_synced_workers_to_the_others():
    synced = [_worker(100) for _ in range(MIN_SYNCED)]
    waiting = [_worker(0, last_seq=-1), _worker(40, in_snapshot=True),
               _worker(100, needs_resync=True), _worker(0), _worker(250, in_snapshot=True)]
    waiting[3].in_snapshot = True
    live = 4 * 100 + 40 + 100 + 250
    # the waiting hold 0, 40, 100, 0, 250 of a typical 100: 100 + 60 + 0 + 100 + 0 to come
    assert expected_pages(synced + waiting, 0, live) == live + 260
    # another medium: no pages anywhere, nothing expected beyond what it holds
    assert expected_pages(synced + waiting, 1, 0) == 0
    # fewer synced workers than MIN_SYNCED: no estimate
    assert expected_pages(synced[1:] + waiting, 0, live - 100) == live - 100
    # every worker synced: nothing to come
    assert expected_pages(synced, 0, 400) == 400
    # and a share of the workers: MIN_SYNCED of 1,000 are too few
    many = synced + [_worker(0, last_seq=-1) for _ in range(996)]
    assert SYNCED_SHARE * 1000 == 10 > MIN_SYNCED and expected_pages(many, 0, 400) == 400
    for w in many[MIN_SYNCED:10]:  # 10 of 1,000 synced (6 holding none): 990 x 40 to come
        w.last_seq = 0
    assert expected_pages(many, 0, 400) == 400 + 990 * 40


def test_no_estimate_below_min_expected_pages(monkeypatch):
    monkeypatch.setattr(expected_module, "MIN_EXPECTED_PAGES", 1 << 20)
    workers = [_worker(1000) for _ in range(60)] + [_worker(0, last_seq=-1)] * 900
    assert expected_pages(workers, 0, 60_000) == 60_000  # 960k expected: under 2^20
    workers += [_worker(0, last_seq=-1)] * 100
    assert expected_pages(workers, 0, 60_000) == 60_000 + 1000 * 1000 >= 1 << 20


def test_shared_pages_count_once_in_the_estimate():
    """Every worker holds the same 50 pages and 50 of its own: 100 held each, 50 + 50 a worker
    as keys. Half of what the waiting ones will hold is already a key."""
    workers = [_worker(100) for _ in range(MIN_SYNCED)] + [_worker(0, last_seq=-1)] * 4
    live = 50 + 50 * MIN_SYNCED
    r = live / (100 * MIN_SYNCED)
    assert expected_pages(workers, 0, live) == live + int(4 * 100 * r)


def _snapshot(index: KvIndex, w: int, prepare: bool = True) -> None:
    """Worker w's snapshot in batches of PART pages, the feed loop's paced call after each."""
    for start in range(0, PAGES, PART):
        first, last = start == 0, start + PART == PAGES
        events = ([cleared()] if first else []) + [stored(pages(PAGES * w + start,
                                                                PAGES * w + start + PART))]
        index.apply(batch(f"w{w}", 0, *events, snapshot=True, snapshot_end=last))
        if prepare:
            index.prepare_growth()


def _warm_up(expect: bool) -> tuple[KvIndex, list[int]]:
    index = KvIndex(IndexConfig(max_entries=1 << 30))
    if not expect:
        index._tables[0].expect = lambda: 0
    for w in range(WORKERS):
        index.add_worker(f"w{w}")
    caps = []
    for w in range(WORKERS):
        _snapshot(index, w)
        caps.append(index._tables[0].cap)
    return index, caps


def test_a_warm_up_grows_once_to_the_fleet_once_enough_workers_are_synced(caplog):
    with caplog.at_level(logging.INFO, logger="gateway.index"):
        index, caps = _warm_up(expect=True)
    sized = [r.getMessage() for r in caplog.records if "index_sized_for_fleet" in r.getMessage()]
    assert len(sized) == 1 and f"expected_pages={WORKERS * PAGES}" in sized[0]
    table = index._tables[0]
    grew_after = [w for w in range(MIN_SYNCED, WORKERS) if caps[w] != caps[w - 1]]
    assert len(grew_after) == 1  # one growth, straight to the fleet's size
    assert len(table) == WORKERS * PAGES and table._old is None
    assert table.cap * 0.45 >= WORKERS * PAGES  # the whole fleet fits at the grown load
    ready, finished, missed = table.growths()
    assert ready == 1 and finished == missed == 0  # its arrays written ahead, not under the lock
    # what the index holds is what the usual growths give
    usual, usual_caps = _warm_up(expect=False)
    assert len({c for c in usual_caps[MIN_SYNCED:]}) >= 4  # the usual way: growth after growth
    assert pages_and_stamps(usual._tables[0]) == pages_and_stamps(table)
    for w in (0, WORKERS // 2, WORKERS - 1):
        probe = pages(PAGES * w, PAGES * w + 10)
        assert index.lookup(probe) == usual.lookup(probe)
        assert index.lookup(probe)[f"w{w}"].device_pages == 10
    # the table sized for the fleet holds it within the bytes a page of the usual growths
    assert table.nbytes() / len(table) < 40


def test_the_spare_for_the_expected_fleet_is_written_ahead_of_its_pages():
    """The spare's bytes a live page bound (WRITTEN_BYTES_PER_PAGE) counts the pages expected:
    the feed loop writes the fleet's arrays while the table still holds a few workers."""
    index = KvIndex(IndexConfig(max_entries=1 << 30))
    for w in range(WORKERS):
        index.add_worker(f"w{w}")
    table = index._tables[0]
    w = 0
    while not table._spare.expected:
        _snapshot(index, w, prepare=False)
        w += 1
    assert w >= MIN_SYNCED
    spare = table._spare
    assert spare.expected >= (WORKERS - 1) * PAGES and spare.planned * 0.45 > WORKERS * PAGES
    index.prepare_growth()  # the paced call between slices: not paced by the room for these
    assert spare.arrays.filled == spare.arrays.cap  # far past 62 bytes a live page
    assert spare.nbytes(written=True) / len(table) > 100


def test_a_table_sized_for_the_fleet_does_not_shrink_while_its_pages_are_expected():
    index, _ = _warm_up(expect=True)
    table = index._tables[0]
    cap = table.cap
    for w in range(MIN_SYNCED + 2, WORKERS):  # the rest restart: their pages cleared, to come
        index.apply(batch(f"w{w}", 0, cleared(), snapshot=True, epoch=2))
    assert len(table) < 0.2 * cap
    while index.migrate_some(1 << 16) or index.prepare_growth(1 << 20):
        pass
    assert table.cap == cap and index.stats().shrinks == 0
    for w in range(MIN_SYNCED + 2, WORKERS):  # they leave instead: nothing expected
        index.remove_worker(f"w{w}")
    while index.migrate_some(1 << 16) or index.prepare_growth(1 << 20):
        pass
    assert table.cap < cap / 4 and index.stats().shrinks == 1


def test_an_index_loaded_from_a_checkpoint_estimates_for_its_own_tables(tmp_path):
    index = KvIndex(IndexConfig(max_entries=1 << 30))
    for w in range(WORKERS):
        index.add_worker(f"w{w}")
    for w in range(MIN_SYNCED + 1):
        _snapshot(index, w, prepare=False)
    path = str(tmp_path / "ckpt")
    write(capture(index, {}, "default", "spec"), path)
    again = KvIndex(IndexConfig(max_entries=1 << 30))
    assert again._tables[0].expect() == 0  # an empty index's, kept until it changes
    assert len(load(again, path, "default", "spec")) == WORKERS
    expected = index._tables[0].expect()
    assert expected == (WORKERS - 1) * PAGES + PAGES and again._tables[0].expect() == expected
    again.remove_worker(f"w{WORKERS - 1}")  # the loaded index's workers, not the first one's
    assert again._tables[0].expect() == expected - PAGES


def test_a_table_sized_for_too_many_pages_shrinks_once_ingest_idles():
    """The first workers hold 4,000 pages, the rest 2,200: sized for ~160k pages, the table ends
    ~26% full; not a fifth (a table grown as it filled would stay), but under 30%, and once
    nothing more is expected its idle steps shrink it."""
    index = KvIndex(IndexConfig(max_entries=1 << 30))
    for w in range(WORKERS):
        index.add_worker(f"w{w}")
    for w in range(WORKERS):
        for start in range(0, PAGES if w < MIN_SYNCED else 2200, PART):
            stop = min(start + PART, PAGES if w < MIN_SYNCED else 2200)
            index.apply(batch(f"w{w}", 0, *([cleared()] if start == 0 else []),
                              stored(pages(PAGES * w + start, PAGES * w + stop)), snapshot=True,
                              snapshot_end=stop == (PAGES if w < MIN_SYNCED else 2200)))
            index.prepare_growth()
    table = index._tables[0]
    cap = table.cap
    assert table.sized_for_expected and 0.2 < len(table) / cap < 0.3
    before = pages_and_stamps(table)
    while index.migrate_some(1 << 16) or index.prepare_growth(1 << 20):
        pass
    assert table.cap < 0.6 * cap and index.stats().shrinks == 1 and not table.sized_for_expected
    assert pages_and_stamps(table) == before


def test_a_growth_before_the_fleets_arrays_are_written_grows_as_usual_and_keeps_them(monkeypatch):
    """Written under the router's lock, the rest of a fleet's arrays would stall routing (~0.7 s
    at 10M pages): a growth that comes first allocates the usual size, and the spare stays for
    the next one, which takes it written whole."""
    fresh: list[int] = []
    empty = TableArrays.empty.__func__
    monkeypatch.setattr(TableArrays, "empty",
                        classmethod(lambda cls, cap: fresh.append(cap) or empty(cls, cap)))
    index = KvIndex(IndexConfig(max_entries=1 << 30))
    for w in range(WORKERS):
        index.add_worker(f"w{w}")
    table, w = index._tables[0], 0
    while not table._spare.expected:
        _snapshot(index, w, prepare=False)
        w += 1
    spare, cap = table._spare, table.cap
    planned = spare.planned
    while table.cap == cap:  # no feed loop's call: nothing written when the table must grow
        _snapshot(index, w, prepare=False)
        w += 1
    assert table.cap < planned and fresh[-1] == table.cap  # the usual growth
    assert spare.planned == planned and spare.expected and spare.arrays is None  # kept
    assert table.growths()[:2] == (0, 0)
    index.prepare_growth()
    while w < WORKERS:
        _snapshot(index, w)
        w += 1
    assert table.cap == planned and table.growths()[:2] == (1, 0) and max(fresh) < planned
    assert len(table) == WORKERS * PAGES


def test_the_estimate_is_made_once_between_two_changes_of_the_index(monkeypatch):
    """A table under its shrink's load asks at every idle step: the index keeps its answer until
    a batch, a worker's removal or another change comes."""
    from gateway.core import index as index_module
    calls = []
    real = index_module.expected_pages
    monkeypatch.setattr(index_module, "expected_pages", lambda *a: calls.append(1) or real(*a))
    index = KvIndex(IndexConfig(max_entries=1 << 30))
    for w in range(WORKERS):
        index.add_worker(f"w{w}")
    for w in range(MIN_SYNCED):
        _snapshot(index, w, prepare=False)
    table = index._tables[0]
    calls.clear()
    first = table.expect()
    assert [table.expect() for _ in range(5)] == [first] * 5 and len(calls) == 1
    _snapshot(index, MIN_SYNCED, prepare=False)  # its batches' looks may have asked
    assert table.expect() == first == WORKERS * PAGES
    n = len(calls)
    index.remove_worker(f"w{WORKERS - 1}")  # one worker fewer to come
    assert table.expect() == table.expect() == first - PAGES and len(calls) == n + 1


def test_a_spare_is_for_pages_expected_only_past_what_a_growth_would_take_anyway():
    """A worker or two still syncing beside a steady state's churn: the spare is planned for
    them, but paced and bound as usual (taken partly written if need be); a warm-up's fleet,
    several times the pages: the spare is for it."""
    from gateway.core.table_arrays import Spare
    live, total, room = 300_000, 330_000, 60_000  # pages replaced as fast as stored: added 0
    for expected, for_it in ((int(live * 1.2), False), (live * 3, True)):
        spare = Spare(live, total - 40_000)
        spare.plan(live, total, room, 0.45, expect=lambda e=expected: e)
        assert spare.planned >= expected / 0.45 and bool(spare.expected) == for_it
