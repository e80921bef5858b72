"""Replay a Mooncake-format trace through the real gateway index and routing policies.

    python -m prefixcache_bench.sim.simulate --trace PATH --workers 8 --capacity-tokens 1000000 --policy all \\
        --json out.json [--png out.png] [--max-requests N] [--page-size 16] [--time-scale 1] [--bench]
        [--scale-copies N [--copy-spacing-s 0.5]] [--index-entries N]
        [--l3-capacity-tokens C3 [--l3-write-through] [--l3-load-s-per-token S] [--no-l3-events]]
    python -m prefixcache_bench.sim.simulate --bench --json bench.json      # micro-benchmarks only

Each trace block id becomes 512 deterministic tokens (prefixcache_bench.sim.trace); prompts are hashed once
with prefixcache_client.hash and replayed through each policy in a discrete-event model of the
workers (prefixcache_bench.sim.engine, whose docstring states the cost model: an 8B model on one H100,
every constant a flag below). The page size defaults to the stack's own 16 tokens, so a prompt
cut inside a 512-token block still shares that block's full pages, as a real engine would.
Prints a table, writes JSON (per policy: hit_ratio, bound_hit_ratio, imbalance = max / mean
prefill tokens computed per worker, mean/p99 TTFT, routing decision p50/p99 in microseconds,
hashing excluded since prompts are hashed up front), and optionally a PNG. With --bench, also
the decision latency for 8k-token prompts over 64 workers with hashing included, and the
index's ingest rate. Progress goes to stderr. Requests are routed by the gateway's own Router
(`decision_p*_us` times each `Router.route` call), and each policy's JSON has the index's size at
the end of its replay (`index_keys`, `index_bytes`, `index_bytes_per_key`). --index-entries N
bounds that index at N keys (by default it holds all the workers can), so that a run shows what
its eviction order keeps for routing (`index_evictions`: the keys the bound dropped).

With --scale-copies N the trace is N disjoint copies on one timeline, copy k `k x
--copy-spacing-s` late (prefixcache_bench.sim.trace.scale_copies says why): 125 copies over
1,000 workers load each worker as one copy loads 8. --max-requests then keeps the first N of
the merged timeline. Only the original prompts are hashed; each copy's page hashes are the
original's under the copy's mask, derived when a request is replayed (trace.CopyHashes).

With --l3-capacity-tokens, the workers share an L3 tier of that many tokens (LRU over pages;
write-back by default, write-through with --l3-write-through; hits past a worker's device and
host run are loaded at --l3-load-s-per-token; the L3 publishes REMOTE events to the index unless
--no-l3-events: see prefixcache_bench.sim.engine). Hits are then split device / host / L3 (`l3_hit_ratio`),
and besides the pooled bound of workers x device capacity (`bound_hit_ratio`, which an L3 can
exceed by capacity alone) the JSON has `l3.bound_hit_ratio`: one pooled LRU of all the capacity
the fleet has, workers x (device + host) + L3. That is the bound the L3 goal (`hit_vs_l3_bound`
>= 0.97) is judged on: it asks whether the tiers and the routing waste capacity (duplicates
across workers and the L3, pages lost to per-worker LRU order), as the pooled bound asks of
routing without an L3. `unbounded_hit_ratio` (every page ever seen kept) is the ceiling.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Sequence

from gateway.core.policies import POLICY_NAMES, RECENT_HALFLIFE_S, AffinityConfig, make_policy
from prefixcache_bench.sim.bench import run_bench
from prefixcache_bench.sim.bounds import bound_hit_ratio, l3_bound_hit_ratio, unbounded_hit_ratio
from prefixcache_bench.sim.engine import CostModel, SimConfig, run_policy
from prefixcache_bench.sim.report import goals, plot, summarize, table
from prefixcache_bench.sim.trace import BlockTokens, CopyHashes, TraceRequest, load_trace, scale_copies
from prefixcache_bench.harness import log, write_json


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m prefixcache_bench.sim.simulate", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", help="Mooncake-format .jsonl trace")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--capacity-tokens", type=int, default=1_000_000, help="device KV capacity per worker")
    p.add_argument("--host-capacity-tokens", type=int, default=0, help="host (L2) tier per worker; 0 = none")
    p.add_argument("--l3-capacity-tokens", type=int, default=0, help="shared L3 tier over all workers; 0 = none")
    p.add_argument("--l3-write-through", action="store_true",
                   help="write computed pages to L3 when published (default: write-back, when dropped)")
    p.add_argument("--no-l3-events", action="store_true",
                   help="the L3 publishes no REMOTE events: the index and the policies never hear of it")
    p.add_argument("--policy", default="affinity", help=f"one of {', '.join(POLICY_NAMES)}, or all")
    p.add_argument("--json", help="write results here")
    p.add_argument("--png", help="write a plot of hit ratio and TTFT per policy here")
    p.add_argument("--max-requests", type=int, help="replay only the first N requests")
    p.add_argument("--scale-copies", type=int, default=1, help="N disjoint copies of the trace (tenants)")
    p.add_argument("--copy-spacing-s", type=float, default=0.5, help="copy k arrives k x this later")
    p.add_argument("--index-entries", type=int, default=0,
                   help="the gateway index's bound in (page hash, medium) keys (0: above all the "
                        "workers hold); past it, its eviction order decides what routing forgets")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--time-scale", type=float, default=1.0, help="> 1 compresses arrival times (more load)")
    p.add_argument("--max-output-tokens", type=int, default=4096)
    p.add_argument("--vocab-size", type=int, default=128256)
    p.add_argument("--seed", type=int, default=0, help="seed of the hash id -> tokens mapping")
    p.add_argument("--event-delay-s", type=float, default=0.005, help="worker -> gateway event latency")
    cost = CostModel()
    p.add_argument("--prefill-s-per-token", type=float, default=cost.prefill_s_per_token)
    p.add_argument("--attention-s-per-pair", type=float, default=cost.attention_s_per_pair)
    p.add_argument("--host-load-s-per-token", type=float, default=cost.host_load_s_per_token)
    p.add_argument("--l3-load-s-per-token", type=float, default=cost.l3_load_s_per_token)
    p.add_argument("--decode-s-per-token", type=float, default=cost.decode_s_per_token)
    p.add_argument("--step-overhead-s", type=float, default=cost.step_overhead_s)
    p.add_argument("--step-tokens", type=int, default=cost.step_tokens, help="prefill tokens per engine step")
    p.add_argument("--tpot-s", type=float, default=cost.tpot_s, help="time per output token while decoding")
    aff = AffinityConfig()
    p.add_argument("--queue-weight", type=float, default=aff.queue_weight, help="affinity/approx")
    p.add_argument("--overload-weight", type=float, default=aff.overload_weight, help="affinity/approx")
    p.add_argument("--balance-weight", type=float, default=aff.balance_weight, help="affinity/approx")
    p.add_argument("--recent-halflife-s", type=float, default=RECENT_HALFLIFE_S,
                   help="half-life of the recent routed prefill the balance terms use")
    p.add_argument("--inflight-weight-tokens", type=float, default=aff.inflight_weight_tokens,
                   help="affinity/approx")
    p.add_argument("--move-queue-tokens", type=float, default=aff.move_queue_tokens,
                   help="affinity/approx: a holder's queue above which load alone may move a request off it")
    p.add_argument("--host-cost", type=float, default=aff.host_cost, help="affinity/approx")
    p.add_argument("--remote-cost", type=float, default=aff.remote_cost, help="affinity/approx: L3 hits")
    p.add_argument("--tie-rel", type=float, default=aff.tie_rel, help="affinity/approx near-tie band")
    p.add_argument("--bench", action="store_true", help="also run the routing micro-benchmarks")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.policy != "all" and args.policy not in POLICY_NAMES:
        parser.error(f"--policy: unknown {args.policy!r}, expected one of {', '.join(POLICY_NAMES)} or all")
    if not args.trace and not args.bench:
        parser.error("--trace is required (or --bench alone for the micro-benchmarks)")
    if not 1 <= args.workers <= 4096 or args.capacity_tokens < args.page_size or args.page_size < 1:
        parser.error("--workers must be in [1, 4096], --page-size >= 1, --capacity-tokens >= --page-size")
    if args.l3_capacity_tokens < 0 or 0 < args.l3_capacity_tokens < args.page_size:
        parser.error("--l3-capacity-tokens must be 0 (no L3) or >= --page-size")
    if args.recent_halflife_s <= 0:
        parser.error("--recent-halflife-s must be > 0")
    if args.scale_copies < 1 or args.copy_spacing_s < 0:
        parser.error("--scale-copies must be >= 1, --copy-spacing-s >= 0")
    if args.index_entries < 0:
        parser.error("--index-entries must be >= 1 (a bound in keys), or 0 (no bound)")
    progress = None if args.quiet else log
    out: dict = {"config": {k: v for k, v in vars(args).items() if k not in ("json", "png", "quiet")},
                 "command": "python -m prefixcache_bench.sim.simulate " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "load_avg_start": os.getloadavg()[0]}
    if args.trace:
        out.update(_simulate(args, progress))
    if args.bench:
        if progress:
            progress("micro-benchmarks: 64 workers, 8k-token prompts ...")
        bench = dataclasses.asdict(run_bench())
        out["bench"] = bench
        print(f"routing decision for an 8k-token prompt over 64 workers (hashing included): "
              f"p50 {bench['decision_p50_us']:.0f} us, p99 {bench['decision_p99_us']:.0f} us "
              f"(CPU time p99 {bench['decision_cpu_p99_us']:.0f} us) "
              f"(hash p99 {bench['hash_p99_us']:.0f} us, index lookup p99 {bench['lookup_p99_us']:.0f} us)")
        print(f"index ingest: {bench['ingest_page_events_per_s']:,.0f} page events/s")
    out["load_avg_end"] = os.getloadavg()[0]
    if args.json:
        write_json(args.json, out)
    return 0


def _simulate(args: argparse.Namespace, progress) -> dict:
    requests = load_trace(args.trace, None if args.scale_copies > 1 else args.max_requests, args.time_scale,
                          args.max_output_tokens)
    if args.scale_copies > 1:
        requests = scale_copies(requests, args.scale_copies, args.copy_spacing_s, args.max_requests)
    cfg = SimConfig(workers=args.workers, capacity_tokens=args.capacity_tokens,
                    host_capacity_tokens=args.host_capacity_tokens, page_size=args.page_size,
                    event_delay_s=args.event_delay_s,
                    cost=CostModel(prefill_s_per_token=args.prefill_s_per_token,
                                   attention_s_per_pair=args.attention_s_per_pair,
                                   host_load_s_per_token=args.host_load_s_per_token,
                                   step_overhead_s=args.step_overhead_s, step_tokens=args.step_tokens,
                                   decode_s_per_token=args.decode_s_per_token, tpot_s=args.tpot_s,
                                   l3_load_s_per_token=args.l3_load_s_per_token),
                    l3_capacity_tokens=args.l3_capacity_tokens, l3_write_through=args.l3_write_through,
                    l3_events=not args.no_l3_events, recent_halflife_s=args.recent_halflife_s,
                    index_entries=args.index_entries)
    blobs, source_blobs = _page_hashes(requests, cfg, BlockTokens(args.vocab_size, args.seed), progress)
    t0 = time.perf_counter()
    bound = bound_hit_ratio(requests, blobs, cfg)
    if progress:
        progress(f"pooled LRU bound over {len(requests)} requests: {time.perf_counter() - t0:.0f}s")
    l3_bound = l3_bound_hit_ratio(requests, blobs, cfg) if cfg.l3_capacity_tokens else None
    unbounded = unbounded_hit_ratio(requests, source_blobs, cfg.page_size)
    affinity = AffinityConfig(queue_weight=args.queue_weight, overload_weight=args.overload_weight,
                              balance_weight=args.balance_weight,
                              inflight_weight_tokens=args.inflight_weight_tokens,
                              move_queue_tokens=args.move_queue_tokens, host_cost=args.host_cost,
                              remote_cost=args.remote_cost, tie_rel=args.tie_rel)
    names = POLICY_NAMES if args.policy == "all" else (args.policy,)
    policies = {}
    for name in names:
        policy = make_policy(name, affinity=affinity, approx_max_pages=cfg.capacity_tokens // cfg.page_size)
        policies[name] = summarize(run_policy(requests, blobs, policy, cfg, progress), bound, l3_bound)
        if progress:
            progress(f"[{name}] done: hit {policies[name]['hit_ratio']:.4f}, "
                     f"mean TTFT {policies[name]['mean_ttft_s']:.3f}s")
    tiers = (f" + host {cfg.host_capacity_tokens:,}" if cfg.host_capacity_tokens else "") + (
        f", shared L3 {cfg.l3_capacity_tokens:,} tokens ({_l3_mode(cfg)})" if cfg.l3_capacity_tokens else "")
    print(f"{args.trace}: {len(requests)} requests, {cfg.workers} workers x {cfg.capacity_tokens:,} tokens{tiers}, "
          f"page {cfg.page_size}, time scale {args.time_scale}")
    print(f"unbounded cache hit ratio (every page ever seen kept): {unbounded:.4f}")
    print(table(policies, bound, l3_bound))
    result = {"bound_hit_ratio": bound, "unbounded_hit_ratio": unbounded, "policies": policies,
              "goals": goals(policies)}
    if cfg.l3_capacity_tokens:
        result["l3"] = {"capacity_tokens": cfg.l3_capacity_tokens,
                        "write_policy": "write-through" if cfg.l3_write_through else "write-back",
                        "events": cfg.l3_events, "load_s_per_token": cfg.cost.l3_load_s_per_token,
                        "bound_hit_ratio": l3_bound,
                        "bound": "one pooled LRU of workers x (device + host) + L3 tokens"}
    if result["goals"]:
        print("goals: " + ", ".join(f"{k}={v}" for k, v in result["goals"].items()))
    if args.png:
        speed = f", time scale {args.time_scale:g}x" if args.time_scale != 1 else ""
        plot(policies, bound, args.png, f"{args.trace.rsplit('/', 1)[-1]}: {cfg.workers} workers x "
             f"{cfg.capacity_tokens:,} tokens{tiers}{speed}", l3_bound)
    return result


def _page_hashes(requests: list[TraceRequest], cfg: SimConfig, blocks: BlockTokens,
                 progress) -> tuple[Sequence[bytes], list[bytes]]:
    """(each request's page hashes concatenated, the original requests' by `source`). Each
    original prompt is hashed once; a scaled trace's copies derive theirs from it on access
    (prefixcache_bench.sim.trace.CopyHashes)."""
    originals: dict[int, TraceRequest] = {}
    for r in requests:
        originals.setdefault(r.source, r)
    t0 = time.perf_counter()
    source_blobs = []
    for i in range(max(originals, default=-1) + 1):
        source_blobs.append(b"".join(blocks.page_hashes(originals[i], cfg.page_size, cfg.model_id)))
        if progress and i % 2000 == 1999:
            progress(f"hashing prompts: {i + 1}/{len(originals)}, {time.perf_counter() - t0:.0f}s")
    if all(r.copy == 0 for r in requests):
        return source_blobs, source_blobs
    return CopyHashes(requests, source_blobs), source_blobs


def _l3_mode(cfg: SimConfig) -> str:
    return ("write-through" if cfg.l3_write_through else "write-back") + (
        "" if cfg.l3_events else ", no REMOTE events") + f", load {cfg.cost.l3_load_s_per_token * 1e6:g} us/token"


if __name__ == "__main__":
    sys.exit(main())
