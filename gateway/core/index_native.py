"""The page table's C kernel (csrc/page_table.c): `PageTable` lookups, placements and slices of
page events run as one C loop over the table's own arrays (issue 31: each numpy call of the
reference path costs ~10-40 us whatever its size, a C step ~50-100 ns an event).

Built on first use with the system compiler into the kernel cache (service_shell/native_build.py:
the gateway's --kernel-cache, -O2 with no fused multiply-add, no OpenMP), or taken prebuilt from
the image (deploy/docker/Dockerfile.gateway builds it at image build time). `configure(mode)` (the
gateway's --index-native / PREFIXCACHE_INDEX_NATIVE): auto uses it when it builds, on refuses to
start without it, off never builds it. Without it the numpy code of index_table.py and
index_bulk.py serves: the same results (tests/gateway/test_index_native.py compares the two
and `add` / `discard` one by one), slower. The same library holds RoutedPrefixes' pages
(routed_native.py), the index's lookup in one call (held_native.py) and the affinity policy's
pick (policies/affinity_arrays.py).

`apply` is `PageTable.add` / `discard` of every event, in order. A page two or three workers
hold names their pair or triple, which the C loop makes and undoes itself; the sets of holders of
pages four or more hold are Python ints (gateway/core/holder_sets.py): the C loop records each
worker joining a triple or a set, marks the page PENDING, and Python gives it the id of its new
set before the call returns; a removal from a set stops the loop (Python clears the bit, then the
loop goes on at the next event). Its loop runs without the GIL and, given a `Preemption`, steps
aside for a routing decision: the decision's thread runs meanwhile, flags that it waits for the
router's lock, and the loop returns within `STOP_EVERY` events so that `Preemption.pause` lets it
in (design.md §6, "Where a decision's time goes").
"""
from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from gateway.core.holder_sets import HolderSets
from service_shell.native_build import NativeLibrary

if TYPE_CHECKING:
    from gateway.core.index_table import PageTable

CSRC = Path(__file__).with_name("csrc")
_P, _N = ctypes.c_void_p, ctypes.c_int64
_S, _K, _W = ctypes.c_int32, ctypes.c_char_p, ctypes.c_uint64  # a slot, packed keys, a word
SIGNATURES = {  # C function -> (restype, argtypes)
    "pt_find": (None, [_P, _P, _N, _P, _N, _P]),
    "pt_find_touch": (None, [_P, _P, _P, _N, _P, _P, _N, _P]),
    "pt_place": (_N, [_P, _P, _N, _P, _P, _N, _P]),
    "pt_apply": (_N, [_P, _P, _P, _N, _P, _P, _P, _P, _N, _N, _P, _P, _P, _P, _N, _P]),
    "pt_migrate": (_N, [_P, _P, _P, _N, _N, _P, _P, _P, _N, _P]),
    "pt_sweep": (_N, [_P, _P, _P, _N, _N, _N, _P, _P]),
    "pt_held": (_N, [_P, _K, _N, _N, _P, _P, _P, _N, _P, _P]),  # held_native.py
    # RoutedPrefixes' pages (csrc/routed_table.c, gateway/core/routed_native.py)
    "rp_new": (_P, [_N]),
    "rp_free": (None, [_P]),
    "rp_record": (ctypes.c_int, [_P, _S, _K, _N]),
    "rp_extend": (_N, [_P, _S, _K, _N, _N]),
    "rp_extend_many": (None, [_P, _P, _P, _N, _K, _N, _P]),
    "rp_holders": (_N, [_P, _W, _W, _P, _N]),
    "rp_match": (_N, [_P, _K, _N, _P, _P]),
    "rp_slots": (_N, [_P, _S]),
    "rp_size": (_N, [_P, _S]),
    "rp_remove": (None, [_P, _S]),
    "rp_pages": (_N, [_P]),
    "rp_bytes": (_N, [_P]),
    # the affinity policy's pick (csrc/affinity_pick.c, gateway/core/policies/affinity_arrays.py)
    "af_pick": (None, [_N, _N, _N, _P, _P, _N, _P, _N, _N, _P]),
}


def table_library(defines: tuple[str, ...] = ()) -> NativeLibrary:
    """The kernel's library; `defines` (-D flags) build a variant of it (the table bench's
    baseline without prefetch, -DPREFETCH_AHEAD=0)."""
    return NativeLibrary(
        "gateway's C tables (page table, routed pages) and affinity pick",
        ("--index-native", "PREFIXCACHE_INDEX_NATIVE"), "numpy and Python dicts",
        lambda: {"name": "prefixcache_page_table", "sources": sorted(CSRC.glob("*.c")),
                 # no fused multiply-add: the affinity pick's floats are numpy's to the last bit
                 "flags": ("-O2", "-ffp-contract=off", "-shared", "-fPIC", *defines)},
        # Calls of µs, under the router's lock: releasing the GIL for each would let another
        # thread take it, and the ingest thread wait up to a switch interval to get it back.
        # `pt_apply`, a whole slice of events, releases it (`_without_gil`): a decision then
        # runs and flags itself.
        SIGNATURES, loader=ctypes.PyDLL)


