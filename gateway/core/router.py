"""The routing state of the gateway behind one lock: the workers it may route to, the global KV
index their event streams feed, the policy, and the load tracker (design.md §6).

Event ingest (the `FeedLoop` thread, gateway/core/feeds.py), Generate calls and the preview RPCs
all meet here, and `KvIndex`, the policies and `LoadTracker` are not thread-safe, so every access
to them holds `Router.lock` (but the index checkpoint's copy, which only reads the index and
holds `writing`: gateway/core/index_checkpoint.py). Ingest holds it for bounded slices
(`apply_stream_items`) and lets a waiting routing decision in between them and between two page
events of one (gateway/core/decisions_first.py); all else that changes the index holds
`writing` too. Hashing a prompt is done by the caller, outside the lock.

Longer than 400 lines: every method that takes `Router.lock` is here, so that what holds it,
and for how long, reads in one module.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from gateway.core.cache_keys import ROUTE_REASON as CACHE_KEY_REASON
from gateway.core.cache_keys import CacheKeyAffinity
from gateway.core.candidates import CandidateSets, eligible_since
from gateway.core.decisions_first import DecisionsFirst
from gateway.core.index import ApplyResult, ApplyStatus, IndexConfig, KvIndex
from gateway.core.shared_index import SharedIndexView
from gateway.core.stream_frames import FrameItem, StreamItem
from gateway.core.metrics import MEDIA, GatewayMetrics, Snapshot
from gateway.core.policies import LoadTracker, Policy, RouteDecision, RouteRequest
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache.v1 import events_pb2
from prefixcache.v1 import gateway_pb2 as gpb
from prefixcache_client.compute import ComputeClient
from service_shell import kv

log = logging.getLogger("gateway.routing")


@dataclass(slots=True, eq=False)
class Worker:
    """A worker the gateway accepted (its model matches the fleet's)."""
    name: str  # its pool id
    address: str
    cache_address: str
    client: ComputeClient
    info: pb.GetModelInfoResponse
    # Its readiness probe answers SERVING and no call failed on it since.
    up: bool = True
    # Its event stream delivered a complete view (a snapshot, or an epoch from seq 0).
    synced: bool = False
    streaming: bool = False  # its stream is live (`set_streaming`): a candidate before `synced`
    # Calls routed to it and not finished. A worker that left keeps its client open for them
    # (a pod draining after its DNS record went); the last one closes it.
    calls: int = 0
    removed: bool = False


@dataclass(slots=True)
class Route:
    worker: Worker
    decision: RouteDecision
    # True when no eligible worker's view was complete and every worker up was a candidate.
    blind: bool = False


class Router:
    def __init__(self, policy: Policy, metrics: GatewayMetrics,
                 index_config: IndexConfig | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 cache_keys: CacheKeyAffinity | None = None,
                 index: KvIndex | SharedIndexView | None = None) -> None:
        self.lock, self.writing = threading.Lock(), threading.Lock()  # writing: see exclusive()
        self.cache_keys = cache_keys or CacheKeyAffinity(clock=clock)
        # The in-process index by default; a SharedIndexView reads the fleet's one in Redis.
        self.index = index if index is not None else KvIndex(index_config, clock)
        # The shared index is written by the indexers (gateway/core/indexer_roles.py): this
        # replica's own feeds bring only the workers' load (their heartbeats).
        self.shared = isinstance(self.index, SharedIndexView)
        if not self.shared:
            self.index.defer_frees()  # given back after the lock (apply_stream_items, ...)
        self.policy, self.metrics, self._clock = policy, metrics, clock
        self.load = LoadTracker(clock)
        self._workers: dict[str, Worker] = {}
        self._calls: dict[str, Worker] = {}  # routed request id -> its worker
        self.decisions = DecisionsFirst(self.lock, metrics.ingest_floor_sleeps.inc)
        # The candidate sets of recent decisions, kept between them (`_candidates`).
        self._candidate_sets = CandidateSets(self._workers, self.index, self._clock,
                                             keep=not self.shared)
        metrics.watch(self._gauges)
        # Each medium's matched-tokens counter (a `labels` call per decision: a lock, a lookup).
        self._matched_tokens = [metrics.matched_tokens.labels(medium) for medium in MEDIA]

    # ----- workers -----------------------------------------------------------------------------

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """The lock, for a change of the index (or a copy of it): no ingest slice is paused."""
        with self.writing, self.lock:
            yield

    def add(self, worker: Worker) -> None:
        with self.exclusive():
            self.index.add_worker(worker.name)
            self._workers[worker.name] = worker
            self._candidate_sets.joined_or_left()

    def remove(self, name: str) -> None:
        """Forgets a worker: its index entries, its policy state, its load. Its client is
        closed once no call uses it."""
        with self.exclusive():
            worker = self._workers.pop(name, None)
            self.index.remove_worker(name)
            self.policy.remove_worker(name)
            self.cache_keys.remove_worker(name)
            self.load.remove_worker(name)
            self._candidate_sets.joined_or_left()
            if worker is not None:
                worker.removed = True
            idle = worker is not None and worker.calls == 0
        if idle:
            worker.client.close()

    def get(self, name: str) -> Worker | None:
        with self.lock:
            return self._workers.get(name)

    def set_up(self, name: str, up: bool) -> bool:
        """Marks a worker (un)reachable; True when that changed its state."""
        with self.lock:
            worker = self._workers.get(name)
            if worker is None or worker.up == up:
                return False
            worker.up = up
            self._candidate_sets.clear()
            return True

    def set_streaming(self, name: str, streaming: bool) -> None:
        """A worker's feed read a Subscribe call's first item (True), or that call ended."""
        with self.lock:
            if (w := self._workers.get(name)) is not None and w.streaming != streaming:
                w.streaming = streaming
                self._candidate_sets.on_streaming(w)

    def ready(self, address: str | None = None) -> bool:
        """At least one worker may be routed to; with `address`, the worker there may (a model
        server is ready when its own worker is, whatever its peers)."""
        with self.lock:
            now = self._clock()
            return any(self._eligible(w, now) for w in self._workers.values()
                       if address is None or w.address == address)

    def warm(self) -> bool:
        """Every worker that is up delivered a complete view (its snapshot), and there is one:
        the index holds what the fleet had when this process started (gateway/core/gc_tuning.py
        freezes the heap then)."""
        with self.lock:
            up = [w for w in self._workers.values() if w.up]
            return bool(up) and all(w.synced for w in up)

    def names_elsewhere(self, address: str) -> list[str]:
        """The workers not at `address` (a model server's peers)."""
        with self.lock:
            return [n for n, w in self._workers.items() if w.address != address]

    def max_context_tokens(self) -> int:
        with self.lock:
            return min((w.info.max_context_tokens for w in self._workers.values()), default=0)

    def _staleness(self, name: str, now: float) -> float:
        seen = self.index.last_seen(name)
        return max(0.0, now - seen) if seen is not None else float("inf")

    def _eligible(self, w: Worker, now: float) -> bool:
        return eligible_since(w, self.index, now) is not None

    # ----- event streams -----------------------------------------------------------------------

    def on_stream_item(self, name: str, item: cpb.SubscribeResponse) -> ApplyResult | None:
        """Applies one item of a worker's event stream; a RESYNC result says where to resume.
        None when the worker is no longer routed to."""
        return self.apply_stream_items([(name, item)])[0]

    def apply_stream_items(self, items: Sequence[tuple[str, StreamItem]]
                           ) -> list[ApplyResult | None]:
        """Applies items of any workers' streams in order under one hold of the lock: the caller
        (gateway/core/feeds.py) bounds how many page events that is, and calls
        `yield_to_routing` between holds."""
        if self.shared:
            return self._apply_load_only(items)
        # Page events of all items: one run per medium, which routing decisions may interrupt.
        with self.exclusive(), self.index.bulk(self.decisions):
            self.policy.settle()  # the last decisions' records, here rather than in the next one
            results = [self._apply_item(name, item) for name, item in items]
        self.index.give_back_retired()
        for result in results:
            if result is not None and result.status is ApplyStatus.RESYNC:
                self.metrics.resyncs.labels(result.pool_id).inc()
        return results

    def _apply_item(self, name: str, item: StreamItem) -> ApplyResult | None:
        worker = self._workers.get(name)
        if worker is None:
            return None
        heartbeat = _heartbeat(item)
        if heartbeat is not None:
            result = self.index.heartbeat(heartbeat)
            self.load.report(name, heartbeat.load)
        elif isinstance(item, FrameItem):
            result = self.index.apply_runs(item.head, item.runs)
        else:
            result = self.index.apply(item.batch)
        was = worker.synced
        if result.status is ApplyStatus.RESYNC:
            worker.synced = False
        elif result.status is ApplyStatus.APPLIED:
            info = self.index.info(name)
            worker.synced = info is not None and not info.in_snapshot
        self._candidate_sets.on_item(name, was, worker.synced)
        return result

    def _apply_load_only(self, items: Sequence[tuple[str, StreamItem]]
                         ) -> list[ApplyResult | None]:
        """The shared index's mode: heartbeats report load; batches are the indexers' to write
        (ignored here, never a RESYNC: the feed keeps its own resume point)."""
        results: list[ApplyResult | None] = []
        with self.lock:
            self.policy.settle()
            for name, item in items:
                if name not in self._workers:
                    results.append(None)
                    continue
                heartbeat = _heartbeat(item)
                if heartbeat is not None:
                    self.load.report(name, heartbeat.load)
                results.append(ApplyResult(ApplyStatus.DUPLICATE, name))
        return results

    def refresh_shared_index(self) -> None:
        """The shared index's mode, called periodically: re-reads the worker table (liveness)
        and takes each worker's `synced` from its row there (a complete view written: no
        snapshot under way)."""
        if not self.shared:
            return
        self.index.refresh()  # outside the lock: a Redis outage must not stall routing on it
        with self.lock:
            for name, worker in self._workers.items():
                info = self.index.info(name)
                worker.synced = info is not None and not info.in_snapshot
            self._candidate_sets.clear()

    def migrate_index(self, max_slots: int) -> bool:
        """Ingest idle: one hold for a step of a growth's migration (feeds.py); True while more."""
        with self.exclusive():
            more = not self.shared and self.index.migrate_some(max_slots)
        if not self.shared:
            self.index.give_back_retired()
        return more

    def prepare_index_growth(self, chunk: int | None = None) -> bool:
        """Ingest, without the lock: writes on the index's next growth's arrays; True while more."""
        return not self.shared and self.index.prepare_growth(chunk)

    def index_sweep_due(self) -> bool:
        """Whether the index has tombstones to sweep (feeds.py: a step between slices too)."""
        return not self.shared and self.index.sweep_due()

    def drop_index_spares(self) -> None:
        """Ingest idle for long: the index's next growths' arrays freed (feeds.py)."""
        with self.exclusive():
            if not self.shared:
                self.index.drop_spares()

    def preemptible_seconds(self) -> float:
        """Seconds ingest held the lock where decisions may interrupt it, ever (decisions_first)."""
        return self.decisions.preemptible_s

    def yield_to_routing(self) -> None:
        """Bulk ingest calls this between two holds of the lock: a waiting decision goes first."""
        self.decisions.yield_to_decisions()

    def resume_point(self, name: str) -> tuple[int, int]:
        """Where a worker's broken stream picks up: SubscribeRequest(epoch, after_seq) right after
        the last batch applied, for the cache service to replay from its buffer (a snapshot when
        that no longer holds it; after_seq -1: nothing complete applied, or a snapshot broke off)."""
        with self.lock:
            info = self.index.info(name)
        if info is None or info.in_snapshot:
            return (info.epoch if info else 0), -1
        return info.epoch, info.last_seq

    # ----- routing -----------------------------------------------------------------------------

    def _candidates(self, exclude: Collection[str],
                    tokenizer_fingerprint: str = "") -> tuple[Sequence[str], bool]:
        """Workers the request may go to (gateway/core/candidates.py): eligible, not excluded,
        with the tokenizer its ids came from when it names one; sorted by name."""
        return self._candidate_sets.get(exclude, tokenizer_fingerprint, self._clock())

    def route(self, request: RouteRequest, exclude: Collection[str] = ()) -> Route | None:
        """Chooses a worker and counts the request on it (`finish` undoes that). None when no
        worker can take it."""
        with self.decisions.decision():
            candidates, blind = self._candidates(exclude, request.tokenizer_fingerprint)
            if not candidates:
                return None
            start = time.perf_counter()
            self.index.touch_lookups = not self.shared  # what it reuses outlasts other pages
            try:
                decision = self._choose(request, candidates)
            finally:
                self.index.touch_lookups = False
            self.metrics.decision_seconds.observe(time.perf_counter() - start)
            self.load.on_route(decision.worker, request.request_id, decision.prefill_tokens)
            worker = self._workers[decision.worker]
            worker.calls += 1
            self._calls[request.request_id] = worker
        chosen = next((s for s in decision.scores if s.worker == decision.worker), None)
        self.metrics.prompt_tokens.inc(request.prompt_tokens)
        if chosen is not None:
            for counter, tokens in zip(self._matched_tokens, (chosen.device_tokens,
                                                              chosen.host_tokens, chosen.remote_tokens)):
                if tokens:
                    counter.inc(tokens)
        return Route(worker, decision, blind)

    def _choose(self, request: RouteRequest, candidates: list[str]) -> RouteDecision:
        """The policy's choice, among the key's worker alone when the request's prompt-cache
        key pins one (gateway/core/cache_keys.py); the key then follows the choice."""
        pinned = self._pinned(request, candidates)
        decision = self.policy.choose(request, [pinned] if pinned else candidates, self.index,
                                      self.load, all_scores=False)
        if request.cache_key:
            self.cache_keys.record(request.cache_key, decision.worker)
        if pinned:
            decision.reason = f"{CACHE_KEY_REASON}: {decision.reason}"
        return decision

    def _pinned(self, request: RouteRequest, candidates: list[str]) -> str | None:
        """The key's worker, unless the index shows another holding more of the prompt on
        device (the key then follows the prefix: a chat whose pages left its worker goes where
        its system prompt still is)."""
        key = request.cache_key
        pinned = self.cache_keys.worker_for(key, candidates, self.load) if key else None
        if pinned is None:
            return None
        matches = self.index.lookup(request.page_hashes)
        allowed = self._candidate_sets.members(candidates)
        best = max((m.device_pages for w, m in matches.items() if w in allowed), default=0)
        mine = matches.get(pinned)
        return pinned if (mine.device_pages if mine else 0) >= best else None

    def settle(self) -> None:
        """Applies what the last decisions queued: their records of the pages they routed
        (gateway/core/routed_prefixes.py). A request's path calls it once its decision is on its
        way (the worker's call started, the picker's answer sent), so that the next decision
        need not; ingest slices do too. The lock as `finish` takes it: a call on a request's
        path, which a slice in progress lets in."""
        with self.decisions.decision():
            self.policy.settle()

    def first_token(self, request_id: str) -> None:
        with self.decisions.decision():
            self.load.on_first_token(request_id)

    def finish(self, request_id: str) -> None:
        """The routed call ended (finished, failed or cancelled)."""
        with self.decisions.decision():
            self.load.on_finish(request_id)
            worker = self._calls.pop(request_id, None)
            if worker is None:
                return
            worker.calls -= 1
            close = worker.removed and worker.calls == 0
        if close:
            worker.client.close()

    # ----- introspection -----------------------------------------------------------------------

    def preview(self, request: RouteRequest) -> gpb.RoutePreviewResponse:
        """What `route` would choose now, and every worker's numbers, changing nothing."""
        with self.lock:
            now = self._clock()
            candidates, blind = self._candidates((), request.tokenizer_fingerprint)
            decision = None
            if candidates:
                pinned = self._pinned(request, candidates)
                decision = self.policy.preview(request, [pinned] if pinned else candidates,
                                               self.index, self.load)
                if pinned:
                    decision.reason = f"{CACHE_KEY_REASON}: {decision.reason}"
            matches = self.index.lookup(request.page_hashes, now)
            scores = {s.worker: s for s in decision.scores} if decision else {}
            eligible, rows = set(candidates), []
            for name, w in sorted(self._workers.items()):
                m, s, wl = matches.get(name), scores.get(name), self.load.get(name, now)
                page = request.page_size
                device, host, remote = ((m.device_pages * page, m.host_pages * page,
                                         m.remote_pages * page) if m else (0, 0, 0))
                if s is not None:  # the policy's view (it may count pages it routed lately)
                    device, host, remote = s.device_tokens, s.host_tokens, s.remote_tokens
                rows.append(gpb.WorkerScore(
                    worker=name, address=w.address, device_tokens=device, host_tokens=host,
                    remote_tokens=remote, in_flight=wl.inflight_requests,
                    queued_prefill_tokens=wl.queued_prefill_tokens,
                    score=s.score if s is not None else 0.0,
                    staleness_s=self._staleness(name, now), eligible=name in eligible))
        out = gpb.RoutePreviewResponse(policy=self.policy.name, prompt_tokens=request.prompt_tokens,
                                       candidates=rows)
        if decision is None:
            out.reason = "no worker is up"
            return out
        out.worker = decision.worker
        row = next(r for r in rows if r.worker == decision.worker)
        held = row.device_tokens + row.host_tokens + row.remote_tokens
        out.reason = (f"holds {held} of {request.prompt_tokens} prompt tokens (device "
                      f"{row.device_tokens}, host {row.host_tokens}, remote {row.remote_tokens}); "
                      f"{decision.reason}")
        if blind:
            out.reason += "; no worker's view is complete yet: routed over every worker up"
        return out

    def _rows(self, rows: Callable[[list[tuple[str, Worker]], float], list],
              chunk: int = 64) -> list:
        """`rows([(name, worker), ...], now)` over every worker by name, the lock held for `chunk`
        of them at a time (all 1,000 in one hold kept decisions waiting ~11 ms a ListWorkers)."""
        names, out = self.names(), []
        for i in range(0, len(names), chunk):
            with self.lock:
                present = [(n, w) for n in names[i:i + chunk] if (w := self._workers.get(n))]
                out += rows(present, self._clock())
        return out

    def list_workers(self) -> gpb.ListWorkersResponse:
        def info_rows(present: list[tuple[str, Worker]], now: float) -> list[gpb.WorkerInfo]:
            loads = self.load.get_many([name for name, _ in present], now)  # ~9 us a call
            return [self._worker_info(name, w, now, load.inflight_requests)
                    for (name, w), load in zip(present, loads)]
        return gpb.ListWorkersResponse(workers=self._rows(info_rows))

    def _worker_info(self, name: str, w: Worker, now: float, in_flight: int) -> gpb.WorkerInfo:
        info = self.index.info(name)
        epoch, seq, held = (info.epoch, info.last_seq, info.pages) if info else (0, -1, (0, 0))
        return gpb.WorkerInfo(worker=name, address=w.address, cache_address=w.cache_address,
                              epoch=epoch, last_seq=seq, device_pages=held[0], host_pages=held[1],
                              staleness_s=self._staleness(name, now), in_flight=in_flight)

    def _gauges(self) -> Snapshot:
        def gauge_rows(present: list[tuple[str, Worker]], now: float) -> list:
            infos = [(name, w, self.index.info(name)) for name, w in present]
            return [(name, info.pages if info else (0, 0, 0), self._eligible(w, now))
                    for name, w, info in infos]
        rows = self._rows(gauge_rows)
        pages = {(name, medium): n for name, held, _ in rows for medium, n in zip(MEDIA, held)}
        with self.lock:
            st, (routed, routed_bytes) = self.index.stats(), self.policy.remembered()
        totals = {"entries": st.entries, "capacity": st.capacity,
                  "evictions": st.evicted_entries, "memory_bytes": st.memory_bytes,
                  "table_bytes": st.table_bytes, "swept_tombstones": st.swept_tombstones,
                  "growths_ready": st.growths_ready, "growths_partial": st.growths_partial,
                  "growths_unready": st.growths_unready, "shrinks": st.shrinks,
                  "shared_pages": st.shared_pages, "holder_sets": st.holder_sets,
                  "routed_pages": routed, "routed_memory_bytes": routed_bytes}
        return pages, {"known": len(rows), "eligible": sum(e for *_, e in rows)}, totals

    def names(self) -> Sequence[str]:
        with self.lock:
            return sorted(self._workers)


def _heartbeat(item: StreamItem) -> events_pb2.Heartbeat | None:
    if isinstance(item, FrameItem):
        return item.heartbeat
    return item.heartbeat if item.WhichOneof("item") == "heartbeat" else None


def log_resync(name: str, result: ApplyResult) -> None:
    log.info(kv("stream_resync", worker=name, reason=result.reason, epoch=result.resume_epoch,
                after_seq=result.resume_after_seq))
