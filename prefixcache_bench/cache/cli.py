"""The run and its command line: every part in `Params.parts`, one table, one JSON."""
from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path

from prefixcache_bench.cache.params import GOALS, PARTS, Params
from prefixcache_bench.cache.parts_events import bench_events
from prefixcache_bench.cache.parts_match import bench_match
from prefixcache_bench.cache.parts_memory import bench_memory
from prefixcache_bench.cache.parts_step import bench_step_rpc
from prefixcache_bench.cache.parts_trace import bench_trace
from prefixcache_bench.cache.parts_zmq import bench_zmq
from prefixcache_bench.cache.serving import cache_server
from prefixcache_bench import CONVERSATION_TRACE
from prefixcache_bench.harness import (check_goals, load_average, log, machine_info,
                                       maybe_profile, metric_table, write_json)

# Numbers depend on uncommitted changes to the service too: the machine info names them.
WATCHED = ("cache_service", "protos")


def run(p: Params) -> dict:
    """Every part in `p.parts`; a flat dict of metrics plus `params`, `machine`, `goals`."""
    results: dict = {}
    machine = machine_info(watched=WATCHED)
    started = time.perf_counter()
    in_process = {"match": bench_match, "memory": bench_memory, "trace": bench_trace}
    for part, fn in in_process.items():
        if part in p.parts:
            log(f"[{part}]")
            with maybe_profile(p.profile, part):
                t = time.perf_counter()
                results.update(fn(p))
                results[f"{part}_s"] = round(time.perf_counter() - t, 2)
    if {"step", "events"} & set(p.parts):
        with cache_server(p.server) as server:
            for part, fn in (("step", bench_step_rpc), ("events", bench_events)):
                if part in p.parts:
                    log(f"[{part}] server={p.server} {server.target}")
                    # cProfile of this process's main thread, not of a server's.
                    with maybe_profile(p.profile, part):
                        t = time.perf_counter()
                        results.update(fn(p, server))
                        results[f"{part}_s"] = round(time.perf_counter() - t, 2)
    if "zmq" in p.parts:  # its own servers, with the ZMQ stream off and on
        log("[zmq]")
        with maybe_profile(p.profile, "zmq"):
            t = time.perf_counter()
            results.update(bench_zmq(p))
            results["zmq_s"] = round(time.perf_counter() - t, 2)
    results["total_s"] = round(time.perf_counter() - started, 2)
    machine["load_avg_end"] = load_average()
    results["goals"] = check_goals(results, GOALS)
    results["params"] = dataclasses.asdict(p)
    results["machine"] = machine
    return results


SIZE_FLAGS = ("match_iters", "step_iters", "step_prompts", "event_pages", "mem_pages", "mem_hits",
              "trace_requests", "trace_device_tokens", "trace_host_tokens", "warmup")


def parse_args(argv: list[str] | None = None) -> tuple[Params, argparse.Namespace]:
    from prefixcache_bench import cache as bench  # the package's docstring: its first line is the --help text

    ap = argparse.ArgumentParser(prog="python -m prefixcache_bench.cache",
                                 description=(bench.__doc__ or "").split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="fewer iterations and the first 2,000 trace requests (Params.quick)")
    ap.add_argument("--json", required=True, metavar="PATH", help="where to write the results")
    ap.add_argument("--trace", metavar="PATH", help=f"trace to replay (default {CONVERSATION_TRACE})")
    ap.add_argument("--server", choices=("process", "thread"),
                    help="run the gRPC server in a child process (default) or in this process")
    ap.add_argument("--only", metavar="PART[,PART]", help=f"subset of {','.join(PARTS)}")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile each part (this process's main thread) to stderr")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--trace-rounds", type=int, metavar="N",
                    help="replay the trace N times per eviction policy, alternating the policies, "
                         "and report the median of the rounds' speed ratios to LRU (default 1)")
    ap.add_argument("--check", action="store_true", help="exit 1 when a goal is missed")
    # Sizes, mainly so that tests can run everything in seconds.
    for name in SIZE_FLAGS:
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, dest=name)
    args = ap.parse_args(argv)
    p = Params.quick() if args.quick else Params()
    overrides = {name: getattr(args, name) for name in ("seed", "server", "trace_rounds", *SIZE_FLAGS)
                 if getattr(args, name) is not None}
    if args.trace:
        overrides["trace_path"] = args.trace
    if args.only:
        parts = tuple(s.strip() for s in args.only.split(",") if s.strip())
        unknown = set(parts) - set(PARTS)
        if unknown:
            ap.error(f"--only: unknown part(s) {', '.join(sorted(unknown))}; choose from {PARTS}")
        overrides["parts"] = parts
    overrides["profile"] = args.profile
    p = dataclasses.replace(p, **overrides)
    if p.step_prompts < p.step_batch:
        ap.error(f"--step-prompts: need at least {p.step_batch} (one step's batch)")
    return p, args


def main(argv: list[str] | None = None) -> int:
    p, args = parse_args(argv)
    if "trace" in p.parts and not Path(p.trace_path).is_file():
        log(f"trace {p.trace_path} not found: pass --trace PATH or leave 'trace' out of --only")
        return 2
    results = run(p)
    # The command, for the results pages (prefixcache_bench.pages); not a table row.
    command = shlex.join(["python", "-m", "prefixcache_bench.cache",
                          *(sys.argv[1:] if argv is None else argv)])
    write_json(args.json, {**results, "command": command})
    print(metric_table(results, results["goals"]))
    print(f"\nwritten to {args.json}")
    # A missed goal is a result, not a failure of the tool; --check turns it into exit status 1.
    return 1 if args.check and not all(g["pass"] for g in results["goals"].values()) else 0
