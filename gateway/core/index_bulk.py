"""Stores and removals of many workers applied to one `PageTable` in one numpy run (issue 31).

A live batch is tens of pages; applied one batch at a time, each paid numpy's fixed cost per call
(~10-40 us) several times, which is what made the flat table slower than dicts for small fleets.
`apply_ops` takes every page event of an ingest slice (all its batches, all workers) for one
medium and applies them with a handful of array operations, the final state equal to applying
them one by one in order:
- the holders: a (page, worker) pair ends held when its last event is a store, not held when it
  is a removal, whatever came before, so only each pair's last event is applied; removals first
  (they only clear bits or kill positions), then stores (found ones join, absent ones are placed);
- the stamps (eviction order): a live page's stamp is that of the last store to it by any worker,
  numbered as `PageTable.add` would number them one by one;
- the counts: per worker, pages it gained minus pages it lost, as the sum of `add` / `discard`.
With the page table's C kernel loaded (gateway/core/index_native.py) the slice goes to its loop
instead, event by event in order; this numpy run is the reference and the fallback.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gateway.core import index_native
from gateway.core.holder_sets import PAIR
from gateway.core.index_table import TOMB, Hashes, PageTable, _fold, _keys

# Fewer events than this go one by one (`add` / `discard`): cheaper than the numpy calls.
SCALAR_OPS = 24


def apply_ops(table: PageTable, hashes: Hashes, slots: Sequence[int] | np.ndarray,
              stores: Sequence[bool] | np.ndarray,
              preempt: index_native.Preemption | None = None) -> dict[int, int]:
    """Applies event i (store or removal of hashes[i] by worker slots[i]) in order; returns the
    change of each worker slot's page count. `hashes` may come packed (`index_table.Hashes`: the
    stream's packed encoding goes from the message to these arrays without a bytes object a
    page). `preempt`: routing decisions may read the table between two events (the C kernel's
    loop only; the numpy run is one piece)."""
    keys = _keys(hashes)
    n = len(keys)
    if index_native.kernel() is not None:
        return index_native.apply(table, _fold(keys), np.asarray(slots, dtype=np.int32),
                                  np.asarray(stores, dtype=bool), preempt)
    delta: dict[int, int] = {}
    if n < SCALAR_OPS:
        for h, s, store in zip(keys.tolist(), _ints(slots), _ints(stores)):
            changed = table.add(h, s) if store else table.discard(h, s)
            if changed:
                delta[s] = delta.get(s, 0) + (1 if store else -1)
        return delta
    slot = np.asarray(slots, dtype=np.int64)
    store = np.asarray(stores, dtype=bool)
    if slot.min() == slot.max() and store.min() == store.max():
        # One worker's stores (a snapshot slice) or removals only: the table's own bulk calls.
        s = int(slot[0])
        change = table.add_many(keys, s) if store[0] else -table.discard_many(keys, s)
        return {s: change} if change else {}
    key = _fold(keys)
    table._touch_many(key)  # while the table grows: every position below is the new table's
    # The last event of each (page, worker) pair: sort by pair, the latest first within it.
    idx = np.arange(n)
    order = np.lexsort((-idx, slot, key))
    first = np.ones(n, dtype=bool)
    same = (key[order][1:] == key[order][:-1]) & (slot[order][1:] == slot[order][:-1])
    first[1:] = ~same
    last = order[first]
    rem = last[~store[last]]
    if len(rem):
        _remove(table, key[rem], slot[rem], delta)
    add = np.sort(last[store[last]])
    if len(add):
        _store(table, key[add], slot[add], delta)
    _stamp(table, key, store)
    return delta


def _ints(values: Sequence[int] | np.ndarray) -> list:
    return values.tolist() if isinstance(values, np.ndarray) else list(values)


def _count(delta: dict[int, int], slots: np.ndarray, sign: int) -> None:
    if len(slots):
        for s, c in zip(*np.unique(slots, return_counts=True)):
            delta[int(s)] = delta.get(int(s), 0) + sign * int(c)


def _remove(table: PageTable, key: np.ndarray, slot: np.ndarray, delta: dict[int, int]) -> None:
    pos = table._find_many(key)
    found = pos >= 0
    pos, slot = pos[found], slot[found]
    holder = table._mem.holder
    hv = holder[pos]
    mine = hv == slot
    # Two workers' removals of one page held by one of them: at most one is its holder.
    holder[pos[mine]] = TOMB
    table.live -= int(np.count_nonzero(mine))
    _count(delta, slot[mine], -1)
    scalar = table._holder
    # Pages several hold, one by one: an earlier removal here may leave a single holder.
    shared = hv >= PAIR
    for p, s in zip(pos[shared].tolist(), slot[shared].tolist()):
        if scalar[p] == s:
            table._kill(p)
        elif not (scalar[p] >= PAIR and table._leave(p, s)):
            continue
        delta[s] = delta.get(s, 0) - 1


def _store(table: PageTable, key: np.ndarray, slot: np.ndarray, delta: dict[int, int]) -> None:
    pos = table._find_many(key)
    found = pos >= 0
    holder = table._mem.holder
    # Found and held by another worker (or several): the masks, one by one.
    others = found.copy()
    others[found] = holder[pos[found]] != slot[found]
    for p, s in zip(pos[others].tolist(), slot[others].tolist()):
        if table._join(p, s):
            delta[s] = delta.get(s, 0) + 1
    absent = np.flatnonzero(~found)
    if not len(absent):
        return
    # An absent page several workers store: the first places it, the others join it after.
    _, head = np.unique(key[absent], return_index=True)
    head = np.sort(head)
    placed = absent[head]
    k = len(placed)
    table._make_room(k)
    at = table._place(key[placed], slot[placed].astype(np.int32))
    table._mem.key[at] = key[placed]
    table.live += k
    _count(delta, slot[placed], +1)
    if k < len(absent):
        rest = np.ones(len(absent), dtype=bool)
        rest[head] = False
        more = absent[rest]
        for p, s in zip(table._find_many(key[more]).tolist(), slot[more].tolist()):
            if table._join(p, s):
                delta[s] = delta.get(s, 0) + 1


def _stamp(table: PageTable, key: np.ndarray, store: np.ndarray) -> None:
    """Every page stored in the run gets the stamp of its last store, numbered from the table's
    clock in the order of the stores (as `add` one by one)."""
    stored = np.flatnonzero(store)
    k = len(stored)
    if not k:
        return
    table._stamps_for(k)
    number = table._clock + 1 + np.arange(k)
    table._clock += k
    _, last_rev = np.unique(key[stored][::-1], return_index=True)
    last = k - 1 - last_rev
    table._pull_many(key[stored[last]])  # `_store` may have started a growth
    pos = table._find_many(key[stored[last]])
    live = pos >= 0
    table._mem.stamp[pos[live]] = number[last[live]].astype(np.uint32)
