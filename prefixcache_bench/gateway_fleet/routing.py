"""`--routing-only`: the cost of one routing decision with ingest idle (issue 31's "p99 <= 1 ms at
1,000 workers and 10M indexed pages"). The pools' snapshots go straight into the Router's index (no
gRPC, no feed threads: nothing else runs in the process; a growth's old table then migrated, as an
idle gateway's feed loop does), then the same requests as the fleet run's routing thread (a pool's
conversation or a shared system prompt, then new pages) are timed through Router.route +
Router.finish, the affinity policy, one after another (`--recent-full`: its memory of recently
routed pages filled first, as a gateway's is after a while, `routed.fill_routed`). Applying is
timed too: the snapshots, then every pool's live batches (64 stored + 64 removed pages each), through Router.on_stream_item on
parsed messages. The policy's decision alone is timed apart, three ways, interleaved, on each
request (a same-minute ratio on a loaded machine): the router's array path (`_decide_fast`), the
same with its pick in numpy rather than C (`pick_in_c` off: affinity_arrays.py), and the
exhaustive one (`preview`: a WorkerScore per candidate, what RoutePreview shows); the index's
lookup alone both ways (`lookup_in_c`: held_native.py's one call or numpy rounds); and the garbage
collector's pauses during the decisions are counted (gc.callbacks): all of them, and those inside
Router.route. Each decision's wall time is timed and its thread's CPU time (time.thread_time: on a
machine shared with other jobs, the wall time's tail is their scheduling), the CPU time also by the
request's kind (shared prompt or a pool's conversation). Before the decisions the warm heap is
frozen as the gateway does once its workers' snapshots are in (gateway/core/gc_tuning.py,
`--gc-freeze-after-warmup`); `--no-gc-freeze` leaves it to the collector."""
from __future__ import annotations

import gc
import random
import time

from gateway.core.gc_tuning import freeze_warm_heap
from gateway.core.index import IndexConfig
from gateway.core.metrics import GatewayMetrics
from gateway.core.policies import make_policy
from gateway.core.router import Router, Worker
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache_bench.gateway_fleet import fleet as F
from prefixcache_bench.gateway_fleet.routed import fill_routed
from prefixcache_bench.gateway_fleet.run import REQUEST_PAGES, _Router
from prefixcache_bench.harness import percentile


