"""`PageTable`: one medium of the gateway's KV index (gateway/core/index.py) in flat arrays.

Open addressing with linear probing over three parallel arrays, 16 bytes a slot: a key of 64 bits
(`key_of`: the two 64-bit words of prefixcache_client.hash's 16-byte HASH_BYTES folded into one; a
hash of another length is cut or zero-padded to 16 bytes first), the holder (a worker slot, a pair
or a triple of them, or SHARED + the id of a set of several in `holder_sets`), and a stamp (when it
was last stored, or found by a routed request's lookup: `touch_stamps`; the eviction order). Two
hashes sharing a key count as one page: with n pages indexed, a lookup of a page nobody holds
matches one with probability ~n / 2**64 (5e-13 at 10M pages) and two indexed pages share a key with
probability ~n**2 / 2**65 (3e-6 at 10M). Either only makes routing credit a worker with a page it
may not hold, or miss one it holds: a mis-scored decision, never a wrong answer (the worker's cache
service matches whole hashes and computes what it lacks). The table grows by ~1.55x when live +
deleted slots pass 70%, so 16 bytes / 0.45..0.7 = 23..36 bytes a page (from 0.36 when the growth
takes arrays written ahead a little larger than it needs), against ~160-185 for the dicts, sets and
ints it replaces (24 bytes a slot while the key was the whole 16-byte hash). Pages two or three
workers hold cost the same (the pair or triple is the holder), pages several hold too, and each
distinct set of those holders its mask once (~300 bytes at 1,000 workers, shared by every page with
those holders: gateway/core/holder_sets.py). While a growth migrates, the old arrays stay allocated
beside the new ones (~0.65x their size); so do the next growth's from when the table passes 55%
(made ready ahead by the ingest thread: gateway/core/table_arrays.py), unless the tombstones of
removed pages are what fill it: the feed loop's idle steps sweep them away in place
(gateway/core/index_sweep.py), so that a steady state neither rebuilds nor holds a spare.

Growth is incremental (issue 31): a whole-table rehash of 1M pages held the router's lock ~1 s.
When the table passes 70% it allocates the bigger one and keeps the old one beside it (`_old`, a
PageTable of its own, positions per table, the sets shared); a key lives in exactly one of them.
Lookups try the new table, then the old. Each mutating call first moves the keys it touches into
the new table, then migrates the next `migrate_step + rate * len(call)` old slots (rate chosen at
growth so that the old table empties before the new one fills); the old table goes when empty.
While ingest is idle the feed loop finishes it in bounded steps (`migrate_some`). The new
arrays, when the feed loop serves the table, were written ahead (`prepare_growth`): a growth
then costs the call that starts it no more than a migration step.

Longer than 400 lines: one data structure whose lookups, bulk calls, scans and incremental growth
all work on the same arrays of one or two tables; split apart, each part would reach into the
others' arrays.

Single keys are probed in Python over memoryviews (element reads ~45 ns); whole-table scans
(a worker's clear, eviction, rehash) run in numpy over views of the same memory. The bulk calls
(`add_many`, `discard_many`, `masks`, `index_bulk.apply_ops`) and the probe rounds under them
(`_find_many`, `_place`) run in C over the same arrays when the page table's kernel is loaded
(gateway/core/index_native.py: --index-native, auto by default); the numpy code below is the
reference and the fallback (--index-native off, or no compiler), with the same results.
"""
from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Sequence

import numpy as np

from gateway.core import index_native
from gateway.core.holder_sets import PAIR, SHARED, TRIPLE, HolderSets, pair_mask, triple_mask
from gateway.core.index_scan import bit_positions
from gateway.core.index_sweep import Sweep, sweep_some
from gateway.core.packed import pack
from gateway.core.table_arrays import EMPTY, SPARE_MIN_SLOTS, TOMB, Spare, TableArrays
from service_shell import kv

log = logging.getLogger("gateway.index")

