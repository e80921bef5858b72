"""The next growth's arrays made ready ahead (gateway/core/table_arrays.py): planned past 55%,
sized by how the table fills, written between ingest slices without the router's lock, taken
by the growth, which then writes no fresh arrays; and the same table either way."""
from __future__ import annotations

import threading
import time

import numpy as np

from gateway.core import table_arrays
from gateway.core.feed_streams import Feed
from gateway.core.feeds import FeedLoop
from gateway.core.index_bulk import apply_ops
from gateway.core.index_table import PageTable, page_keys
from gateway.core.metrics import GatewayMetrics
from gateway.core.policies import make_policy
from gateway.core.router import Router, Worker
from gateway.core.table_arrays import SPARE_MIN_SLOTS, Spare, TableArrays
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import compute_service_pb2 as pb
from tests.gateway.gateway_harness import wait_until
from tests.gateway.helpers import batch, heartbeat, pages, pages_and_stamps, stored
from tests.gateway.index_impls import table_impl  # noqa: F401  (each test with C, then numpy)

START = 1 << 40


def _keys(start: int, n: int) -> bytes:
    return np.arange(start, start + n, dtype=np.uint64).repeat(2).tobytes()


def _stores(table: PageTable, start: int, n: int) -> None:
    apply_ops(table, _keys(start, n), np.full(n, 1, dtype=np.int32), np.ones(n, dtype=bool))


def _churn(table: PageTable, gone: int, new: int, n: int) -> None:
    """n pages removed from worker 1 (from `gone` on), n others stored (from `new` on)."""
    keys = _keys(gone, n) + _keys(new, n)
    apply_ops(table, keys, np.full(2 * n, 1, dtype=np.int32), np.arange(2 * n) >= n)


def _fresh_arrays(monkeypatch) -> list[int]:
    """Capacities of the arrays written whole when a table needs them (growths without a spare)."""
    sizes: list[int] = []
    empty = TableArrays.empty.__func__

    def counted(cls, cap):
        sizes.append(cap)
        return empty(cls, cap)
    monkeypatch.setattr(TableArrays, "empty", classmethod(counted))
    return sizes


def _grow_past_the_plan(table: PageTable, step: int = 2000) -> int:
    """Stores pages until the table plans its spare; how many."""
    n = 0
    while not table._spare.planned:
        _stores(table, START + n, step)
        n += step
    return n


def test_a_growth_takes_the_arrays_written_ahead_and_writes_none(monkeypatch):
    table, shadow = PageTable(), PageTable()
    n = _grow_past_the_plan(table)
    _stores(shadow, START, n)
    fresh, cap = _fresh_arrays(monkeypatch), table.cap
    while table.cap == cap:
        spare = table._spare.arrays
        table.prepare_growth()  # the feed loop's call after each slice
        _stores(table, START + n, 2000)
        _stores(shadow, START + n, 2000)
        n += 2000
    assert table._mem is spare and spare.filled == spare.cap
    assert [c for c in fresh if c >= SPARE_MIN_SLOTS] == []
    assert table.growths() == (1, 0, 0)  # counted: the gateway's growths metric
    assert shadow.growths()[:2] == (0, 0) < shadow.growths()[2:]  # no feed loop: fresh arrays
    # Pages only added: sized as a growth (~1.55x), not as a table of replaced pages.
    assert 1.4 * cap < table.cap < 1.7 * cap
    while table.migrate_some(1 << 20):
        pass
    while shadow.migrate_some(1 << 20):
        pass
    assert pages_and_stamps(table) == pages_and_stamps(shadow)
    assert table.keys_held(1) == shadow.keys_held(1) and len(table) == len(shadow) == n


def test_pages_replaced_as_fast_as_stored_plan_a_spare_of_about_the_same_size():
    """At a fleet's steady state the tombstones of removed pages fill the table: its next
    growth is to the same size (a rebuild), and so is the spare."""
    table = PageTable()
    n = 0
    while table.cap < 4 * SPARE_MIN_SLOTS or table._old is not None or table._spare.planned:
        _stores(table, START + n, 4000)
        n += 4000
        table.migrate_some(1 << 20)
    gone, cap = START, table.cap
    while not table._spare.planned:
        _churn(table, gone, START + n, 2000)
        gone, n = gone + 2000, n + 2000
    assert cap <= table._spare.planned <= 1.15 * cap


