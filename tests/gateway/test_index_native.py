"""The page table's C kernel (gateway/core/index_native.py) against the numpy table and against
`add` / `discard` one by one: random slices of stores and removals by many workers (more than
64: masks past one machine word), duplicates, pages several workers hold, growth inside a slice
with an old table alive, tombstones reused, the stamp clock passing its limit. Every table must
end with the same holders of every page, the same eviction order, the same live count, and each
slice must return the same per-worker changes."""
from __future__ import annotations

import random

import numpy as np
import pytest

from gateway.core import index_native
from gateway.core.index_bulk import apply_ops
from gateway.core.holder_sets import SHARED
from gateway.core.index_table import _STORE_LIMIT, TOMB, PageTable, key_of
from tests.gateway.index_impls import use

WORKERS = 70


@pytest.fixture(autouse=True)
def restore_mode():
    before = index_native.TABLE.mode, index_native.TABLE.cache_dir
    yield
    index_native.configure(*before)


def _page(i: int) -> bytes:
    return (i * 0x9E3779B97F4A7C15 % 2**64).to_bytes(8, "little") + i.to_bytes(8, "little")


def _slices(seed: int, pages: int, slices: int) -> list[tuple[list[bytes], list[int], list[bool]]]:
    """Slices of events: stores mostly, removals of pages stored before, a few hot pages many
    workers share, repeats inside a slice; one slice in five a single worker's (the tables'
    add_many / discard_many)."""
    rng = random.Random(seed)
    out = []
    for _ in range(slices):
        n = rng.choice([1, 5, 30, 200, 600])
        single = rng.random() < 0.2
        w, store = rng.randrange(WORKERS), rng.random() < 0.7
        hashes, slots, stores = [], [], []
        for _ in range(n):
            hot = rng.random() < 0.3
            hashes.append(_page(rng.randrange(20) if hot else rng.randrange(pages)))
            slots.append(w if single else rng.randrange(WORKERS))
            stores.append(store if single else rng.random() < 0.65)
        out.append((hashes, slots, stores))
    return out


def _by_one(table: PageTable, hashes, slots, stores) -> dict[int, int]:
    delta: dict[int, int] = {}
    for h, s, store in zip(hashes, slots, stores):
        if table.add(h, s) if store else table.discard(h, s):
            delta[s] = delta.get(s, 0) + (1 if store else -1)
    return delta


def _stamp(table: PageTable, h: bytes) -> int:
    for t in table._tables():
        pos = t._probe(key_of(h))[0]
        if pos >= 0:
            return t._stamp[pos]
    raise AssertionError("a live page without a stamp")


def _state(table: PageTable, pages: int) -> tuple:
    """Every page's holders, the live pages in eviction (stamp) order, the live count."""
    hashes = [_page(i) for i in range(pages)]
    masks = [table.mask(h) for h in hashes]
    live = [h for h, m in zip(hashes, masks) if m]
    return masks, sorted(live, key=lambda h: _stamp(table, h)), len(table)


def _run(impl: str, how: str, seed: int, pages: int, clock: int = 0) -> tuple[list, tuple]:
    use(impl)
    table = PageTable(capacity=64, migrate_step=4)  # small steps: old tables live across slices
    table._clock = clock
    deltas = []
    for hashes, slots, stores in _slices(seed, pages, 40):
        if how == "bulk":
            delta = apply_ops(table, hashes, slots, stores)
        else:
            delta = _by_one(table, hashes, slots, stores)
        deltas.append({s: d for s, d in delta.items() if d})
    return deltas, _state(table, pages)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_c_numpy_and_one_by_one_end_alike(seed):
    pages = 3000
    reference = _run("numpy", "one", seed, pages)
    assert _run("c", "bulk", seed, pages) == reference
    assert _run("numpy", "bulk", seed, pages) == reference
    assert _run("c", "one", seed, pages) == reference


class _AlwaysWaiting:
    """A decision always waiting: the C loop stops as often as it may; each pause checks that
    the table is whole (every page it holds findable, the live count right) before going on."""

    def __init__(self, table: PageTable) -> None:
        self.flag = np.ones(1, dtype=np.int64)
        self.table, self.pauses, self.preemptible_s = table, 0, 0.0

    def pause(self) -> None:
        self.pauses += 1
        live = [t for t in self.table._tables() if t.live]
        assert sum(int(np.count_nonzero(t._mem.holder >= 0)) for t in live) == len(self.table)


@pytest.mark.parametrize("seed", [1, 2])
def test_a_slice_stopped_for_decisions_ends_as_one_run(seed):
    """A slice that steps aside for routing decisions between its page events ends exactly as
    one applied whole (same holders, eviction order, live count, per-worker changes); the C loop
    stops after STOP_EVERY events, then after AFTER_PAUSE events past each pause."""
    pages = 3000
    reference = _run("numpy", "one", seed, pages)
    use("c")
    table = PageTable(capacity=64, migrate_step=4)
    preempt, deltas, events = _AlwaysWaiting(table), [], 0
    for hashes, slots, stores in _slices(seed, pages, 40):
        delta = apply_ops(table, hashes, slots, stores, preempt)
        deltas.append({s: d for s, d in delta.items() if d})
        events += len(hashes) if len(hashes) > index_native.STOP_EVERY else 0
    assert (deltas, _state(table, pages)) == reference
    assert preempt.pauses >= events // (index_native.AFTER_PAUSE + index_native.STOP_EVERY)
    assert preempt.pauses > 0 and preempt.preemptible_s > 0