_MIX = 0x9E3779B97F4A7C15  # Fibonacci hashing: spreads sequential or structured hashes
_MIX_HI = 0xC2B2AE3D27D4EB4F  # a hash's second word, multiplied in as it is folded into its key
_MIX_NP, _MIX_HI_NP, _SHIFT_NP = np.uint64(_MIX), np.uint64(_MIX_HI), np.uint64(29)
_M64 = (1 << 64) - 1
_MAX_LOAD = 0.7
_GROWN_LOAD = 0.45
_SPARE_LOAD = 0.55  # past it, the next growth's arrays are made ready ahead (table_arrays.py)
# Live pages under this share of the slots (16 bytes a slot: 80 bytes a page, over issue 31's 64):
# a fleet scaled down, whose pages were cleared and swept. The table shrinks to _GROWN_LOAD.
_SHRINK_LOAD = 0.2
# A table whose last growth was sized for the pages expected (a warm-up's fleet, estimated:
# expected_pages.py) shrinks from under this share once they are in: an estimate that was too
# high (pages shared more than the first workers showed) costs memory only until ingest idles.
_OVERSIZED_LOAD = 0.3
_LOOK_LOAD = 0.5  # past it, the spare's looks read how the table fills (Spare.plan's look_only)
_STAMP_LIMIT = 2**32 - 1
# A touch stamps pages up to this many stores ahead of the clock (`touch_stamps`); stores renumber
# the stamps this far below their limit, so that a touch always finds room.
_TOUCH_AHEAD_MAX = 2**28
_STORE_LIMIT = _STAMP_LIMIT - _TOUCH_AHEAD_MAX
# Keys left when a vectorised probe goes on to the scalar one: linear probing at 45-70% load has
# clusters of ~100 slots somewhere, and a numpy round costs ~10 us whatever the keys left.
_SCALAR_REST = 16
# Old slots migrated per mutating call while an old table remains, plus `rate` per page of the
# call: ~1k slots is ~0.1-0.3 ms of numpy, the stall it replaces ~1 s.
MIGRATE_STEP = 1024


_unpack = struct.Struct("<QQ").unpack


def split(h: bytes) -> tuple[int, int]:
    """A page hash's first and second 8 bytes as integers (cut or zero-padded to 16 bytes)."""
    if len(h) == 16:
        return _unpack(h)
    return int.from_bytes(h[:8], "little"), int.from_bytes(h[8:16], "little")


def key_of(h: bytes) -> int:
    """The table's key for a page hash: its first word, xor its second multiplied by an odd
    constant (`_fold` in numpy). For either word fixed it is a bijection of the other, so a
    hash of 8 bytes or fewer keeps all of them."""
    lo, hi = split(h)
    return lo ^ ((hi * _MIX_HI) & _M64)


def page_keys(hashes: Sequence[bytes]) -> frozenset[int]:
    """The keys of these page hashes: what `KvIndex.pages` holds for them."""
    return frozenset(key_of(h) for h in hashes)


# Page hashes as the bulk calls take them: a sequence of hashes, or already packed (16 bytes each,
# concatenated: the gateway's stream encoding, design.md §6) as bytes or a "V16" array.
Hashes = Sequence[bytes] | bytes | np.ndarray


