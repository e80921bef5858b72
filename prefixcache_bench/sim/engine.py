"""Discrete-event model of N workers behind the gateway, driving the real index and policies.

Per worker, as in an engine with continuous batching:
- a FIFO prefill lane run in steps: a step takes queued prompts in order while their uncached
  tokens fit `step_tokens` (a prompt longer than that is a step of its own), matching each one
  against the worker's page cache (device LRU, optional host tier, then the shared L3) as it is
  taken. A step costs `step_overhead_s` plus `CostModel.prefill_s` of each prompt; at its end
  each prompt's pages are committed to the cache, the resulting KV events go to the gateway's
  `KvIndex` as one real `EventBatch` (after `event_delay_s`), and each request's time to first
  token is recorded. As in the engine: a prompt sharing uncached pages with one already in the
  step waits for the next step and matches them then (a sibling in flight), and a queued twin of
  a prompt the step completes (the same tokens) gets its first token at the step's end, sampled
  from the same logits (Scheduler.twins), then still runs a step of its own (it recomputes the
  prompt's partial last page);
- a decode batch that runs beside it: each request then decodes for `tpot_s` per output token,
  and while it does it takes `decode_s_per_token / tpot_s` of the worker's compute, so a worker
  with R requests decoding prefills 1 / (1 - R * that share) times slower (share capped).
Workers report their queue (LoadReport) after every change (after the delay), a Heartbeat every `heartbeat_s`.

The gateway side is the gateway's own `Router`: `Router.route` routes each request (timed per call
as `decision_ns`), `first_token` / `finish` / `on_stream_item` take first tokens, finishes and
heartbeats; event batches go to its `KvIndex.apply` directly (timed as `index_apply_ns`;
`Router._apply_item` adds only the "synced" flag the first heartbeat sets).

Shared L3 (`SimConfig.l3_capacity_tokens` > 0), as compute_service's Redis tier works:
- writes: write-back (default) sends the pages a worker drops altogether (evicted from device
  with no host tier, else dropped from host) to the L3 when they leave; write-through sends
  every page a prefill computed when it is published (end of its step). Writes run in the
  background and cost the worker nothing here;
- reads: the part of a prompt past the chosen worker's device run and host extension is looked
  up in the L3 as a contiguous extension and loaded at `l3_load_s_per_token` instead of being
  computed; loaded pages then sit on the worker's device like computed ones. These are hits
  (`l3_hit_tokens`), counted apart from device and host hits;
- the index: the L3 publishes its own event stream (pool id `L3_POOL`): BlockStored(REMOTE)
  when a page enters it, BlockRemoved(REMOTE) when its LRU drops one, what a subscriber to the
  Redis keyspace notifications (new key, evicted) sees. `KvIndex.lookup` counts a REMOTE page
  for every worker, so the affinity policy prices an L3 hit the same on every worker (at
  `AffinityConfig.remote_cost`) and still prefers the worker holding the prefix on device.
  With `l3_events` False the index hears nothing of the L3 and the policies ignore it.
"""
from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.core.index import IndexConfig, KvIndex
from gateway.core.metrics import GatewayMetrics
from gateway.core.policies import RECENT_HALFLIFE_S, LoadTracker, Policy, RouteRequest
from gateway.core.router import Router, Worker as RouterWorker
from prefixcache_bench.sim.cache import PageCache, SharedL3
from prefixcache_bench.sim.index_memory import index_bytes
from prefixcache_bench.sim.trace import TraceRequest
from prefixcache.v1 import cache_service_pb2, common_pb2, compute_service_pb2, events_pb2