TABLE = table_library()


class Preemption(Protocol):
    """Who may interrupt a slice of page events (gateway/core/decisions_first.py)."""

    # int64[1], read by the C loop without the GIL: nonzero while a routing decision waits.
    flag: np.ndarray
    # Seconds spent in the interruptible C loop and in `pause`, added up by `apply`.
    preemptible_s: float

    def pause(self) -> None:
        """Between two events: lets the waiting decisions take the router's lock, and takes it
        back."""


_NEVER = np.zeros(1, dtype=np.int64)  # the flag of a slice nobody interrupts
# Page events the C loop applies before it looks at the flag: in a call, and in the call after a
# pause (~0.1-0.2 ms: with decisions back to back, ingest still applies that much a pause).
STOP_EVERY, AFTER_PAUSE = 64, 1024
_released: dict[tuple[str, ctypes.CDLL], Callable[..., int]] = {}


def configure(mode: str = "auto", kernel_cache: str | Path | None = None) -> None:
    """The gateway's settings (--index-native, --kernel-cache), before the first table call."""
    TABLE.configure(mode, kernel_cache)


def kernel() -> ctypes.CDLL | None:
    """The loaded library, or None (off, or it cannot be built: the numpy table serves)."""
    return TABLE.library()


def implementation() -> str:
    """What serves the page tables: "c" or "numpy" (the log line and metric at start)."""
    return "c" if kernel() is not None else "numpy"


def _without_gil(name: str) -> Callable[..., int]:
    """The kernel's function `name` called through a prototype that releases the GIL."""
    key = (name, kernel())
    fn = _released.get(key)
    if fn is None:
        restype, argtypes = SIGNATURES[name]
        fn = _released[key] = ctypes.CFUNCTYPE(restype, *argtypes)(key)
    return fn


def _arrays(table: PageTable) -> tuple[int, int]:
    """The addresses of the table's keys and holders (the calls that read no stamp)."""
    return table._mem.addresses[:2]


def find(table: PageTable, key: np.ndarray, stamps: np.ndarray | None = None) -> np.ndarray:
    """Positions of the keys (uint64) in this table alone, -1 where absent; with `stamps`
    (uint32, one a key), each key found stamped its own (`PageTable._find_many`)."""
    key = np.ascontiguousarray(key, np.uint64)
    out = np.empty(len(key), dtype=np.int64)
    if stamps is None:
        kernel().pt_find(*_arrays(table), table.cap, key.ctypes.data, len(key), out.ctypes.data)
        return out
    stamps = np.ascontiguousarray(stamps, np.uint32)
    kernel().pt_find_touch(*table._mem.addresses, table.cap, key.ctypes.data,
                           stamps.ctypes.data, len(key), out.ctypes.data)
    return out


def place(table: PageTable, key: np.ndarray, holders: np.ndarray) -> np.ndarray:
    """Keys known to be absent written (keys and holders) at the first free position of each
    one's path, in order; their positions."""
    key = np.ascontiguousarray(key, np.uint64)
    holders = np.ascontiguousarray(holders, np.int32)
    out = np.empty(len(key), dtype=np.int64)
    table._used += kernel().pt_place(*_arrays(table), table.cap, key.ctypes.data,
                                     holders.ctypes.data, len(key), out.ctypes.data)
    return out


def migrate(table: PageTable, start: int, end: int) -> None:
    """The live slots [start, end) of the table's old table moved into it (`PageTable._step`)."""
    old, fresh = table._old, _N()
    moved = kernel().pt_migrate(*old._mem.addresses, start, end, *table._mem.addresses, table.cap,
                                ctypes.byref(fresh))
    table._used += fresh.value
    old.live -= moved


