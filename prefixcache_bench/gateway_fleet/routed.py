"""`python -m prefixcache_bench.gateway_fleet.routed --json PATH`: the affinity policy's memory of
recently routed pages (`RoutedPrefixes`, 4,096 pages a worker by default) at fleet scale, its C
store (csrc/routed_table.c) against the Python dicts (`DictPages`). Each run is its own process
(so that its resident memory is its own), the two alternated `--repeats` times:
- fill: every worker's memory filled to its bound (prompts of 32 new pages);
- bytes a remembered page: the process's resident memory grown by the fill, over the pages;
- record: `--calls` prompts of 32 new pages to random workers (each evicting 32), timed one by
  one (perf_counter; p50 / p99 / max);
- holders + extend: what a decision's `_extenders` asks, timed the same way;
- match: a prompt whose first 64 pages every worker was routed (a system prompt), what the
  approx and sglang policies ask each decision;
- extend, every worker: the same prompt's run for each worker, as the affinity policy extends a
  shared prompt's holders: a call each (`extend`) and one call (`extend_many`).
The ratios are c / dicts of the medians over the repeats; the load average is recorded."""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

from prefixcache_bench.harness import percentile, print_and_write

IMPLS = ("c", "dicts")
NEW_PAGES = 32
MATCHES = 300  # timed matches of a prefix every worker holds (what approx and sglang ask)
EXTENDS = 30  # timed extensions of every worker's run of that prefix, each way


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _pct(times_ns: list[int], q: float) -> float:
    return percentile(times_ns, q) / 1e3


