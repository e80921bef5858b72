"""The gateway's global KV index: page hash -> which workers hold it, on which medium (design.md §6).

It is fed the `prefixcache.v1.EventBatch` stream of every worker's cache service and answers one
question fast: for the page hashes of a request, how many leading pages does each worker hold
on device, then (as a contiguous extension) on host, then on remote (L3)?

Layout, chosen for memory at fleet scale (issue 31: ~35-55 bytes a page instead of ~160-185):
- one `PageTable` per medium (gateway/core/index_table.py), open addressing over flat arrays:
  page hash -> the worker slot holding it, or a bitmask of slots when several do (bit i = slot i).
  A lookup walks the request's pages once and ANDs masks, so its cost is O(pages), not
  O(pages x workers);
- per worker only counts: a snapshot, a new epoch or `remove_worker` finds that worker's pages
  with one vectorised scan of the table (numpy), skipped when it holds none.

Longer than 400 lines: one class whose stream rules, bulk runs, bound and lookups all share the
per-worker state (`_Worker`) and the three tables; split apart, each part would reach into the
others'.

Stream rules (events.proto): batches of one pool come in `seq` order, strictly increasing from 0
within an epoch. A seq jump (gap), a batch of another epoch that is not a snapshot or seq 0, or a
snapshot that breaks off, is reported as RESYNC with the point to re-subscribe from; the worker's
entries are kept (scored with less confidence) until the snapshot that follows replaces them.

Bound, on purpose and never silent: at most `capacity()` (page hash, medium) keys, which is
`max_entries` or, when that is 0, the memory budget `memory_budget_mb`, less `BYTES_PER_HOLDER_SET`
for each distinct set of holders of shared pages, divided by `BYTES_PER_ENTRY` (measured:
prefixcache_bench/gateway_fleet/). Over it, keys go in batches of `evict_fraction` (amortised
O(1)): REMOTE before HOST before DEVICE (the cheapest hits to lose first), within a medium the
least recently used first (stored, or found by a routed request's lookup: `touch_lookups`, which
also keeps a prefix's first pages longest), and among those a page held by one worker before a page
several hold (a widely shared prefix serves more requests). An evicted key only turns a hit into a
miss for routing; the worker still has the page. `stats()` counts keys, evictions and the estimated
memory (exported as metrics), and the first eviction, then one per minute, is logged as a warning:
the fleet has outgrown the budget.

`routed_prefixes.RoutedPrefixes` is the event-less variant: what the gateway itself routed where.
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np

from gateway.core import index_native
from gateway.core.expected_pages import expected_pages
from gateway.core.held_native import HeldProbe
from gateway.core.index_bulk import apply_ops
from gateway.core.index_native import Preemption
from gateway.core.index_scan import bit_positions, held_masks, holder_runs
from gateway.core.index_table import PageTable
from gateway.core.index_types import (ApplyResult, ApplyStatus, BatchHead, Holders, IndexConfig,
                                      IndexStats, Packed, PrefixMatch, Run, WorkerInfo)
from gateway.core.stream_items import MEDIUM_TIER, batch_head, message_runs
from prefixcache.v1 import events_pb2
from service_shell import kv

__all__ = ["BYTES_PER_ENTRY", "BYTES_PER_HOLDER_SET", "ApplyResult", "ApplyStatus", "Holders",
           "IndexConfig", "IndexStats", "KvIndex", "PrefixMatch", "WorkerInfo", "bit_positions"]

log = logging.getLogger("gateway.index")

# Eviction order under the memory bound: remote keys first, device keys last.
_EVICT_ORDER = (2, 1, 0)
# Bytes one (page hash, medium) key is counted as: a PageTable slot is 16 bytes at 45-70% load
# (23-36 bytes a page; ~60 with a growth's old arrays beside its new ones, at most 62 with the
# next growth's as far as written: table_arrays.py), a page several workers hold too (its holder
# names a set: holder_sets.py). 128 until stop 52, when a shared page's mask sat in a dict beside
# the arrays (117-265 bytes a page at 1,000 workers).
BYTES_PER_ENTRY = 64
# Bytes each distinct set of holders is counted as: its mask (an int of as many bits as the
# highest worker slot in it), list entries, count and the dict entry finding it; measured at
# 1,000 workers' slots (`HolderSets.nbytes`, tests/gateway/test_holder_sets.py).
BYTES_PER_HOLDER_SET = 320
# A stored or removed event this long goes to the table in numpy (snapshots: 4,096 pages a batch;
# live batches of a busy worker: tens); shorter ones page by page (numpy's fixed cost per call,
# ~20-40 us, is more than a few probes in Python).
_BULK_PAGES = 32
# Seconds between two "index full" warnings.
_FULL_WARNING_INTERVAL_S = 60.0


@dataclass(slots=True)
class _Worker:
    pool_id: str
    slot: int
    bit: int
    epoch: int = 0
    last_seq: int = -1
    # Nothing applied yet in this epoch: only a snapshot or seq 0 can start it.
    started: bool = False
    needs_resync: bool = False
    in_snapshot: bool = False
    last_seen: float = 0.0
    # Pages held per medium (the tables hold which).
    held: list[int] = field(default_factory=lambda: [0, 0, 0])


class KvIndex:
    """Not thread-safe: the gateway serialises apply/heartbeat/lookup/remove_worker (one lock)."""

    # A lookup probes this many of the request's pages first, then twice as many per round, and
    # stops at the first page no medium holds (`index_scan.held_masks`): one numpy round for a
    # typical prompt, a few for a long one whatever its uncached tail.
    lookup_chunk_pages = 64
    # Those probes and the runs by segments in one C call when the kernel is loaded
    # (held_native.py); off, in numpy rounds and per page (the benchmark times both).
    lookup_in_c = True

    def __init__(self, config: IndexConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or IndexConfig()
        self._clock = clock
        self._tables = (PageTable(), PageTable(), PageTable())
        for tier, table in enumerate(self._tables):  # a warm-up's growths sized for the fleet
            table.expect = functools.partial(self._expected_pages, tier)
        self._expected: list[tuple[int, int] | None] = [None, None, None]  # (changes, pages)
        self._workers: dict[str, _Worker] = {}
        self._by_slot: dict[int, _Worker] = {}
        self._free_slots: list[int] = []
        self._all = 0
        self.page_events = 0
        self.evicted_entries = 0
        self.resyncs = 0
        # Bumped by each call that may change what a checkpoint holds (index_checkpoint.py).
        self.changes = 0
        self._warned_at: float | None = None
        # Inside `bulk()`: runs of page events per medium waiting for one `apply_ops` run
        # (packed hashes, worker slot, store or not, per run); None outside.
        self._deferred: tuple[tuple[list[bytes], list[int], list[bool]], ...] | None = None
        # True while lookups are a routed request's (`Router.route`): the pages they find count
        # as used again, on every medium (`PageTable.touch_stamps`): newer in the eviction order
        # than a whole bound's worth of stores to come, the first page newest. A page asked for
        # again then outlives the pages stored since that nobody asked for yet (most of a
        # fleet's stores), and a prefix goes from its end, not from its first page. Stamps
        # only: not a change of what the index holds (`changes` stays).
        self.touch_lookups = False
        self._probe = HeldProbe()  # the lookup's C call's buffers (held_native.py)
        if (self.config.max_entries or self._budget_keys(holder_sets=0)) < 1:
            raise ValueError(f"index bound: max_entries={self.config.max_entries}, "
                             f"memory_budget_mb={self.config.memory_budget_mb} hold no entry")

    def capacity(self) -> int:
        """The most (page hash, medium) keys held: max_entries, else from the memory budget,
        less what the sets of holders of shared pages take of it (at least one key)."""
        cfg = self.config
        if cfg.max_entries:
            return cfg.max_entries
        return max(1, self._budget_keys(self._holder_sets()))

    def _budget_keys(self, holder_sets: int) -> int:
        """Keys the memory budget has room for beside this many sets of holders."""
        room = self.config.memory_budget_mb * 2**20 - holder_sets * BYTES_PER_HOLDER_SET
        return int(room // BYTES_PER_ENTRY)

    def _expected_pages(self, tier: int) -> int:
        """The pages the medium's table holds once every worker's snapshot is in (estimated
        from the synced workers: expected_pages.py), within the index's bound. Kept until the
        index changes: a table under its shrink's load asks at every idle step (~0.1 ms a call
        at 1,000 workers, under the router's lock)."""
        kept = self._expected[tier]
        if kept is not None and kept[0] == self.changes:
            return kept[1]
        live = len(self._tables[tier])
        pages = min(expected_pages(self._workers.values(), tier, live), max(live, self.capacity()))
        self._expected[tier] = (self.changes, pages)
        return pages

    def _holder_sets(self) -> int:
        return sum(len(t.holder_sets) for t in self._tables)

    def stats(self) -> IndexStats:
        n = len(self)
        ready, partial, unready = map(sum, zip(*(t.growths() for t in self._tables)))
        sets = self._holder_sets()
        return IndexStats(n, self.capacity(), self.evicted_entries,
                          n * BYTES_PER_ENTRY + sets * BYTES_PER_HOLDER_SET,
                          self.page_events, sum(t.nbytes() for t in self._tables),
                          sum(t.sweep.cleared for t in self._tables), ready, partial, unready,
                          shrinks=sum(t.shrinks for t in self._tables),
                          shared_pages=sum(t.shared_pages() for t in self._tables),
                          holder_sets=sets)

    # ----- workers -----------------------------------------------------------------------------

    def add_worker(self, pool_id: str) -> None:
        """Known from now on (also done implicitly by the first batch or heartbeat)."""
        self._worker(pool_id)

    def remove_worker(self, pool_id: str) -> bool:
        """Forget a worker and every page it held. False when it was unknown."""
        worker = self._workers.pop(pool_id, None)
        if worker is None:
            return False
        self.changes += 1
        self._clear(worker)
        del self._by_slot[worker.slot]
        self._all &= ~worker.bit
        self._free_slots.append(worker.slot)
        return True

    def workers(self) -> list[str]:
        return list(self._workers)

    def info(self, pool_id: str) -> WorkerInfo | None:
        w = self._workers.get(pool_id)
        if w is None:
            return None
        return WorkerInfo(w.pool_id, w.epoch, w.last_seq, w.needs_resync, w.in_snapshot, w.last_seen,
                          tuple(w.held))

    def last_seen(self, pool_id: str) -> float | None:
        """When the worker's stream last delivered anything; None when unknown. (What routing
        asks of every worker per decision: cheaper than `info`.)"""
        w = self._workers.get(pool_id)
        return None if w is None else w.last_seen

    def pages(self, pool_id: str, medium: int) -> frozenset[int]:
        """The keys of the pages the index holds for a worker on a medium (index_table.key_of;
        `page_keys` gives them for hashes; for tests and debugging)."""
        w = self._workers.get(pool_id)
        return frozenset(self._tables[MEDIUM_TIER[medium]].keys_held(w.slot)) if w else frozenset()

    def confidence(self, pool_id: str, now: float | None = None) -> float:
        """How much to trust a worker's entries: 1 when fresh and in sync, less when stale."""
        w = self._workers.get(pool_id)
        return 0.0 if w is None else self._confidence(w, self._clock() if now is None else now)

    def _confidence(self, w: _Worker, now: float) -> float:
        return self.config.confidence(now - w.last_seen, w.needs_resync or w.in_snapshot)

    def __len__(self) -> int:
        """(page hash, medium) keys held."""
        return len(self._tables[0]) + len(self._tables[1]) + len(self._tables[2])

    def migrate_some(self, max_slots: int) -> bool:
        """Up to `max_slots` old slots of the media's growths migrated, or their tombstones swept
        (`PageTable.migrate_some`: the feed loop's steps while ingest is idle); True while some
        remain."""
        migrating = False
        for table in self._tables:
            before = table.migrated_slots + table.sweep.scanned
            migrating |= table.migrate_some(max_slots)
            max_slots -= table.migrated_slots + table.sweep.scanned - before
        return migrating

    def defer_frees(self) -> None:
        """From now on a growth's old arrays, once migrated, wait for `give_back_retired` (the
        router calls it after its lock) instead of being freed under it (`PageTable.retire`)."""
        for table in self._tables:
            table.retire = True

    def give_back_retired(self) -> None:
        """The tables' arrays retired by a migration that ended, freed (`PageTable.retired`):
        after the router's lock, not under it."""
        for table in self._tables:
            table.give_back_retired()

    def sweep_due(self) -> bool:
        """Whether a medium's table has tombstones to sweep (index_sweep.py; read without the
        router's lock by the feed loop, the only thread that adds them)."""
        return any(table.sweep_due() for table in self._tables)

    def drop_spares(self) -> None:
        """`PageTable.drop_spare` of every medium (ingest idle for long: feeds.py)."""
        for table in self._tables:
            table.drop_spare()

    def prepare_growth(self, chunk: int | None = None) -> bool:
        """`PageTable.prepare_growth` of every medium (the ingest thread, without the router's
        lock); True while some spare remains to write."""
        return any([table.prepare_growth(chunk) for table in self._tables])  # each one a turn

    # ----- stream ------------------------------------------------------------------------------

    def apply(self, batch: events_pb2.EventBatch, now: float | None = None) -> ApplyResult:
        """Apply one batch of a worker's stream, or say why it cannot be applied."""
        return self.apply_runs(batch_head(batch), message_runs(batch.events), now)

    def apply_runs(self, batch: BatchHead, runs: Iterable[Run], now: float | None = None
                   ) -> ApplyResult:
        """`apply` of a batch given as its head and its events' runs (a stream frame's form,
        gateway/core/stream_frames.py: no message object); `runs` is read only if applied."""
        self.changes += 1
        w = self._worker(batch.pool_id)
        w.last_seen = self._clock() if now is None else now
        if batch.snapshot and batch.clears_first:
            # A snapshot replaces the worker's view whatever came before (any epoch).
            self._clear(w)
            w.epoch, w.last_seq, w.started = batch.epoch, -1, True
            w.in_snapshot, w.needs_resync = True, False
        elif batch.epoch != w.epoch or not w.started:
            if batch.epoch != w.epoch:
                self._clear(w)  # a new epoch starts from an empty pool
                w.epoch, w.last_seq, w.started = batch.epoch, -1, False
            if batch.snapshot or batch.seq != 0:
                return self._resync(w, f"epoch {batch.epoch} joined at seq {batch.seq} without a snapshot")
            w.started, w.needs_resync = True, False
        elif batch.snapshot:
            if not w.in_snapshot:
                return self._resync(w, f"snapshot batch seq {batch.seq} without its start")
        elif w.in_snapshot:
            return self._resync(w, f"live batch seq {batch.seq} inside an unfinished snapshot")
        elif batch.seq <= w.last_seq:
            return ApplyResult(ApplyStatus.DUPLICATE, w.pool_id, f"seq {batch.seq} <= {w.last_seq}",
                               w.epoch, w.last_seq)
        elif batch.seq != w.last_seq + 1:
            return self._resync(w, f"gap: seq {batch.seq} after {w.last_seq}")
        else:
            w.needs_resync = False  # a replay resumed right after the last applied batch
        n = self._apply_events(w, runs)
        if batch.snapshot:
            if batch.snapshot_end:
                w.in_snapshot = False
                w.last_seq = batch.seq
        else:
            w.last_seq = batch.seq
        self.page_events += n
        if self._deferred is None and len(self) > self.capacity():
            self._evict()
        return ApplyResult(ApplyStatus.APPLIED, w.pool_id, "", w.epoch, w.last_seq, n)

    def heartbeat(self, hb: events_pb2.Heartbeat, now: float | None = None) -> ApplyResult:
        """Freshness, and a check that no batch was missed (head_seq beyond what was applied)."""
        w = self._worker(hb.pool_id)
        w.last_seen = self._clock() if now is None else now
        if hb.epoch != w.epoch or not w.started:
            self.changes += 1
            if hb.epoch != w.epoch:
                self._clear(w)
                w.epoch, w.last_seq, w.started = hb.epoch, -1, False
            if hb.head_seq >= 0:
                return self._resync(w, f"epoch {hb.epoch} is at seq {hb.head_seq}, nothing applied")
            w.started, w.needs_resync = True, False  # a new epoch that has emitted nothing yet
        elif not w.in_snapshot and hb.head_seq > w.last_seq:
            return self._resync(w, f"heartbeat head seq {hb.head_seq} > applied {w.last_seq}")
        return ApplyResult(ApplyStatus.APPLIED, w.pool_id, "", w.epoch, w.last_seq)

    def _resync(self, w: _Worker, reason: str) -> ApplyResult:
        self.changes += 1
        w.needs_resync = True
        w.in_snapshot = False
        self.resyncs += 1
        after = w.last_seq if w.started else -1
        return ApplyResult(ApplyStatus.RESYNC, w.pool_id, reason, w.epoch, after)

    def _apply_events(self, w: _Worker, events: Iterable[Run]) -> int:
        """Consecutive stored (or removed) events of one medium are applied as one run, so that a
        live batch of many small events takes the numpy path as a snapshot does; the order of
        stores and removals is kept (a run ends where the kind or the medium changes)."""
        n = 0
        run: list[Packed] = []  # packed hashes of the run's events
        run_key: tuple[str, int] | None = None
        for kind, tier, packed in events:
            if kind == "cleared":
                n += self._apply_run(w, run_key, run)
                run, run_key = [], None
                self._clear(w)
                continue
            if run_key != (kind, tier):
                n += self._apply_run(w, run_key, run)
                run, run_key = [], (kind, tier)
            run.append(packed)
        return n + self._apply_run(w, run_key, run)

    @contextmanager
    def bulk(self, preempt: Preemption | None = None) -> Iterator[None]:
        """`apply` calls inside are checked (seq, epoch, snapshot) one by one as they come, and
        their page events applied together at the end, one numpy run per medium
        (gateway/core/index_bulk.py), with the same final state as one by one; a clear (snapshot,
        new epoch, removal of a worker) applies what waits first. The bound is checked at the end.
        Page counts (`info().held`, `len`) are current only after the block. `preempt`: routing
        decisions may read the tables between two page events of that end."""
        if self._deferred is not None:
            yield
            return
        self._deferred = (([], [], []), ([], [], []), ([], [], []))
        try:
            yield
        finally:
            self._flush(preempt)
            self._deferred = None
        if len(self) > self.capacity():
            self._evict()

    def _flush(self, preempt: Preemption | None = None) -> None:
        if self._deferred is None:
            return
        for tier, (runs, slots, stores) in enumerate(self._deferred):
            if not runs:
                continue
            keys = np.frombuffer(b"".join(runs), dtype="V16")
            sizes = [len(r) >> 4 for r in runs]
            for slot, change in apply_ops(self._tables[tier], keys, np.repeat(slots, sizes),
                                          np.repeat(stores, sizes), preempt).items():
                self._by_slot[slot].held[tier] += change
            runs.clear()
            slots.clear()
            stores.clear()

    def _apply_run(self, w: _Worker, key: tuple[str, int] | None, run: list[Packed]) -> int:
        """Applies (or, inside `bulk()`, queues) a run of packed hashes; its page events."""
        packed = run[0] if len(run) == 1 else b"".join(run)
        if key is None or not packed:
            return 0
        kind, tier = key
        if self._deferred is not None:
            pending_runs, pending_slots, pending_stores = self._deferred[tier]
            pending_runs.append(packed)
            pending_slots.append(w.slot)
            pending_stores.append(kind == "stored")
            return len(packed) >> 4
        hashes = np.frombuffer(packed, dtype="V16")
        if len(hashes) < _BULK_PAGES:
            hashes = hashes.tolist()
        table = self._tables[tier]
        if kind == "stored":
            # add() restamps a page already held: its eviction order is the last store.
            if len(hashes) >= _BULK_PAGES:
                w.held[tier] += table.add_many(hashes, w.slot)
            else:
                w.held[tier] += sum(table.add(h, w.slot) for h in hashes)
        elif len(hashes) >= _BULK_PAGES:
            w.held[tier] -= table.discard_many(hashes, w.slot)
        else:
            w.held[tier] -= sum(table.discard(h, w.slot) for h in hashes)
        return len(hashes)

    def _clear(self, w: _Worker) -> None:
        self._flush()  # what waits in `bulk()` came before the clear
        for tier, table in enumerate(self._tables):
            if w.held[tier]:  # a scan of the table, so only when the worker holds something
                table.clear_slot(w.slot)
                w.held[tier] = 0

    def _evict(self) -> None:
        cap = self.capacity()
        target = int(cap * (1.0 - self.config.evict_fraction))
        excess = len(self) - target
        self._warn_full(cap, excess)
        for tier in _EVICT_ORDER:
            if excess <= 0:
                return
            table = self._tables[tier]
            before = len(table)
            for slot, count in table.evict(excess).items():
                self._by_slot[slot].held[tier] -= count
            dropped = before - len(table)
            excess -= dropped
            self.evicted_entries += dropped

    def _warn_full(self, cap: int, excess: int) -> None:
        now = self._clock()
        if self._warned_at is not None and now - self._warned_at < _FULL_WARNING_INTERVAL_S:
            return
        self._warned_at = now
        log.warning(kv("kv_index_full", capacity=cap, evicting=excess,
                       evicted_total=self.evicted_entries + excess, workers=len(self._workers),
                       budget_mb=self.config.memory_budget_mb, bytes_per_entry=BYTES_PER_ENTRY,
                       hint="raise --index-memory-mb: routing is losing prefix knowledge"))

    def _worker(self, pool_id: str) -> _Worker:
        w = self._workers.get(pool_id)
        if w is None:
            self.changes += 1
            slot = self._free_slots.pop() if self._free_slots else len(self._by_slot)
            w = _Worker(pool_id, slot, 1 << slot, last_seen=self._clock())
            self._workers[pool_id] = self._by_slot[slot] = w
            self._all |= w.bit
        return w

    # ----- lookup ------------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes], now: float | None = None) -> dict[str, PrefixMatch]:
        """Per worker holding the first page anywhere: its device run, host and remote extension.

        REMOTE (L3) is shared by every worker, so a page any worker reported on REMOTE extends
        every worker's match. A worker's host extension also counts pages it holds on device
        after its device run ended (their load cost is then overestimated, never the reverse).
        Workers missing from the answer match nothing. (`holders`, as PrefixMatch objects.)
        """
        return self.holders(hashes, now).matches()

    def holders(self, hashes: Sequence[bytes], now: float | None = None) -> Holders:
        """`lookup`'s answer as arrays: the runs are found per group of slots ending together
        (`run_ends`), and a shared prefix's hundred holders cost a few numpy calls, not a
        PrefixMatch and a confidence call each."""
        dev, host, rem = self._tables
        everyone = self._all
        if not everyone or not hashes:
            return Holders.empty()
        # The pages' holders in vectorised probes per medium, up to the first page held nowhere;
        # ends past 0 only (see `runs`): workers holding none of the first page cost nothing.
        media = (dev, host if len(host) else None, rem if len(rem) else None)
        touch = [t.touch_stamps(len(hashes), self.capacity()) if t is not None and
                 self.touch_lookups else None for t in media]
        held = None if not self.lookup_in_c or index_native.kernel() is None else \
            self._probe.probe(media, hashes, self.lookup_chunk_pages, touch)
        if held is not None:  # in one C call, by segments of pages held alike (held_native.py)
            devm, hostm, remm, at, end, _ = held
        else:
            devm, hostm, remm = held_masks(*media, hashes, self.lookup_chunk_pages, touch)
            at, end = None, len(devm)
        if not devm:  # the first page is held nowhere
            return Holders.empty()
        slots, d_end, h_end, r_end = holder_runs(devm, hostm, remm, everyone, at, end)
        workers = list(map(self._by_slot.__getitem__, slots.tolist()))
        now = self._clock() if now is None else now
        return Holders(list(map(_POOL_ID, workers)), d_end, h_end - d_end, r_end - h_end,
                       self._confidences(workers, now))

    def _confidences(self, workers: list[_Worker], now: float) -> np.ndarray:
        """`_confidence` of each worker: all 1 when every one is fresh and complete (the usual
        case, checked in one pass over them), else worker by worker."""
        k = len(workers)
        # now - min(seen) is max(now - seen): a float subtraction is monotone
        if (not any(map(_NEEDS_RESYNC, workers)) and not any(map(_IN_SNAPSHOT, workers))
                and now - min(map(_LAST_SEEN, workers), default=now) <= self.config.stale_after_s):
            return np.ones(k)
        return np.fromiter((self._confidence(w, now) for w in workers), np.float64, k)


_POOL_ID, _LAST_SEEN = attrgetter("pool_id"), attrgetter("last_seen")
_NEEDS_RESYNC, _IN_SNAPSHOT = attrgetter("needs_resync"), attrgetter("in_snapshot")
