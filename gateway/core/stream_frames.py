"""Stream items of many workers as one frame, applied without a message object a batch (issue 31).

At 1,000 workers a gateway receives 1M+ page events/s. Decoding them as protobuf messages in
the gateway's process costs routing decisions their wake-up time (design.md, "The next step"):
the plan moves the feeds' streams to a process of their own, which hands the gateway frames.
A frame carries any number of `SubscribeResponse` items of any workers in the form the index
applies (`KvIndex.apply_runs`): per item its head in one record, per event a run record, and the
page hashes of all events as one buffer, so the gateway reads a frame with a few `np.frombuffer`
calls and applies each event's hashes as a view of it.

Layout (little-endian):

    header   magic b"PCF1", then u32 each: names bytes, items, runs, pages, extra bytes
    names    the pool ids, UTF-8, each ended by b"\\0"
    items    ITEM records: the pool (its index in names), batch or heartbeat, flags (snapshot,
             snapshot_end, first event clears), epoch, seq (a heartbeat's head_seq), its runs
             (first, count), its page events, and a heartbeat's bytes in `extra` (offset, length)
    runs     RUN records: stored / removed / cleared, the medium's tier, first page, pages
    hashes   16 bytes a page, the runs' pages in order
    extra    heartbeats, serialized (one a second a worker: decoded as messages)

Events of a medium the index does not keep, or of an unknown kind, are left out when encoding,
as `KvIndex.apply` leaves them out; hashes come packed (`packed.packed_hashes`).
"""
from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gateway.core.index_types import BatchHead, Run
from gateway.core.packed import HASH_BYTES
from gateway.core.stream_items import batch_head, message_runs
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import events_pb2

MAGIC = b"PCF1"
_HEADER = struct.Struct("<4s5I")
ITEM = np.dtype([("name", "<u4"), ("heartbeat", "u1"), ("flags", "u1"), ("epoch", "<u8"),
                 ("seq", "<i8"), ("first_run", "<u4"), ("runs", "<u4"), ("events", "<u4"),
                 ("extra", "<u4"), ("extra_len", "<u4")])
RUN = np.dtype([("kind", "u1"), ("tier", "u1"), ("start", "<u4"), ("count", "<u4")])
KINDS = ("stored", "removed", "cleared")
_SNAPSHOT, _SNAPSHOT_END, _CLEARS_FIRST = 1, 2, 4


@dataclass(slots=True)
class FrameItem:
    """One item of a frame: a batch or a heartbeat; `events`: its page events as the applier
    counts them (at least 1 for a batch). A batch keeps plain ints (its epoch, seq, flags and its
    runs' (kind, tier, first page, pages) in one tuple) and the frame's hash buffer; `head` and
    `runs` are built when it is applied. Why: at a million page events a second an item waits in
    the applier's queue long enough to survive a young collection, and every tracked object it
    holds (a head, a list, a memoryview and a tuple per run) was walked again by the garbage
    collector's older generations, inside whichever routing decision triggered them."""
    pool_id: str
    heartbeat: events_pb2.Heartbeat | None
    events: int
    epoch: int = 0
    seq: int = 0
    flags: int = 0
    spans: tuple[tuple[int, int, int, int], ...] = ()
    hashes: memoryview | None = None

    @property
    def head(self) -> BatchHead | None:
        if self.heartbeat is not None:
            return None
        f = self.flags
        return BatchHead(self.pool_id, self.epoch, self.seq, bool(f & _SNAPSHOT),
                         bool(f & _SNAPSHOT_END), bool(f & _CLEARS_FIRST))

    @property
    def runs(self) -> list[Run]:
        """(kind, tier, packed hashes: a view of the frame) per event run."""
        h = self.hashes
        return [(KINDS[kind], tier, h[start * HASH_BYTES:(start + n) * HASH_BYTES])
                for kind, tier, start, n in self.spans]


# What the applier queues and the router applies: an item as gRPC decoded it, or one of a frame.
StreamItem = cpb.SubscribeResponse | FrameItem


class FrameError(ValueError):
    """A frame that is not one (bad magic, sizes that do not add up)."""


