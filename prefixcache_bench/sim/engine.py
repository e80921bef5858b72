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
Workers report their queue (LoadReport) after every change, also after the delay, and send a
Heartbeat every `heartbeat_s`.

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
from gateway.core.policies import RECENT_HALFLIFE_S, LoadTracker, Policy, RouteRequest
from prefixcache_bench.sim.cache import PageCache, SharedL3
from prefixcache_bench.sim.trace import TraceRequest
from prefixcache.v1 import common_pb2, events_pb2


@dataclass(slots=True)
class CostModel:
    """Roughly Llama-3-8B in bf16 on one H100 (~55% of its 989 dense TFLOP/s)."""
    # ~16 GFLOP per token in the linear layers -> ~33k tokens/s.
    prefill_s_per_token: float = 30e-6
    # Causal attention, per (query, context token) pair: 4 * 32 layers * 4096 FLOP.
    attention_s_per_pair: float = 9.7e-10
    # 128 KiB of KV per token over ~25 GB/s of PCIe.
    host_load_s_per_token: float = 5e-6
    # Per prefill step: scheduling plus the first decode step.
    step_overhead_s: float = 0.010
    # Uncached prompt tokens one step takes (chunked-prefill budget).
    step_tokens: int = 8192
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


@dataclass(slots=True)
class _Job:
    rid: str
    hashes: list[bytes]
    prompt: int
    output: int
    arrival: float
    estimate: int  # prefill tokens the worker counts as queued for it
    # Equal for prompts with the same tokens: (input_length, the trace's block ids).
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


