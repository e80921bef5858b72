"""`python -m prefixcache_bench.gateway_fleet.record_queue --json PATH`: what a routing decision
saves when the ingest slice before it applies the last decision's record of the pages it routed
(`RoutedPrefixes` queues records; `Router.apply_stream_items` settles them under the lock).

One process, one router: 1,000 pools' snapshots applied (no gRPC, as `--routing-only`), the
affinity policy's memory of routed pages filled to its bound (`--recent-full`: each record then
evicts as many pages as it adds), the warm heap frozen. Then decisions one after another, each
after an ingest slice of live batches through `Router.apply_stream_items` (the gateway's feed
loop's call). Alternating: a slice that settles the queued record (the gateway's code), and one
that leaves it to the decision (`policy.settle` a no-op for that slice: the decision's first read
applies it, as every decision did its own record before). Each decision's route() + finish()
timed, wall and thread CPU, by the request's kind; the two groups' medians and p99s (and their
ratios, settled / queued) come from the same minutes of the same process."""
from __future__ import annotations

import argparse
import random
import sys
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
from prefixcache_bench.harness import machine_info, percentile, print_and_write

SLICE_ITEMS = 2  # live batches a slice: 256 page events, ~a 0.25 ms slice on this machine


def _router_and_live(pools: int, pages_per_pool: int, live_batches: int
                     ) -> tuple[Router, list[tuple[str, cpb.SubscribeResponse]]]:
    """A router given every pool's snapshot; the pools' live batches, in seq order, not applied."""
    frozen = time.monotonic()  # every pool stays fresh however long the run takes
    router = Router(make_policy("affinity"), GatewayMetrics(), IndexConfig(memory_budget_mb=1e6),
                    clock=lambda: frozen)
    live = []
    for i in range(pools):
        name = F.pool_name(i)
        router.add(Worker(name, "bench", "bench", None, pb.GetModelInfoResponse(worker=name)))
        stream = [cpb.SubscribeResponse.FromString(raw)
                  for raw in F.recorded_stream(i, pages_per_pool, live_batches)]
        for item in stream[:len(stream) - live_batches]:
            router.on_stream_item(name, item)
        live += [(name, item) for item in stream[len(stream) - live_batches:]]
    while router.migrate_index(1 << 20):  # as an idle feed loop does (routing.py)
        pass
    return router, sorted(live, key=lambda x: x[1].batch.seq)


def run(pools: int, pages_per_pool: int, decisions: int) -> dict:
    live_batches = -(-decisions * SLICE_ITEMS // pools) + 1
    router, live = _router_and_live(pools, pages_per_pool, live_batches)
    requests = _Router(router, pools, pages_per_pool, live_batches, REQUEST_PAGES)
    recent = fill_routed(router.policy.recent, [F.pool_name(i) for i in range(pools)])
    freeze_warm_heap()
    settle, rng = router.policy.settle, random.Random(1)
    wall: dict[str, list[float]] = {"settled": [], "queued": []}
    cpu: dict[str, list[float]] = {"settled": [], "queued": []}
    by_kind: dict[tuple[str, str], list[float]] = {}
    for n in range(decisions):
        group = "settled" if n % 2 else "queued"
        if group == "queued":  # this slice leaves the record to the decision
            router.policy.settle = lambda: None  # type: ignore[method-assign]
        router.apply_stream_items(live[n * SLICE_ITEMS:(n + 1) * SLICE_ITEMS])
        router.policy.settle = settle  # type: ignore[method-assign]
        req, holder = requests._request(rng, n)
        start, cpu_start = time.perf_counter(), time.thread_time()
        router.route(req)
        router.finish(req.request_id)
        wall[group].append((time.perf_counter() - start) * 1e6)
        cpu[group].append((time.thread_time() - cpu_start) * 1e6)
        kind = "shared" if holder is None else "private"
        by_kind.setdefault((group, kind), []).append(cpu[group][-1])
    out: dict = {"pools": pools, "pages_per_pool": pages_per_pool, "decisions": decisions,
                 "slice_items": SLICE_ITEMS, "recent_pages": recent}
    for group in ("queued", "settled"):
        for q, name in ((0.5, "p50"), (0.99, "p99")):
            out[f"{group}_route_{name}_us"] = percentile(wall[group], q)
            out[f"{group}_route_cpu_{name}_us"] = percentile(cpu[group], q)
            for kind in ("shared", "private"):
                out[f"{group}_route_cpu_{kind}_{name}_us"] = percentile(
                    by_kind.get((group, kind), [0.0]), q)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pools", type=int, default=1000)
    p.add_argument("--total-pages", type=int, default=1_000_000)
    p.add_argument("--decisions", type=int, default=6000)
    p.add_argument("--json", help="write the results here (and a text table beside it)")
    args = p.parse_args(argv)
    result = run(args.pools, args.total_pages // args.pools, args.decisions)
    result["command"] = "python -m prefixcache_bench.gateway_fleet.record_queue " + " ".join(
        argv if argv is not None else sys.argv[1:])
    result["machine"] = machine_info()
    print_and_write(result, _table(result), args.json)
    return 0


def _table(result: dict) -> str:
    lines = [f"== a decision after an ingest slice, {result['pools']} pools, "
             f"{result['pools'] * result['pages_per_pool']:,} pages",
             f"{'':34}{'queued':>10}{'settled':>10}{'ratio':>8}"]
    for name in ("route_p50_us", "route_p99_us", "route_cpu_p50_us", "route_cpu_p99_us",
                 "route_cpu_shared_p50_us", "route_cpu_shared_p99_us",
                 "route_cpu_private_p50_us", "route_cpu_private_p99_us"):
        q, s = result[f"queued_{name}"], result[f"settled_{name}"]
        lines.append(f"{name:34}{q:10.1f}{s:10.1f}{s / q:8.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
