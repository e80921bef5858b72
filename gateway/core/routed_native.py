"""`NativePages`: RoutedPrefixes' pages in the gateway's C library (csrc/routed_table.c), with
the slot-based interface of `routed_prefixes.DictPages` and the same results (keys are the page
hashes' 16 bytes, as the index's: a hash of another length is cut or zero-padded to 16).

Built and chosen as the page table is (index_native.TABLE: --index-native auto|on|off); calls
keep the GIL (they take microseconds, under the router's lock)."""
from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence

from gateway.core.index_table import split
from gateway.core.packed import pack


class NativePages:
    """Per worker slot, an LRU set of the page hashes routed to it (at most `max_pages`)."""

    def __init__(self, max_pages: int, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._handle = lib.rp_new(max_pages)
        if not self._handle:
            raise MemoryError("routed pages: rp_new failed")
        weakref.finalize(self, lib.rp_free, self._handle)
        self._cap = 0
        self._reserve(0)

    def _reserve(self, slot: int) -> None:
        """Room for `slot` in the C arrays and in match's and holders' output buffers."""
        cap = self._lib.rp_slots(self._handle, slot)
        if cap < 0:
            raise MemoryError("routed pages: no memory for another worker")
        if cap != self._cap:  # ctypes arrays: a slice of one is a list, no numpy call
            self._cap = cap
            self._slots_out = (ctypes.c_int32 * cap)()
            self._ends_out = (ctypes.c_int64 * cap)()

    def record(self, slot: int, hashes: Sequence[bytes]) -> None:
        if slot >= self._cap:
            self._reserve(slot)
        if self._lib.rp_record(self._handle, slot, pack(hashes), len(hashes)) < 0:
            raise MemoryError("routed pages: no memory to record a prompt")

    def match(self, hashes: Sequence[bytes]) -> list[tuple[int, int]]:
        k = self._lib.rp_match(self._handle, pack(hashes), len(hashes), self._slots_out,
                               self._ends_out)
        return list(zip(self._slots_out[:k], self._ends_out[:k]))

    def extend(self, slot: int, hashes: Sequence[bytes], start: int) -> int:
        rest = hashes[start:]  # only these are probed
        return start + self._lib.rp_extend(self._handle, slot, pack(rest), len(rest), 0)

    def extend_many(self, slots: Sequence[int], hashes: Sequence[bytes],
                    starts: Sequence[int]) -> list[int]:
        k = len(slots)
        ends = (ctypes.c_int64 * k)()
        self._lib.rp_extend_many(self._handle, (ctypes.c_int32 * k)(*slots),
                                 (ctypes.c_int64 * k)(*starts), k, pack(hashes), len(hashes),
                                 ends)
        return ends[:]

    def holders(self, h: bytes) -> list[int]:
        k = self._lib.rp_holders(self._handle, *split(h), self._slots_out, self._cap)
        return self._slots_out[:k]

    def size(self, slot: int) -> int:
        return self._lib.rp_size(self._handle, slot)

    def remove(self, slot: int) -> None:
        self._lib.rp_remove(self._handle, slot)

    def pages(self) -> int:
        return self._lib.rp_pages(self._handle)

    def nbytes(self) -> int:
        """What the C store holds (entries, tables, per-slot arrays)."""
        return self._lib.rp_bytes(self._handle)