def test_a_warm_up_that_ends_just_before_the_plan_does_not_size_the_spare_as_a_growth():
    """Pages added up to 52% of a table (a warm-up), then only replaced: the spare planned at
    55% is a rebuild's size, read from how the table filled lately, not the ~1.5x of the growth
    since the table's last one."""
    table, n = PageTable(), 0
    while table.cap < 4 * SPARE_MIN_SLOTS or table._old is not None:
        _stores(table, START + n, 2000)
        n += 2000
        table.migrate_some(1 << 20)
    cap = table.cap
    while table._used_slots() < 0.52 * cap:
        _stores(table, START + n, 500)
        n += 500
    assert table.cap == cap and not table._spare.planned
    gone = START
    while not table._spare.planned:
        _churn(table, gone, START + n, 256)
        gone, n = gone + 256, n + 256
    # A rebuild for the pages there are (45% of it, and the spare's 5% margin), not a growth.
    assert table.cap == cap and table._spare.planned <= 1.1 * len(table) / 0.45


def test_a_fleet_that_stops_growing_gets_its_spare_planned_anew_and_taken(monkeypatch):
    """Planned while pages were being added (~1.6x), then pages only replaced: the growth to
    come is a rebuild of about the same size, which would not take that spare."""
    table, n = PageTable(), 0
    while table.cap < 4 * SPARE_MIN_SLOTS or not table._spare.planned:
        _stores(table, START + n, 2000)
        n += 2000
    grown_plan, cap, gone = table._spare.planned, table.cap, START
    assert grown_plan > 1.4 * cap
    fresh, live = _fresh_arrays(monkeypatch), len(table)
    while table.cap == cap:
        spare = table._spare.arrays
        table.prepare_growth()
        _churn(table, gone, START + n, 256)
        gone, n = gone + 256, n + 256
    assert fresh == [] and table._mem is spare
    # Sized for the pages there are (45% of it), not for the growth planned first.
    assert 0.9 * live / 0.45 <= table.cap <= 1.25 * live / 0.45 and table.cap < 0.85 * grown_plan
    assert len(table) == live


def test_a_spare_partly_written_at_the_growth_is_taken_and_finished_under_the_lock():
    """A growth before the spare is complete (a slice larger than the room the pace left): it
    takes what was written and writes the rest itself (counted `partial`), and the table equals
    one that grew into fresh arrays."""
    table, shadow = PageTable(), PageTable()
    n = _grow_past_the_plan(table)
    _stores(shadow, START, n)
    table.prepare_growth(4096)
    spare = table._spare.arrays
    assert spare is not None and 0 < spare.filled < spare.cap
    cap = table.cap
    while table.cap == cap:
        _stores(table, START + n, 2000)
        _stores(shadow, START + n, 2000)
        n += 2000
    assert table._mem is spare and spare.filled == spare.cap and table._spare.arrays is None
    assert table.growths() == (0, 1, 0)
    assert table.prepare_growth(1 << 20) is False  # nothing planned: nothing written
    while table.migrate_some(1 << 20) or shadow.migrate_some(1 << 20):
        pass
    assert pages_and_stamps(table) == pages_and_stamps(shadow) and len(table) == n


def test_a_growth_waits_for_the_spare_write_in_flight_and_then_writes_alone():
    """The ingest thread writes a chunk of the spare without the router's lock while a growth
    comes: the growth waits for that chunk (the spare's write lock) before it takes the arrays,
    so no write lands after its pages (as an EMPTY over a placed key would)."""
    table = PageTable()
    n = _grow_past_the_plan(table)
    table.prepare_growth(4096)
    spare, cap = table._spare.arrays, table.cap
    stores = [START + n]

    def grow() -> None:
        while table.cap == cap:
            _stores(table, stores[0], 2000)
            stores[0] += 2000
    table._spare._writing.acquire()  # a chunk in flight
    grower = threading.Thread(target=grow)
    grower.start()
    grower.join(0.5)
    assert grower.is_alive() and table._mem is not spare  # the growth waits in take()
    table._spare._writing.release()
    grower.join(10)
    assert not grower.is_alive() and table._mem is spare
    assert table.prepare_growth(1 << 20) is False
    stored_keys = page_keys([k.to_bytes(8, "little") * 2 for k in range(START, stores[0])])
    assert len(table) == stores[0] - START and table.keys_held(1) == stored_keys


