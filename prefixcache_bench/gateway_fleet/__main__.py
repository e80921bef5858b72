"""`python -m prefixcache_bench.gateway_fleet --pools 1000 --total-pages 1000000 --json PATH`:
one configuration (run each in its own process: the index's memory is measured by growth);
`--summary DIR` tabulates the JSONs of a folder (w*.json; ingest_w*.json: ingest slice pairs);
`--routing-only` times routing
decisions alone (routing.py; its JSONs are routing_w*.json). `--checkpoint` times a restart
from an index checkpoint (restart.py; its JSONs are checkpoint_w*.json). `--warmup-compare`
compares routing during a cold warm-up with load-only routing (warmup.py; warmup_w*.json). See run.py for what is measured and how the two
cores are split (gateway on core 0, load generator on core 1)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from prefixcache_bench.gateway_fleet.restart import run_checkpoint
from prefixcache_bench.gateway_fleet.routing import routing_only
from gateway.core.ingest_slices import SLICE_S
from gateway.core.thread_priority import PRIORITIES, SWITCH_INTERVAL_S
from prefixcache_bench.gateway_fleet.index_memory import (idle_gateway_bytes_per_page,
                                                          index_bytes_per_page)
from prefixcache_bench.gateway_fleet.run import DECISION_PERIOD_S, IngestTuning, run_config
from prefixcache_bench.gateway_fleet.stalls import stalls_note
from prefixcache_bench.harness import Goal, columns_table, machine_info, report

# The goals (issue 31): judged on every configuration, so a FAIL is a gap, not a bug.
# A decision's p99 is judged three ways: route()'s own time, and its end from the request's
# planned wake-up and from its due time (what a request waits for, a stall included).
GOALS = {
    "live_page_events_per_s": Goal(">=", 1e6),
    "routing_p99_during_ingest_us": Goal("<=", 1000),
    "routing_p99_from_wake_during_ingest_us": Goal("<=", 1000),
    "routing_p99_from_due_during_ingest_us": Goal("<=", 1000),
    "index_bytes_per_page": Goal("<=", 64),
    # an idle gateway: what it holds, its next growth's arrays as far as written
    "index_bytes_per_page_idle_written": Goal("<=", 64),
    "restart_to_warm_s": Goal("<=", 5),
}
# --routing-only: the decision's own cost with ingest idle, and the index's size.
# --checkpoint: a restart from an index checkpoint (restart.py; its JSONs are checkpoint_w*.json).
CHECKPOINT_GOALS = {"restart_to_warm_s": Goal("<=", 5)}
CHECKPOINT_COLUMNS = ("pools", "indexed_pages", "restart_to_warm_s", "cold_restart_to_warm_s",
                      "checkpoint_load_s", "checkpoint_lock_held_s", "checkpoint_save_s",
                      "checkpoint_write_s", "checkpoint_bytes", "downtime_page_events", "resumed_from_seq")
ROUTING_GOALS = {"routing_p99_idle_us": Goal("<=", 1000), "index_bytes_per_page": Goal("<=", 64)}
ROUTING_COLUMNS = ("pools", "indexed_pages", "prompt_pages", "routing_p50_idle_us",
                   "routing_p99_idle_us", "routing_max_idle_us", "routing_cpu_p50_us",
                   "routing_cpu_p99_us", "routing_cpu_shared_p50_us", "routing_cpu_shared_p99_us",
                   "routing_cpu_private_p50_us", "routing_cpu_private_p99_us", "routed_to_holder",
                   "index_bytes_per_page",
                   "snapshot_apply_page_events_per_s", "live_apply_page_events_per_s",
                   "lookup_c_p50_us", "lookup_rounds_p50_us",
                   "policy_fast_p50_us", "policy_fast_numpy_p50_us", "policy_exhaustive_p50_us",
                   "gc_pauses_during_decisions", "gc_max_pause_us", "gc_max_pause_cpu_us",
                   "gc_total_cpu_ms", "gc_pauses_in_routing", "gc_max_pause_in_routing_us")
# The ingest slices' runs (ingest_w*.json): before/after pairs of the same minutes.
INGEST_COLUMNS = ("pools", "indexed_pages", "feeds_grpc", "ingest_slice_events_fixed",
                  "ingest_slice_ms", "switch_interval_ms", "ingest_priority",
                  "live_page_events_per_s", "live_slice_p50_ms", "live_slice_p99_ms",
                  "routing_p50_during_ingest_us", "routing_p99_during_ingest_us",
                  "routing_max_during_ingest_us", "routing_p99_from_wake_during_ingest_us",
                  "routing_p99_from_due_during_ingest_us",
                  "routing_p99_idle_us", "feed_loop_cpu_share_live",
                  "routing_cpu_share_during_ingest", "generator_cpu_share_live",
                  "generator_send_page_events_per_s")
COLUMNS = ("pools", "indexed_pages", "feed_process", "restart_to_warm_s",
           "snapshot_page_events_per_s", "live_page_events_per_s", "routing_p50_during_ingest_us",
           "routing_p99_during_ingest_us", "routing_p99_from_wake_during_ingest_us",
           "routing_p99_from_due_during_ingest_us",
           # stalls.py: the decisions that waited behind another task, and the p99 without them
           "routing_stalled_decisions_during_ingest",
           "routing_p99_from_due_outside_stalls_during_ingest_us", "routing_p99_idle_us",
           "routed_to_holder", "index_bytes_per_page", "index_bytes_per_page_idle_written",
           "gateway_threads")


def decisions_share_note(results: dict) -> str | None:
    """A line for a run whose routing decisions took over half the gateway's core during ingest
    (a fixed rate of them on a slow machine): its ingest figures then measure what the decisions
    left to the feed loop, not the feed loop."""
    share = results.get("routing_cpu_share_during_ingest")
    if share is None or share <= 0.5:
        return None
    return (f"note: the routing decisions took {share:.0%} of the gateway's core during ingest; "
            f"ingest had the rest (the machine's speed: python_loop_s in the JSON)")


def _flatten(results: dict) -> dict:
    out = {}
    for key, value in results.items():
        if isinstance(value, dict):
            phase = key.removeprefix("routing_")
            for k, v in value.items():
                out[f"routing_{k.removesuffix('_us')}_{phase}" + ("_us" if k.endswith("_us") else "")] = v
        else:
            out[key] = value
    return out


def _cores(args: argparse.Namespace) -> str:
    if args.routing_only:
        return "one process, unpinned (routing only)"
    if args.no_grpc:
        return "one process (no load generator), pinned to core 0" if not args.no_pin else "unpinned"
    return "gateway process pinned to core 0, load generator to core 1" if not args.no_pin else "unpinned"


def _command(argv: list[str] | None) -> str:
    return "python -m prefixcache_bench.gateway_fleet " + " ".join(argv or sys.argv[1:])


def _add_tuning_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ingest-slice-ms", type=float, default=SLICE_S * 1e3,
                   help="the time one ingest slice may hold the router's lock (the gateway's "
                        "--ingest-slice-ms)")
    p.add_argument("--slice-events", type=int,
                   help="a fixed number of page events per ingest slice instead (1024: the "
                        "gateway before --ingest-slice-ms)")
    p.add_argument("--switch-interval-ms", type=float, default=SWITCH_INTERVAL_S * 1e3,
                   help="the gateway process's sys.setswitchinterval (the gateway's "
                        "--switch-interval-ms)")
    p.add_argument("--decision-period-ms", type=float, default=DECISION_PERIOD_S * 1e3,
                   help="a timed request is due every this many ms (raise it on a machine where "
                        "route() alone takes most of the default's millisecond)")
    p.add_argument("--ingest-priority", choices=PRIORITIES, default="idle",
                   help="the feed loop thread's scheduling priority (the gateway's "
                        "--ingest-priority; default idle, as deploy/k8s runs the gateway: the "
                        "bench's gateway process has its core to itself, as a pod its cgroup)")
    p.add_argument("--no-spare", action="store_true",
                   help="the feed loop writes no next growth's arrays ahead (table_arrays.Spare): "
                        "what writing them costs ingest, and a growth then allocates them")


def _tuning(args: argparse.Namespace) -> IngestTuning:
    return IngestTuning(args.ingest_slice_ms / 1e3, args.slice_events,
                        args.switch_interval_ms / 1e3, args.ingest_priority,
                        args.decision_period_ms / 1e3, spare=not args.no_spare)


def _summary(folder: Path) -> None:
    """The table of each kind of run in `folder` (--summary)."""
    for pattern, columns in (("w[0-9]*.json", COLUMNS), ("routing_w*.json", ROUTING_COLUMNS),
                             ("checkpoint_w*.json", CHECKPOINT_COLUMNS),
                             ("ingest_w*.json", INGEST_COLUMNS)):
        rows = [json.loads(f.read_text()) for f in sorted(folder.glob(pattern))]
        rows.sort(key=lambda r: (r["indexed_pages"] > 5e6, r["pools"]))
        if rows:
            print(columns_table(columns, [[r.get(c) for c in columns] for r in rows]))


def _add_source_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-grpc", action="store_true",
                   help="no load generator and no gRPC: the recorded items, decoded ahead, put on "
                        "the gateway's applier directly (sources.py: what the gateway's process "
                        "would still do with its feeds in a process of their own)")
    p.add_argument("--frame-items", type=int,
                   help="with --no-grpc: the live items as stream frames of this many items "
                        "(gateway/core/stream_frames.py), decoded as they are put (what the "
                        "gateway's process would run with a feed process sending it frames); "
                        "with --feed-process, the most items a frame (default 64)")
    p.add_argument("--feed-process", action="store_true",
                   help="the pools' streams read by the gateway's feed process (its "
                        "--feed-process, gateway/core/feed_process.py), pinned to the load "
                        "generator's core")
    p.add_argument("--live-rate", type=float,
                   help="with --no-grpc: put the live items at this many page events a second at "
                        "most (default: as fast as the applier takes them), to compare item forms "
                        "at one ingest rate")


def _check_source_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.no_grpc and (args.checkpoint or args.warmup_compare or args.routing_only):
        p.error("--no-grpc times the ingest run only (not --checkpoint, --warmup-compare or "
                "--routing-only)")
    if args.feed_process and (args.no_grpc or args.checkpoint or args.warmup_compare
                              or args.routing_only or args.unpacked):
        p.error("--feed-process times the ingest run over gRPC, packed (not --no-grpc, "
                "--checkpoint, --warmup-compare, --routing-only or --unpacked)")
    if args.frame_items is not None and (not (args.no_grpc or args.feed_process)
                                         or args.frame_items < 1):
        p.error("--frame-items: a positive count, with --no-grpc or --feed-process")
    if args.recent_full and not args.routing_only:
        p.error("--recent-full: with --routing-only")
    if args.live_rate is not None and (not args.no_grpc or args.live_rate <= 0):
        p.error("--live-rate: a positive rate, with --no-grpc")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixcache_bench.gateway_fleet", description=__doc__)
    p.add_argument("--pools", type=int, default=100)
    p.add_argument("--total-pages", type=int, default=1_000_000, help="private pages over all pools")
    p.add_argument("--live-page-events", type=int, default=1_280_000,
                   help="live page events over all pools (batches of 64 stored + 64 removed); "
                        "the default is over a second of ingest at the 1M/s goal")
    p.add_argument("--memory-sample-pages", type=int, default=200_000,
                   help="pages of the tracemalloc measurement of bytes per indexed page")
    p.add_argument("--routing-only", action="store_true",
                   help="only time routing decisions with ingest idle (snapshots applied directly)")
    p.add_argument("--decisions", type=int, default=5000, help="timed decisions of --routing-only")
    p.add_argument("--prompt-pages", type=int, default=64,
                   help="--routing-only: pages per request (32 held by a pool or a system prompt, "
                        "the rest new)")
    p.add_argument("--recent-full", action="store_true",
                   help="--routing-only: the affinity policy's memory of recently routed pages "
                        "filled to its bound first (4,096 pages a pool), as a gateway's is after "
                        "a while of routing")
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="--routing-only: leave the warm heap to the garbage collector (the gateway's "
                        "--no-gc-freeze-after-warmup)")
    p.add_argument("--no-pin", action="store_true", help="leave both processes on any core")
    _add_source_flags(p)
    p.add_argument("--unpacked", action="store_true",
                   help="the feeds ask for the per-page hash encoding, not the packed one")
    p.add_argument("--checkpoint", action="store_true",
                   help="restart the gateway from an index checkpoint written after the warm-up "
                        "(restart.py) and time that restart")
    p.add_argument("--warmup-compare", action="store_true",
                   help="only the cold warm-up: each decision of the gateway's affinity routing "
                        "compared with load-only routing (least_loaded over every worker), per "
                        "share of pools warm (warmup.py; its JSONs are warmup_w*.json)")
    _add_tuning_flags(p)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--summary", help="print the table of every JSON in this folder and exit")
    args = p.parse_args(argv)
    _check_source_flags(p, args)
    if args.summary:
        _summary(Path(args.summary))
        return 0
    per_pool = args.total_pages // args.pools
    live = max(1, args.live_page_events // (128 * args.pools))
    if args.checkpoint:
        results = run_checkpoint(args.pools, per_pool, live, cpus=None if args.no_pin else (0, 1))
        command = "python -m prefixcache_bench.gateway_fleet " + " ".join(argv or sys.argv[1:])
        report(results, CHECKPOINT_GOALS, f"gateway restart from a checkpoint, {args.pools} pools",
               command, machine_info({"cores": _cores(args)}, watched=["gateway", "prefixcache_client"]),
               args.json)
        return 0
    if args.warmup_compare:
        results = run_config(args.pools, per_pool, live, cpus=None if args.no_pin else (0, 1),
                             packed=not args.unpacked, warmup_compare=True)
        report(results, {}, f"routing during warm-up, {args.pools} pools", _command(argv),
               machine_info({"cores": _cores(args)}, watched=["gateway", "prefixcache_client"]),
               args.json)
        rows = results["warmup_compare"]
        print(columns_table(tuple(rows[0]), [list(r.values()) for r in rows]))
        return 0
    if args.routing_only:
        results = routing_only(args.pools, per_pool, args.decisions, live,
                               gc_freeze=not args.no_gc_freeze, prompt_pages=args.prompt_pages,
                               recent_full=args.recent_full)
    else:
        results = _flatten(run_config(args.pools, per_pool, live, cpus=None if args.no_pin else (0, 1),
                                      packed=not args.unpacked, tuning=_tuning(args),
                                      grpc=not args.no_grpc, frame_items=args.frame_items,
                                      live_rate=args.live_rate, feed_process=args.feed_process))
    sample = min(per_pool, max(1, args.memory_sample_pages // args.pools))
    results["index_bytes_per_page"] = index_bytes_per_page(args.pools, sample)
    results.update(idle_gateway_bytes_per_page(args.pools, sample))
    command = "python -m prefixcache_bench.gateway_fleet " + " ".join(argv or sys.argv[1:])
    goals = ROUTING_GOALS if args.routing_only else GOALS
    report(results, goals, f"gateway index, {args.pools} pools", command,
           machine_info({"cores": _cores(args)}, watched=["gateway", "prefixcache_client"]),
           args.json)
    for note in (decisions_share_note(results), stalls_note(results)):
        if note:
            print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