def run_policy(requests: Sequence[TraceRequest], blobs: Sequence[bytes], policy: Policy, cfg: SimConfig,
               progress: Callable[[str], None] | None = None) -> PolicyResult:
    """Replay `requests` (their page hashes concatenated in `blobs`) through `policy`."""
    started = time.perf_counter()
    clock = _Clock()
    page = cfg.page_size
    index_pages = (cfg.workers * (cfg.capacity_tokens + cfg.host_capacity_tokens) + cfg.l3_capacity_tokens) // page
    # Sized above everything the workers can hold, so the bound never drops live entries here.
    index = KvIndex(IndexConfig(max_entries=2 * index_pages + 1024), clock=clock)
    load = LoadTracker(clock=clock, recent_halflife_s=cfg.recent_halflife_s)
    workers = [_Worker(f"worker-{i:03d}", cfg) for i in range(cfg.workers)]
    names = [w.name for w in workers]
    by_name = {w.name: w for w in workers}
    l3 = SharedL3(max(cfg.l3_capacity_tokens // page, 1), page, cfg.model_id) if cfg.l3_capacity_tokens else None
    l3_stream = _Stream(L3_POOL) if l3 is not None and cfg.l3_events else None
    heap: list[tuple[float, int, int, object]] = []
    order = 0

    def push(t: float, kind: int, item: object) -> None:
        nonlocal order
        order += 1
        heapq.heappush(heap, (t, order, kind, item))

    def send(kind: int, item: object) -> None:
        push(clock.now + cfg.event_delay_s, kind, item)

    def start(w: _Worker) -> None:
        cost = cfg.cost
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
        push(clock.now + duration * cost.slowdown(w.decoding), _PREFILL_DONE, w)

    for i, req in enumerate(requests):
        push(req.arrival_s, _ARRIVE, i)
    push(0.0, _TICK, None)
    pending_arrivals = len(requests)
    ttft: list[float] = []
    decision_ns: list[int] = []
    prompt_tokens = cached_tokens = host_tokens = l3_tokens = 0
    last_progress = started
    while heap:
        clock.now, _, kind, item = heapq.heappop(heap)
        if kind == _ARRIVE:
            req = requests[item]  # type: ignore[index]
            hashes = split_hashes(blobs[item])  # type: ignore[index]
            route = RouteRequest(str(req.index), hashes, req.input_length, page)
            t0 = time.perf_counter_ns()
            decision = policy.choose(route, names, index, load)
            decision_ns.append(time.perf_counter_ns() - t0)
            load.on_route(decision.worker, route.request_id, decision.prefill_tokens)
            w = by_name[decision.worker]
            estimate = req.input_length - w.cache.match(hashes)[0] * page
            w.queue.append(_Job(route.request_id, hashes, req.input_length, req.output_length,
                                req.arrival_s, estimate, (req.input_length, req.hash_ids)))
            w.queued_prefill += estimate
            if not w.current:
                start(w)
            send(_REPORT, (w.name, w.report(clock.now)))
            pending_arrivals -= 1
            if progress is not None and time.perf_counter() - last_progress > 2.0:
                last_progress = time.perf_counter()
                done = len(requests) - pending_arrivals
                progress(f"[{policy.name}] {done}/{len(requests)} requests routed "
                         f"({100 * done / len(requests):.0f}%), sim t={clock.now:.0f}s, "
                         f"{last_progress - started:.0f}s")
        elif kind == _PREFILL_DONE:
            w = item  # type: ignore[assignment]
            events = []
            l3_writes: list[tuple[bytes, bytes]] = []
            done = {job.prompt_key for job in w.current}
            for job in w.queue:  # twins of a prompt this step completed: their first token now
                if not job.first_token and job.prompt_key in done:
                    job.first_token = True
                    ttft.append(clock.now - job.arrival)
                    load.on_first_token(job.rid)
            for job in w.current:
                events += w.cache.commit(job.hashes, job.device_hit, job.host_hit)
                if l3 is not None:
                    if cfg.l3_write_through:  # the pages this prefill computed, deepest first
                        hashes = job.hashes
                        first = job.device_hit + job.host_hit + job.l3_hit
                        l3_writes += [(hashes[i], hashes[i - 1] if i else b"")
                                      for i in range(len(hashes) - 1, first - 1, -1)]
                    else:
                        l3_writes += w.cache.spilled
                if not job.first_token:  # a twin's was recorded at its twin's step
                    ttft.append(clock.now - job.arrival)
                    load.on_first_token(job.rid)
                prompt_tokens += job.prompt
                cached_tokens += job.cached
                host_tokens += job.host_hit * page
                l3_tokens += job.l3_hit * page
                w.computed += job.prompt - job.cached
                w.queued_prefill -= job.estimate
                w.decoding += 1
                push(clock.now + cfg.cost.tpot_s * job.output, _DECODE_DONE, (w, job.rid))
            if events:
                send(_BATCH, w.batch(events, clock.now))
            if l3_writes:
                l3_events = l3.write(l3_writes, emit=l3_stream is not None)  # type: ignore[union-attr]
                if l3_events:
                    send(_BATCH, l3_stream.batch(l3_events, clock.now))  # type: ignore[union-attr]
            w.current = []
            if w.queue:
                start(w)
            send(_REPORT, (w.name, w.report(clock.now)))
        elif kind == _DECODE_DONE:
            w, rid = item  # type: ignore[misc]
            load.on_finish(rid)
            w.decoding -= 1
            send(_REPORT, (w.name, w.report(clock.now)))
        elif kind == _BATCH:
            index.apply(item, clock.now)  # type: ignore[arg-type]
        elif kind == _REPORT:
            name, rep = item  # type: ignore[misc]
            load.report(name, rep, clock.now)
        elif kind == _TICK:
            for w in workers:
                send(_HEARTBEAT, events_pb2.Heartbeat(pool_id=w.name, epoch=w.epoch, head_seq=w.seq,
                                                       timestamp=clock.now, load=w.report(clock.now)))
            if l3_stream is not None:
                send(_HEARTBEAT, events_pb2.Heartbeat(pool_id=l3_stream.name, epoch=l3_stream.epoch,
                                                       head_seq=l3_stream.seq, timestamp=clock.now))
            if pending_arrivals or any(w.current or w.decoding for w in workers):
                push(clock.now + cfg.heartbeat_s, _TICK, None)
        elif kind == _HEARTBEAT:
            index.heartbeat(item, clock.now)  # type: ignore[arg-type]
    return PolicyResult(policy.name, len(ttft), prompt_tokens, cached_tokens, host_tokens,
                        [w.computed for w in workers], ttft, decision_ns, index.page_events, index.resyncs,
                        time.perf_counter() - started, l3_hit_tokens=l3_tokens,
                        l3_page_writes=l3.writes if l3 else 0, l3_new_pages=l3.new_pages if l3 else 0,
                        l3_evictions=l3.evictions if l3 else 0)


def bound_hit_ratio(requests: Sequence[TraceRequest], blobs: Sequence[bytes], cfg: SimConfig) -> float:
    """Hit ratio of one pooled LRU of workers x capacity tokens serving the trace in arrival order."""
    return pooled_lru_hit_ratio(requests, blobs, cfg.workers * cfg.capacity_tokens, cfg.page_size)


def l3_bound_hit_ratio(requests: Sequence[TraceRequest], blobs: Sequence[bytes], cfg: SimConfig) -> float:
    """The bound with every tier pooled: one LRU of workers x (device + host) + L3 tokens."""
    total = cfg.workers * (cfg.capacity_tokens + cfg.host_capacity_tokens) + cfg.l3_capacity_tokens
    return pooled_lru_hit_ratio(requests, blobs, total, cfg.page_size)


def unbounded_hit_ratio(requests: Sequence[TraceRequest], blobs: Sequence[bytes], page: int) -> float:
    """Prompt tokens whose page was seen before (leading run): the ceiling of any cache."""
    seen: set[bytes] = set()
    hit = total = 0
    for req, blob in zip(requests, blobs):
        hashes = split_hashes(blob)
        d = 0
        while d < len(hashes) and hashes[d] in seen:
            d += 1
        seen.update(hashes[d:])
        hit += d * page
        total += req.input_length
    return hit / total if total else 0.0


def pooled_lru_hit_ratio(requests: Sequence[TraceRequest], blobs: Sequence[bytes], capacity_tokens: int,
                         page: int) -> float:
    """Hit ratio of one LRU of `capacity_tokens` serving the trace in arrival order."""
    cache = PageCache(max(capacity_tokens // page, 1), 0, page)
    hit = total = 0
    for req, blob in zip(requests, blobs):
        hashes = split_hashes(blob)
        d, _ = cache.match(hashes)
        cache.commit(hashes, d, 0, emit=False)
        hit += d * page
        total += req.input_length
    return hit / total if total else 0.0