def test_a_spare_too_small_for_the_growth_is_not_taken():
    spare = Spare()
    spare.plan(live=100_000, total=100_000, room=0, grown_load=0.45)
    assert spare.planned >= SPARE_MIN_SLOTS
    while spare.fill_some(0, 100_000, 0, chunk=1 << 16):
        pass
    assert spare.take(int(spare.planned / 0.9) + 2) is None and spare.arrays is None and not spare.planned
    spare.plan(live=100_000, total=100_000, room=0, grown_load=0.45)
    while spare.fill_some(0, 100_000, 0, chunk=1 << 16):
        pass
    assert spare.take(int(spare.planned / 1.3)) is None  # too big: memory for nothing
    spare.plan(live=100_000, total=100_000, room=0, grown_load=0.45)
    while spare.fill_some(0, 100_000, 0, chunk=1 << 16):
        pass
    arrays = spare.take(int(spare.planned / 1.1))
    assert arrays is not None and (arrays.holder == table_arrays.EMPTY).all()


def test_the_spare_is_written_at_the_pace_of_the_room_used():
    """Complete once half the room left at the plan is used: a slice's share, not all at once."""
    spare, live, slots = Spare(), 10**7, 0  # no bound on the bytes a page
    spare.plan(live=100_000, total=150_000, room=60_000, grown_load=0.45)
    assert spare.fill_some(60_000, live, slots) and spare.arrays.filled == 0  # no room used yet
    spare.fill_some(57_000, live, slots)  # a tenth of the half
    assert 0.09 * spare.planned <= spare.arrays.filled <= 0.11 * spare.planned
    assert spare.fill_some(30_000, live, slots) is False and spare.arrays.filled == spare.planned


def test_a_growing_table_and_its_spare_hold_at_most_62_bytes_a_live_page():
    """Pages only added: the spare (~1.63x the slots, planned at 55%: 76.6 bytes a page were it
    written whole) is written, paced or all it may (an idle feed loop), no further than keeps
    the arrays' written bytes within 62 a page; still complete before the growth, which takes
    it. (Those bytes: the table's arrays and the spare's written part, what the process holds.)"""
    for chunk in (None, 1 << 30):
        table, n, peak = PageTable(), 0, 0.0
        while table.cap < 4 * SPARE_MIN_SLOTS or table._old is not None:
            _stores(table, START + n, 2000)
            n += 2000
            table.migrate_some(1 << 20)
            table.give_back_retired()  # as the router does after its lock
        cap, (taken, finished, missed) = table.cap, table.growths()  # so far none written ahead
        while table.cap == cap:
            more = table.prepare_growth(chunk)
            spare = table._spare.arrays
            peak = max(peak, table.nbytes(written=True) / len(table))
            if chunk and spare is not None and spare.filled < spare.cap:
                assert not more  # all it may write for now: the idle loop waits for pages
            _stores(table, START + n, 500)
            n += 500
        assert table._mem is spare and table.growths() == (taken + 1, finished, missed)
        assert 61 < peak <= table_arrays.WRITTEN_BYTES_PER_PAGE == 62, (chunk, peak)


def test_a_spare_for_pages_replaced_is_written_whole_when_the_growth_holds_as_much():
    """Live pages at 55% of the table and only replaced (no sweep: a table no feed loop
    sweeps): the rebuild to come holds its old and new arrays for as many pages as now, over 64
    bytes a page. Writing its spare ahead adds nothing to that peak, so the bound lets it."""
    spare = Spare()
    spare.plan(live=550_000, total=550_000, room=150_000, grown_load=0.45)  # first look: added
    spare.plan(live=550_000, total=700_000, room=0, grown_load=0.45)  # replaced: a rebuild
    assert 1.2e6 < spare.planned < 1.35e6
    while spare.fill_some(0, 550_000, 1_000_000, chunk=1 << 16):
        pass
    assert spare.arrays.filled == spare.planned
    assert (1_000_000 + spare.planned) * 16 / 550_000 > 64


