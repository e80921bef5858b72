"""The in-process routing index on disk, so that a restarted gateway is warm again without
rebuilding it (issue 31; design.md §6, "Restarts").

A restart used to start every feed from a full snapshot: 10M pages at ~1M pages/s of table
inserts is ~30 s cold. A checkpoint holds the `PageTable` arrays of each medium (their occupied
slots, below; an old table too while a growth migrates), the sets of holders of shared pages
by id, and per worker its
pool id, address, slot, epoch and last applied seq. On start the arrays are rebuilt at their
positions (no insert) and the workers restored; when a worker is admitted again its feed subscribes from the
checkpoint's (epoch, seq) (`Router.resume_point`): the cache service replays what came since, or,
when its buffer no longer holds that seq or the epoch changed, sends a snapshot that replaces
that worker's entries only (KvIndex.apply's existing rules).

Consistency: `capture` copies everything holding `Router.writing`, which every change of the
index holds (`Router.exclusive`: ingest slices, their pauses included, so nothing is deferred;
growth steps; workers added and removed), but not `Router.lock`: routing decisions only read the
index, so they go on during the copy (at 10M pages ~24 ms, which they used to wait for, once
a save) and only ingest waits; the write happens after, without either lock, to a
temporary file renamed over the old one (a crash never leaves half a checkpoint: a SIGKILL at any
point of the write leaves the previous file, tests/gateway/test_index_checkpoint_crash.py). The
temporary file has one name per checkpoint, so a killed writer's leftover is overwritten by the
next write, and removed by the next restore. A checkpoint of another version, namespace or hash
spec, or one that does not parse, is ignored with a warning.

What a write costs is its bytes (copying them into the page cache at ~0.3 GB/s here; the zip's
CRC and the fsync are ~20% of it), so the file holds only the occupied slots of each table
(gateway/core/checkpoint_arrays.py: 14 bytes a slot and a bit per slot, where a table's arrays
are 16 bytes a slot at 30-70% occupancy, and a growing table's new arrays are mostly empty), and
a write is skipped when the index has not changed since the last one (`KvIndex.changes`).

This module reads the tables' and the index's private fields on purpose: it is their on-disk
form, and keeping it here keeps index.py and index_table.py about the live structure.
"""
from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import threading
import time
import zipfile
from dataclasses import dataclass

import numpy as np

from gateway.core.checkpoint_arrays import compact, expand, masks_of, sets
from gateway.core.holder_sets import PAIR, SHARED, TRIPLE, HolderSets, pair_slots, triple_slots
from gateway.core.index import KvIndex, _Worker
from gateway.core.index_sweep import Sweep
from gateway.core.index_table import MIGRATE_STEP, PageTable
from gateway.core.table_arrays import Spare
from service_shell import kv

log = logging.getLogger("gateway.checkpoint")

# Bumped whenever the layout below or PageTable's hashing (its `_home`) changes. 2: only the
# occupied slots (checkpoint_arrays.py); 3: one 64-bit key a slot (index_table.key_of); 4: shared
# pages' holders as the ids of sets (holder_sets.py), not masks by position; 5: pages two workers
# hold name their pair (holder_sets.PAIR), not a set; 6: pages three hold, their triple.
VERSION = 6
_MEDIA = 3


@dataclass(slots=True)
class Captured:
    """A consistent copy of the index, ready to write."""
    arrays: dict[str, np.ndarray | list[int]]  # each table's sets of holders by id, copied
    meta: dict
    lock_held_s: float = 0.0


def _own_views(t: PageTable, prefix: str) -> dict[str, np.ndarray]:
    """numpy views of one table's own arrays."""
    return {prefix + "key": t._mem.key,
            prefix + "holder": t._mem.holder,
            prefix + "stamp": t._mem.stamp}


def _views(t: PageTable, prefix: str) -> dict[str, np.ndarray]:
    """numpy views of one table's arrays and its old table's (while a growth migrates)."""
    views = _own_views(t, prefix)
    return views if t._old is None else views | _views(t._old, prefix + "old.")


def sizes(index: KvIndex) -> dict[str, tuple[np.dtype, int]]:
    """(dtype, length) of every array `capture` copies; under the router's lock (microseconds)."""
    return {name: (v.dtype, len(v)) for tier, t in enumerate(index._tables)
            for name, v in _views(t, f"t{tier}.").items()}


