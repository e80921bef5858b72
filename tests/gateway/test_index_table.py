"""The KV index's flat-array table (gateway/core/index_table.py): the same answers as a dict of
sets through inserts, removals, clears, evictions and rehashes; its size per page; what a key
shared by two hashes can and cannot do."""
from __future__ import annotations

import random
import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st
import numpy as np

from gateway.core.index import IndexConfig, KvIndex
from gateway.core.index_bulk import apply_ops
from gateway.core.index_table import _MIX_HI, PageTable, _fold, key_of, page_keys
from prefixcache_client.hash import prompt_hashes
from tests.gateway.helpers import (DEVICE, HOST, REMOTE, batch, check_holder_sets, page, pages,
                                   pages_and_stamps, removed, stored)
from tests.gateway.index_impls import table_impl  # noqa: F401  (each test with C, then numpy)

_ops = st.lists(st.tuples(st.sampled_from(["add", "add_many", "discard", "clear", "evict"]),
                          st.integers(0, 4), st.lists(st.integers(0, 200), max_size=40)), max_size=60)


def _check(table: PageTable, model: dict[int, set[bytes]]) -> None:
    for slot, held in model.items():
        assert table.keys_held(slot) == page_keys(held), slot
    assert len(table) == len(set().union(*model.values()))
    everyone = set().union(*model.values()) | {page(i) for i in range(0, 200, 7)}
    for h in everyone:
        assert table.mask(h) == sum(1 << s for s, held in model.items() if h in held)


@settings(max_examples=60, deadline=None)
@given(_ops)
def test_the_table_answers_as_a_dict_of_sets(ops):
    table = PageTable(capacity=8)  # tiny: most runs rehash several times, with deleted slots
    model: dict[int, set[bytes]] = {s: set() for s in range(5)}
    for op, slot, ids in ops:
        _apply_checked(table, model, op, slot, [page(i) for i in ids])
        _check(table, model)


def test_eviction_takes_the_least_recently_stored_and_single_holders_first():
    table = PageTable()
    table.add_many(pages(0, 10), 0)
    table.add_many(pages(0, 2), 1)  # shared, and restamped
    table.add(page(5), 0)  # restamped: now the newest
    lost = table.evict(4)
    assert lost == {0: 4}
    # The oldest 8: pages 2-4, 6-9 and 0; the first 4 held by one worker go.
    assert table.keys_held(0) == page_keys([page(i) for i in (0, 1, 5, 7, 8, 9)])


def test_an_indexed_page_takes_at_most_64_bytes():
    """tracemalloc's count of everything the index allocates, 100 workers x 1,000 private pages
    (snapshot-sized events and live-sized ones) plus pages a tenth of them share: the goal of
    issue 31 is 64 bytes; measured 40.5, of which the table's arrays 28.8 (with the whole 16-byte
    hash as the key: 54.9 and 43.2; the dict layout before the table: ~170)."""
    index = KvIndex(IndexConfig(max_entries=1 << 30))
    tracemalloc.start()
    try:
        for w in range(100):
            own = [((w + 1) << 40 | j).to_bytes(16, "little") for j in range(1000)]
            shared = pages(0, 64) if w % 10 == 0 else []
            index.apply(batch(f"w{w}", 0, stored(shared + own[:900])))
            for seq, start in enumerate(range(900, 1000, 25), 1):
                index.apply(batch(f"w{w}", seq, stored(own[start:start + 25])))
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(index) == 100 * 1000 + 64
    assert used / len(index) <= 48, used / len(index)  # 16-byte keys: 55


def _sharing_key_with(h: bytes, hi: int) -> bytes:
    """Another 16-byte hash with `h`'s key (`key_of`): its second word `hi`, its first chosen."""
    lo_h, hi_h = int.from_bytes(h[:8], "little"), int.from_bytes(h[8:], "little")
    lo = lo_h ^ (hi_h * _MIX_HI & (2**64 - 1)) ^ (hi * _MIX_HI & (2**64 - 1))
    return lo.to_bytes(8, "little") + hi.to_bytes(8, "little")


def test_hashes_sharing_a_key_only_make_routing_count_a_page_it_may_not_find():
    """Keys are a hash's two 8-byte words folded into 64 bits (`key_of`); a hash of another
    length is cut or padded to 16 bytes first. Two hashes that share a key are one page to the
    index: a lookup may credit a worker with the other one, and a removal of either drops it,
    which only mis-scores that worker (the worker checks every page it is sent against its own
    cache and computes what it lacks). For random hashes a key is shared with probability
    ~n / 2**64 a lookup (design.md §6)."""
    long_a, long_b = b"p" * 16 + b"a", b"p" * 16 + b"b"
    twin = _sharing_key_with(page(3), hi=12345)
    assert twin != page(3) and key_of(twin) == key_of(page(3))
    index = KvIndex()
    index.apply(batch("w", 0, stored([page(1), long_a, page(3)])))
    assert set(index.lookup([page(1), long_b])) == {"w"}  # credited with long_b: 2 pages
    assert index.lookup([page(1), long_b])["w"].device_pages == 2
    assert index.lookup([page(1), long_a, twin])["w"].device_pages == 3  # and with the twin
    assert index.lookup([page(2)]) == {}  # a hash whose key nobody stored is not found
    assert len(index) == 3
    index.apply(batch("w", 1, removed([twin])))  # the twin's removal drops page 3: a miss
    assert index.lookup([page(1), long_a, page(3)])["w"].device_pages == 2
    assert len(index) == 2