def fill_routed(routed, names: list[str]) -> int:
    """Every worker's memory in `routed` (a RoutedPrefixes) filled to its bound with prompts of
    NEW_PAGES pages no request has, as a gateway's is after a while of routing: its records then
    evict as many pages as they add. Returns the pages remembered."""
    counter = iter(range(1 << 62))
    for name in names:
        for _ in range(-(-routed.max_pages // NEW_PAGES)):
            routed.record(name, [(1 << 127 | next(counter)).to_bytes(16, "little")
                                 for _ in range(NEW_PAGES)])
    return sum(routed.size(name) for name in names)


def one_run(impl: str, workers: int, pages: int, calls: int, seed: int) -> dict:
    """One implementation, filled and timed in this process."""
    import gc

    from gateway.core.routed_prefixes import RoutedPrefixes
    routed = RoutedPrefixes(pages, native=impl == "c")
    names = [f"w{w}" for w in range(workers)]
    counter = iter(range(1 << 62))

    def prompt() -> list[bytes]:
        return [next(counter).to_bytes(16, "little") for _ in range(NEW_PAGES)]

    gc.collect()
    before, start = _rss(), time.perf_counter()
    remembered = fill_routed(routed, names)
    fill_s = time.perf_counter() - start
    gc.collect()
    grown = _rss() - before
    rng = random.Random(seed)
    work = [(rng.choice(names), prompt()) for _ in range(calls)]
    record, ask = [], []
    for name, hashes in work:
        t = time.perf_counter_ns()
        routed.record(name, hashes)
        routed.settle()  # applied now: a record is queued until then (routed_prefixes.py)
        record.append(time.perf_counter_ns() - t)
    for name, hashes in work:  # a prompt recorded a while ago: its root's holders, its run
        t = time.perf_counter_ns()
        routed.holders(hashes[0])
        routed.extend(name, hashes, 0)
        ask.append(time.perf_counter_ns() - t)
    # A system prompt every worker was routed: 64 pages all of them hold, then 32 nobody does.
    shared = [(1 << 126 | i).to_bytes(16, "little") for i in range(64)]
    for name in names:
        routed.record(name, shared)
    routed.settle()
    probe, match = shared + prompt(), []
    for _ in range(MATCHES):
        t = time.perf_counter_ns()
        routed.match(probe)
        match.append(time.perf_counter_ns() - t)
    each, many, starts = [], [], [0] * len(names)
    for _ in range(EXTENDS):
        t = time.perf_counter_ns()
        ends = [routed.extend(name, probe, 0) for name in names]
        each.append(time.perf_counter_ns() - t)
        t = time.perf_counter_ns()
        assert routed.extend_many(names, probe, starts) == ends
        many.append(time.perf_counter_ns() - t)
    return {"impl": impl, "remembered_pages": remembered, "fill_s": fill_s,
            "match_shared_p50_us": _pct(match, 0.5),
            "extend_each_shared_p50_us": _pct(each, 0.5),
            "extend_many_shared_p50_us": _pct(many, 0.5),
            "bytes_per_page": grown / remembered, "record_p50_us": _pct(record, 0.5),
            "record_p99_us": _pct(record, 0.99), "record_max_us": max(record) / 1e3,
            "holders_extend_p50_us": _pct(ask, 0.5), "holders_extend_p99_us": _pct(ask, 0.99)}


ROWS = (("bytes a remembered page (RSS)", "bytes_per_page"), ("fill s", "fill_s"),
        ("record p50 us", "record_p50_us"), ("record p99 us", "record_p99_us"),
        ("record max us", "record_max_us"), ("holders + extend p50 us", "holders_extend_p50_us"),
        ("holders + extend p99 us", "holders_extend_p99_us"),
        ("match, 64 pages all hold, p50 us", "match_shared_p50_us"),
        ("extend all, a call each, p50 us", "extend_each_shared_p50_us"),
        ("extend all, one call, p50 us", "extend_many_shared_p50_us"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=1000)
    p.add_argument("--pages", type=int, default=4096, help="pages remembered a worker")
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="write the results here (and a text table beside it)")
    p.add_argument("--one", choices=IMPLS, help=argparse.SUPPRESS)  # a child process's run
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one_run(args.one, args.workers, args.pages, args.calls, 1)))
        return 0
    load_before, runs = os.getloadavg(), []
    for _ in range(args.repeats):
        for impl in IMPLS:
            child = [sys.executable, "-m", "prefixcache_bench.gateway_fleet.routed", "--one", impl,
                     "--workers", str(args.workers), "--pages", str(args.pages),
                     "--calls", str(args.calls)]
            out = subprocess.run(child, capture_output=True, text=True, check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    rows = []
    for what, key in ROWS:
        c, d = (statistics.median(r[key] for r in runs if r["impl"] == i) for i in IMPLS)
        rows.append({"what": what, "key": key, "c": c, "dicts": d,
                     "ratio_c_over_dicts": c / d if d else None})
    result = {"command": "python -m prefixcache_bench.gateway_fleet.routed " + " ".join(
        argv if argv is not None else sys.argv[1:]), "workers": args.workers,
        "pages_per_worker": args.pages, "new_pages_a_call": NEW_PAGES, "calls": args.calls,
        "repeats": args.repeats, "load_average_before": load_before,
        "load_average_after": os.getloadavg(), "rows": rows, "runs": runs}
    print_and_write(result, _table(result), args.json)
    return 0


def _table(result: dict) -> str:
    lines = [f"# {result['command']}",
             f"# RoutedPrefixes: {result['workers']:,} workers x {result['pages_per_worker']:,} "
             f"pages, prompts of {result['new_pages_a_call']} new pages; medians of "
             f"{result['repeats']} runs a side, each in its own process, alternated; load average "
             f"{result['load_average_before'][0]:.1f} before, {result['load_average_after'][0]:.1f}"
             " after",
             f"{'what':<32} {'c':>12} {'dicts':>12} {'c/dicts':>9}"]
    for r in result["rows"]:
        ratio = r["ratio_c_over_dicts"]
        lines.append(f"{r['what']:<32} {r['c']:>12,.1f} {r['dicts']:>12,.1f} "
                     + (f"{ratio:>8.2f}x" if ratio is not None else f"{'-':>9}"))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
