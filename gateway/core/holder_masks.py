"""Holder masks of shared pages stored once per distinct set of holders (issue 31's memory goal).

A page two or more workers hold keeps its holders as a Python int mask in its table's `multi`
dict (gateway/core/index_table.py). The int's size follows the highest worker slot among the
holders: ~160 bytes at 1,000 workers, on top of the dict's entry and the position's int. Many
shared pages have the same holders (a conversation's pages on the workers that served it, a
system prompt everywhere), so each new mask is looked up here and the page keeps the one object
of that value. Masks are immutable ints, so sharing one changes no answer: a mask that misses
this table (one created before a clean, or a caller that skips it) is as correct, only stored
twice.

The table of masks forgets the ones no page holds any more when it has doubled since its last
clean: a mask held by this table alone (its key and its value are the one object) has four
references while the clean looks at it. That count is CPython's (`sys.getrefcount`); a mask
wrongly kept costs memory, one wrongly dropped costs a duplicate, neither a wrong answer.
"""
from __future__ import annotations

import sys

# Distinct masks kept before the first clean (a few hundred kB at most).
_CLEAN_FROM = 4096
# References to a mask only this table holds, during the clean: its key and value (the same
# object), the loop's name for it and `getrefcount`'s argument.
_ONLY_HERE = 4


class HolderMasks:
    """`masks(m)`: the stored mask equal to `m` (m itself the first time)."""

    __slots__ = ("_masks", "_clean_at")

    def __init__(self) -> None:
        self._masks: dict[int, int] = {}
        self._clean_at = _CLEAN_FROM

    def __call__(self, mask: int) -> int:
        stored = self._masks.setdefault(mask, mask)
        if len(self._masks) >= self._clean_at:
            self._clean()
        return stored

    def __len__(self) -> int:
        return len(self._masks)

    def _clean(self) -> None:
        self._masks = {m: m for m in self._masks if sys.getrefcount(m) > _ONLY_HERE}
        self._clean_at = max(_CLEAN_FROM, 2 * len(self._masks))