def encode(items: Sequence[cpb.SubscribeResponse]) -> bytes:
    """The frame of `items`, in order."""
    names: dict[str, int] = {}
    rows, runs, hashes, extra = [], [], [], []
    pages = extra_bytes = 0
    for item in items:
        if item.WhichOneof("item") == "heartbeat":
            hb = item.heartbeat
            raw = hb.SerializeToString()
            rows.append((names.setdefault(hb.pool_id, len(names)), 1, 0, hb.epoch, hb.head_seq,
                         0, 0, 0, extra_bytes, len(raw)))
            extra.append(raw)
            extra_bytes += len(raw)
            continue
        batch, first, events = item.batch, len(runs), 0
        for kind, tier, packed in message_runs(batch.events):
            n = len(packed) // HASH_BYTES
            runs.append((KINDS.index(kind), tier, pages, n))
            hashes.append(packed)
            pages, events = pages + n, events + n
        head = batch_head(batch)
        flags = (_SNAPSHOT * head.snapshot) | (_SNAPSHOT_END * head.snapshot_end) \
            | (_CLEARS_FIRST * head.clears_first)
        rows.append((names.setdefault(head.pool_id, len(names)), 0, flags, head.epoch,
                     head.seq, first, len(runs) - first, max(1, events), 0, 0))
    name_bytes = b"".join(n.encode() + b"\0" for n in names)
    return b"".join([_HEADER.pack(MAGIC, len(name_bytes), len(rows), len(runs), pages,
                                  extra_bytes), name_bytes,
                     np.array(rows, dtype=ITEM).tobytes(), np.array(runs, dtype=RUN).tobytes(),
                     *hashes, *extra])


def decode(frame: bytes | memoryview) -> list[FrameItem]:
    """The items of a frame; their runs' hashes are views of `frame` (kept alive by them)."""
    view = memoryview(frame).cast("B")
    if len(view) < _HEADER.size:
        raise FrameError(f"a frame of {len(view)} bytes is shorter than its header")
    magic, name_bytes, n_items, n_runs, pages, extra_bytes = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise FrameError(f"not a stream frame (magic {bytes(magic)!r})")
    at = _HEADER.size
    sizes = (name_bytes, n_items * ITEM.itemsize, n_runs * RUN.itemsize, pages * HASH_BYTES,
             extra_bytes)
    if at + sum(sizes) != len(view):
        raise FrameError(f"a frame of {len(view)} bytes, its header says {at + sum(sizes)}")
    names = bytes(view[at:at + name_bytes]).split(b"\0")[:-1]
    at += name_bytes
    items = np.frombuffer(view, ITEM, n_items, at)
    at += sizes[1]
    run_array = np.frombuffer(view, RUN, n_runs, at)
    at += sizes[2]
    _check(items, run_array, len(names), pages)
    rows, run_rows = items.tolist(), run_array.tolist()
    hashes = view[at:at + sizes[3]]
    extra = view[at + sizes[3]:]
    pools = [n.decode() for n in names]
    out = []
    for name, heartbeat, flags, epoch, seq, first, count, events, off, length in rows:
        pool = pools[name]
        if heartbeat:
            hb = events_pb2.Heartbeat.FromString(extra[off:off + length])
            out.append(FrameItem(pool, hb, 0))
            continue
        out.append(FrameItem(pool, None, events, epoch, seq, flags,
                             tuple(run_rows[first:first + count]), hashes))
    return out


def _check(items: np.ndarray, runs: np.ndarray, names: int, pages: int) -> None:
    """Every reference inside the frame points inside it (a frame comes from another process)."""
    if len(items) and (int(items["name"].max()) >= names or int(
            (items["first_run"].astype(np.int64) + items["runs"]).max()) > len(runs)):
        raise FrameError("an item names a pool or runs the frame does not hold")
    if len(runs) and (int(runs["kind"].max()) >= len(KINDS) or int(
            (runs["start"].astype(np.int64) + runs["count"]).max()) > pages):
        raise FrameError("a run of an unknown kind or past the frame's hashes")