def _table_arrays(t: PageTable, prefix: str, out: dict, meta: dict,
                  into: dict[str, np.ndarray]) -> None:
    """Copies of one table's arrays (into `into`'s where the sizes still match)."""
    for name, view in _own_views(t, prefix).items():
        buf = into.get(name)
        if buf is not None and buf.shape == view.shape:
            np.copyto(buf, view)
            out[name] = buf
        else:
            out[name] = view.copy()
    # A growth's old table (PageTable._grow) has no clock, cursor or rate of its own.
    meta[prefix] = {"cap": len(t._holder), "used": t._used, "live": t.live, "clock": getattr(t, "_clock", 0),
                    "cursor": getattr(t, "_cursor", 0), "rate": getattr(t, "rate", 0),
                    "old": t._old is not None}
    if t._old is not None:
        _table_arrays(t._old, prefix + "old.", out, meta, into)


def _table_from(arrays: dict[str, np.ndarray], prefix: str, meta: dict) -> PageTable:
    m = meta[prefix]
    t = PageTable.__new__(PageTable)
    t._use(expand(arrays, prefix, int(m["cap"])))
    t._used, t.live, t._clock = int(m["used"]), int(m["live"]), int(m["clock"])
    t._cursor, t.rate = int(m["cursor"]), int(m["rate"])
    t.migrate_step, t.migrated_slots, t.shrinks = MIGRATE_STEP, 0, 0
    t.retire, t.retired = False, None
    t._old = _table_from(arrays, prefix + "old.", meta) if m["old"] else None
    t._spare = Spare(t.live, t._used + (t._old.live if t._old is not None else 0))
    t.sweep = Sweep()
    return t


def _medium_from(arrays: dict[str, np.ndarray], prefix: str, meta: dict) -> PageTable:
    """A medium's table (and a growth's old one), sharing their sets of holders, each set
    counted from the pages of both that hold it."""
    t = _table_from(arrays, prefix, meta)
    tables = t._tables()
    held = np.concatenate([x._mem.holder[x._mem.holder >= PAIR] for x in tables])
    values, pages = np.unique(held[held >= SHARED], return_counts=True)
    holder_sets = HolderSets.restored(masks_of(arrays[prefix + "sets"]),
                                      zip(values.tolist(), pages.tolist()),
                                      pairs=int(np.count_nonzero(held < TRIPLE)),
                                      triples=int(np.count_nonzero((held >= TRIPLE)
                                                                   & (held < SHARED))))
    for x in tables:
        x.holder_sets = holder_sets
    return t


def capture(index: KvIndex, addresses: dict[str, str], namespace: str, hash_spec: str,
            into: dict[str, np.ndarray] | None = None) -> Captured:
    """The index's state as copies; call it holding `Router.writing` (outside `bulk()`). `into`:
    arrays of `sizes`' shapes to copy into (any that no longer fit are allocated afresh)."""
    start = time.perf_counter()
    if index._deferred is not None:
        raise RuntimeError("index checkpoint inside a bulk() block")
    arrays: dict[str, np.ndarray] = {}
    tables: dict = {}
    for tier, table in enumerate(index._tables):
        _table_arrays(table, f"t{tier}.", arrays, tables, into or {})
        arrays[f"t{tier}.sets"] = list(table.holder_sets.masks)  # encoded by `write`
    workers = [{"pool_id": w.pool_id, "address": addresses.get(w.pool_id, ""), "slot": w.slot,
                "epoch": w.epoch, "last_seq": w.last_seq, "started": w.started,
                "in_snapshot": w.in_snapshot or w.needs_resync, "held": list(w.held)}
               for w in index._workers.values()]
    meta = {"version": VERSION, "namespace": namespace, "hash_spec": hash_spec,
            "written_at": time.time(), "tables": tables, "workers": workers,
            "free_slots": list(index._free_slots)}
    return Captured(arrays, meta, time.perf_counter() - start)


def temporary_path(path: str) -> str:
    """Where `write` writes before the rename: one name, so a killed writer's leftover is
    overwritten by the next write."""
    return path + ".tmp"


def remove_leftovers(path: str) -> None:
    """Removes what a writer killed mid-write left beside `path` (version 1 writers named their
    temporary file after their pid)."""
    for leftover in glob.glob(glob.escape(path) + ".tmp*"):
        if leftover == temporary_path(path) or leftover[len(path) + 4:].isdigit():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)
                log.info(kv("index_checkpoint_leftover_removed", path=leftover))