def test_keys_of_a_hash_table_are_spread_and_distinct():
    """Keys of real page hashes (prefixcache_client.hash: 16 bytes of a cryptographic hash) never
    meet, and a hash of 8 bytes keeps its 8 bytes as its key (the second word is zero)."""
    hashes = prompt_hashes(list(range(400_000)), 2, "m")  # 200k pages of one chain
    assert len(set(hashes)) == len(page_keys(hashes)) == 200_000
    assert len(page_keys(pages(0, 200_000))) == 200_000  # the tests' stand-ins too
    assert key_of(bytes(range(8))) == int.from_bytes(bytes(range(8)), "little")
    assert int(_fold(np.frombuffer(b"".join(hashes[:64]), dtype="V16"))[5]) == key_of(hashes[5])


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32))
def test_lookup_equals_a_brute_force_over_every_worker(seed):
    """Lookups record only runs past 0; every worker's match still equals one computed from its
    own page sets, page by page, whatever the media and the sharing."""
    rng, index = random.Random(seed), KvIndex()
    # Small rounds: the lookup stops at the first page held nowhere, and rounds end anywhere.
    index.lookup_chunk_pages = rng.choice([1, 2, 3, 64])
    media = (DEVICE, HOST, REMOTE)
    for w in range(rng.randrange(1, 12)):
        events = [stored([page(i) for i in range(rng.randrange(8)) if rng.random() < 0.85], m)
                  for m in media if rng.random() < 0.6]
        if events:
            index.apply(batch(f"w{w}", 0, *events))
    hashes = [page(rng.choice([i, i, i, 50 + i])) for i in range(rng.randrange(1, 14))]
    keys = [key_of(h) for h in hashes]
    want = {}
    remote = set().union(*(index.pages(w, REMOTE) for w in index.workers()))
    for w in index.workers():
        dev, host = index.pages(w, DEVICE), index.pages(w, HOST)
        d = next((i for i, k in enumerate(keys) if k not in dev), len(keys))
        e = next((i for i in range(d, len(keys)) if keys[i] not in dev | host), len(keys))
        r = next((i for i in range(e, len(keys)) if keys[i] not in dev | host | remote),
                 len(keys))
        if r:
            want[w] = (d, e - d, r - e)
    got = {w: (m.device_pages, m.host_pages, m.remote_pages) for w, m in index.lookup(hashes).items()}
    assert got == want


_growing_ops = st.lists(st.tuples(
    st.sampled_from(["add", "add_many", "discard", "discard_many", "clear", "evict", "bulk"]),
    st.integers(0, 4), st.lists(st.integers(0, 300), max_size=40)), max_size=80)


def _check_tables(table: PageTable) -> None:
    """While an old table remains: every key in exactly one table, `live` their sum, each
    page's set of holders counted (check_holder_sets)."""
    tables = [table] if table._old is None else [table, table._old]
    keys = []
    for t in tables:
        holder = t._mem.holder
        live = np.flatnonzero(holder >= 0)
        keys += [t._key[p] for p in live.tolist()]
    assert len(keys) == len(set(keys)) == table.live
    check_holder_sets(table)
    if table._old is not None:
        assert table._old.live == int(np.count_nonzero(table._old._mem.holder >= 0))


def _apply_checked(table: PageTable, model: dict[int, set[bytes]], op: str, slot: int,
                   hashes: list[bytes]) -> None:
    """One operation on the table and on the model, the table's answer checked."""
    if op == "add":
        assert sum(table.add(h, slot) for h in hashes) == len(set(hashes) - model[slot])
        model[slot].update(hashes)
    elif op == "add_many" and hashes:
        assert table.add_many(hashes, slot) == len(set(hashes) - model[slot])
        model[slot].update(hashes)
    elif op == "discard":
        assert sum(table.discard(h, slot) for h in hashes) == len(set(hashes) & model[slot])
        model[slot].difference_update(hashes)
    elif op == "discard_many" and hashes:
        assert table.discard_many(hashes, slot) == len(set(hashes) & model[slot])
        model[slot].difference_update(hashes)
    elif op == "clear":
        assert table.clear_slot(slot) == len(model[slot])
        model[slot].clear()
    elif op == "evict":
        before = {s: set(h) for s, h in model.items()}
        lost = table.evict(len(hashes))
        assert sum(lost.values()) <= sum(len(h) for h in before.values())
        for s in model:
            kept = table.keys_held(s)
            model[s] = {h for h in before[s] if key_of(h) in kept}
            assert model[s] <= before[s]
            assert lost.get(s, 0) == len(before[s] - model[s])
    elif op == "bulk":  # several workers' stores and removals (gateway/core/index_bulk.py)
        slots = [(slot + i) % 5 for i in range(len(hashes))]
        stores = [i % 3 != 2 for i in range(len(hashes))]
        want = {s: set(held) for s, held in model.items()}
        for h, s, store in zip(hashes, slots, stores):
            (want[s].add if store else want[s].discard)(h)
        delta = apply_ops(table, hashes, slots, stores)
        for s in model:
            assert delta.get(s, 0) == len(want[s]) - len(model[s])
        model.update(want)


