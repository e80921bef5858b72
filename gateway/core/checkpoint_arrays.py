"""The index checkpoint's on-disk form of a `PageTable`'s arrays (gateway/core/index_checkpoint.py).

A write's cost is its bytes, and most of a table's bytes are empty slots: a table runs at 30-70%
occupancy, and while it grows its new arrays are mostly empty (at 10M pages mid-growth, 0.85 GB of
arrays for 0.25 GB of occupied slots). So a table is written as its occupancy, one bit per slot
(np.packbits of holder != EMPTY), and its three arrays at the occupied slots only (tombstones
included: probing walks over them), the holders narrowed to 16 bits when every value fits: 14 bytes
an occupied slot (16 when some page is held by a pair or a triple). A holder is a worker slot, TOMB,
a pair or a triple of slots (PAIR + ... or TRIPLE + ..., as it is) or SHARED + a set's id
(gateway/core/holder_sets.py), written as -4 - the id, so that the ids of a few thousand sets fit
too. Loading puts them back at their positions in arrays of the table's capacity (empty slots:
zero, holder EMPTY), so no key is re-inserted.
Compression was measured and left out: zlib at level 1 ran at 40-70 MB/s on these arrays here,
slower than writing the bytes it saves (~0.3 GB/s).
"""
from __future__ import annotations

import numpy as np

from gateway.core.holder_sets import SHARED
from gateway.core.table_arrays import EMPTY, TableArrays

# A table's arrays (TableArrays' attributes) and their dtypes.
_ARRAYS = (("key", np.uint64), ("holder", np.int32), ("stamp", np.uint32))
# A shared page's holder as written: this, less its set's id (below EMPTY and TOMB).
_SET_WRITTEN = -4


def compact(arrays: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """One table's arrays (the copies `capture` made) as written: occupancy bits and the
    occupied slots' values."""
    occupied = arrays[prefix + "holder"] != EMPTY
    at = np.flatnonzero(occupied)  # once: a gather by index is ~2x one by mask, per array
    out = {prefix + "occupied": np.packbits(occupied)}
    for name, _ in _ARRAYS:
        out[prefix + name] = np.take(arrays[prefix + name], at)
    held = out[prefix + "holder"]
    shared = held >= SHARED
    held[shared] = _SET_WRITTEN - (held[shared] - SHARED)
    small = np.iinfo(np.int16)
    if not len(held) or small.min <= held.min() and held.max() <= small.max:
        out[prefix + "holder"] = held.astype(np.int16)
    return out


def expand(arrays: dict[str, np.ndarray], prefix: str, cap: int) -> TableArrays:
    """One table's arrays of `cap` slots, from what `compact` wrote."""
    occupied = np.unpackbits(arrays[prefix + "occupied"], count=cap).view(bool)
    if len(occupied) != cap:
        raise ValueError(f"table {prefix}: {len(occupied)} occupancy bits for {cap} slots")
    at = np.flatnonzero(occupied)
    n = len(at)
    for name, dtype in _ARRAYS:
        values = arrays[prefix + name]
        if values.shape != (n,) or not np.can_cast(values.dtype, dtype, "safe"):
            raise ValueError(f"table {prefix}: {name} of {values.dtype} {values.shape}, "
                             f"{n} occupied slots of {np.dtype(dtype)}")
    out = TableArrays.empty(cap)
    for name, _ in _ARRAYS:
        getattr(out, name)[at] = arrays[prefix + name]
    holder = out.holder[at]
    shared = holder <= _SET_WRITTEN
    holder[shared] = SHARED + (_SET_WRITTEN - holder[shared])
    out.holder[at] = holder
    return out


def sets(name: str, masks: list[int]) -> dict[str, np.ndarray]:
    """The sets of holders by id (0 where an id is free; up to as many bits as slots: 1,000
    workers) as rows of bytes."""
    width = max((m.bit_length() + 7) // 8 for m in masks) if masks else 1
    rows = b"".join(m.to_bytes(width, "little") for m in masks)
    return {name: np.frombuffer(rows, dtype=np.uint8).reshape(len(masks), width)}


def masks_of(rows: np.ndarray) -> list[int]:
    """`sets`' rows as the masks again."""
    return [int.from_bytes(row.tobytes(), "little") for row in rows]