@dataclass(slots=True)
class CostModel:
    """Roughly Llama-3-8B in bf16 on one H100 (~55% of its 989 dense TFLOP/s)."""
    # ~16 GFLOP per token in the linear layers -> ~33k tokens/s.
    prefill_s_per_token: float = 30e-6
    # Causal attention, per (query, context token) pair: 4 * 32 layers * 4096 FLOP.
    attention_s_per_pair: float = 9.7e-10
    # 128 KiB of KV per token over ~25 GB/s of PCIe.
    host_load_s_per_token: float = 5e-6
    step_overhead_s: float = 0.010  # per prefill step: scheduling plus the first decode step
    step_tokens: int = 8192  # uncached prompt tokens one step takes (chunked-prefill budget)
    # Worker compute per output token: a ~25 ms decode step shared by a batch of ~64.
    decode_s_per_token: float = 0.4e-3
    # Time per output token a decoding request sees.
    tpot_s: float = 0.030
    # Decoding never takes more than this share of the worker's compute away from prefill.
    max_decode_share: float = 0.8
    # 128 KiB of KV per token from the shared L3 at ~13 GB/s (100 GbE-class network, pipelined
    # reads): a third of computing it, as AffinityConfig.remote_cost (0.35) prices it.
    l3_load_s_per_token: float = 10e-6

    def prefill_s(self, prompt: int, cached: int, host_tokens: int, l3_tokens: int = 0) -> float:
        """Compute time of one prompt's uncached part, plus loading its host and L3 hits (the
        step overhead is counted per step)."""
        pairs = (prompt * prompt - cached * cached) / 2
        return (self.prefill_s_per_token * (prompt - cached) + self.attention_s_per_pair * pairs
                + self.host_load_s_per_token * host_tokens + self.l3_load_s_per_token * l3_tokens)

    def slowdown(self, decoding: int) -> float:
        """Prefill time multiplier while `decoding` requests share the worker."""
        return 1.0 / (1.0 - min(self.max_decode_share, decoding * self.decode_s_per_token / self.tpot_s))


@dataclass(slots=True)
class SimConfig:
    workers: int = 8
    capacity_tokens: int = 1_000_000
    host_capacity_tokens: int = 0
    page_size: int = 16
    event_delay_s: float = 0.005
    heartbeat_s: float = 1.0
    model_id: str = "sim-model"
    cost: CostModel = field(default_factory=CostModel)
    # Shared L3 over every worker; 0 = none (see the module docstring).
    l3_capacity_tokens: int = 0
    l3_write_through: bool = False
    # The L3 publishes REMOTE events to the index (else the policies never hear of it).
    l3_events: bool = True
    # The gateway's LoadTracker: half-life of its recent routed prefill.
    recent_halflife_s: float = RECENT_HALFLIFE_S
    index_entries: int = 0  # the gateway index's bound in keys; 0: above all the workers hold


@dataclass(slots=True)
class PolicyResult:
    policy: str
    requests: int
    prompt_tokens: int
    cached_tokens: int  # device + host + L3 hits
    host_hit_tokens: int
    computed_per_worker: list[int]
    ttft_s: list[float]
    decision_ns: list[int]
    page_events: int
    index_resyncs: int
    wall_s: float
    l3_hit_tokens: int = 0
    # Pages written to the L3 (rewrites included), new to it, and dropped by its LRU.
    l3_page_writes: int = 0
    l3_new_pages: int = 0
    l3_evictions: int = 0
    # The Router's index at the end of the replay: (page hash, medium) keys and their bytes.
    index_keys: int = 0
    index_apply_ns: int = 0  # time in the gateway's KvIndex.apply (the workers' event batches)
    index_bytes: int = 0
    index_evictions: int = 0  # keys the index's bound dropped (SimConfig.index_entries)


@dataclass(slots=True)
class _Job:
    rid: str
    hashes: list[bytes]
    prompt: int
    output: int
    arrival: float
    estimate: int  # prefill tokens the worker counts as queued for it
    # Equal for prompts with the same tokens: (trace copy, input_length, the trace's block ids).
    prompt_key: tuple = ()
    first_token: bool = False  # already sampled from a twin's logits (see the module docstring)
    cached: int = 0
    device_hit: int = 0
    host_hit: int = 0
    l3_hit: int = 0


# The pool id of the shared L3's event stream.
L3_POOL = "l3-shared"


class _Stream:
    """One event stream into the index: a pool id, its epoch and its last seq."""

    def __init__(self, name: str) -> None:
        self.name, self.epoch, self.seq = name, 1, -1

    def batch(self, events: list[events_pb2.KvEvent], now: float) -> events_pb2.EventBatch:
        self.seq += 1
        return events_pb2.EventBatch(pool_id=self.name, epoch=self.epoch, seq=self.seq, timestamp=now,
                                     events=events)


