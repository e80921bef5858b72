"""One configuration of the fleet benchmark: N pools streamed by the load generator (its own
process, pinned to one core) into one gateway's Router through the real feed code path
(gateway/core/feeds.py: a grpc.aio channel and `follow_events` per pool on the one `FeedLoop`,
`BatchApplier` -> `Router.apply_stream_items`), the gateway pinned to the other core, while a
routing thread times Router.route. Phases: warm (every pool's snapshot applied:
restart-to-warm; how late ingest started is noted on the way, `_StartMarks`), then live (every
pool's recorded live batches applied), timed in the gateway from the first slice holding a live
batch to the last (live_clock.py). `--no-grpc` (sources.py)
leaves the load generator and the feeds' gRPC out: the apply path alone."""
from __future__ import annotations

import ctypes
import gc
import math
import multiprocessing
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from gateway.core import thread_priority
from gateway.core.feed_process import FRAME_ITEMS
from gateway.core.feeds import FeedLoop
from gateway.core.gc_tuning import freeze_warm_heap
from gateway.core.index import IndexConfig
from gateway.core.ingest_slices import SLICE_S
from gateway.core.thread_priority import SWITCH_INTERVAL_S
from gateway.core.metrics import GatewayMetrics
from gateway.core.policies import RouteRequest, make_policy
from gateway.core.router import Router, Worker
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache_bench.gateway_fleet import fleet as F
from prefixcache_bench.gateway_fleet.live_clock import LiveClock
from prefixcache_bench.gateway_fleet.sources import (SETTINGS, DirectSource, FeedProcessSource,
                                                     FrameSource, GrpcSource, follow)
from prefixcache_bench.gateway_fleet.stalls import (STALL_S, Kdamond, other_tasks, outside_stalls,
                                                    runqueue_wait_s, stalled_windows, task_cpu)
from prefixcache_bench.gateway_fleet.warmup import compare_run
from prefixcache_bench.harness import percentile

PAGE_SIZE = 16
REQUEST_PAGES = 64  # a 1,024-token prompt: a held conversation or system prompt, then new pages


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# The timed routing thread's requests: one due every millisecond.
DECISION_PERIOD_S = 0.001
_PR_SET_TIMERSLACK = 29