def apply(table: PageTable, key: np.ndarray, slot: np.ndarray, store: np.ndarray,
          preempt: Preemption | None = None) -> dict[int, int]:
    """Event i (store[i]: `add`, else `discard` of key i by worker slot[i]) in order; the change
    of each worker slot's page count. With `preempt`, a routing decision may read the table
    between two events (never change it: the router's mutations wait for the whole slice)."""
    n = len(key)
    if not n:
        return {}
    key = np.ascontiguousarray(key, np.uint64)
    slot = np.ascontiguousarray(slot, np.int32)
    if slot.min() < 0:  # the C loop indexes its per-slot counts with them
        raise ValueError(f"worker slot {int(slot.min())}")
    store = np.ascontiguousarray(store, np.bool_).view(np.uint8)
    stored = np.flatnonzero(store)
    table._stamps_for(len(stored))
    # Every key of the slice in the new table (or in neither), and room for every placement: a
    # growth makes the current table the old one, and the keys are pulled out of it again.
    table._touch_many(key)
    if len(stored) and not table._has_room(len(stored)) \
            and table._make_room(_new_keys(table, key[stored])):
        table._pull_many(key)
    delta = np.zeros(int(slot.max()) + 1, dtype=np.int64)
    rec, nrec, stopped = np.empty(3 * n, dtype=np.int64), ctypes.c_int64(), ctypes.c_int64()
    shared: dict[int, int] = {}  # the deltas Python counts (masks of shared pages)
    fn, i = _without_gil("pt_apply"), 0
    stop, before_stop = (_NEVER if preempt is None else preempt.flag).ctypes.data, STOP_EVERY
    while i < n:
        state = np.array([table._used, table.live, table._clock, 0, 0], dtype=np.int64)
        start = time.perf_counter()
        i = fn(*table._mem.addresses, table.cap, state.ctypes.data,
               key.ctypes.data, slot.ctypes.data, store.ctypes.data, i, n,
               delta.ctypes.data, rec.ctypes.data, ctypes.byref(nrec), stop, before_stop,
               ctypes.byref(stopped))
        if preempt is not None:
            preempt.preemptible_s += time.perf_counter() - start
        table._used, table.live, table._clock, pairs, triples = state.tolist()
        table.holder_sets.pairs += pairs
        table.holder_sets.triples += triples
        _share(table, rec[:3 * nrec.value], shared)
        before_stop = STOP_EVERY
        if stopped.value:  # the table is whole between two events: a decision may read it
            start = time.perf_counter()
            preempt.pause()
            preempt.preemptible_s += time.perf_counter() - start
            before_stop = AFTER_PAUSE
        elif i < n:  # a removal from a page several workers hold
            s = int(slot[i])
            pos = int(find(table, key[i:i + 1])[0])
            if table._leave(pos, s):
                shared[s] = shared.get(s, 0) - 1
            i += 1
    changed = np.flatnonzero(delta)
    out = dict(zip(changed.tolist(), delta[changed].tolist()))
    for s, d in shared.items():
        if out.get(s, 0) + d:
            out[s] = out.get(s, 0) + d
        else:
            out.pop(s, None)
    return out


def _share(table: PageTable, rec: np.ndarray, counts: dict[int, int]) -> None:
    """The records of one `pt_apply` call, in order: (position, its holder before, a slot
    joining it). Each page joined gets the set of its holders once all of them are in, each slot
    that newly holds a page counted. Pages joined once in the call, with the same holder before
    and the same slot joining (a snapshot's batch: one worker joining many pages of one set),
    make their new set once, and their holders are written in numpy."""
    if not len(rec):
        return
    pos, hv, slot = rec[0::3], rec[1::3], rec[2::3]
    _, at, times = np.unique(pos, return_inverse=True, return_counts=True)
    again = times[at] > 1  # joined twice or more in the call (its later records: hv PENDING)
    sets = table.holder_sets
    once = ~again
    kinds, kind = np.unique(hv[once] << 31 | slot[once], return_inverse=True)
    made = np.empty(len(kinds), dtype=np.int32)
    for k, (n, key) in enumerate(zip(np.bincount(kind).tolist(), kinds.tolist())):
        made[k] = _joined(sets, key >> 31, [key & 0x7FFFFFFF], n, counts)
    table._mem.holder[pos[once]] = made[kind]
    if again.any():
        steps: dict[int, list[int]] = {}  # position -> [its holder before, the slots joining]
        for p, h, s in zip(pos[again].tolist(), hv[again].tolist(), slot[again].tolist()):
            steps.setdefault(p, [h]).append(s)
        for p, (h, *joining) in steps.items():
            table._holder[p] = _joined(sets, h, joining, 1, counts)


def _joined(sets: HolderSets, hv: int, joining: list[int], pages: int,
            counts: dict[int, int]) -> int:
    """The holder of `pages` pages held by `hv` that these slots joined, in order; each slot new
    to them counted once a page."""
    before = sets.mask(hv)
    m = before
    for s in joining:
        if not m >> s & 1:
            m |= 1 << s
            counts[s] = counts.get(s, 0) + pages
    if m == before:  # stored again by holders: the same set
        return hv
    new = sets.hold(m, pages)
    sets.release(hv, pages)
    return new


def _new_keys(table: PageTable, key: np.ndarray) -> int:
    """How many of the stored keys are in neither table (an upper bound of the placements: a
    key stored twice counts twice), for `_make_room`."""
    absent = find(table, key) < 0
    if table._old is not None and absent.any():
        return int(np.count_nonzero(find(table._old, key[absent]) < 0))
    return int(np.count_nonzero(absent))
