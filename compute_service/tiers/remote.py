"""The compute side of L3: page writes in the background and validated page loads.

Writes: the engine gathers a page's bytes to the CPU inside its step (so the page may be reused
right after) and hands them to `write`; a writer thread serializes them (payload.encode) and
sends them in pipelined batches (L3Client.set_many). The queue is bounded in bytes: when Redis
is slower than the engine, new writes are dropped and counted, never waited for.

Loads: `load` fetches every page wanted in one step at once, for all requests, as consecutive
MGETs of `batch_pages` (L3Client.get_many), stopping at the first batch that returns nothing
(a failing Redis costs one timeout per step, not one per batch); it decodes each needed payload
and returns, per request, the contiguous prefix of valid pages. A missing page, or one on a
Redis Cluster master that cannot be asked, ends that prefix; a rejected one (payload.decode)
also ends it, is counted under its reason and its key is deleted (in the background, after any
write queued before it).

Payloads carry a MAC keyed with the L3 MAC key (L3Config.mac_key) over the Redis key and the
bytes: a page forged, written without the key or copied from another key is rejected
(payload.decode) like any invalid one. Without a key this tier warns once at start.

Invariant: nothing here raises because of Redis. The L3Client bounds every call by its timeout
and circuit breaker and turns every failure into "missing". A write that fails, is skipped while
the breaker is open, or is dropped from the full queue is counted and its page hash kept for
`take_failed`: the engine reports it in its next Step (`failed_remote_writes`), and the cache
service lists the write again once the store answers (cache_service/l3_refill.py).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from compute_service.tiers.payload import (REASONS, MambaStates, PageData, PageLayout,
                                           PayloadRejected, decode, encode)
from pagestore.client import UNAVAILABLE, L3Client

log = logging.getLogger("compute_service.tiers")
# L3Client counters always reported (0 until they happen), so the metric set is stable.
CLIENT_COUNTERS = ("probes", "probe_hit_pages", "get_pages", "set_pages", "set_failed_pages",
                   "deleted", "timeouts", "errors", "skipped_breaker_open", "moved",
                   "topology_refreshes")


@dataclass(slots=True)
class RemoteTierConfig:
    write_queue_bytes: int = 256 << 20  # gathered page bytes waiting for Redis
    # Pages per Redis round trip (a pipelined SET batch, or one MGET). Bounded so that one reply
    # stays a few MB: a single huge reply is more likely to meet a stall longer than the
    # per-operation timeout on a loaded machine, and then loses every page instead of a batch.
    batch_pages: int = 32
    # Page hashes of writes not done, kept for the engine to report (the oldest go beyond it:
    # their runs stay marked written until the store is found to have lost its data).
    failed_kept: int = 65536


@dataclass(slots=True)
class RemoteCounters:
    """Monotonic counters. Fields written by the writer thread and by the engine thread are
    disjoint, so no lock is needed."""
    # engine thread
    write_pages_queued: int = 0
    write_pages_dropped: int = 0  # queue full
    load_pages_requested: int = 0
    load_pages_ok: int = 0
    load_pages_missing: int = 0
    load_pages_unavailable: int = 0  # on a cluster master that could not be asked
    load_pages_skipped: int = 0  # after a missing or rejected page of the same request
    load_bytes: int = 0
    load_seconds: float = 0.0
    loads: int = 0
    rejected: collections.Counter = field(default_factory=collections.Counter)
    # writer thread
    write_pages_ok: int = 0
    write_pages_failed: int = 0
    write_bytes: int = 0
    write_seconds: float = 0.0
    deletes: int = 0


@dataclass(slots=True)
class _Job:
    """One queued write (kv set) or delete (kv None) of the page `page_hash`."""
    page_hash: bytes
    kv: torch.Tensor | None = None
    mamba: MambaStates | None = None
    nbytes: int = 0


class RemoteTier:
    def __init__(self, client: L3Client, model_id: str, layout: PageLayout,
                 cfg: RemoteTierConfig | None = None):
        self.client, self.model_id, self.layout = client, model_id, layout
        self.cfg = cfg or RemoteTierConfig()
        self.counters = RemoteCounters()
        self.mac_key = client.cfg.mac_key
        if not self.mac_key:
            log.warning("event=l3_unauthenticated model=%s: no L3 MAC key (--l3-mac-key-file): "
                        "pages are checksummed, not authenticated; anyone who can write to "
                        "Redis can change this worker's output", model_id)
        self._jobs: collections.deque[_Job] = collections.deque()
        self._failed: list[bytes] = []  # page hashes not written, not yet reported
        self._queued_bytes = 0
        self._busy = False
        self._closed = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._write_loop, name="l3-writer", daemon=True)
        self._thread.start()

    # ---- writes ---------------------------------------------------------------------------

    def write(self, hashes: list[bytes], kv: torch.Tensor, mamba: list[MambaStates | None]) -> None:
        """Queues pages for L3: kv [layers, 2, n, ...] on the CPU (owned by the tier from now
        on; queued pages are views of it, so it lives until its last page is attempted),
        mamba[i] the checkpoint after page i or None. Pages beyond the byte budget are dropped."""
        page_bytes = self.layout.kv_bytes()
        for i, h in enumerate(hashes):
            nbytes = page_bytes + (self.layout.checkpoint_bytes() if mamba[i] is not None else 0)
            with self._cv:
                if self._queued_bytes + nbytes > self.cfg.write_queue_bytes:
                    self.counters.write_pages_dropped += 1
                    if len(self._failed) < self.cfg.failed_kept:
                        self._failed.append(h)
                    continue
                self._jobs.append(_Job(h, kv[:, :, i], mamba[i], nbytes))
                self._queued_bytes += nbytes
                self.counters.write_pages_queued += 1
                self._cv.notify()

    def _delete(self, page_hash: bytes) -> None:
        # Deletes are not bounded by the byte budget: they carry no bytes and are rare.
        with self._cv:
            self._jobs.append(_Job(page_hash))
            self._cv.notify()

    def take_failed(self, limit: int) -> list[bytes]:
        """Up to `limit` page hashes whose writes were not done (oldest first), handed over to
        be reported; the rest stay for the next call."""
        with self._cv:
            taken, self._failed = self._failed[:limit], self._failed[limit:]
        return taken

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Waits until every queued write and delete has been attempted; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._jobs or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Stops the writer after it has attempted what is queued (at most `timeout_s`)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout_s)

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if not self._jobs:
                    return
                batch = [self._jobs.popleft()
                         for _ in range(min(len(self._jobs), self.cfg.batch_pages))]
                self._busy = True
            try:
                self._run(batch)
            except Exception:  # the writer must outlive any one bad batch
                log.exception("event=l3_write_batch_failed pages=%d", len(batch))
                self.counters.write_pages_failed += sum(j.kv is not None for j in batch)
                self._lost([j.page_hash for j in batch if j.kv is not None])
            finally:
                with self._cv:
                    self._queued_bytes -= sum(j.nbytes for j in batch)
                    self._busy = False
                    self._cv.notify_all()

    def _run(self, batch: list[_Job]) -> None:
        """Executes the batch in queue order: runs of writes as one pipelined set_many."""
        start = time.perf_counter()
        i = 0
        while i < len(batch):
            if batch[i].kv is None:
                self.client.delete(self.model_id, batch[i].page_hash)
                self.counters.deletes += 1
                i += 1
                continue
            j = i
            while j < len(batch) and batch[j].kv is not None:
                j += 1
            items = [(job.page_hash, encode(job.page_hash, self.layout, job.kv, job.mamba,
                                            mac_key=self.mac_key,
                                            context=self._context(job.page_hash)))
                     for job in batch[i:j]]
            # On a cluster, a dead master's share of the batch fails and the rest is written.
            ok = self.client.set_pages(self.model_id, items)
            written = sum(ok)
            if written < len(items):
                self._lost([h for (h, _), done in zip(items, ok, strict=True) if not done])
            self.counters.write_pages_ok += written
            self.counters.write_pages_failed += len(items) - written
            if written:
                self.counters.write_bytes += written * len(items[0][1])
            i = j
        self.counters.write_seconds += time.perf_counter() - start

    def _lost(self, hashes: list[bytes]) -> None:
        with self._cv:
            self._failed += hashes
            if len(self._failed) > self.cfg.failed_kept:
                del self._failed[:-self.cfg.failed_kept]

    # ---- loads ----------------------------------------------------------------------------

    def load(self, wanted: list[list[bytes]]) -> list[list[PageData]]:
        """Per request, the valid pages of L3 from the start of its hash list up to the first
        missing or rejected one."""
        unique = list(dict.fromkeys(h for hashes in wanted for h in hashes))
        if not unique:
            return [[] for _ in wanted]
        start = time.perf_counter()
        c = self.counters
        c.loads += 1
        c.load_pages_requested += sum(len(hashes) for hashes in wanted)
        payloads: dict[bytes, bytes | None] = dict.fromkeys(unique)
        for i in range(0, len(unique), self.cfg.batch_pages):
            batch = unique[i:i + self.cfg.batch_pages]
            fetched = self.client.get_many(self.model_id, batch)
            if fetched is None:
                break  # Redis failed: a miss; later batches are not worth a wait
            payloads.update(zip(batch, fetched, strict=True))
            for h, value in zip(batch, fetched, strict=True):
                if value is None:  # the probe saw the key: a value of another type, or just
                    self._delete(h)  # evicted; either way it must not be probed again
            if all(v is None or v is UNAVAILABLE for v in fetched):
                break  # these pages are gone: later batches are not worth a wait
        pages: dict[bytes, PageData | None] = {}
        out = []
        for hashes in wanted:
            valid: list[PageData] = []
            for h in hashes:
                if h not in pages:
                    pages[h] = self._decode(h, payloads[h])
                if pages[h] is None:
                    c.load_pages_missing += payloads[h] is None
                    c.load_pages_unavailable += payloads[h] is UNAVAILABLE
                    break
                valid.append(pages[h])
            c.load_pages_ok += len(valid)
            c.load_pages_skipped += len(hashes) - len(valid) - (len(valid) < len(hashes))
            out.append(valid)
        c.load_seconds += time.perf_counter() - start
        return out

    def _context(self, page_hash: bytes) -> bytes:
        """What the MAC binds a payload to besides its bytes: the Redis key it is stored under."""
        return self.client.key(self.model_id, page_hash).encode()

    def _decode(self, page_hash: bytes, payload) -> PageData | None:
        if payload is None or payload is UNAVAILABLE:
            return None
        self.counters.load_bytes += len(payload)
        try:
            return decode(payload, page_hash, self.layout, mac_key=self.mac_key,
                          context=self._context(page_hash))
        except PayloadRejected as err:
            self.counters.rejected[err.reason] += 1
            log.warning("event=l3_payload_rejected page=%s reason=%s detail=%s", page_hash.hex(),
                        err.reason, err.detail)
            self._delete(page_hash)
            return None

    # ---- metrics --------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """Flat name -> value: this tier's counters, the client's call counters and breaker."""
        c = self.counters
        out: dict[str, float] = {name: getattr(c, name) for name in RemoteCounters.__slots__
                                 if name != "rejected"}
        out.update({f"rejected_{reason}": c.rejected[reason] for reason in REASONS})
        calls = self.client.counters.calls
        out.update({f"client_{name}": calls[name] for name in (*CLIENT_COUNTERS, *calls)})
        out["breaker_open"] = {"closed": 0, "half-open": 1, "open": 2}[self.client.breaker_state()]
        out["up"] = 1 if self.client.up is not False else 0
        with self._cv:
            out["write_queue_bytes"] = self._queued_bytes
        return out
