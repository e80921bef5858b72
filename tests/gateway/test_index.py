from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.index import ApplyStatus, IndexConfig, KvIndex, PrefixMatch
from gateway.core.index_table import page_keys
from gateway.core.routed_prefixes import RoutedPrefixes
from tests.gateway.helpers import (DEVICE, HOST, REMOTE, FakeClock, batch, cleared, heartbeat, page, pages,
                                   removed, stored)
from tests.gateway.index_impls import table_impl  # noqa: F401  (each test with C, then numpy)

MEDIA = (DEVICE, HOST, REMOTE)


def _check_consistent(index: KvIndex, model: dict[tuple[str, int], set[bytes]]) -> None:
    for (pool, medium), expected in model.items():
        assert index.pages(pool, medium) == page_keys(expected), (pool, medium)
    assert len(index) == len({(h, m) for (_, m), hs in model.items() for h in hs})


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from(MEDIA), st.booleans(),
                          st.lists(st.integers(0, 30), min_size=1, max_size=6)), max_size=60))
def test_applied_events_equal_the_described_page_sets(ops):
    index = KvIndex()
    model: dict[tuple[str, int], set[bytes]] = {(f"w{w}", m): set() for w in range(3) for m in MEDIA}
    seqs = [-1, -1, -1]
    for w, medium, is_store, ids in ops:
        hashes = [page(i) for i in ids]
        seqs[w] += 1
        event = stored(hashes, medium) if is_store else removed(hashes, medium)
        assert index.apply(batch(f"w{w}", seqs[w], event)).status is ApplyStatus.APPLIED
        target = model[(f"w{w}", medium)]
        target.update(hashes) if is_store else target.difference_update(hashes)
    _check_consistent(index, model)


def test_random_streams_with_clears_match_a_model():
    rng = random.Random(7)
    index = KvIndex()
    model = {(f"w{w}", m): set() for w in range(4) for m in MEDIA}
    for w in range(4):
        for seq in range(200):
            pool, medium = f"w{w}", rng.choice(MEDIA)
            hashes = [page(rng.randrange(100)) for _ in range(rng.randint(1, 8))]
            roll = rng.random()
            if roll < 0.02:
                ev = cleared()
                for m in MEDIA:
                    model[(pool, m)].clear()
            elif roll < 0.6:
                ev = stored(hashes, medium)
                model[(pool, medium)].update(hashes)
            else:
                ev = removed(hashes, medium)
                model[(pool, medium)].difference_update(hashes)
            index.apply(batch(pool, seq, ev))
    _check_consistent(index, model)


def test_gap_is_reported_with_the_resume_point_and_a_replay_heals_it():
    index = KvIndex()
    assert index.apply(batch("a", 0, stored(pages(0, 4)))).status is ApplyStatus.APPLIED
    res = index.apply(batch("a", 2, stored(pages(4, 8))))
    assert res.status is ApplyStatus.RESYNC and "gap" in res.reason
    assert (res.resume_epoch, res.resume_after_seq) == (1, 0)
    assert index.info("a").needs_resync
    assert index.pages("a", DEVICE) == page_keys(pages(0, 4))  # kept, with less confidence
    assert index.apply(batch("a", 1, stored(pages(4, 6)))).status is ApplyStatus.APPLIED
    assert not index.info("a").needs_resync
    assert index.apply(batch("a", 1, stored(pages(9, 10)))).status is ApplyStatus.DUPLICATE


def test_new_epoch_clears_and_needs_a_snapshot_unless_it_starts_at_seq_0():
    index = KvIndex()
    index.apply(batch("a", 0, stored(pages(0, 4))))
    res = index.apply(batch("a", 5, stored(pages(10, 12)), epoch=2))
    assert res.status is ApplyStatus.RESYNC
    assert (res.resume_epoch, res.resume_after_seq) == (2, -1)
    assert index.pages("a", DEVICE) == frozenset()
    assert index.apply(batch("a", 0, stored(pages(20, 22)), epoch=3)).status is ApplyStatus.APPLIED
    assert index.pages("a", DEVICE) == page_keys(pages(20, 22))
    assert index.info("a").epoch == 3


def test_first_contact_mid_stream_needs_a_snapshot():
    res = KvIndex().apply(batch("a", 7, stored(pages(0, 2))))
    assert res.status is ApplyStatus.RESYNC and res.resume_after_seq == -1