def precise_sleep() -> None:
    """The calling thread's timer slack to 1 ns (Linux; elsewhere nothing): the kernel's default
    50 us let the routing thread's sleeps to a request's due time end ~75 us late at p50 (~120
    us at p99, on this VM), counted in the figures "from wake-up" and "from due" although no
    gateway pays it (a request wakes its thread by the network, not by a timer)."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class _Router:
    """The timed routing thread: requests for a pool's conversation (routed to it when the index
    knows it) or a system prompt, each followed by new pages."""

    def __init__(self, router: Router, pools: int, pages_per_pool: int, live_batches: int,
                 request_pages: int = REQUEST_PAGES, period_s: float = DECISION_PERIOD_S):
        self.router, self.pools, self.pages = router, pools, pages_per_pool
        self.period_s = period_s
        self.request_pages = request_pages  # of which CONVERSATION_PAGES held, the rest new
        # Conversations the live batches do not remove (those go oldest first).
        self.first_conv = (live_batches * F.LIVE_PAGES) // F.CONVERSATION_PAGES + 1
        # (start, seconds in route(), seconds from its planned wake-up to route()'s end: the
        # GIL's hand-off after the sleep too, which route()'s own time cannot see; seconds from
        # its arrival on the schedule to route()'s end: a stall delays every decision due in it)
        self.samples: list[tuple[float, float, float, float]] = []
        self.cpu: list[tuple[float, float]] = []  # (start, this thread's CPU time then)
        # (start, this thread's CPU seconds in route()): against its wall time, what the other
        # threads and processes on the cores took of it
        self.route_cpu: list[tuple[float, float]] = []
        # (start, routed to the holder) of each request for a pool's conversation: counted by
        # phase, since during the warm-up the holder's pages are not all indexed yet
        self.held: list[tuple[float, bool]] = []
        # (start, planned wake-up, end, seconds on the core's run queue from before the sleep to
        # the end, the DAMON threads' CPU seconds meanwhile): what other tasks held the core
        # (stalls.py)
        self.waits: list[tuple[float, float, float, float, float]] = []
        self.kdamond = Kdamond()
        self.new_phase = threading.Event()  # set: the schedule starts again now (no backlog)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="bench-router", daemon=True)

    def _request(self, rng: random.Random, n: int) -> tuple[RouteRequest, str | None]:
        fresh = [(n * 131 + j).to_bytes(16, "big")
                 for j in range(self.request_pages - F.CONVERSATION_PAGES)]
        if rng.random() < 0.3:
            held, holder = [F.shared_page(rng.randrange(F.SHARED_PROMPTS), j)
                            for j in range(F.CONVERSATION_PAGES)], None
        else:
            pool = rng.randrange(self.pools)
            convs = self.pages // F.CONVERSATION_PAGES
            c = rng.randrange(min(self.first_conv, convs - 1), convs)
            held = [F.private_page(pool, c * F.CONVERSATION_PAGES + j) for j in range(F.CONVERSATION_PAGES)]
            holder = F.pool_name(pool)
        return RouteRequest(f"r{n}", held + fresh, self.request_pages * PAGE_SIZE + 1, PAGE_SIZE), holder

    def _run(self) -> None:
        """A request due every `period_s` (an open loop: one late starts when the one
        before ends, and counts its lateness)."""
        precise_sleep()
        rng, n = random.Random(1), 0
        due = end = time.perf_counter()
        while not self.stop.is_set():
            if self.new_phase.is_set():  # a phase's figures start without the last one's backlog
                self.new_phase.clear()
                due = time.perf_counter()
            wake = max(due, end)
            queued, damon = runqueue_wait_s(), self.kdamond.ran_s()
            if (ahead := wake - time.perf_counter()) > 0:
                time.sleep(ahead)
            req, holder = self._request(rng, n)
            start, cpu = time.perf_counter(), time.thread_time()
            self.cpu.append((start, cpu))
            route = self.router.route(req)
            end = time.perf_counter()
            self.route_cpu.append((start, time.thread_time() - cpu))
            self.samples.append((start, end - start, end - wake, end - due))
            if queued is not None and (now_queued := runqueue_wait_s()) is not None:
                self.waits.append((start, wake, end, now_queued - queued,
                                   self.kdamond.ran_s() - damon))
            # What the gateway's request path does once the decision is on its way (proxy.py,
            # epp/servicer.py): its record of the pages routed applied, in this thread's time.
            self.router.settle()
            if route is not None:
                self.router.finish(req.request_id)
                if holder is not None and self.router.index.info(holder) is not None:
                    self.held.append((start, route.worker.name == holder))
            n += 1
            due += self.period_s

    def to_holder(self, t0: float, t1: float = math.inf) -> float | None:
        """The share of conversation requests started in [t0, t1) routed to their pool."""
        hits = [hit for t, hit in self.held if t0 <= t < t1]
        return sum(hits) / len(hits) if hits else None

    def summary(self, t0: float, t1: float) -> dict:
        phase = [x for x in self.samples if t0 <= x[0] < t1]
        if not phase:
            return {"decisions": 0}
        lat, woken, due = ([x[i] * 1e6 for x in phase] for i in (1, 2, 3))
        out = {"decisions": len(lat), "p50_us": percentile(lat, 0.5), "p99_us": percentile(lat, 0.99),
               "max_us": max(lat), "p99_from_wake_us": percentile(woken, 0.99),
               "p99_from_due_us": percentile(due, 0.99), "routed_to_holder": self.to_holder(t0, t1)}
        own = [c * 1e6 for t, c in self.route_cpu if t0 <= t < t1]
        if own:  # (warmup.py fills `samples` with its own loop, not this)
            out["cpu_p50_us"], out["cpu_p99_us"] = percentile(own, 0.5), percentile(own, 0.99)
        cpu = [(t, c) for t, c in self.cpu if t0 <= t < t1]
        if len(cpu) > 1:  # the routing thread's share of its core over the phase
            out["cpu_share"] = (cpu[-1][1] - cpu[0][1]) / max(cpu[-1][0] - cpu[0][0], 1e-9)
        if waits := [w for w in self.waits if t0 <= w[0] < t1]:
            out.update(self._stalls(phase, waits))
        return out

    def _stalls(self, phase: list, waits: list) -> dict:
        """The phase's decisions that waited behind another task on the core, the longest
        wait, and the p99 from the due time of the decisions no such wait caught (stalls.py)."""
        windows = stalled_windows([w[1:4] for w in self.waits])  # a stall may start a phase early
        spans = [(start + lat - late, start + lat) for start, lat, _, late in phase]
        kept = [phase[i][3] * 1e6 for i in outside_stalls(spans, windows)]
        stalled = [w for w in waits if w[3] >= STALL_S]
        return {"stalled_decisions": len(stalled),
                "stalled_decisions_kdamond_ran": sum(w[4] >= w[3] / 2 for w in stalled),
                "runqueue_wait_max_us": max(w[3] for w in waits) * 1e6,
                "p99_from_due_outside_stalls_us": percentile(kept, 0.99) if kept else None}


class _StartMarks:
    """How late ingest started, noted at each poll of the warm-up's `_wait`: seconds from t0 to
    the first page in the index and to every pool's stream delivering (`streaming`: routing then
    scores the pool by the index), to a poll's resolution. The check stops at the first pool
    not streaming yet, as `_wait`'s does."""

    def __init__(self, router: Router, names: list[str], t0: float) -> None:
        self.router, self.names, self.t0 = router, names, t0
        self.first_page: float | None = None
        self.all_streaming: float | None = None

    def __call__(self) -> None:
        now = time.perf_counter() - self.t0
        if self.first_page is None and len(self.router.index):  # the fleet starts empty
            self.first_page = now
        if self.all_streaming is None and all(self.router.get(n).streaming for n in self.names):
            self.all_streaming = now

    def summary(self) -> dict:
        return {"warmup_first_page_s": self.first_page,
                "warmup_all_streaming_s": self.all_streaming}


