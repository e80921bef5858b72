"""`PageTable`: one medium of the gateway's KV index (gateway/core/index.py) in flat arrays.

Open addressing with linear probing over four parallel arrays, 24 bytes a slot: the page hash as
two 64-bit words (all 16 bytes of prefixcache_client.hash's HASH_BYTES, so the table adds no
collision of its own; a hash of another length is cut or zero-padded to 16 bytes, where two
such hashes may share a key: that only makes routing count a page a worker may not hold, and
the worker verifies every page it is sent), the holder (a worker slot, or MULTI: several, their
bitmask in `multi`), and a stamp (when it was last stored: the eviction order). The table grows
by ~1.55x when live + deleted slots pass 70%, so 24 bytes / 0.45..0.7 = 34..53 bytes a page,
against ~160-185 for the dicts, sets and ints it replaces. Pages several workers hold cost one
`multi` dict entry more (~100 bytes plus the mask int).

Single keys are probed in Python over `array.array` (element reads ~30 ns); whole-table scans
(a worker's clear, eviction, rehash) run in numpy over views of the same memory.
"""
from __future__ import annotations

from array import array

import numpy as np

EMPTY, TOMB, MULTI = -3, -2, -1  # holder values below 0; a live slot's holder is >= MULTI
_MIX = 0x9E3779B97F4A7C15  # Fibonacci hashing: spreads sequential or structured hashes
_M64 = (1 << 64) - 1
_MAX_LOAD = 0.7
_GROWN_LOAD = 0.45
_STAMP_LIMIT = 2**32 - 1


def split(h: bytes) -> tuple[int, int]:
    """The table's key for a page hash: its first and second 8 bytes as integers."""
    return int.from_bytes(h[:8], "little"), int.from_bytes(h[8:16], "little")


def _home(lo: int, hi: int, cap: int) -> int:
    return (((lo ^ hi) * _MIX) & _M64) % cap