def test_snapshot_replaces_the_workers_entries():
    index = KvIndex()
    index.apply(batch("a", 0, stored(pages(0, 4)), stored(pages(50, 52), HOST)))
    index.apply(batch("b", 0, stored(pages(0, 4))))
    res = index.apply(batch("a", 9, cleared(), stored(pages(10, 12)), snapshot=True))
    assert res.status is ApplyStatus.APPLIED and index.info("a").in_snapshot
    assert index.pages("a", DEVICE) == page_keys(pages(10, 12)) and index.pages("a", HOST) == frozenset()
    index.apply(batch("a", 9, stored(pages(12, 14)), snapshot=True, snapshot_end=True))
    info = index.info("a")
    assert not info.in_snapshot and info.last_seq == 9
    assert index.pages("a", DEVICE) == page_keys(pages(10, 14))
    assert index.pages("b", DEVICE) == page_keys(pages(0, 4))  # other workers untouched
    assert index.apply(batch("a", 10, removed(pages(10, 11)))).status is ApplyStatus.APPLIED
    assert index.pages("a", DEVICE) == page_keys(pages(11, 14))


def test_broken_snapshots_are_resynced():
    index = KvIndex()
    index.apply(batch("a", 0, stored(pages(0, 2))))
    assert index.apply(batch("a", 3, stored(pages(5, 6)), snapshot=True)).status is ApplyStatus.RESYNC
    index.apply(batch("a", 3, cleared(), snapshot=True))
    assert index.apply(batch("a", 4, stored(pages(5, 6)))).status is ApplyStatus.RESYNC


def test_heartbeat_detects_missed_batches_and_new_epochs():
    index = KvIndex()
    index.apply(batch("a", 0, stored(pages(0, 2))))
    assert index.heartbeat(heartbeat("a", 0)).status is ApplyStatus.APPLIED
    res = index.heartbeat(heartbeat("a", 3))
    assert res.status is ApplyStatus.RESYNC and res.resume_after_seq == 0
    assert index.heartbeat(heartbeat("a", -1, epoch=2)).status is ApplyStatus.APPLIED  # fresh, empty
    assert index.pages("a", DEVICE) == frozenset()
    assert index.apply(batch("a", 0, stored(pages(0, 1)), epoch=2)).status is ApplyStatus.APPLIED


def test_remove_worker_drops_its_pages_and_frees_its_slot():
    index = KvIndex()
    index.apply(batch("a", 0, stored(pages(0, 8))))
    index.apply(batch("b", 0, stored(pages(0, 4))))
    assert index.remove_worker("a") and not index.remove_worker("a")
    assert set(index.lookup(pages(0, 8))) == {"b"}
    index.apply(batch("c", 0, stored(pages(100, 101))))  # reuses a's slot
    assert set(index.lookup(pages(0, 8))) == {"b"}
    assert len(index) == 5


def test_memory_bound_evicts_remote_first_then_least_recently_stored():
    index = KvIndex(IndexConfig(max_entries=100, evict_fraction=0.1))
    index.apply(batch("a", 0, stored(pages(1000, 1030), REMOTE)))
    for seq in range(1, 11):
        index.apply(batch("a", seq, stored(pages(seq * 10, seq * 10 + 10))))
    assert len(index) <= 100
    assert index.pages("a", REMOTE) == frozenset()  # the cheapest hits went first
    kept = index.pages("a", DEVICE)
    assert page_keys(pages(100, 110)) <= kept  # the newest survive
    assert index.evicted_entries == 130 - len(index)
    # Internal sets and masks agree: every kept page is found, no evicted one is.
    assert index.lookup(pages(100, 110))["a"].device_pages == 10


def test_lookup_device_run_then_host_then_remote_extension():
    index = KvIndex()
    index.apply(batch("a", 0, stored(pages(0, 10)), stored(pages(10, 15), HOST)))
    index.apply(batch("b", 0, stored(pages(0, 3)), stored(pages(3, 6), HOST), stored(pages(15, 20), REMOTE)))
    index.apply(batch("c", 0, stored(pages(0, 12), REMOTE)))
    result = index.lookup(pages(0, 25))
    # a: 10 on device, 5 on host, then 15..19 on the shared remote tier.
    assert result["a"] == PrefixMatch(10, 5, 5, 1.0)
    # b: 3 device, 3 host, then pages 6..11 are remote (c wrote them), 12..14 nowhere.
    assert result["b"] == PrefixMatch(3, 3, 6, 1.0)
    # c: nothing local; remote covers 0..11.
    assert result["c"] == PrefixMatch(0, 0, 12, 1.0)
    assert index.lookup(pages(500, 510)) == {}
    assert index.lookup([]) == {}