def _reached(router: Router, name: str, done) -> bool:
    """Whether a worker's index entry is in the state `done` asks for: the router's lock held
    for that one worker (holding it over a thousand workers' entries made the bench's routing
    thread wait up to ~100 ms each poll of the warm-up, in no gateway's path)."""
    with router.lock:
        info = router.index.info(name)
    return info is not None and done(info)


def _wait(router: Router, names: list[str], done, poll_s: float = 0.05,
          timeout_s: float = 1800.0, on_poll: Callable[[], None] = lambda: None) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        on_poll()
        if all(_reached(router, name, done) for name in names):
            return time.perf_counter()
        if time.monotonic() > deadline:
            raise TimeoutError("the fleet did not reach the state in time")
        time.sleep(poll_s)


def run_config(pools: int, pages_per_pool: int, live_batches: int, idle_s: float = 2.0,
               cpus: tuple[int, int] | None = (0, 1), packed: bool = True,
               warmup_compare: bool = False, tuning: IngestTuning | None = None,
               grpc: bool = True, frame_items: int | None = None,
               live_rate: float | None = None, feed_process: bool = False) -> dict:
    """Measures one configuration; `cpus`: (gateway core, load-generator core), None = unpinned;
    `packed`: the gateway's feeds ask for packed hashes (SubscribeRequest.packed_hashes), as
    they do in the gateway, or not (the per-page encoding an older cache service sends);
    `warmup_compare`: only the warm-up, its decisions compared with load-only routing
    (warmup.py); `tuning`: the gateway's ingest settings (the defaults when None); `grpc`
    False: no load generator, the items put on the applier directly (sources.DirectSource; with
    `frame_items`, the live ones as stream frames of that many items: sources.FrameSource; with
    `live_rate`, put at that many page events a second at most); `feed_process`: the streams
    read by the gateway's feed process (gateway/core/feed_process.py), frames of
    `frame_items`."""
    tuning = tuning or IngestTuning()
    if not grpc:
        if warmup_compare:
            raise ValueError("the warm-up comparison reads its pools over gRPC")
        if cpus:
            os.sched_setaffinity(0, {cpus[0]})
        source = (FrameSource(pools, pages_per_pool, live_batches, packed, live_rate, frame_items)
                  if frame_items else
                  DirectSource(pools, pages_per_pool, live_batches, packed, live_rate))
        return _measure(source, pools, pages_per_pool, live_batches, idle_s, packed, tuning)
    with load_generator(pools, pages_per_pool, live_batches, cpus, packed) as generator:
        if warmup_compare:
            return _measure_warmup(generator.address, pools, pages_per_pool, live_batches, packed)
        if not feed_process:
            return _measure(GrpcSource(generator, packed), pools, pages_per_pool, live_batches,
                            idle_s, packed, tuning)
        source = FeedProcessSource(generator, frame_items or FRAME_ITEMS, cpus[1] if cpus else None)
        return _measure(source, pools, pages_per_pool, live_batches, idle_s, packed, tuning)


