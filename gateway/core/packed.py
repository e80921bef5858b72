"""The page hashes of a BlockStored / BlockRemoved event as one bytes object (design.md §6).

The gateway subscribes with `SubscribeRequest.packed_hashes`: a cache service that knows the
field sends `packed_block_hashes` (16-byte hashes concatenated), which the index reads with
`np.frombuffer`, without one Python bytes object a page; an older one sends `block_hashes`, joined
here into the same form. Both give the same index state.
"""
from __future__ import annotations

from collections.abc import Sequence

from prefixcache.v1 import events_pb2

HASH_BYTES = 16

Body = events_pb2.BlockStored | events_pb2.BlockRemoved


def packed_hashes(body: Body) -> bytes:
    """The event's page hashes, 16 bytes each, concatenated (a hash of another length in the
    per-page field cut or zero-padded to 16, as the index's keys are; a trailing partial hash of
    the packed field dropped)."""
    packed = body.packed_block_hashes
    if packed:
        extra = len(packed) % HASH_BYTES
        return packed[:len(packed) - extra] if extra else packed
    return pack(body.block_hashes)


def pack(hashes: Sequence[bytes]) -> bytes:
    """Hashes, 16 bytes each, concatenated (one of another length cut or zero-padded to 16)."""
    joined = b"".join(hashes)
    if len(joined) != HASH_BYTES * len(hashes):
        joined = b"".join(h[:HASH_BYTES].ljust(HASH_BYTES, b"\0") for h in hashes)
    return joined


def page_count(body: Body) -> int:
    """Pages in the event, whichever encoding it came in."""
    return len(body.packed_block_hashes) // HASH_BYTES or len(body.block_hashes)
