"""The holders of pages several workers hold, each distinct set stored once (issue 31's memory
goal: ≤ 64 bytes an indexed page at 1,000 workers, shared pages included).

A page one worker holds keeps that worker's slot in its holder (gateway/core/table_arrays.py). A
page two workers hold keeps both slots there, `PAIR + (high << PAIR_BITS) + low` (slots below
2^14: a fleet of 16,384 workers), with no set at all: a page another worker fetched or
recomputed, whose pair no other page has, costs its table slot alone (until stop 53 it named a
set: ~218 bytes a page where each page had a pair of its own). A page three workers hold keeps
them the same way, `TRIPLE + rank` (slots below TRIPLE_SLOTS, 1,477: the rank of the three in the
combinatorial number system, C(high, 3) + C(mid, 2) + low, fits below 2^29; until stop 54 a
triple named a set, ~288 bytes a page where each page had its own). A page four or more hold (or
two or three of which one slot is past those bounds) keeps `SHARED + id`: the id of its set of
holders here, a bitmask (a Python int of as many bits as the highest slot among them: ~160 bytes
at 1,000 workers).
Pages with the same holders (a conversation's pages on the workers that served it, a system
prompt everywhere) share one id, so a shared page costs its table slot alone, and each distinct
set its mask, its list entries and a dict entry (~300 bytes at 1,000 workers) once. The value
moves with the slot (a growth's migration, a sweep), so those need no bookkeeping; a page
joined or left gets the id of its new set, and the old set's count drops.

Sets are counted (`refs`): one no page holds any more is forgotten, its id reused. The lookup
of a mask is keyed by its residue modulo a prime below 2^61, not by the mask: Python hashes an
int modulo 2^61 - 1, where 2^a and 2^(a + 61) are one value, so the masks of 1,000 workers' pairs
fell in ~1,900 hash values (a dict keyed by them ran 4x slower, measured). The residues of 2^a
modulo this prime are distinct for every a below 200,000. Two masks with one residue (~n / 2^61)
each get an id; the second is not found by the lookup and stays apart (stored twice if made
again: memory, never a wrong answer).

Before stop 52 a shared page kept its mask in a dict by slot position: ~85 bytes of entry and
position int beside the slot, and the mask's int unless another page shared it (117-119 bytes a
page where sets repeat, 265 where they do not: docs/results/gateway/fleet/shared_masks/).
"""
from __future__ import annotations

import sys
from bisect import bisect_right
from collections.abc import Iterable
from math import comb

import numpy as np

# Holder values from SHARED on name a set of holders; from TRIPLE to SHARED, three worker slots
# each below TRIPLE_SLOTS; from PAIR to TRIPLE, two each below PAIR_SLOTS; below PAIR, one
# worker's slot (a fleet of 2^28 workers). 2^30 distinct sets fit above, a holder being int32.
SHARED = 1 << 30
TRIPLE = 1 << 29
PAIR = 1 << 28
PAIR_BITS = 14
PAIR_SLOTS = 1 << PAIR_BITS  # a pair's slots are below this: PAIR + 2^28 - 1 < TRIPLE
# A triple's slots are below this: its rank, below C(TRIPLE_SLOTS, 3), fits below 2^29 (1,477).
TRIPLE_SLOTS = max(n for n in range(2048) if comb(n, 3) <= 1 << 29)
# C(k, 3) and C(k, 2) for k below TRIPLE_SLOTS: a triple's slots found from its rank by bisection.
_C3 = [comb(k, 3) for k in range(TRIPLE_SLOTS)]
_C2 = [comb(k, 2) for k in range(TRIPLE_SLOTS)]
_C3_ARRAY, _C2_ARRAY = np.array(_C3, dtype=np.int64), np.array(_C2, dtype=np.int64)
_PRIME = 0x1FFFFFFFFFFFFFE1  # the largest prime below 2^61 - 1