class _Worker(_Stream):
    def __init__(self, name: str, cfg: SimConfig) -> None:
        super().__init__(name)
        page = cfg.page_size
        self.cache = PageCache(max(cfg.capacity_tokens // page, 1), cfg.host_capacity_tokens // page,
                               page, cfg.model_id)
        self.queue: deque[_Job] = deque()
        self.current: list[_Job] = []  # the prefill step in progress
        self.decoding = 0
        self.queued_prefill = 0
        self.computed = 0

    def report(self, now: float) -> common_pb2.LoadReport:
        return common_pb2.LoadReport(waiting_requests=len(self.queue),
                                     running_requests=self.decoding + len(self.current),
                                     queued_prefill_tokens=self.queued_prefill, timestamp=now)


def split_hashes(blob: bytes) -> list[bytes]:
    return [blob[i:i + 16] for i in range(0, len(blob), 16)]


class _Clock:
    __slots__ = ("now",)
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


_ARRIVE, _PREFILL_DONE, _DECODE_DONE, _BATCH, _REPORT, _HEARTBEAT, _TICK = range(7)


class _Replay:
    """One policy's replay: the event heap, the workers, the L3, and the gateway's index and load
    tracker, all on the simulated clock. Events are handled in (time, push order): the order
    counter keeps ties in the order they were pushed, so a replay is deterministic."""

    def __init__(self, requests: Sequence[TraceRequest], blobs: Sequence[bytes], policy: Policy,
                 cfg: SimConfig, progress: Callable[[str], None] | None) -> None:
        self.requests, self.blobs, self.policy, self.cfg, self.progress = requests, blobs, policy, cfg, progress
        self.started = self.last_progress = time.perf_counter()
        self.clock = _Clock()
        page = cfg.page_size
        index_pages = (cfg.workers * (cfg.capacity_tokens + cfg.host_capacity_tokens)
                       + cfg.l3_capacity_tokens) // page
        bound = cfg.index_entries or 2 * index_pages + 1024  # unless set: one that drops nothing
        self.router = Router(policy, GatewayMetrics(), IndexConfig(max_entries=bound), clock=self.clock)
        self.router.load = LoadTracker(clock=self.clock, recent_halflife_s=cfg.recent_halflife_s)
        self.index, self.load = self.router.index, self.router.load
        self.workers = [_Worker(f"worker-{i:03d}", cfg) for i in range(cfg.workers)]
        for w in self.workers:  # no client: the simulated worker is called in-process
            self.router.add(RouterWorker(w.name, w.name, w.name, None, compute_service_pb2.GetModelInfoResponse()))  # type: ignore[arg-type]
        self.by_name = {w.name: w for w in self.workers}
        self.l3 = SharedL3(max(cfg.l3_capacity_tokens // page, 1), page, cfg.model_id) if cfg.l3_capacity_tokens else None
        self.l3_stream = _Stream(L3_POOL) if self.l3 is not None and cfg.l3_events else None
        self.heap: list[tuple[float, int, int, object]] = []
        self.order = 0
        self.pending_arrivals = len(requests)
        # Totals over the requests whose prefill completed, and the policy's time per decision.
        self.prompt_tokens = self.cached_tokens = self.host_tokens = self.l3_tokens = 0
        self.ttft: list[float] = []
        self.decision_ns: list[int] = []
        self.index_apply_ns = 0

    def push(self, t: float, kind: int, item: object) -> None:
        self.order += 1
        heapq.heappush(self.heap, (t, self.order, kind, item))

    def send(self, kind: int, item: object) -> None:
        """A message to the gateway: it arrives `event_delay_s` later."""
        self.push(self.clock.now + self.cfg.event_delay_s, kind, item)

    def run(self) -> PolicyResult:
        for i, req in enumerate(self.requests):
            self.push(req.arrival_s, _ARRIVE, i)
        self.push(0.0, _TICK, None)
        clock = self.clock
        handlers: dict[int, Callable[[object], None]] = {
            _ARRIVE: self.arrive, _PREFILL_DONE: self.prefill_done, _DECODE_DONE: self.decode_done,
            _BATCH: self.apply_batch,
            _REPORT: lambda item: self.load.report(*item, clock.now),  # type: ignore[misc]
            _TICK: lambda _: self.tick(), _HEARTBEAT: self.heartbeat}
        while self.heap:
            clock.now, _, kind, item = heapq.heappop(self.heap)
            handlers[kind](item)
        return self.result()

    def apply_batch(self, batch: events_pb2.EventBatch) -> None:  # timed: the gateway's share
        t0 = time.perf_counter_ns()
        self.index.apply(batch, self.clock.now)
        self.index_apply_ns += time.perf_counter_ns() - t0

    def start(self, w: _Worker) -> None:
        """Start `w`'s next prefill step: take queued prompts in order while they fit the budget."""
        cost, page, l3 = self.cfg.cost, self.cfg.page_size, self.l3
        budget, duration = cost.step_tokens, cost.step_overhead_s
        computing: set[bytes] = set()  # pages this step computes
        waiting: list[_Job] = []  # siblings of a job in this step: they wait for its pages
        while w.queue:
            job = w.queue[0]
            d, h = w.cache.match(job.hashes)
            r = l3.extend(job.hashes, d + h) if l3 is not None else 0
            first = d + h + r
            # Chained hashes: sharing any uncached page with a job of this step means sharing
            # the first one. The engine then holds the request back (Scheduler._waits_for_sibling)
            # and admits the ones behind it; it matches the pages as hits next step.
            if first < len(job.hashes) and job.hashes[first] in computing:
                waiting.append(w.queue.popleft())
                continue
            cached = first * page
            new = job.prompt - cached
            if w.current and new > budget:
                break
            w.queue.popleft()
            if r:
                l3.read(job.hashes[d + h:first])  # type: ignore[union-attr]
            job.device_hit, job.host_hit, job.l3_hit, job.cached = d, h, r, cached
            w.current.append(job)
            computing.update(job.hashes[first:])
            budget -= new
            duration += cost.prefill_s(job.prompt, cached, h * page, r * page)
        w.queue.extendleft(reversed(waiting))
        self.push(self.clock.now + duration * cost.slowdown(w.decoding), _PREFILL_DONE, w)

    def arrive(self, i: int) -> None:
        """The gateway routes request `i` with the real policy; the chosen worker queues it."""
        req, page, now = self.requests[i], self.cfg.page_size, self.clock.now
        hashes = split_hashes(self.blobs[i])
        route = RouteRequest(str(req.index), hashes, req.input_length, page)
        t0 = time.perf_counter_ns()
        routed = self.router.route(route)
        self.decision_ns.append(time.perf_counter_ns() - t0)
        assert routed is not None, "every simulated worker is up"
        w = self.by_name[routed.decision.worker]
        # What the worker itself counts as queued: its device misses, not the policy's estimate.
        estimate = req.input_length - w.cache.match(hashes)[0] * page
        w.queue.append(_Job(route.request_id, hashes, req.input_length, req.output_length,
                            req.arrival_s, estimate, (req.copy, req.input_length, req.hash_ids)))
        w.queued_prefill += estimate
        if not w.current:
            self.start(w)
        self.send(_REPORT, (w.name, w.report(now)))
        self.pending_arrivals -= 1
        self.report_progress()

    def report_progress(self) -> None:
        if self.progress is None or time.perf_counter() - self.last_progress <= 2.0:
            return
        self.last_progress = time.perf_counter()
        total = len(self.requests)
        done = total - self.pending_arrivals
        self.progress(f"[{self.policy.name}] {done}/{total} requests routed "
                      f"({100 * done / total:.0f}%), sim t={self.clock.now:.0f}s, "
                      f"{self.last_progress - self.started:.0f}s")

    def first_token(self, job: _Job) -> None:
        self.ttft.append(self.clock.now - job.arrival)
        self.router.first_token(job.rid)

    def prefill_done(self, w: _Worker) -> None:
        """End of `w`'s step: commit its pages, publish the events, start decoding its jobs."""
        events: list[events_pb2.KvEvent] = []
        l3_writes: list[tuple[bytes, bytes]] = []
        done = {job.prompt_key for job in w.current}
        for job in w.queue:  # twins of a prompt this step completed: their first token now
            if not job.first_token and job.prompt_key in done:
                job.first_token = True
                self.first_token(job)
        for job in w.current:
            events += w.cache.commit(job.hashes, job.device_hit, job.host_hit)
            if self.l3 is not None:
                l3_writes += self.l3_writes_of(w, job)
            if not job.first_token:  # a twin's was recorded at its twin's step
                self.first_token(job)
            self.count(w, job)
            self.push(self.clock.now + self.cfg.cost.tpot_s * job.output, _DECODE_DONE, (w, job.rid))
        if events:  # the step's pages as one batch of w's stream
            self.send(_BATCH, w.batch(events, self.clock.now))
        if l3_writes:
            l3_events = self.l3.write(l3_writes, emit=self.l3_stream is not None)  # type: ignore[union-attr]
            if l3_events:
                self.send(_BATCH, self.l3_stream.batch(l3_events, self.clock.now))  # type: ignore[union-attr]
        w.current = []
        if w.queue:
            self.start(w)
        self.send(_REPORT, (w.name, w.report(self.clock.now)))

    def l3_writes_of(self, w: _Worker, job: _Job) -> list[tuple[bytes, bytes]]:
        """(page, parent) pairs `job`'s commit sends to the L3 (read right after the commit)."""
        if not self.cfg.l3_write_through:
            return w.cache.spilled  # write-back: what the commit dropped from the worker
        # Write-through: the pages this prefill computed, deepest first.
        hashes = job.hashes
        first = job.device_hit + job.host_hit + job.l3_hit
        return [(hashes[i], hashes[i - 1] if i else b"") for i in range(len(hashes) - 1, first - 1, -1)]

    def count(self, w: _Worker, job: _Job) -> None:
        """`job`'s prefill is done: add it to the totals and move it to `w`'s decode batch."""
        page = self.cfg.page_size
        self.prompt_tokens += job.prompt
        self.cached_tokens += job.cached
        self.host_tokens += job.host_hit * page
        self.l3_tokens += job.l3_hit * page
        w.computed += job.prompt - job.cached
        w.queued_prefill -= job.estimate
        w.decoding += 1

    def decode_done(self, item: tuple[_Worker, str]) -> None:
        w, rid = item
        self.router.finish(rid)
        w.decoding -= 1
        self.send(_REPORT, (w.name, w.report(self.clock.now)))

    def heartbeat(self, beat: events_pb2.Heartbeat) -> None:
        """A worker's heartbeat through the Router (freshness, load, sync); the L3's to the index."""
        if beat.pool_id in self.by_name:
            self.router.on_stream_item(beat.pool_id, cache_service_pb2.SubscribeResponse(heartbeat=beat))
        else:
            self.index.heartbeat(beat, self.clock.now)

    def tick(self) -> None:
        """Every `heartbeat_s`: each stream's heartbeat; ticks stop once nothing is left to do."""
        now = self.clock.now
        for w in self.workers:
            self.send(_HEARTBEAT, events_pb2.Heartbeat(pool_id=w.name, epoch=w.epoch, head_seq=w.seq,
                                                        timestamp=now, load=w.report(now)))
        if self.l3_stream is not None:
            s = self.l3_stream
            self.send(_HEARTBEAT, events_pb2.Heartbeat(pool_id=s.name, epoch=s.epoch, head_seq=s.seq, timestamp=now))
        if self.pending_arrivals or any(w.current or w.decoding for w in self.workers):
            self.push(now + self.cfg.heartbeat_s, _TICK, None)

    def result(self) -> PolicyResult:
        l3 = self.l3
        return PolicyResult(self.policy.name, len(self.ttft), self.prompt_tokens, self.cached_tokens,
                            self.host_tokens, [w.computed for w in self.workers], self.ttft, self.decision_ns,
                            self.index.page_events, self.index.resyncs, time.perf_counter() - self.started,
                            l3_hit_tokens=self.l3_tokens,
                            l3_page_writes=l3.writes if l3 else 0, l3_new_pages=l3.new_pages if l3 else 0,
                            l3_evictions=l3.evictions if l3 else 0, index_keys=len(self.index),
                            index_evictions=self.index.evicted_entries,
                            index_bytes=index_bytes(self.index), index_apply_ns=self.index_apply_ns)


def run_policy(requests: Sequence[TraceRequest], blobs: Sequence[bytes], policy: Policy, cfg: SimConfig,
               progress: Callable[[str], None] | None = None) -> PolicyResult:
    """Replay `requests` (their page hashes concatenated in `blobs`) through `policy`."""
    return _Replay(requests, blobs, policy, cfg, progress).run()