class PageTable:
    """Page hash -> holder mask for one medium. Not thread-safe (the router's lock)."""

    def __init__(self, capacity: int = 64) -> None:
        self._alloc(capacity)
        self.live = 0
        self._clock = 0
        self.multi: dict[int, int] = {}  # slot position -> mask of its holders (2+ bits)

    def _alloc(self, cap: int) -> None:
        self.cap = cap
        self._used = 0  # live + tombstones
        self._lo = array("Q", bytes(8 * cap))
        self._hi = array("Q", bytes(8 * cap))
        self._holder = array("i", [EMPTY]) * cap
        self._stamp = array("I", bytes(4 * cap))

    def __len__(self) -> int:
        return self.live

    def nbytes(self) -> int:
        """Bytes of the arrays (the `multi` entries not included)."""
        return self.cap * 24

    def _probe(self, lo: int, hi: int) -> tuple[int, int]:
        """(position of the key or -1, the first free position on its probe path)."""
        klo, khi, holder, cap = self._lo, self._hi, self._holder, self.cap
        p, free = _home(lo, hi, cap), -1
        while True:
            hv = holder[p]
            if hv == EMPTY:
                return -1, (p if free < 0 else free)
            if hv == TOMB:
                if free < 0:
                    free = p
            elif klo[p] == lo and khi[p] == hi:
                return p, -1
            p += 1
            if p == cap:
                p = 0

    def mask(self, h: bytes) -> int:
        """Bitmask of the worker slots holding the page (0: none)."""
        lo, hi = split(h)
        pos = self._probe(lo, hi)[0]
        if pos < 0:
            return 0
        hv = self._holder[pos]
        return self.multi[pos] if hv == MULTI else 1 << hv

    def add(self, h: bytes, slot: int) -> bool:
        """Records the page on a worker as stored now; True when the worker did not hold it."""
        lo, hi = split(h)
        pos, free = self._probe(lo, hi)
        if self._clock >= _STAMP_LIMIT:
            self._renumber()
        self._clock += 1
        if pos < 0:
            if self._holder[free] == EMPTY:
                self._used += 1
            self._lo[free], self._hi[free], self._holder[free] = lo, hi, slot
            self._stamp[free] = self._clock
            self.live += 1
            if self._used > _MAX_LOAD * self.cap:
                self._rehash()
            return True
        self._stamp[pos] = self._clock
        hv = self._holder[pos]
        if hv == slot:
            return False
        if hv == MULTI:
            m = self.multi[pos]
            if m >> slot & 1:
                return False
            self.multi[pos] = m | 1 << slot
        else:
            self._holder[pos] = MULTI
            self.multi[pos] = 1 << hv | 1 << slot
        return True

    def discard(self, h: bytes, slot: int) -> bool:
        """Drops the page from a worker; True when it held it."""
        pos = self._probe(*split(h))[0]
        if pos < 0:
            return False
        hv = self._holder[pos]
        if hv == slot:
            self._kill(pos)
            return True
        if hv != MULTI or not self.multi[pos] >> slot & 1:
            return False
        m = self.multi[pos] & ~(1 << slot)
        if m & (m - 1):
            self.multi[pos] = m
        else:
            del self.multi[pos]
            self._holder[pos] = m.bit_length() - 1
        return True

    def _kill(self, pos: int) -> None:
        self._holder[pos] = TOMB
        self.multi.pop(pos, None)
        self.live -= 1

    def clear_slot(self, slot: int) -> int:
        """Drops every page of one worker; how many it held."""
        holder = np.frombuffer(self._holder, dtype=np.int32)
        mine = np.flatnonzero(holder == slot)
        holder[mine] = TOMB
        self.live -= len(mine)
        bit, shared = 1 << slot, 0
        for pos in [p for p, m in self.multi.items() if m & bit]:
            m = self.multi[pos] & ~bit
            shared += 1
            if m & (m - 1):
                self.multi[pos] = m
            else:
                del self.multi[pos]
                holder[pos] = m.bit_length() - 1
        return len(mine) + shared

    def hashes_of(self, slot: int) -> set[bytes]:
        """The page hashes one worker holds (for tests and debugging: a full scan)."""
        holder = np.frombuffer(self._holder, dtype=np.int32)
        pos = np.flatnonzero(holder == slot).tolist()
        pos += [p for p, m in self.multi.items() if m >> slot & 1]
        return {self._lo[p].to_bytes(8, "little") + self._hi[p].to_bytes(8, "little") for p in pos}

    def evict(self, n: int) -> dict[int, int]:
        """Drops up to n pages from the least recently stored 2n, pages one worker holds first,
        then the oldest shared ones. Returns how many pages each worker slot lost."""
        holder = np.frombuffer(self._holder, dtype=np.int32)
        stamp = np.frombuffer(self._stamp, dtype=np.uint32)
        live = np.flatnonzero(holder >= MULTI)
        if 2 * n < len(live):
            live = live[np.argpartition(stamp[live], 2 * n)[:2 * n]]
        window = live[np.argsort(stamp[live], kind="stable")]
        single = window[holder[window] >= 0]
        chosen = single[:n]
        shared = window[holder[window] == MULTI][:max(0, n - len(chosen))]
        lost: dict[int, int] = {}
        for slot, count in zip(*np.unique(holder[chosen], return_counts=True)):
            lost[int(slot)] = int(count)
        for pos in shared.tolist():
            m = self.multi[pos]
            while m:
                low = m & -m
                s = low.bit_length() - 1
                lost[s] = lost.get(s, 0) + 1
                m ^= low
            del self.multi[pos]
        holder[chosen] = TOMB
        holder[shared] = TOMB
        self.live -= len(chosen) + len(shared)
        return lost

    def _renumber(self) -> None:
        """Stamps near their limit: keep their order, renumber them from 1."""
        stamp = np.frombuffer(self._stamp, dtype=np.uint32)
        live = np.flatnonzero(np.frombuffer(self._holder, dtype=np.int32) >= MULTI)
        order = live[np.argsort(stamp[live], kind="stable")]
        stamp[:] = 0
        stamp[order] = np.arange(1, len(order) + 1, dtype=np.uint32)
        self._clock = len(order)

    def _rehash(self) -> None:
        """Into a table sized so that the live pages fill ~45% of it (tombstones dropped)."""
        old_holder = np.frombuffer(self._holder, dtype=np.int32)
        live = np.flatnonzero(old_holder >= MULTI)
        lo = np.frombuffer(self._lo, dtype=np.uint64)[live]
        hi = np.frombuffer(self._hi, dtype=np.uint64)[live]
        hv = old_holder[live]
        st = np.frombuffer(self._stamp, dtype=np.uint32)[live]
        old_multi = self.multi
        self._alloc(max(64, int(len(live) / _GROWN_LOAD) + 1))
        pos = self._place(lo, hi)
        np.frombuffer(self._lo, dtype=np.uint64)[pos] = lo
        np.frombuffer(self._hi, dtype=np.uint64)[pos] = hi
        np.frombuffer(self._holder, dtype=np.int32)[pos] = hv
        np.frombuffer(self._stamp, dtype=np.uint32)[pos] = st
        self._used = len(live)
        new_at = dict(zip(live.tolist(), pos.tolist()))
        self.multi = {new_at[p]: m for p, m in old_multi.items()}

    def _place(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Free positions for distinct keys in a fresh table, each on its own probe path (the
        same as `_probe` would find one by one): all keys advance together; where several reach
        one empty position, the first takes it."""
        cap = np.uint64(self.cap)
        with np.errstate(over="ignore"):
            p = ((lo ^ hi) * np.uint64(_MIX)) % cap
        p = p.astype(np.int64)
        taken = np.zeros(self.cap, dtype=bool)
        out = np.empty(len(lo), dtype=np.int64)
        todo = np.arange(len(lo))
        while len(todo):
            cand = p[todo]
            free = ~taken[cand]
            first = np.zeros(len(todo), dtype=bool)
            _, idx = np.unique(cand[free], return_index=True)
            first[np.flatnonzero(free)[idx]] = True
            out[todo[first]] = cand[first]
            taken[cand[first]] = True
            todo = todo[~first]
            p[todo] = (p[todo] + 1) % self.cap
        return out