def write(captured: Captured, path: str) -> None:
    """Writes the checkpoint atomically: a temporary file beside `path`, fsynced, renamed."""
    tmp = temporary_path(path)
    arrays = {}
    for name, value in captured.arrays.items():
        if isinstance(value, list):
            arrays.update(sets(name, value))
        elif name.endswith("holder"):
            arrays.update(compact(captured.arrays, name.removesuffix("holder")))
    try:
        with open(tmp, "wb") as f:
            np.savez(f, meta=np.array(json.dumps(captured.meta)), **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(index: KvIndex, path: str, namespace: str, hash_spec: str) -> list[str]:
    """Restores a checkpoint into an empty index; the pool ids restored. Any problem (no file,
    another version, namespace or hash spec, a corrupt file) leaves the index empty, with a
    warning, and returns []."""
    if not os.path.exists(path):
        return []
    if len(index) or index.workers():
        raise RuntimeError("index checkpoint: load into an empty index only")
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            why = _incompatible(meta, namespace, hash_spec)
            if why:
                log.warning(kv("index_checkpoint_ignored", path=path, reason=why))
                return []
            arrays = {k: z[k] for k in z.files if k != "meta"}
        tables = tuple(_medium_from(arrays, f"t{tier}.", meta["tables"]) for tier in range(_MEDIA))
        workers = _workers(meta, index._clock())
        _check_holders(tables, {w.slot for w in workers})
        free_slots = [int(s) for s in meta["free_slots"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError, zipfile.BadZipFile,
            EOFError) as exc:
        log.warning(kv("index_checkpoint_ignored", path=path, reason=f"{type(exc).__name__}: {exc}"))
        return []
    for old, new in zip(index._tables, tables):
        new.retire, new.expect = old.retire, old.expect
    index._tables, index._free_slots = tables, free_slots
    index.changes += 1  # what it holds is the file's now (and what it estimated is stale)
    for w in workers:
        index._workers[w.pool_id] = index._by_slot[w.slot] = w
        index._all |= w.bit
    log.info(kv("index_checkpoint_loaded", path=path, workers=len(workers), keys=len(index),
                written_at=meta["written_at"]))
    return [w.pool_id for w in workers]


def _workers(meta: dict, now: float) -> list[_Worker]:
    """The checkpoint's workers. A restored worker counts as seen now (the staleness clock
    starts at the restart) and resumes where it was, or from a snapshot when it was inside one
    or waiting for a resync."""
    workers = []
    for entry in meta["workers"]:
        slot = int(entry["slot"])
        if slot < 0:
            raise ValueError(f"worker slot {slot}")
        workers.append(_Worker(str(entry["pool_id"]), slot, 1 << slot, epoch=int(entry["epoch"]),
                               last_seq=int(entry["last_seq"]), started=bool(entry["started"]),
                               in_snapshot=bool(entry["in_snapshot"]), last_seen=now,
                               held=[int(h) for h in entry["held"]][:_MEDIA]))
    if len({w.slot for w in workers}) != len(workers) or len({w.pool_id for w in workers}) != len(workers):
        raise ValueError("two workers share a slot or a pool id")
    return workers


def _check_holders(tables: tuple[PageTable, ...], slots: set[int]) -> None:
    """Every holder a table names is a restored worker's slot: routing looks them up."""
    known = np.zeros(max(slots, default=-1) + 2, dtype=bool)
    known[list(slots)] = True
    every = 0
    for table in tables:
        for t in (table, table._old) if table._old is not None else (table,):
            holder = t._mem.holder
            pairs = holder[(holder >= PAIR) & (holder < TRIPLE)]
            triples = holder[(holder >= TRIPLE) & (holder < SHARED)]
            single = np.concatenate([holder[(holder >= 0) & (holder < PAIR)], *pair_slots(pairs),
                                     *triple_slots(triples)])
            if len(single) and (single.max() >= len(known) or not known[single].all()):
                raise ValueError("a page held by a slot no worker has")
        for m in table.holder_sets.masks:
            every |= m
    if every >> len(known) or any(every >> s & 1 and not known[s] for s in range(len(known))):
        raise ValueError("a shared page held by a slot no worker has")


def _incompatible(meta: dict, namespace: str, hash_spec: str) -> str:
    if meta.get("version") != VERSION:
        return f"version {meta.get('version')}, this build reads {VERSION}"
    if meta.get("namespace") != namespace:
        return f"namespace {meta.get('namespace')!r}, this gateway's is {namespace!r}"
    if meta.get("hash_spec") != hash_spec:
        return f"hash spec {meta.get('hash_spec')!r}, this gateway's is {hash_spec!r}"
    return ""


class IndexCheckpointer:
    """Writes the router's index to `path` every `interval_s` and once more at `stop()` (a clean
    shutdown); at `restore()`, loads it. Workers restored but not admitted again within
    `drop_after_s` (the index's dead_after_s: the usual staleness) are removed from the index."""

    def __init__(self, router, path: str, interval_s: float, namespace: str, hash_spec: str,
                 drop_after_s: float) -> None:
        self.router, self.path, self.interval_s = router, path, interval_s
        self.namespace, self.hash_spec, self.drop_after_s = namespace, hash_spec, drop_after_s
        self._waiting: dict[str, float] = {}  # restored pool id -> when it is dropped unless admitted
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="index-checkpoint", daemon=True)
        self.last_lock_held_s = self.last_write_s = 0.0  # the last write's, as logged
        self.writes = self.skipped = 0
        self._written_changes: int | None = None  # KvIndex.changes the file on disk holds
        self._last = time.monotonic()

    def restore(self) -> list[str]:
        remove_leftovers(self.path)
        with self.router.exclusive():
            names = load(self.router.index, self.path, self.namespace, self.hash_spec)
            if names:
                self._written_changes = self.router.index.changes
        deadline = time.monotonic() + self.drop_after_s
        self._waiting = {n: deadline for n in names}
        return names

    def start(self) -> IndexCheckpointer:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Ends the periodic writes and writes a last checkpoint."""
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()
        self.save()

    def save(self) -> float:
        """One checkpoint now, unless the index has not changed since the last one (then only
        `skipped` counts it); the seconds `Router.writing` was held for the copy (the index's
        writers waited that long; decisions, which only read it, did not)."""
        router = self.router
        with router.writing:
            if router.index.changes == self._written_changes and os.path.exists(self.path):
                self.skipped += 1
                return 0.0
            shapes = sizes(router.index)
        into = {name: np.empty(n, dtype=dt) for name, (dt, n) in shapes.items()}
        for buf in into.values():
            # np.empty maps lazily: fault the pages in here, not under the lock (at 10M pages,
            # allocating and faulting in ~0.85 GB under it held the lock ~2 s).
            buf.fill(0)
        with router.writing:
            addresses = {n: w.address for n, w in router._workers.items()}
            captured = capture(router.index, addresses, self.namespace, self.hash_spec, into)
            changes = router.index.changes
        del into
        start = time.perf_counter()
        write(captured, self.path)
        self._written_changes = changes
        self.last_lock_held_s, self.writes = captured.lock_held_s, self.writes + 1
        self.last_write_s = time.perf_counter() - start
        log.info(kv("index_checkpoint_written", path=self.path, keys=len(router.index),
                    lock_held_s=round(captured.lock_held_s, 4), write_s=round(self.last_write_s, 3)))
        return captured.lock_held_s

    def drop_unclaimed(self, now: float | None = None) -> list[str]:
        """Removes restored workers that were not admitted again in time; their pool ids."""
        now = time.monotonic() if now is None else now
        router, dropped = self.router, []
        for name, deadline in list(self._waiting.items()):
            if router.get(name) is not None:
                del self._waiting[name]
            elif now >= deadline:
                del self._waiting[name]
                with router.exclusive():
                    if name not in router._workers:  # admitted meanwhile: keep it
                        router.index.remove_worker(name)
                        dropped.append(name)
        if dropped:
            log.info(kv("index_checkpoint_workers_dropped", workers=len(dropped)))
        return dropped

    def _run(self) -> None:
        while not self._stop.wait(min(self.interval_s, 1.0) if self._waiting else self.interval_s):
            self.drop_unclaimed()
            if self._due():
                try:
                    self.save()
                except Exception:  # a full disk must not take routing down
                    log.exception(kv("index_checkpoint_failed", path=self.path))

    def _due(self) -> bool:
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self._last = now
            return True
        return False
