"""The value types of the gateway's KV index (gateway/core/index.py): its settings, a batch as the
stream rules read it, what applying a batch answers, a worker's match and state, and the index's
totals."""
from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class IndexConfig:
    # Memory the index may use, in MiB: its bound is memory_budget_mb / BYTES_PER_ENTRY keys,
    # less the sets of holders' share (--index-memory-mb). 1024 MiB: ~16.8M keys.
    memory_budget_mb: float = 1024.0
    # Explicit bound on (page hash, medium) keys; 0 = from memory_budget_mb.
    max_entries: int = 0
    # Fraction of max_entries dropped at once when over the bound (amortises the scan).
    evict_fraction: float = 0.05
    # A worker heard from (event or heartbeat) within stale_after_s has full confidence; it then
    # falls linearly to min_confidence at dead_after_s.
    stale_after_s: float = 5.0
    dead_after_s: float = 30.0
    min_confidence: float = 0.0
    # Multiplier while a worker's view is known to be incomplete (gap seen, snapshot in progress).
    resync_confidence: float = 0.5

    def confidence(self, age_s: float, incomplete: bool) -> float:
        """How much to trust a worker last heard from `age_s` ago (the in-process and the
        shared index score workers alike)."""
        if age_s <= self.stale_after_s:
            conf = 1.0
        elif age_s >= self.dead_after_s:
            conf = self.min_confidence
        else:
            frac = (age_s - self.stale_after_s) / (self.dead_after_s - self.stale_after_s)
            conf = 1.0 - frac * (1.0 - self.min_confidence)
        return conf * self.resync_confidence if incomplete else conf


@dataclass(frozen=True, slots=True)
class BatchHead:
    """What the stream rules read of an `EventBatch` (`KvIndex.apply_runs`): its pool, epoch and
    seq, its snapshot flags, and whether its first event clears the pool (a snapshot's start)."""
    pool_id: str
    epoch: int
    seq: int
    snapshot: bool = False
    snapshot_end: bool = False
    clears_first: bool = False


# A batch's page hashes of one event, 16 bytes each, concatenated: bytes from a message, a
# memoryview of a stream frame's hashes.
Packed = bytes | memoryview
# One event of a batch as the index applies it: ("stored" | "removed" | "cleared", the medium's
# position in the index's tables, its packed hashes).
Run = tuple[str, int, Packed]


class ApplyStatus(enum.Enum):
    APPLIED = "applied"
    # Already applied (seq not above the last one): ignored.
    DUPLICATE = "duplicate"
    # Cannot be applied: re-subscribe from (resume_epoch, resume_after_seq).
    RESYNC = "resync"


@dataclass(slots=True)
class ApplyResult:
    status: ApplyStatus
    pool_id: str
    reason: str = ""
    # Where the subscriber should resume: SubscribeRequest(epoch, after_seq). -1 = snapshot.
    resume_epoch: int = 0
    resume_after_seq: int = -1
    page_events: int = 0


@dataclass(slots=True)
class PrefixMatch:
    """Leading pages of a request one worker holds: device run, then host, then remote extension."""
    device_pages: int
    host_pages: int
    remote_pages: int
    confidence: float


@dataclass(slots=True)
class Holders:
    """`KvIndex.lookup`'s answer as columns (`KvIndex.holders`): per worker holding the request's
    first page anywhere, in the index's order, its device run, host and remote extension (int64
    pages) and confidence (float64). A routing decision over many holders scores them in numpy
    instead of a PrefixMatch and a confidence call each."""
    workers: list[str]
    device_pages: np.ndarray
    host_pages: np.ndarray
    remote_pages: np.ndarray
    confidence: np.ndarray

    @staticmethod
    def empty() -> Holders:
        none = np.zeros(0, np.int64)
        return Holders([], none, none, none, np.zeros(0))

    @staticmethod
    def from_matches(matches: dict[str, PrefixMatch]) -> Holders:
        k = len(matches)
        ms = matches.values()
        return Holders(list(matches), np.fromiter((m.device_pages for m in ms), np.int64, k),
                       np.fromiter((m.host_pages for m in ms), np.int64, k),
                       np.fromiter((m.remote_pages for m in ms), np.int64, k),
                       np.fromiter((m.confidence for m in ms), np.float64, k))

    def matches(self) -> dict[str, PrefixMatch]:
        return dict(zip(self.workers, map(PrefixMatch, self.device_pages.tolist(),
                                          self.host_pages.tolist(), self.remote_pages.tolist(),
                                          self.confidence.tolist())))

    def match(self, i: int) -> PrefixMatch:
        return PrefixMatch(int(self.device_pages[i]), int(self.host_pages[i]),
                           int(self.remote_pages[i]), float(self.confidence[i]))


@dataclass(slots=True)
class IndexStats:
    entries: int
    capacity: int
    # Keys dropped under the bound since start: > 0 means the fleet outgrew the budget.
    evicted_entries: int
    # entries x BYTES_PER_ENTRY + holder_sets x BYTES_PER_HOLDER_SET: an estimate, measured by
    # the fleet benchmarks.
    memory_bytes: int
    page_events: int
    # The page tables' arrays as allocated: a growth's old table and the next one's spare
    # included (the sets of holders of shared pages not).
    table_bytes: int = 0
    # Tombstones of removed pages the feed loop's idle steps cleared in place (index_sweep.py).
    swept_tombstones: int = 0
    # Growths (of a table's size worth a spare) that took arrays written ahead, that took them
    # partly written (the rest written under the router's lock), and that wrote fresh ones there
    # (table_arrays.Spare.take).
    growths_ready: int = 0
    growths_partial: int = 0
    growths_unready: int = 0
    # Tables moved into smaller arrays once their pages filled under a fifth of them (a fleet
    # scaled down: PageTable._shrink_some).
    shrinks: int = 0
    # Keys two or more workers hold: two or three name their pair or triple, four or more a set
    # of holders, which every key with the same holders shares (holder_sets.py,
    # gateway_fleet/shared_masks.py).
    shared_pages: int = 0
    # Distinct sets of 4+ holders those keys name (~300 bytes each at 1,000 workers: its mask),
    # counted in memory_bytes and in the bound, not in table_bytes.
    holder_sets: int = 0


@dataclass(slots=True)
class WorkerInfo:
    pool_id: str
    epoch: int
    last_seq: int
    needs_resync: bool
    in_snapshot: bool
    last_seen: float
    pages: tuple[int, int, int]