def test_lookup_with_many_workers_matches_a_naive_scan():
    rng = random.Random(3)
    index = KvIndex()
    held = {}
    for w in range(40):
        n = rng.randrange(0, 300)
        held[f"w{w}"] = n
        if n:
            index.apply(batch(f"w{w}", 0, stored(pages(0, n))))
    result = index.lookup(pages(0, 256))
    assert {w: m.device_pages for w, m in result.items()} == {w: min(n, 256) for w, n in held.items() if n}


def test_stale_and_resyncing_workers_get_less_confidence():
    clock = FakeClock()
    index = KvIndex(IndexConfig(stale_after_s=5, dead_after_s=25, resync_confidence=0.5), clock=clock)
    index.apply(batch("a", 0, stored(pages(0, 4))))
    index.apply(batch("b", 0, stored(pages(0, 4))))
    assert index.confidence("a") == 1.0
    clock.now += 15
    index.heartbeat(heartbeat("b", 0))
    assert index.confidence("a") == 0.5 and index.confidence("b") == 1.0
    assert index.lookup(pages(0, 4))["a"].confidence == 0.5
    index.apply(batch("b", 5, stored(pages(9, 10))))  # gap
    assert index.confidence("b") == 0.5
    clock.now += 100
    assert index.confidence("a") == 0.0
    assert index.confidence("nobody") == 0.0


def test_routed_prefixes_is_an_lru_of_prefixes():
    routed = RoutedPrefixes(max_pages_per_worker=10)
    routed.record("a", pages(0, 6))
    routed.record("b", pages(0, 3))
    assert routed.match(pages(0, 8)) == {"a": 6, "b": 3}
    routed.record("a", pages(100, 108))  # pushes out a's deepest old pages first
    assert routed.match(pages(0, 8)) == {"a": 2, "b": 3}
    assert routed.size("a") == 10
    routed.remove_worker("a")
    assert routed.match(pages(0, 8)) == {"b": 3} and routed.size("a") == 0


def test_a_lookup_while_a_growth_migrates_finds_the_pages_of_both_tables():
    """While a growth's migration leaves pages in the old table, a lookup finds them there too
    (the C lookup in one call reads one table: it leaves such lookups to the per-round path)."""
    index = KvIndex()
    table = index._tables[0]
    table.migrate_step = 1
    seen_old = 0
    for i in range(40):
        index.apply(batch("a", i, stored(pages(20 * i, 20 * i + 20))))
        index.apply(batch("b", i, stored(pages(20 * i, 20 * i + 10))))
        seen_old += table._old is not None
        result = index.lookup(pages(0, 20 * i + 25))
        assert (result["a"].device_pages, result["b"].device_pages) == (20 * i + 20, 10)
    assert seen_old >= 3


def test_a_lookup_stops_probing_at_the_first_page_held_nowhere():
    """A long prompt whose cached prefix is short costs a probe of its first round of pages
    (64), not of every page: no run goes past a page that no medium holds."""
    index = KvIndex()
    index.apply(batch("a", 0, stored(pages(0, 40))))
    index.apply(batch("b", 0, stored(pages(0, 20)), stored(pages(20, 30), HOST)))
    probed = []
    table = index._tables[0]
    masks = table.masks
    table.masks = lambda hashes, touch_from=None: (  # type: ignore[method-assign]
        probed.append(len(hashes)) or masks(hashes, touch_from))
    probe = index._probe.probe  # the C kernel's lookup in one call (held_native.py)

    def counted(*args):
        held = probe(*args)
        if held is not None:
            probed.append(held[-1])  # the pages it probed
        return held
    index._probe.probe = counted  # type: ignore[method-assign]
    result = index.lookup(pages(0, 2048))
    assert sum(probed) == 64
    assert (result["a"].device_pages, result["b"].device_pages, result["b"].host_pages) == (40, 20, 10)