class _GcPauses:
    """The collector's pauses (gc.callbacks), in wall and thread CPU time, and those that fell
    inside Router.route (`routing` set around it)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.in_route: list[float] = []
        self.routing = False
        self._start = (0.0, 0.0)

    def on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter(), time.thread_time()
            return
        self.wall.append(time.perf_counter() - self._start[0])
        self.cpu.append(time.thread_time() - self._start[1])  # preemption not counted
        if self.routing:
            self.in_route.append(self.wall[-1])

    def summary(self) -> dict:
        return {"gc_pauses_during_decisions": len(self.wall),
                "gc_max_pause_us": max(self.wall, default=0.0) * 1e6,
                "gc_max_pause_cpu_us": max(self.cpu, default=0.0) * 1e6,
                "gc_total_cpu_ms": sum(self.cpu) * 1e3,
                "gc_pauses_in_routing": len(self.in_route),
                "gc_max_pause_in_routing_us": max(self.in_route, default=0.0) * 1e6}


def _timed_records(recent) -> list[float]:
    """The times of the policy's records applied from now on (µs), one a decision: its
    `recent`'s store's `record` (RoutedPrefixes queues a decision's record; `routing_only`
    applies it within the decision's time)."""
    store = recent._pages
    times, record = [], store.record

    def timed(slot, hashes) -> None:
        start = time.perf_counter()
        record(slot, hashes)
        times.append((time.perf_counter() - start) * 1e6)
    store.record = timed
    return times


def _built_router(pools: int, pages_per_pool: int, live_batches: int) -> tuple[Router, dict]:
    """A Router given every pool's snapshot, then their live batches; and the timings."""
    # A frozen clock: every pool stays fresh however long the build takes, and the decisions are
    # reproducible (the time it takes is measured with perf_counter).
    frozen = time.monotonic()
    router = Router(make_policy("affinity"), GatewayMetrics(), IndexConfig(memory_budget_mb=1e6),
                    clock=lambda: frozen)
    snapshot_s, live, t0 = 0.0, [], time.perf_counter()
    for i in range(pools):
        name = F.pool_name(i)
        router.add(Worker(name, "bench", "bench", None, pb.GetModelInfoResponse(worker=name)))
        stream = [cpb.SubscribeResponse.FromString(raw)
                  for raw in F.recorded_stream(i, pages_per_pool, live_batches)]
        live += [(name, item) for item in stream[len(stream) - live_batches:]]
        start = time.perf_counter()
        for item in stream[:len(stream) - live_batches]:
            router.on_stream_item(name, item)
        snapshot_s += time.perf_counter() - start
    load_s = time.perf_counter() - t0
    start = time.perf_counter()  # every pool's live batches, pool after pool, seq after seq
    for name, item in sorted(live, key=lambda x: x[1].batch.seq):
        router.on_stream_item(name, item)
    live_s = time.perf_counter() - start
    snap_events, live_events = map(sum, zip(*(F.page_events(i, pages_per_pool, live_batches)
                                                for i in range(pools))))
    # What an idle gateway's feed loop does (feeds.IdleMigration): a growth's old table is
    # migrated, so a lookup probes one table. Left alone here (no feed loop), it stayed: at
    # 1,000 pools and 1M pages every decision probed two (stop 45).
    while router.migrate_index(1 << 20):
        pass
    return router, {"build_s": load_s,
                    # Router.on_stream_item alone (parsed messages, no gRPC, no other thread)
                    "snapshot_apply_page_events_per_s": snap_events / snapshot_s,
                    "live_apply_page_events_per_s": live_events / live_s}


def routing_only(pools: int, pages_per_pool: int, decisions: int = 5000, live_batches: int = 2,
                 gc_freeze: bool = True, prompt_pages: int = REQUEST_PAGES,
                 recent_full: bool = False) -> dict:
    router, built = _built_router(pools, pages_per_pool, live_batches)
    requests = _Router(router, pools, pages_per_pool, live_batches, prompt_pages)
    names = [F.pool_name(i) for i in range(pools)]
    recent_pages = fill_routed(router.policy.recent, names) if recent_full else 0
    frozen_objects = freeze_warm_heap() if gc_freeze else 0
    rng, lat, cpu, to_holder, private = random.Random(1), [], [], 0, 0
    cpu_of: dict[str, list[float]] = {"shared": [], "private": []}  # by the request's kind
    fast, fast_numpy, exhaustive, collector = [], [], [], _GcPauses()
    lookup: dict[bool, list[float]] = {True: [], False: []}  # the index's lookup, in C or not
    recorded = _timed_records(router.policy.recent)  # inside route(): its share of a decision
    gc.callbacks.append(collector.on_gc)
    for n in range(decisions):
        req, holder = requests._request(rng, n)
        candidates, policy = router._candidates(())[0], router.policy
        for in_c in (n % 2 == 0, n % 2 == 1):  # which goes first alternates (warm caches)
            router.index.lookup_in_c, start = in_c, time.perf_counter()
            router.index.holders(req.page_hashes)
            lookup[in_c].append((time.perf_counter() - start) * 1e6)
        router.index.lookup_in_c = True
        for way, in_c, times in ((policy._decide_fast, True, fast),
                                 (policy._decide_fast, False, fast_numpy),
                                 (policy.preview, True, exhaustive)):
            policy.pick_in_c, start = in_c, time.perf_counter()
            way(req, candidates, router.index, router.load)
            times.append((time.perf_counter() - start) * 1e6)
        collector.routing, cpu_start, start = True, time.thread_time(), time.perf_counter()
        route = router.route(req)
        # Its record of the pages routed, which it queued (routed_prefixes.py): with no ingest to
        # apply it between decisions, the next decision's first read would; timed with this one.
        router.policy.settle()
        lat.append((time.perf_counter() - start) * 1e6)
        cpu.append((time.thread_time() - cpu_start) * 1e6)
        cpu_of["shared" if holder is None else "private"].append(cpu[-1])
        collector.routing = False
        router.finish(req.request_id)
        if holder is not None:
            private += 1
            to_holder += route.worker.name == holder
    gc.callbacks.remove(collector.on_gc)
    if gc_freeze:
        gc.unfreeze()
    st = router.index.stats()
    return {"pools": pools, "pages_per_pool": pages_per_pool, "indexed_pages": st.entries,
            "prompt_pages": prompt_pages, "recent_full": recent_full,
            "recent_pages_before": recent_pages, "decisions": decisions,
            "routing_p50_idle_us": percentile(lat, 0.5),
            "routing_p99_idle_us": percentile(lat, 0.99), "routing_max_idle_us": max(lat),
            # The routing thread's own CPU time per decision: what other processes' use of the
            # cores (the load average) adds to the wall time above is not in it.
            "routing_cpu_p50_us": percentile(cpu, 0.5), "routing_cpu_p99_us": percentile(cpu, 0.99),
            # The same by kind: a shared system prompt's request (~100 holders at 1,000 pools),
            # where the p99 comes from, and a pool's conversation (one holder).
            **{f"routing_cpu_{kind}_{name}_us": percentile(times, q) for kind, times in cpu_of.items()
               for name, q in (("p50", 0.5), ("p99", 0.99)) if times},
            "recent_record_p50_us": percentile(recorded, 0.5),
            "recent_record_p99_us": percentile(recorded, 0.99),
            "routed_to_holder": to_holder / max(private, 1), "build_s": built["build_s"],
            "policy_fast_p50_us": percentile(fast, 0.5), "policy_fast_p99_us": percentile(fast, 0.99),
            # the index's lookup of each request, in one C call and in numpy rounds
            "lookup_c_p50_us": percentile(lookup[True], 0.5),
            "lookup_c_p99_us": percentile(lookup[True], 0.99),
            "lookup_rounds_p50_us": percentile(lookup[False], 0.5),
            "lookup_rounds_p99_us": percentile(lookup[False], 0.99),
            # the same decisions with the array path's pick in numpy (affinity_arrays.py)
            "policy_fast_numpy_p50_us": percentile(fast_numpy, 0.5),
            "policy_fast_numpy_p99_us": percentile(fast_numpy, 0.99),
            "policy_exhaustive_p50_us": percentile(exhaustive, 0.5),
            "policy_exhaustive_p99_us": percentile(exhaustive, 0.99),
            **collector.summary(), "gc_frozen_objects": frozen_objects,
            "snapshot_apply_page_events_per_s": built["snapshot_apply_page_events_per_s"],
            "live_apply_page_events_per_s": built["live_apply_page_events_per_s"]}
