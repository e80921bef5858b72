"""Bulk apply (KvIndex.bulk, gateway/core/index_bulk.py) against one-by-one apply: the same
results, holders, page counts and eviction order for random streams of several workers, with
pages stored and removed inside one run, clears, snapshots, gaps and duplicates."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.index import KvIndex
from gateway.core.index_table import PageTable
from tests.gateway.helpers import DEVICE, HOST, batch, cleared, page, removed, stored
from tests.gateway.index_impls import table_impl  # noqa: F401  (each test with C, then numpy)

_POOLS = ["a", "b", "c", "d"]
_event = st.one_of(
    st.tuples(st.sampled_from(["stored", "removed"]), st.sampled_from([DEVICE, HOST]),
              st.lists(st.integers(0, 60), min_size=1, max_size=30)),
    st.just(("cleared", DEVICE, [])))
# (pool, seq step: 1 in order, 0 a duplicate, 2 a gap; snapshot start; events)
_batch = st.tuples(st.sampled_from(_POOLS), st.sampled_from([1, 1, 1, 1, 0, 2]), st.booleans(),
                   st.lists(_event, max_size=4))


def _stream(spec):
    seq = {p: -1 for p in _POOLS}
    out = []
    for pool, step, snapshot, events in spec:
        evs = [stored([page(i) for i in ids], medium) if kind == "stored" else
               removed([page(i) for i in ids], medium) if kind == "removed" else cleared()
               for kind, medium, ids in events]
        if snapshot:
            out.append(batch(pool, 0, cleared(), *evs, snapshot=True, snapshot_end=True))
            seq[pool] = 0
            continue
        seq[pool] += step
        out.append(batch(pool, max(seq[pool], 0), *evs))
    return out


def _stamps(table: PageTable) -> dict[int, int]:
    """Every live page's stamp, an old table's too: a slice makes room for all its stores, so
    bulk apply may grow a table that one-by-one apply does not, and be mid-migration at the end."""
    out = {}
    for t in table._tables():
        holder = np.frombuffer(t._holder, dtype=np.int32)
        for p in np.flatnonzero(holder >= 0).tolist():
            out[t._key[p]] = t._stamp[p]
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(_batch, max_size=40), st.integers(1, 12))
def test_bulk_apply_ends_as_one_by_one(spec, chunk):
    one, bulk = KvIndex(clock=lambda: 0.0), KvIndex(clock=lambda: 0.0)
    stream = _stream(spec)
    expected = [one.apply(b) for b in stream]
    got = []
    for i in range(0, len(stream), chunk):
        with bulk.bulk():
            got += [bulk.apply(b) for b in stream[i:i + chunk]]
    assert got == expected
    assert len(bulk) == len(one)
    for pool in one.workers():
        assert bulk.info(pool) == one.info(pool)
        for medium in (DEVICE, HOST):
            assert bulk.pages(pool, medium) == one.pages(pool, medium)
    for t_one, t_bulk in zip(one._tables, bulk._tables):
        assert _stamps(t_bulk) == _stamps(t_one)
        for i in range(61):
            assert t_bulk.mask(page(i)) == t_one.mask(page(i))


def test_a_large_run_takes_the_numpy_path_and_matches():
    """Hundreds of events per run (above index_bulk.SCALAR_OPS), pages shared by workers."""
    rng = np.random.default_rng(7)
    one, bulk = KvIndex(clock=lambda: 0.0), KvIndex(clock=lambda: 0.0)
    stream = []
    for seq in range(30):
        for pool in _POOLS:
            ids = rng.integers(0, 400, 64).tolist()
            kind = stored if rng.random() < 0.7 else removed
            stream.append(batch(pool, seq, kind([page(i) for i in ids], DEVICE)))
    for b in stream:
        one.apply(b)
    for i in range(0, len(stream), 16):
        with bulk.bulk():
            for b in stream[i:i + 16]:
                bulk.apply(b)
    for pool in _POOLS:
        assert bulk.info(pool) == one.info(pool)
        assert bulk.pages(pool, DEVICE) == one.pages(pool, DEVICE)
    assert _stamps(bulk._tables[0]) == _stamps(one._tables[0])
