"""A routed request's pages count as used again (`PageTable.touch_stamps`, `KvIndex.touch_lookups`,
`Router.route`): the index's bound then keeps the prefixes requests come back for, and drops a
prefix from its end, not from its first page (which every deeper page needs to be matched). Each
test runs with the page table's C kernel and with the numpy table."""
from __future__ import annotations

import numpy as np

from gateway.core.index import IndexConfig
from gateway.core.index_table import _STAMP_LIMIT, _STORE_LIMIT, PageTable, key_of
from gateway.core.metrics import GatewayMetrics
from gateway.core.policies import AffinityPolicy, RouteRequest
from gateway.core.router import Router, Worker
from prefixcache.v1 import compute_service_pb2 as pb
from tests.gateway.helpers import NoClient, batch, page, pages, pages_and_stamps, stored
from tests.gateway.index_impls import table_impl, use  # noqa: F401  (C, then numpy)


def _stamps(table: PageTable, hashes: list[bytes]) -> list[int]:
    """The stamp of each page (all held)."""
    every = pages_and_stamps(table)
    return [every[key_of(h)][1] for h in hashes]


def _table_with_a_chain(chain: list[bytes], later: list[bytes]) -> PageTable:
    """A chain stored (in prompt order: its first page gets the oldest stamp), then other pages."""
    table = PageTable()
    table.add_many(chain, 0)
    table.add_many(later, 1)
    return table


def _touch(table: PageTable, hashes: list[bytes], ahead: int = 0) -> None:
    table.masks(hashes, table.touch_stamps(len(hashes), ahead))


def test_a_touch_stamps_the_pages_found_newest_the_first_page_newest_of_all():
    chain, later = pages(0, 10), pages(100, 120)
    table = _table_with_a_chain(chain, later)
    clock = table._clock
    _touch(table, chain + [page(999)])  # a page nobody holds is skipped
    stamps = _stamps(table, chain)
    assert stamps == sorted(stamps, reverse=True) and len(set(stamps)) == 10
    assert min(stamps) > max(_stamps(table, later))
    assert table._clock == clock + 11  # the next store is newer again
    table.add_many(pages(200, 201), 1)
    assert _stamps(table, pages(200, 201))[0] > max(stamps)


def test_eviction_drops_a_touched_prefix_from_its_end_and_an_untouched_one_from_its_start():
    chain, later = pages(0, 20), pages(100, 120)
    untouched = _table_with_a_chain(chain, later)
    untouched.evict(5)
    assert untouched.masks(chain) == [0] * 5 + [1] * 15  # its first pages: no match left at all
    touched = _table_with_a_chain(chain, later)
    _touch(touched, chain)
    touched.add_many(pages(200, 220), 1)  # stored after the touch, so newer
    touched.evict(25)
    assert touched.masks(chain) == [1] * 15 + [0] * 5  # 15 pages still match
    assert touched.masks(later + pages(200, 220)) == [0] * 20 + [2] * 20


def test_a_touched_page_outlives_the_stores_ahead_it_was_given():
    chain, later = pages(0, 10), pages(100, 110)
    table = _table_with_a_chain(chain, later)
    _touch(table, chain, ahead=30)
    table.add_many(pages(200, 220), 1)  # 20 stores after the touch: within its 30 ahead
    table.evict(30)
    assert table.masks(chain) == [1] * 10
    assert table.masks(later + pages(200, 220)) == [0] * 30


def test_a_touch_reaches_pages_still_in_the_old_table_while_a_growth_migrates():
    table = PageTable(capacity=64, migrate_step=1)
    table.add_many(pages(0, 44), 0)  # past 70%: the next store grows the table
    table.add_many(pages(100, 101), 1)
    assert table._old is not None and table._old.live > 0
    in_old = [h for h in pages(0, 44) if table._old.masks([h]) == [1]]
    assert in_old
    _touch(table, in_old)
    stamps = _stamps(table, in_old)
    assert stamps == sorted(stamps, reverse=True)
    assert min(stamps) > _stamps(table, pages(100, 101))[0]  # stored last, in the new table


def test_the_c_and_numpy_tables_touch_alike(table_impl):  # noqa: F811
    states = []
    for impl in ("c", "numpy"):
        use(impl)
        table = PageTable(capacity=64, migrate_step=3)
        table.add_many(pages(0, 40), 0)
        table.add_many(pages(20, 70), 1)  # shared pages, and a growth with an old table
        _touch(table, pages(10, 60) + pages(500, 510), ahead=7)
        states.append((pages_and_stamps(table), table._clock))
    use(table_impl)
    assert states[0] == states[1]


def test_stores_renumber_before_a_touch_could_pass_the_stamp_limit():
    table = _table_with_a_chain(pages(0, 10), pages(100, 110))
    table._clock = _STAMP_LIMIT - 5
    assert table.touch_stamps(10, 0) is None  # a hint skipped, never a wrapped stamp
    table._clock = _STORE_LIMIT - 1
    table.add_many(pages(200, 210), 1)  # renumbered first: room for a touch of 2**28 ahead
    assert table._clock < 100
    assert table.touch_stamps(10, 2**28) is not None


def _router(max_entries: int) -> Router:
    router = Router(AffinityPolicy(), GatewayMetrics(),
                    IndexConfig(max_entries=max_entries, evict_fraction=0.2))
    for name in ("w0", "w1"):
        router.add(Worker(name, f"{name}:1", f"{name}:2", client=NoClient(),  # type: ignore[arg-type]
                          info=pb.GetModelInfoResponse()))
    return router


def _flood(router: Router, start: int) -> None:
    """w1 stores 70 pages nobody asks for: the index (100 keys) goes past its bound."""
    router.index.apply(batch("w1", 0, stored(pages(start, start + 70))))


def test_a_bounded_index_keeps_the_prefix_requests_come_back_for():
    chain = pages(0, 40)
    routed = _router(100)
    routed.index.apply(batch("w0", 0, stored(chain)))
    request = RouteRequest("r1", chain + pages(900, 904), 44 * 16, 16)
    changes = routed.index.changes
    assert routed.route(request).worker.name == "w0"
    assert routed.index.changes == changes and not routed.index.touch_lookups
    _flood(routed, 1000)
    assert routed.index.evicted_entries > 0
    assert routed.index.lookup(chain)["w0"].device_pages == 40
    # Without the request, the flood takes the chain from its first page: nothing matches.
    idle = _router(100)
    idle.index.apply(batch("w0", 0, stored(chain)))
    _flood(idle, 1000)
    assert "w0" not in idle.index.lookup(chain)


def test_a_preview_touches_nothing():
    router = _router(1000)
    chain = pages(0, 40)
    router.index.apply(batch("w0", 0, stored(chain)))
    table = router.index._tables[0]
    before = (pages_and_stamps(table), table._clock)
    router.preview(RouteRequest("r1", chain, 40 * 16, 16))
    assert (pages_and_stamps(table), table._clock) == before
    stamps = np.array(_stamps(table, chain))
    router.route(RouteRequest("r2", chain, 40 * 16, 16))
    assert (np.array(_stamps(table, chain)) > stamps.max()).all()