class HolderSets:
    """Sets of 2+ holders (bitmasks) by id, counted by the pages that hold them, and the pages
    held by pairs and by triples counted. A table and the old table of its growth share one: ids
    stay valid as pages move between them."""

    __slots__ = ("masks", "refs", "pages", "pairs", "triples", "_ids", "_free")

    def __init__(self) -> None:
        self.masks: list[int] = []  # id -> mask (0: the id is free)
        self.refs: list[int] = []  # id -> how many pages hold it
        self.pages = 0  # pages holding some set (both tables)
        self.pairs = 0  # pages two workers hold, written in place (both tables; C counts its own)
        self.triples = 0  # pages three workers hold, written in place (likewise)
        self._ids: dict[int, int] = {}  # mask % _PRIME -> id
        self._free: list[int] = []

    def __len__(self) -> int:
        """Distinct sets held by some page."""
        return len(self.masks) - len(self._free)

    def mask(self, hv: int) -> int:
        """The bitmask of the slots of a live page's holder value."""
        if hv < PAIR:
            return 1 << hv
        if hv >= SHARED:
            return self.masks[hv - SHARED]
        return pair_mask(hv) if hv < TRIPLE else triple_mask(hv)

    def hold(self, mask: int, pages: int = 1) -> int:
        """The holder value of `pages` pages held by the workers of `mask` (1+ bits), counted: a
        slot, a pair, a triple or a set's id, the most compact that holds them."""
        if not mask & (mask - 1):
            return mask.bit_length() - 1
        bits, width = mask.bit_count(), mask.bit_length()
        if bits == 2 and width <= PAIR_SLOTS:
            self.pairs += pages
            high = width - 1
            return PAIR + (high << PAIR_BITS) + (mask ^ 1 << high).bit_length() - 1
        if bits == 3 and width <= TRIPLE_SLOTS:
            self.triples += pages
            rest = mask ^ 1 << (width - 1)
            mid = rest.bit_length() - 1
            return TRIPLE + _C3[width - 1] + _C2[mid] + (rest ^ 1 << mid).bit_length() - 1
        key = mask % _PRIME
        i = self._ids.get(key)
        if i is None or self.masks[i] != mask:
            i = self._new(mask, key, register=i is None)
        self.refs[i] += pages
        self.pages += pages
        return SHARED + i

    def release(self, hv: int, pages: int = 1) -> None:
        """`pages` pages hold `hv` no more (a slot's, or PENDING's: nothing to count)."""
        if hv < SHARED:
            if hv >= TRIPLE:
                self.triples -= pages
            elif hv >= PAIR:
                self.pairs -= pages
            return
        i = hv - SHARED
        left = self.refs[i] = self.refs[i] - pages
        self.pages -= pages
        if not left:
            key = self.masks[i] % _PRIME
            if self._ids.get(key) == i:
                del self._ids[key]
            self.masks[i] = 0
            self._free.append(i)

    def _new(self, mask: int, key: int, register: bool) -> int:
        if self._free:
            i = self._free.pop()
            self.masks[i], self.refs[i] = mask, 0
        else:
            i = len(self.masks)
            if SHARED + i >= 1 << 31:
                raise OverflowError("2^30 distinct sets of holders: the holder's int32 is full")
            self.masks.append(mask)
            self.refs.append(0)
        if register:
            self._ids[key] = i
        return i

    def nbytes(self) -> int:
        """Bytes of the sets as sys.getsizeof counts them: lists, dict, masks and the ints of
        counts and keys (a scan of every set: for benchmarks and tests, not a metric)."""
        ints = self.masks + self.refs + list(self._ids)
        return sum(map(sys.getsizeof, (self.masks, self.refs, self._ids, self._free, *ints)))

    def holding(self, values: np.ndarray, slot: int) -> np.ndarray:
        """Which of these holder values (pairs, triples and sets: PAIR or more) include the
        worker (a scan of every set)."""
        ids = [SHARED + i for i, m in enumerate(self.masks) if m >> slot & 1]
        out = np.isin(values, ids)
        pairs = values < TRIPLE
        out[pairs] = np.any(np.stack(pair_slots(values[pairs])) == slot, axis=0)
        triples = (values >= TRIPLE) & (values < SHARED)
        out[triples] = np.any(np.stack(triple_slots(values[triples])) == slot, axis=0)
        return out

    @classmethod
    def restored(cls, masks: Iterable[int], values_held: Iterable[tuple[int, int]],
                 pairs: int = 0, triples: int = 0) -> HolderSets:
        """Sets as a checkpoint holds them (id -> mask, 0 where free), counted from (holder
        value, pages) of the tables' pages that name a set; `pairs` and `triples`: their pages
        held by pairs and by triples."""
        sets = cls()
        sets.pairs, sets.triples = pairs, triples
        for mask in masks:
            key = mask % _PRIME
            sets._new(mask, key, register=bool(mask) and key not in sets._ids)
        for hv, pages in values_held:
            i = hv - SHARED
            if not 0 <= i < len(sets.masks) or sets.masks[i] & (sets.masks[i] - 1) == 0:
                raise ValueError(f"a shared page names set {i}, which has fewer than 2 holders")
            sets.refs[i] += pages
            sets.pages += pages
        for i, refs in enumerate(sets.refs):
            if not refs:
                sets.release(SHARED + i, 0)
        return sets


def pair_mask(hv: int) -> int:
    """The bitmask of a pair's two slots."""
    v = hv - PAIR
    return 1 << (v >> PAIR_BITS) | 1 << (v & (PAIR_SLOTS - 1))


def pair_slots(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(high, low) slots of pair values."""
    v = values - PAIR
    return v >> PAIR_BITS, v & (PAIR_SLOTS - 1)


def triple_mask(hv: int) -> int:
    """The bitmask of a triple's three slots."""
    rank = hv - TRIPLE
    high = bisect_right(_C3, rank) - 1
    rank -= _C3[high]
    mid = bisect_right(_C2, rank) - 1
    return 1 << high | 1 << mid | 1 << (rank - _C2[mid])


def triple_slots(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(high, mid, low) slots of triple values."""
    rank = values.astype(np.int64) - TRIPLE
    high = np.searchsorted(_C3_ARRAY, rank, side="right") - 1
    rank -= _C3_ARRAY[high]
    mid = np.searchsorted(_C2_ARRAY, rank, side="right") - 1
    return high, mid, rank - _C2_ARRAY[mid]
