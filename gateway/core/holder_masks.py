"""Holder masks of shared pages stored once per distinct set of holders (issue 31's memory goal).

A page two or more workers hold keeps its holders as a Python int mask in its table's `multi`
dict (gateway/core/index_table.py). The int's size follows the highest worker slot among the
holders: ~160 bytes at 1,000 workers, on top of the dict's entry and the position's int. Many
shared pages have the same holders (a conversation's pages on the workers that served it, a
system prompt everywhere), so each new mask is looked up here and the page keeps the one object
of that value. Masks are immutable ints, so sharing one changes no answer: a mask that misses
this table (one created before a clean, or a caller that skips it) is as correct, only stored
twice.

Masks of slots below 61 are left as they are: their ints take 36 bytes at most, about what a
store's entry would, and the store costs a lookup an event (~0.8 us at 1,000 workers here).
The store is a dict keyed by the mask's residue modulo a prime below 2^61, not by the mask:
Python hashes an int modulo 2^61 - 1, where 2^a and 2^(a + 61) are one value, so the masks of
1,000 workers' pairs fall in ~1,900 hash values (a store keyed by them ran 4x slower than
without it, measured). The residues of 2^a modulo this prime are distinct for every a below
200,000. Two masks with one residue (~n / 2^61) are not shared: the second stays its own.

The store forgets the masks no page holds any more when it has doubled since its last clean: a
mask the store alone holds has two references while the clean looks at it (its dict's value and
`getrefcount`'s argument). That count is CPython's (`sys.getrefcount`); a mask wrongly kept costs
memory, one wrongly dropped costs a duplicate, neither a wrong answer.
"""
from __future__ import annotations

import sys

# Distinct masks kept before the first clean (under a MB at 1,000 workers).
_CLEAN_FROM = 4096
_PRIME = 0x1FFFFFFFFFFFFFE1  # the largest prime below 2^61 - 1
# References to a mask only the store holds, during the clean (above).
_ONLY_HERE = 2


class HolderMasks:
    """`masks(m)`: the stored mask equal to `m` (m itself the first time)."""

    __slots__ = ("_masks", "_clean_at")

    def __init__(self) -> None:
        self._masks: dict[int, int] = {}
        self._clean_at = _CLEAN_FROM

    def __call__(self, mask: int) -> int:
        if mask < _PRIME:
            return mask  # workers' slots below 61: an int of 36 bytes at most, not worth a key
        stored = self._masks.setdefault(mask % _PRIME, mask)
        if stored != mask:
            return mask  # another mask with this residue: this one kept apart
        if len(self._masks) >= self._clean_at:
            self._clean()
        return stored

    def __len__(self) -> int:
        return len(self._masks)

    def _clean(self) -> None:
        masks = self._masks
        for key in list(masks):
            if sys.getrefcount(masks[key]) <= _ONLY_HERE:
                del masks[key]
        self._masks = dict(masks)  # a dict keeps its size through deletions: copied smaller
        self._clean_at = max(_CLEAN_FROM, 2 * len(masks))