def test_an_unflagged_slice_is_never_stopped():
    use("c")
    table = PageTable(capacity=64)
    preempt = _AlwaysWaiting(table)
    preempt.flag[0] = 0
    apply_ops(table, [_page(i) for i in range(5000)], [i % WORKERS for i in range(5000)],
              [True] * 5000, preempt)
    assert preempt.pauses == 0 and len(table) == 5000


def test_the_stamp_clock_passing_its_limit_keeps_the_eviction_order():
    start = _STORE_LIMIT - 3000  # passed within the run's first slices
    reference = _run("numpy", "one", 5, 800, clock=start)
    for impl in ("c", "numpy"):
        assert _run(impl, "bulk", 5, 800, clock=start) == reference


def test_growth_inside_a_slice_with_an_old_table_alive():
    use("c")
    table = PageTable(capacity=64, migrate_step=1)
    one = PageTable(capacity=64, migrate_step=1)
    grew = old_alive = 0
    for i in range(60):
        hashes = [_page(i * 97 + j) for j in range(40)] + [_page(j) for j in range(0, i, 3)]
        slots = [(i + j) % WORKERS for j in range(len(hashes))]
        stores = [j % 7 != 3 for j in range(len(hashes))]
        cap = table.cap
        use("c")
        got = apply_ops(table, hashes, slots, stores)
        grew += table.cap != cap
        old_alive += table._old is not None
        use("numpy")
        assert {s: d for s, d in got.items() if d} == _by_one(one, hashes, slots, stores)
    use("c")
    assert grew >= 3 and old_alive > 10, (grew, old_alive)
    assert _state(table, 60 * 97 + 40) == _state(one, 60 * 97 + 40)


@pytest.mark.parametrize("impl", ["c", "numpy"])
def test_a_tombstone_on_the_path_is_reused(impl):
    use(impl)
    table = PageTable(capacity=1024)
    h = _page(1)
    # Stored, removed (a tombstone at its home), stored again: the tombstone is taken back.
    assert apply_ops(table, [h] * 3 + [_page(2)] * 30, [0, 0, 0] + [1] * 30,
                     [True, False, True] + [True] * 30) == {0: 1, 1: 1}
    assert table._used == 2 and len(table) == 2
    apply_ops(table, [h] * 30, [0] * 30, [False] * 30)
    assert table._used == 2 and len(table) == 1
    holder = np.frombuffer(table._holder, dtype=np.int32)
    assert np.count_nonzero(holder == TOMB) == 1
    table.add_many([_page(3), h], 2)
    assert len(table) == 3 and table._used <= 3 and np.count_nonzero(holder == TOMB) == 0


def test_masks_past_64_workers_and_the_leaving_of_shared_pages():
    use("c")
    table = PageTable()
    h = _page(7)
    slots = list(range(WORKERS))
    assert apply_ops(table, [h] * WORKERS, slots, [True] * WORKERS) == {s: 1 for s in slots}
    assert table.mask(h) == (1 << WORKERS) - 1 and table._mem.holder.max() == SHARED
    # Removals from a shared page stop the C loop each time; the stores between them go on.
    gone = apply_ops(table, [h] * 60 + [_page(8)] * 2, list(range(60)) + [69, 69],
                     [False] * 60 + [True, False])
    assert gone == {**{s: -1 for s in range(60)}}
    assert table.mask(h) == sum(1 << s for s in range(60, WORKERS)) and len(table) == 1
    assert apply_ops(table, [h] * 9, list(range(60, 69)), [False] * 9) == {s: -1 for s in range(60, 69)}
    assert table.mask(h) == 1 << 69 and table._mem.holder.max() == 69
    assert table.shared_pages() == 0 and len(table.holder_sets) == 0
    with pytest.raises(ValueError, match="worker slot -1"):  # never an index out of the counts
        apply_ops(table, [h] * 2, [3, -1], [True, True])


def test_the_gateway_starts_without_a_compiler_in_auto_and_refuses_in_on(tmp_path, monkeypatch,
                                                                         caplog):
    monkeypatch.setattr(index_native.TABLE, "_state", {})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    index_native.configure("auto", tmp_path / "empty")
    assert index_native.implementation() == "numpy" and "no C compiler" in caplog.text
    assert apply_ops(PageTable(), [_page(1)] * 30, [3] * 30, [True] * 30) == {3: 1}
    index_native.configure("on", tmp_path / "empty")
    with pytest.raises(RuntimeError, match=r"--index-native on \(PREFIXCACHE_INDEX_NATIVE\)"):
        index_native.kernel()
    # Built once (at image build time), the library serves where no compiler is.
    monkeypatch.delenv("CC")
    index_native.configure("on", tmp_path / "built")
    built = index_native.TABLE.path()
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    index_native.configure("auto", tmp_path / "built")
    assert index_native.TABLE.path() == built and index_native.implementation() == "c"
