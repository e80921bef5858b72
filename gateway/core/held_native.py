"""`HeldProbe`: `KvIndex.holders`' probes of a request's pages in one C call (csrc/page_table.c's
`pt_held`) instead of `index_scan.held_masks`' numpy rounds and per-page Python (issue 31: the
index's lookup was ~35-40% of a routing decision at 1,000 workers).

The answer is cut into segments: runs of pages whose holder values are equal on every table (a
conversation's 32 pages on one worker, a system prompt's on the same hundred), so that the masks
and the runs (`index_scan.run_ends` over segments) cost a few steps a request rather than a few a
page. Same rounds, same pages stamped, same holders as `held_masks` + `holder_runs` per page
(tests/gateway/test_index_holders.py and test_index_touch.py run both ways). Used when the C
kernel is loaded and no table migrates a growth (then a page may sit in either of two tables:
`held_masks` serves, as it does without the kernel)."""
from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gateway.core import index_native
from gateway.core.packed import pack

if TYPE_CHECKING:
    from gateway.core.index_table import PageTable

# (masks of each segment on device, host and remote: None for a table left out; each segment's
# first page; the pages held anywhere from page 0; the pages probed)
Held = tuple[list[int], list[int] | None, list[int] | None, list[int], int, int]


class HeldProbe:
    """The call's buffers, kept between lookups (one index's: used under the router's lock)."""

    def __init__(self) -> None:
        self.tables = (ctypes.c_int64 * 12)()
        self.touch = (ctypes.c_int64 * 3)()
        self.end, self.probed = ctypes.c_int64(), ctypes.c_int64()
        self.cap = 0
        self._reserve(64)

    def _reserve(self, n: int) -> None:
        if n > self.cap:
            self.cap = max(n, 2 * self.cap)
            self.seg = (ctypes.c_int64 * self.cap)()
            self.val = (ctypes.c_int32 * (3 * self.cap))()

    def probe(self, media: Sequence[PageTable | None], hashes: Sequence[bytes], first_chunk: int,
              touch_from: Sequence[int | None]) -> Held | None:
        """The segments of the request's pages on the tables given (None: a table left out),
        each page found stamped `touch_from[m]` less its place where that is not None; None when
        a table migrates a growth (`held_masks` serves)."""
        if any(t is not None and t._old is not None for t in media):
            return None
        n = len(hashes)
        self._reserve(n)
        tables, touch = self.tables, self.touch
        for m, t in enumerate(media):
            if t is None:
                tables[4 * m] = 0
            else:
                tables[4 * m:4 * m + 4] = (*t._mem.addresses, t.cap)
            touch[m] = -1 if touch_from[m] is None else touch_from[m]
        k = index_native.kernel().pt_held(tables, pack(hashes), n, first_chunk, touch, self.seg,
                                          self.val, self.cap, ctypes.byref(self.end),
                                          ctypes.byref(self.probed))
        at, val, cap = self.seg[:k], self.val, self.cap
        masks: list[list[int] | None] = []
        for m, t in enumerate(media):
            if t is None:
                masks.append(None)
                continue
            mask = t.holder_sets.mask
            masks.append([0 if v < 0 else mask(v) for v in val[m * cap:m * cap + k]])
        return masks[0], masks[1], masks[2], at, self.end.value, self.probed.value