def test_the_feed_loop_writes_the_spare_while_ingest_is_idle():
    """Pages stored up to past 55% and then nothing: the idle feed loop writes the spare as far
    as 62 bytes a live page allow (its allocated memory counts in the table's bytes whole), and
    then stops asking to (no busy loop)."""
    pool = "spare"
    router = Router(make_policy("affinity"), GatewayMetrics())
    router.add(Worker(pool, "w", "c", None, pb.GetModelInfoResponse(worker=pool)))
    table, seq = router.index._tables[0], 0
    while not table._spare.planned:
        router.apply_stream_items([(pool, cpb.SubscribeResponse(batch=batch(
            pool, seq, stored(pages(seq * 512, seq * 512 + 512)))))])
        seq += 1
    bytes_before = table.nbytes()
    feeds = FeedLoop(router)
    try:
        item = cpb.SubscribeResponse(heartbeat=heartbeat(pool, seq - 1))
        feeds.run_sync(feeds.applier.put(Feed(pool), item), 10)
        allowed = table_arrays.WRITTEN_BYTES_PER_PAGE * len(table) // 16 - table.cap
        wait_until(lambda: table._spare.arrays is not None
                   and table._spare.arrays.filled == allowed,
                   timeout_s=30, what="spare written")
        cpu = time.process_time()
        time.sleep(1.0)
        assert time.process_time() - cpu < 0.5  # idle: not a loop asking to write on
    finally:
        feeds.close()
    assert 0 < allowed < table._spare.planned
    assert table.nbytes() == bytes_before + table._spare.planned * 16



def test_retired_arrays_are_given_back_after_the_lock_and_their_pages_returned(monkeypatch):
    """A growth's old arrays, once migrated, wait on the router's table (`retired`, counted in
    its bytes) until the router gives them back after its lock: madvise returns their whole
    pages (read back as zeros; arrays of any size here, 32 MiB or more in the gateway), and the
    table holds what it held."""
    monkeypatch.setattr(table_arrays, "_GIVE_BACK_MIN_BYTES", 0)
    router = Router(make_policy("affinity"), GatewayMetrics())
    router.add(Worker("w", "a", "s", None, pb.GetModelInfoResponse(worker="w")))
    table = router.index._tables[0]
    _stores(table, START, 60_000)  # growths past SPARE_MIN_SLOTS: the last one still migrating
    _stores(table, START + 60_000, 40_000)
    while table._old is None:
        _stores(table, START + 100_000 + table.live, 5000)
    old = table._old._mem
    want = pages_and_stamps(table)
    assert old.cap >= SPARE_MIN_SLOTS
    table.migrate_some(old.cap)  # under the lock, as an idle step: retired, not yet given back
    assert table._old is None and table.retired is old
    assert table.nbytes() == table._mem.nbytes() + old.nbytes() + table._spare.nbytes()
    assert np.count_nonzero(old.holder != table_arrays.EMPTY) > 0
    router.migrate_index(1 << 16)  # the feed loop's step: gives them back once out of the lock
    assert table.retired is None and table.nbytes() == table._mem.nbytes() + table._spare.nbytes()
    page = table_arrays.mmap.PAGESIZE // old.holder.itemsize
    inner = old.holder[page:-page]  # whole pages inside the array: returned, zeros now
    assert len(inner) and not inner.any() and not old.key[page:-page].any()
    assert pages_and_stamps(table) == want


def test_arrays_under_32_mib_are_not_given_back_nor_a_lone_tables_retired():
    """Heap memory that free keeps for reuse (table_arrays._GIVE_BACK_MIN_BYTES); and a table
    with no router to give its arrays back frees them when their migration ends."""
    arrays = TableArrays.empty(SPARE_MIN_SLOTS)
    arrays.give_back()
    assert (arrays.holder == table_arrays.EMPTY).all()
    table = PageTable()
    _stores(table, START, 5000)
    while table.migrate_some(1 << 20):
        pass
    assert table.cap > 64 and table._old is None and table.retired is None