def _keys(hashes: Hashes) -> np.ndarray:
    """The hashes as 16-byte keys (cut or zero-padded when not 16 bytes long)."""
    if isinstance(hashes, np.ndarray):
        return hashes
    if isinstance(hashes, bytes):
        return np.frombuffer(hashes, dtype="V16", count=len(hashes) // 16)
    return np.frombuffer(pack(hashes), dtype="V16")


def _fold(keys: np.ndarray) -> np.ndarray:
    """`key_of` of 16-byte keys, in numpy (uint64 array products wrap silently, as `& _M64`)."""
    pairs = keys.view(np.uint64).reshape(-1, 2)
    return pairs[:, 0] ^ pairs[:, 1] * _MIX_HI_NP


def _grown_slots(pages: int) -> int:
    """The slots of the table a growth (or a shrink, whose arrays it takes) moves these pages
    into: they fill `_GROWN_LOAD` of it."""
    return max(64, int(pages / _GROWN_LOAD) + 1)


def _nothing_expected() -> int:
    """A table alone expects no pages beyond its own (`PageTable.expect`)."""
    return 0


def _home(key: int, cap: int) -> int:
    """A key's first position: the key multiplied, then the product's high bits folded into its
    low ones (a bare product modulo cap left half the positions unused for the benchmark's
    structured hashes, and linear probing then walks long clusters)."""
    x = (key * _MIX) & _M64
    return (x ^ x >> 29) % cap


class PageTable:
    """Page hash -> holder mask for one medium. Not thread-safe (the router's lock)."""

    # The pages the table is about to hold (set by KvIndex for its tables: a warm-up's fleet,
    # expected_pages.py): its growths and spares are sized for them when more than it holds, and
    # it does not shrink below them. Asked at the spare's looks and the shrink's checks only.
    expect: Callable[[], int] = staticmethod(_nothing_expected)
    sized_for_expected = False  # the last growth was (`_OVERSIZED_LOAD`)

    def __init__(self, capacity: int = 64, migrate_step: int = MIGRATE_STEP) -> None:
        self._use(TableArrays.empty(capacity))
        self._used = 0  # live + tombstones
        self._spare = Spare()  # the next growth's arrays, made ready ahead
        self.sweep = Sweep()  # tombstones cleared in place (index_sweep.py)
        self.live = 0  # pages in both tables while an old one remains
        self._clock = 0
        self.holder_sets = HolderSets()  # shared pages' holders, each set once (holder_sets.py)
        self._old: PageTable | None = None  # the table being migrated from, if any
        self._cursor = 0  # old slots below it are migrated
        self.migrate_step, self.rate = migrate_step, 0
        self.migrated_slots = 0  # old slots scanned by migration, ever (tests bound it per call)
        self.shrinks = 0  # migrations into smaller arrays begun
        # With `retire` (the router's index: KvIndex.defer_frees), an old table's arrays once
        # its migration ended, until the router gives them back after its lock
        # (`give_back_retired`): their free is then ~0.03 ms, not ~1 ms under it. Without, they
        # are freed there and then, as a table used alone needs.
        self.retire = False
        self.retired: TableArrays | None = None

    def _use(self, arrays: TableArrays) -> None:
        """Takes these arrays as the table's slots, as they are written."""
        self._mem, self.cap = arrays, arrays.cap
        self._key, self._holder, self._stamp = arrays.views()

    def __len__(self) -> int:
        return self.live

    def nbytes(self, written: bool = False) -> int:
        """Bytes of the arrays, an old table's and the spare's (once allocated) included (the
        sets of holders not). `written`: the spare's only as far as written, what the process
        holds (the rest is address space until written)."""
        old = self._old._mem.nbytes() if self._old is not None else 0
        retired = self.retired.nbytes() if self.retired is not None else 0
        return self._mem.nbytes() + old + retired + self._spare.nbytes(written)

    def shared_pages(self) -> int:
        """Pages two or more workers hold, an old table's included."""
        sets = self.holder_sets
        return sets.pages + sets.pairs + sets.triples

    def growths(self) -> tuple[int, int, int]:
        """(growths that took arrays written ahead, that took them partly written and wrote the
        rest under the router's lock, that wrote fresh ones there), of tables large enough for a
        spare (table_arrays.Spare.take)."""
        return self._spare.taken, self._spare.finished, self._spare.missed

    def home(self, key: int) -> int:
        """A key's first position in this table (`_home`)."""
        return _home(key, self.cap)

    def _probe(self, key: int) -> tuple[int, int]:
        """(position of the key or -1, the first free position on its probe path)."""
        keys, holder, cap = self._key, self._holder, self.cap
        p, free = _home(key, cap), -1
        while True:
            hv = holder[p]
            if hv == EMPTY:
                return -1, (p if free < 0 else free)
            if hv == TOMB:
                if free < 0:
                    free = p
            elif keys[p] == key:
                return p, -1
            p += 1
            if p == cap:
                p = 0

    def mask(self, h: bytes) -> int:
        """Bitmask of the worker slots holding the page (0: none)."""
        pos = self._probe(key_of(h))[0]
        if pos < 0:
            return 0 if self._old is None else self._old.mask(h)
        return self.holder_sets.mask(self._holder[pos])

    def add(self, h: bytes, slot: int) -> bool:
        """Records the page on a worker as stored now; True when the worker did not hold it."""
        key = key_of(h)
        if self._old is not None:
            self._step(1)
            self._pull(key)
        pos, free = self._probe(key)
        if self._clock >= _STORE_LIMIT:
            self._renumber()
        self._clock += 1
        if pos < 0:
            if self._make_room(1):
                free = self._probe(key)[1]
            if self._holder[free] == EMPTY:
                self._used += 1
            self._key[free], self._holder[free] = key, slot
            self._stamp[free] = self._clock
            self.live += 1
            return True
        self._stamp[pos] = self._clock
        return self._join(pos, slot)

    def discard(self, h: bytes, slot: int) -> bool:
        """Drops the page from a worker; True when it held it."""
        key = key_of(h)
        if self._old is not None:
            self._step(1)
            self._pull(key)
        pos = self._probe(key)[0]
        if pos < 0:
            return False
        hv = self._holder[pos]
        if hv == slot:
            self._kill(pos)
            return True
        return hv >= PAIR and self._leave(pos, slot)

    def _leave(self, pos: int, slot: int) -> bool:
        """Drops a worker from a shared position's holders (a pair, a triple or a set); True
        when it was one."""
        sets, hv = self.holder_sets, self._holder[pos]
        m = sets.mask(hv)
        if not m >> slot & 1:
            return False
        self._holder[pos] = sets.hold(m & ~(1 << slot))
        sets.release(hv)
        return True

    def _kill(self, pos: int) -> None:
        self.holder_sets.release(self._holder[pos])
        self._holder[pos] = TOMB
        self.live -= 1

    def clear_slot(self, slot: int) -> int:
        """Drops every page of one worker; how many it held."""
        held = self._clear_here(slot)
        if self._old is not None:
            live = self._old.live
            held += self._old._clear_here(slot)
            self.live -= live - self._old.live
            self._step(0)
        return held

    def _clear_here(self, slot: int) -> int:
        """`clear_slot` in this table's arrays only."""
        holder = self._mem.holder
        mine = np.flatnonzero(holder == slot)
        holder[mine] = TOMB
        self.live -= len(mine)
        shared = self._shared_with(slot).tolist()
        for pos in shared:
            self._leave(pos, slot)
        return len(mine) + len(shared)

    def _shared_with(self, slot: int) -> np.ndarray:
        """Positions of this table's shared pages (pairs, triples and sets) that this worker
        holds."""
        holder = self._mem.holder
        pos = np.flatnonzero(holder >= PAIR)
        return pos[self.holder_sets.holding(holder[pos], slot)]

    def keys_held(self, slot: int) -> set[int]:
        """The keys of the pages one worker holds (`key_of`; for tests and debugging: a full
        scan)."""
        holder = self._mem.holder
        pos = np.flatnonzero(holder == slot).tolist() + self._shared_with(slot).tolist()
        mine = {self._key[p] for p in pos}
        return mine if self._old is None else mine | self._old.keys_held(slot)

    def evict(self, n: int) -> dict[int, int]:
        """Drops up to n pages from the 2n of oldest stamps (stored or touched least recently),
        pages one worker holds first, then the oldest shared ones. Returns how many pages each
        worker slot lost."""
        tables = self._tables()
        pos, hv, st, base = [], [], [], 0  # positions in the old table come after the new one's
        for t in tables:
            holder, stamp = t._mem.holder, t._mem.stamp
            live = np.flatnonzero(holder >= 0)
            if 2 * n < len(live):
                live = live[np.argpartition(stamp[live], 2 * n)[:2 * n]]
            pos.append(live + base)
            hv.append(holder[live])
            st.append(stamp[live])
            base += t.cap
        pos, hv, st = np.concatenate(pos), np.concatenate(hv), np.concatenate(st)
        if 2 * n < len(pos):
            keep = np.argpartition(st, 2 * n)[:2 * n]
            pos, hv, st = pos[keep], hv[keep], st[keep]
        order = np.argsort(st, kind="stable")
        pos, hv = pos[order], hv[order]
        single = hv < PAIR
        chosen = pos[single][:n]
        shared = pos[~single][:max(0, n - len(chosen))]
        lost: dict[int, int] = {}
        for slot, count in zip(*np.unique(hv[single][:n], return_counts=True)):
            lost[int(slot)] = int(count)
        base, old_live = 0, tables[-1].live
        for t in tables:
            t._drop(chosen[(chosen >= base) & (chosen < base + t.cap)] - base,
                    shared[(shared >= base) & (shared < base + t.cap)] - base, lost)
            base += t.cap
        if self._old is not None:
            self.live -= old_live - self._old.live  # the old table's share of the total
            self._step(0)
        return lost

    def _drop(self, single: np.ndarray, shared: np.ndarray, lost: dict[int, int]) -> None:
        """Kills positions of this table (`evict`'s choice), counting the shared ones' holders."""
        holder, sets = self._mem.holder, self.holder_sets
        for hv, pages in zip(*np.unique(holder[shared], return_counts=True)):
            m, pages = sets.mask(int(hv)), int(pages)
            sets.release(int(hv), pages)
            for s in bit_positions(m):
                lost[s] = lost.get(s, 0) + pages
        holder[single] = TOMB
        holder[shared] = TOMB
        self.live -= len(single) + len(shared)

    def _tables(self) -> list[PageTable]:
        return [self] if self._old is None else [self, self._old]

    def _renumber(self) -> None:
        """Stamps near their limit: keep their order (across both tables), renumber them from 1."""
        tables = self._tables()
        stamps = [t._mem.stamp for t in tables]
        lives = [np.flatnonzero(t._mem.holder >= 0) for t in tables]
        every = np.concatenate([s[live] for s, live in zip(stamps, lives)])
        rank = np.empty(len(every), dtype=np.uint32)
        rank[np.argsort(every, kind="stable")] = np.arange(1, len(every) + 1, dtype=np.uint32)
        at = 0
        for s, live in zip(stamps, lives):
            s[:] = 0
            s[live] = rank[at:at + len(live)]
            at += len(live)
        self._clock = len(every)

    def _stamps_for(self, k: int) -> None:
        """Before k stores are stamped: renumbers the stamps when the clock would pass its limit."""
        if self._clock + k >= _STORE_LIMIT:
            self._renumber()

    def add_many(self, hashes: Hashes, slot: int) -> int:
        """`add` for every hash in order, in C or numpy (a snapshot's thousands of pages); how
        many the worker did not hold."""
        key = _fold(_keys(hashes))
        n = len(key)
        if index_native.kernel() is not None:
            return index_native.apply(self, key, np.full(n, slot, dtype=np.int32),
                                      np.ones(n, dtype=bool)).get(slot, 0)
        self._stamps_for(n)
        # A page listed twice counts once, at its last position (as `add` one by one would).
        _, last = np.unique(key[::-1], return_index=True)
        order = np.sort(n - 1 - last)
        key = key[order]
        self._touch_many(key)
        stamps = (self._clock + 1 + order).astype(np.uint32)
        self._clock += n
        pos = self._find_many(key)
        found = pos >= 0
        self._mem.stamp[pos[found]] = stamps[found]
        new = int(np.count_nonzero(self._mem.holder[pos[found]] != slot))
        if new:  # held by others (or by several): the masks, one by one
            holder = self._holder
            for p in pos[found].tolist():
                if holder[p] != slot:
                    new -= not self._join(p, slot)
        absent = ~found
        k = int(np.count_nonzero(absent))
        self._make_room(k)  # may move every found page into an old table: they are done
        key = key[absent]
        at = self._place(key, np.full(k, slot, dtype=np.int32))
        self._mem.key[at] = key
        self._mem.stamp[at] = stamps[absent]
        self.live += k
        return new + k

    def touch_stamps(self, n: int, ahead: int) -> int | None:
        """The stamp of the first of a routed request's n pages, which its lookup finds used
        again (`masks`' `touch_from`): page i gets it less i, so each is newer than any page
        stored so far and than the next `ahead` stores, the first page newest of all. The
        eviction order (`evict`) then drops a prefix's deeper pages before the pages they
        extend, as a radix cache's LRU does (stores alone stamp a chain's root first: the page
        every deeper one needs to be matched was evicted first). None when the stamps are near
        their limit (the next store renumbers them, keeping the order, not the stores ahead)."""
        ahead = min(ahead, _TOUCH_AHEAD_MAX)
        if not n or self._clock + n + ahead >= _STAMP_LIMIT:
            return None
        self._clock += n
        return self._clock + ahead

    def masks(self, hashes: Sequence[bytes], touch_from: int | None = None) -> list[int]:
        """`mask` of each hash, in numpy (a request's pages); with `touch_from`, the pages found
        stamped it less their place in `hashes` (`touch_stamps`)."""
        key = _fold(_keys(hashes))
        stamps = None if touch_from is None else \
            np.arange(touch_from, touch_from - len(key), -1, dtype=np.uint32)
        return self._masks_of(key, stamps)

    def _masks_of(self, key: np.ndarray, stamps: np.ndarray | None = None) -> list[int]:
        pos = self._find_many(key, stamps)
        hv = self._mem.holder[pos].tolist()
        masks = self.holder_sets.masks
        # HolderSets.mask inlined (a new kind of holder goes in both): a call a page cost ~2.4 us
        # more a 64-page lookup, measured, on routing's path
        out = [0 if p < 0 else 1 << v if v < PAIR else masks[v - SHARED] if v >= SHARED
               else pair_mask(v) if v < TRIPLE else triple_mask(v)
               for p, v in zip(pos.tolist(), hv)]
        if self._old is not None:  # the pages not in the new table may be in the old one
            # (their keys reused, not packed again: 35 against 39 us a 64-page request at
            # 1,000 workers while a growth migrates, as tombstones make it now and then)
            rest = np.flatnonzero(pos < 0)
            if len(rest):
                touched = None if stamps is None else stamps[rest]
                for i, m in zip(rest.tolist(), self._old._masks_of(key[rest], touched)):
                    out[i] = m
        return out

    def discard_many(self, hashes: Hashes, slot: int) -> int:
        """`discard` of every hash, in C or numpy; how many the worker held."""
        key = np.unique(_fold(_keys(hashes)))
        if index_native.kernel() is not None:
            return -index_native.apply(self, key, np.full(len(key), slot, dtype=np.int32),
                                       np.zeros(len(key), dtype=bool)).get(slot, 0)
        self._touch_many(key)
        pos = self._find_many(key)
        pos = pos[pos >= 0]
        holder = self._mem.holder
        hv = holder[pos]
        mine = pos[hv == slot]
        holder[mine] = TOMB
        self.live -= len(mine)
        shared = sum(self._leave(p, slot) for p in pos[hv >= PAIR].tolist())
        return len(mine) + shared

    def _join(self, pos: int, slot: int) -> bool:
        """Adds a worker to a live position's holders; False when it was one already."""
        hv = self._holder[pos]
        if hv == slot:
            return False
        sets = self.holder_sets
        m = sets.mask(hv)
        if m >> slot & 1:
            return False
        self._holder[pos] = sets.hold(m | 1 << slot)
        sets.release(hv)
        return True

    def _homes(self, key: np.ndarray) -> np.ndarray:
        # `_home`, in numpy: uint64 array products wrap silently, as `& _M64` does.
        x = key * _MIX_NP
        return ((x ^ x >> _SHIFT_NP) % np.uint64(self.cap)).astype(np.int64)

    def _find_many(self, key: np.ndarray, stamps: np.ndarray | None = None) -> np.ndarray:
        """Positions of the keys, -1 where absent: `_probe` for all of them at once; with
        `stamps`, each key found stamped its own (`touch_stamps`)."""
        if index_native.kernel() is not None:
            return index_native.find(self, key, stamps)
        holder, keys = self._mem.holder, self._mem.key
        p, out = self._homes(key), np.full(len(key), -1, dtype=np.int64)
        todo = np.arange(len(key))
        while len(todo) > _SCALAR_REST:
            cand = p[todo]
            hv = holder[cand]
            hit = (hv >= 0) & (keys[cand] == key[todo])
            out[todo[hit]] = cand[hit]
            todo = todo[~hit & (hv != EMPTY)]
            p[todo] = (p[todo] + 1) % self.cap
        for k in todo.tolist():  # the few in long clusters: one step costs ~0.1 us in Python
            out[k] = self._probe(int(key[k]))[0]
        if stamps is not None:
            found = out >= 0
            self._mem.stamp[out[found]] = stamps[found]
        return out

    def _make_room(self, k: int) -> bool:
        """Before k pages are placed: grows when they would take the table past 70%, counting
        the pages still to come from an old table; True when it grew."""
        if self._has_room(k):
            return False
        self._grow(k)
        return True

    def _has_room(self, k: int) -> bool:
        """Whether k more pages (and those still to come from an old table) stay within 70%.
        Past 55%, plans the next growth's arrays (made ready ahead: `prepare_growth`), from how
        the table filled since its spare's last look (taken from 50% on); none while its sweep
        keeps it from growing (index_sweep.py: a steady state's tombstones cleared in place)."""
        total = self._used_slots()
        if total >= _LOOK_LOAD * self.cap and self._old is None \
                and self.sweep.holds(self, _MAX_LOAD):
            self._spare.drop(self.live, total)
        elif total >= _LOOK_LOAD * self.cap:
            self._spare.plan(self.live, total, int(_MAX_LOAD * self.cap) - total, _GROWN_LOAD,
                             look_only=total < _SPARE_LOAD * self.cap, expect=self.expect)
        return total + k <= _MAX_LOAD * self.cap

    def sweep_due(self) -> bool:
        """Whether `migrate_some` would sweep (a round goes on, or its tombstones call for one)."""
        return self._old is None and self.sweep.due(self)

    def drop_spare(self) -> None:
        """Ingest idle for long (feeds.py): the next growth's arrays are not kept for it."""
        self._spare.drop(self.live, self._used_slots())

    def prepare_growth(self, chunk: int | None = None) -> bool:
        """The ingest thread, between its slices and without the router's lock: writes the next
        part of the next growth's arrays (`chunk` slots, or paced by the room used:
        table_arrays.Spare.fill_some, within its bytes a page), or of a shrink's (idle calls
        only: a chunk); True while some remains that it may write now, or a shrink's arrays
        wait whole for the idle step that starts its growth (`_shrink_some`)."""
        old = self._old  # read once, as in _used_slots
        slots = self.cap + (old.cap if old is not None else 0)
        spare = self._spare
        more = spare.fill_some(int(_MAX_LOAD * self.cap) - self._used_slots(), self.live, slots,
                               chunk)
        return more or (spare.shrinking and spare.arrays is not None and chunk is not None)

    def _used_slots(self) -> int:
        """Slots used (live and deleted), the pages still to come from an old table included."""
        old = self._old  # read once: prepare_growth runs without the lock, a growth may end it
        return self._used + (old.live if old is not None else 0)

    def _grow(self, extra: int) -> None:
        """Starts a migration into a table sized so that every live page (and `extra` more) fill
        ~45% of it: the current arrays become the old table. An old table still there is
        finished first (a whole-table stall, which the migration rate makes rare)."""
        if self._old is not None:
            self._step(0, self._old.cap - self._cursor)
        old = PageTable.__new__(PageTable)
        old._used, old.live, old._old = self._used, self.live, None
        old.holder_sets = self.holder_sets
        old._use(self._mem)
        # The pages a spare written whole was planned for when more (a warm-up's fleet), not
        # asked anew: it fits; fresh arrays that large would be written under the lock.
        expected = self._spare.ready_for()
        need = _grown_slots(max(self.live + extra, expected))
        self._use(self._spare.take(need) or TableArrays.empty(need))
        self.sized_for_expected = expected > self.live + extra
        if self.sized_for_expected:  # once a warm-up: what the operator sees it reserve
            log.info(kv("index_sized_for_fleet", pages=self.live, expected_pages=expected,
                        slots=self.cap, bytes=self._mem.nbytes()))
        self._used = 0
        self._spare.grew(self.live)
        self.sweep.at = self.sweep.left = 0  # a round over the old arrays ends with them
        self._old, self._cursor = old, 0
        # Scan every old slot (twice over, to spare) before the pages to come fill the room left.
        room = max(1, int(_MAX_LOAD * self.cap) - self.live - extra)
        self.rate = -(-2 * old.cap // room)

    def _step(self, pages: int, slots: int | None = None) -> None:
        """Migrates the next old slots: `migrate_step + rate * pages` of them (or `slots`)."""
        old = self._old
        if old is None:
            return
        if slots is None:
            slots = self.migrate_step + self.rate * pages
        end = min(old.cap, self._cursor + slots)
        if index_native.kernel() is not None:
            index_native.migrate(self, self._cursor, end)
        else:
            seg = old._mem.holder[self._cursor:end]
            pos = self._cursor + np.flatnonzero(seg >= 0)
            if len(pos):
                self._move(pos)
        self.migrated_slots += end - self._cursor
        self._cursor = end
        if end == old.cap:
            self._old = None
            if self.retire:
                self.retired = old._mem  # one retired before and not given back is freed here

    def give_back_retired(self) -> None:
        """The retired arrays' memory returned (`TableArrays.give_back`), then dropped. Called
        without the router's lock, by the thread that applies (an ingest slice, an idle step);
        a table that retires arrays meanwhile (another thread's clear, under the lock) only has
        them freed the usual way, by whichever drops the last reference."""
        arrays, self.retired = self.retired, None
        if arrays is not None:
            arrays.give_back()

    def migrate_some(self, max_slots: int) -> bool:
        """Migrates up to `max_slots` old slots without a mutating call (the feed loop's idle
        steps, gateway/core/feeds.py: a growth's old table otherwise stays until more events
        come), or with no old table, sweeps as many slots' tombstones once they are many
        (index_sweep.py), or else plans a smaller table's arrays when the pages fill under a
        fifth of this one and, once `prepare_growth` wrote them, starts the growth into them
        (`_shrink_some`); True while some migration, sweep or shrink's growth remains."""
        if max_slots <= 0:
            return self._old is not None or self.sweep.left > 0
        if self._old is None:
            return sweep_some(self, max_slots) or self._shrink_some()
        self._step(0, max_slots)
        return self._old is not None

    def _shrink_some(self) -> bool:
        """A table whose live pages fill under `_SHRINK_LOAD` of its slots, tombstones swept (a
        fleet scaled down: the table never shrank, and held 16 bytes a slot over few pages):
        the arrays of one at `_GROWN_LOAD` planned (the spare, as for a growth), written by the
        feed loop's idle `prepare_growth` calls without the lock (until stop 53 a step at a
        time under it: page faults on fresh memory, ~5 ms steps now and then at 10M pages),
        then a growth into them, whose migration the next steps do. True once that growth
        began (its migration goes on); False while the arrays are not written whole."""
        below = (_OVERSIZED_LOAD if self.sized_for_expected else _SHRINK_LOAD) * self.cap
        if self.cap < 2 * SPARE_MIN_SLOTS or self.live >= below \
                or self._used > _LOOK_LOAD * self.cap or self.expect() >= below:
            self._spare.drop_shrink()
            return False
        if not self._spare.plan_shrink(_grown_slots(self.live)):
            return False
        self.shrinks += 1
        self._grow(0)
        return True

    def _touch_many(self, key: np.ndarray) -> None:
        """Before a mutating call on these keys: a migration step, then the keys still in the
        old table moved into the new one (so the call's positions are all the new table's)."""
        if self._old is not None:
            self._step(len(key))
            self._pull_many(key)

    def _pull_many(self, key: np.ndarray) -> None:
        """The keys still in the old table moved into this one."""
        if self._old is not None:
            pos = self._old._find_many(key)
            pos = np.unique(pos[pos >= 0])
            if len(pos):
                self._move(pos)

    def _pull(self, key: int) -> None:
        """`_touch_many` of one key, without numpy."""
        old = self._old
        if old is None:
            return
        pos = old._probe(key)[0]
        if pos < 0:
            return
        free = self._probe(key)[1]
        self._used += self._holder[free] == EMPTY
        hv = old._holder[pos]
        self._key[free], self._holder[free] = key, hv
        self._stamp[free] = old._stamp[pos]
        old._holder[pos] = TOMB
        old.live -= 1

    def _move(self, pos: np.ndarray) -> None:
        """Moves live positions of the old table into this one (tombstones left behind keep
        the old table's other keys reachable)."""
        old = self._old
        hv = old._mem.holder[pos]
        key = old._mem.key[pos]
        at = self._place(key, hv)
        self._mem.key[at] = key
        self._mem.stamp[at] = old._mem.stamp[pos]
        old._mem.holder[pos] = TOMB
        old.live -= len(pos)

    def _place(self, key: np.ndarray, holders: np.ndarray) -> np.ndarray:
        """Writes the holders of keys known to be absent at the first free (empty or deleted)
        position of each one's probe path, as `add` would one by one; returns the positions.
        All keys advance together; where several reach one free position, one takes it and the
        others go on (every position they pass is taken, so each stays reachable from its home)."""
        if index_native.kernel() is not None:
            return index_native.place(self, key, holders)
        holder = self._mem.holder
        p = self._homes(key)
        out = np.empty(len(key), dtype=np.int64)
        todo = np.arange(len(key))
        while len(todo):
            cand = p[todo]
            free = np.flatnonzero(holder[cand] < 0)
            spots = cand[free]
            was_empty = holder[spots] == EMPTY
            # Claim with a marker below EMPTY (one write wins per position), then keep the winners.
            holder[spots] = -4 - free
            mine = holder[spots] == -4 - free
            won, at = free[mine], spots[mine]
            self._used += int(np.count_nonzero(was_empty[mine]))
            holder[at] = holders[todo[won]]
            out[todo[won]] = at
            lost = np.ones(len(todo), dtype=bool)
            lost[won] = False
            todo = todo[lost]
            p[todo] = (p[todo] + 1) % self.cap
            if len(todo) <= _SCALAR_REST:
                break
        scalar, cap = self._holder, self.cap  # the same memory, read faster one by one
        for k in todo.tolist():  # the few in long clusters, one by one
            at = int(p[k])
            while scalar[at] >= 0:
                at = at + 1 if at + 1 < cap else 0
            self._used += scalar[at] == EMPTY
            scalar[at] = int(holders[k])
            out[k] = at
        return out