@dataclass(frozen=True)
class IngestTuning:
    """The gateway's ingest settings a run uses: the slice's target hold of the router's lock
    (`--ingest-slice-ms`), or a fixed number of page events a slice (the former behaviour), and
    the interpreter's thread switch interval and the feed loop's priority, as the gateway sets
    them (gateway/core/thread_priority.py); and the timed requests' period (`--decision-period-ms`:
    longer on a machine where route() alone takes most of a millisecond); `spare` False: the
    feed loop writes no growth's arrays ahead (`--no-spare`)."""
    slice_s: float = SLICE_S
    slice_events: int | None = None
    switch_interval_s: float = SWITCH_INTERVAL_S
    priority: str = "idle"
    decision_period_s: float = DECISION_PERIOD_S
    spare: bool = True

    def summary(self) -> dict:
        return {"ingest_slice_ms": self.slice_s * 1e3, "ingest_slice_events_fixed": self.slice_events,
                "switch_interval_ms": self.switch_interval_s * 1e3,
                "ingest_priority": self.priority,
                "decision_period_ms": self.decision_period_s * 1e3, "spare": self.spare}


@dataclass(frozen=True)
class LoadGenerator:
    address: str
    go: Any  # the event that releases its live batches
    last_sent: Any  # a shared double: its last live send (time.perf_counter)
    pid: int


@contextmanager
def load_generator(pools: int, pages_per_pool: int, live_batches: int,
                   cpus: tuple[int, int] | None, packed: bool) -> Iterator[LoadGenerator]:
    """The simulated pools' cache service in a process of its own (on `cpus[1]`, this process
    moved to `cpus[0]`)."""
    ctx = multiprocessing.get_context("spawn")
    ports, go, sent = ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
    server = ctx.Process(target=F.serve, args=(pools, pages_per_pool, live_batches, ports, go,
                                               cpus[1] if cpus else None, packed, sent), daemon=True)
    server.start()
    try:
        address = f"127.0.0.1:{ports.get(timeout=1800)}"
        if cpus:
            os.sched_setaffinity(0, {cpus[0]})
        yield LoadGenerator(address, go, sent, server.pid)
    finally:
        server.kill()
        server.join(10)


def bench_router() -> Router:
    """The gateway's router as the bench runs it: affinity, an index bounded by nothing here."""
    return Router(make_policy("affinity"), GatewayMetrics(), IndexConfig(memory_budget_mb=1e6))


def admit(router: Router, names: list[str], address: str) -> None:
    """The pools as workers, their cache service at `address`."""
    for name in names:
        router.add(Worker(name, "bench", address, None, pb.GetModelInfoResponse(worker=name)))


def _fleet_router(address: str, pools: int) -> tuple[Router, list[str]]:
    router, names = bench_router(), [F.pool_name(i) for i in range(pools)]
    admit(router, names, address)
    return router, names


def _measure_warmup(address: str, pools: int, pages_per_pool: int, live_batches: int,
                    packed: bool) -> dict:
    """The cold warm-up alone, routed by both policies (warmup.py)."""
    router, names = _fleet_router(address, pools)
    timed, warm = _Router(router, pools, pages_per_pool, live_batches), threading.Event()
    timed.thread = threading.Thread(target=compare_run, args=(timed, router, names, warm),
                                    name="bench-router", daemon=True)
    timed.thread.start()
    t0 = time.perf_counter()
    feeds = FeedLoop(router)
    for name in names:
        feeds.submit(follow(feeds, address, name, SETTINGS, packed))
    t_warm = _wait(router, names, lambda i: i.last_seq >= 0 and not i.in_snapshot, poll_s=0.01)
    warm.set()
    timed.thread.join(10)
    feeds.close()
    return {"pools": pools, "pages_per_pool": pages_per_pool, "indexed_pages": len(router.index),
            "restart_to_warm_s": t_warm - t0, "routing_during_warmup": timed.summary(t0, t_warm),
            "inflight_requests": pools, "warmup_compare": timed.tally.summary(),
            "packed_hashes": packed}