@settings(max_examples=80, deadline=None)
@given(_growing_ops, st.integers(1, 6))
def test_a_table_growing_incrementally_answers_as_a_dict_of_masks(ops, step):
    """Issue 31's incremental growth: a tiny table and a migration of a few slots a call, so most
    operations meet two tables (pages in either, their sets of holders shared)."""
    table = PageTable(capacity=8, migrate_step=step)
    model: dict[int, set[bytes]] = {s: set() for s in range(5)}
    for op, slot, ids in ops:
        hashes = [page(i) for i in ids]
        _apply_checked(table, model, op, slot, hashes)
        _check_tables(table)
        _check(table, model)
        probe = [page(i) for i in range(0, 300, 11)]
        assert table.masks(probe) == [table.mask(h) for h in probe]


def test_growth_meets_two_tables_often_and_still_matches_the_model():
    """The same check, seeded and long: growth happens many times with an old table alive."""
    rng = random.Random(31)
    table = PageTable(capacity=8, migrate_step=2)
    model: dict[int, set[bytes]] = {s: set() for s in range(5)}
    both = grows = 0
    for _ in range(1500):
        op = rng.choice(["add", "add_many", "add_many", "bulk", "discard", "discard_many",
                         "evict", "clear"] if rng.random() < 0.05 else ["add_many", "bulk", "add",
                                                                         "discard_many"])
        cap = table.cap
        hashes = [page(rng.randrange(4000)) for _ in range(rng.randrange(1, 40))]
        _apply_checked(table, model, op, rng.randrange(5), hashes)
        grows += table.cap != cap
        both += table._old is not None
        _check_tables(table)
    _check(table, model)
    assert grows >= 5 and both >= 50, (grows, both)


def test_no_call_migrates_more_than_its_bound():
    """Each mutating call migrates at most `migrate_step + rate * pages` old slots, and the old
    table is always gone before the new one fills (no whole-table finish inside a call)."""
    rng = random.Random(7)
    table = PageTable(capacity=64, migrate_step=64)
    migrating = 0

    def bounded(call, pages: int) -> None:
        before, rate = table.migrated_slots, table.rate
        call()
        assert table.migrated_slots - before <= 64 + rate * pages

    for i in range(6000):
        hashes = [(i << 20 | j).to_bytes(16, "little") for j in range(rng.randrange(1, 60))]
        bounded(lambda: table.add_many(hashes, i % 5), len(hashes))
        if i % 10 == 9:
            bounded(lambda: table.discard_many(hashes[:5], i % 5), 5)
            bounded(lambda: table.evict(3), 0)
            bounded(lambda: table.add(hashes[0], 4), 1)
        migrating += table._old is not None
        if i % 500 == 0:
            _check_tables(table)
    assert table.cap > 100_000 / 0.7 and migrating > 1000, (table.cap, migrating)


def _grow_until_an_old_table(table: PageTable, min_old_slots: int) -> int:
    """Live-sized batches of several workers (some pages shared) until a growth leaves an old
    table of at least `min_old_slots` slots; the batches' count."""
    i = 0
    while table._old is None or table._old.cap < min_old_slots:
        hashes = [(i << 20 | j).to_bytes(16, "little") for j in range(64)]
        table.add_many(hashes, i % 7)
        table.add_many(hashes[:4], (i + 1) % 7)
        i += 1
    return i


def test_migrate_some_finishes_a_growth_in_bounded_steps():
    """Ingest idle right after a growth (feeds.BatchApplier's idle steps): each call migrates at
    most its slots, the old table goes, and every page keeps its holders and its stamp."""
    table = PageTable()
    _grow_until_an_old_table(table, 20_000)
    before, left, nbytes = pages_and_stamps(table), table._old.cap - table._cursor, table.nbytes()
    calls = 0
    while True:
        scanned = table.migrated_slots
        more = table.migrate_some(1000)
        assert table.migrated_slots - scanned <= 1000
        calls += 1
        if not more:
            break
    assert table._old is None and calls >= left // 1000 > 5
    assert pages_and_stamps(table) == before
    assert table.nbytes() == table.cap * 16 < nbytes
    assert table.migrate_some(1000) is False and table.migrate_some(0) is False