def _measure(source: GrpcSource | DirectSource | FeedProcessSource, pools: int, pages_per_pool: int,
             live_batches: int, idle_s: float, packed: bool, tuning: IngestTuning) -> dict:
    router, names = _fleet_router(source.address, pools)
    if not tuning.spare:  # what the feed loop calls to write a growth's arrays ahead: nothing
        router.prepare_index_growth = lambda chunk=None: False  # type: ignore[method-assign]
    rss0, tasks0 = _rss_bytes(), task_cpu()
    timed = _Router(router, pools, pages_per_pool, live_batches,
                    period_s=tuning.decision_period_s)
    timed.thread.start()
    t0 = time.perf_counter()
    thread_priority.configure(tuning.priority, tuning.switch_interval_s)
    feeds = FeedLoop(router, tuning.slice_s, tuning.slice_events)
    source.start(feeds, names)
    marks = _StartMarks(router, names, t0)
    t_warm = _wait(router, names, lambda i: i.last_seq >= 0 and not i.in_snapshot, on_poll=marks)
    # What the gateway does once warm (--gc-freeze-after-warmup, on by default): without it a
    # full collection walking the warm heap paused the FeedLoop thread 80-130 ms in the live phase.
    frozen = freeze_warm_heap()
    threads = threading.active_count()
    clock = LiveClock(router, source.pid, pools * live_batches)
    clock.start()
    timed.new_phase.set()
    source.go(feeds)  # the live batches come now
    t_live = time.perf_counter()
    slices0 = feeds.applier.slices
    clock.done.wait(1800)
    clock.stop()
    t_done = _wait(router, names, lambda i: i.last_seq == live_batches)
    slices = feeds.applier.slices - slices0
    rss = _rss_bytes() - rss0
    timed.new_phase.set()
    time.sleep(idle_s)
    timed.stop.set()
    timed.thread.join(10)
    tasks = task_cpu()
    feeds.close()
    gc.unfreeze()
    snap, live = map(sum, zip(*(F.page_events(i, pages_per_pool, live_batches) for i in range(pools))))
    st = router.index.stats()
    return {
        "pools": pools, "pages_per_pool": pages_per_pool, "live_batches_per_pool": live_batches,
        "indexed_pages": st.entries, "snapshot_page_events": snap, "live_page_events": live,
        "restart_to_warm_s": t_warm - t0, "snapshot_page_events_per_s": snap / (t_warm - t0),
        **marks.summary(),
        **clock.summary(live, source.last_sent()),
        "routing_during_warmup": timed.summary(t0, t_warm),
        "routing_during_ingest": timed.summary(clock.first or t_live, clock.last or t_done),
        "routing_idle": timed.summary(t_done, t_done + idle_s + 1),
        "routed_to_holder": timed.to_holder(t_warm),  # once warm: the index holds every pool's
        "gateway_threads": threads, "rss_growth_bytes_per_page": rss / max(st.entries, 1),
        "index_evictions": st.evicted_entries, "live_apply_slices": slices,
        "index_growths_ready": st.growths_ready, "index_growths_partial": st.growths_partial,
        "index_growths_unready": st.growths_unready,
        "live_slice_events_mean": live / max(slices, 1),
        "slice_events_at_end": feeds.applier.size.events, **tuning.summary(),
        "packed_hashes": packed, "feeds_grpc": isinstance(source, GrpcSource),
        "frame_items": getattr(source, "frame_items", None),
        "feed_process": isinstance(source, FeedProcessSource),
        "live_rate_limit": getattr(source, "live_rate", None),
        "gc_frozen_objects": frozen, "load_avg_end": os.getloadavg(),
        "other_tasks": other_tasks(tasks0, tasks),
    }
