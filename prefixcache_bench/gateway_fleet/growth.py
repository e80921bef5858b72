"""`python -m prefixcache_bench.gateway_fleet.growth --pages 2000000 --json PATH`: the worst single
`PageTable.add_many` of a live batch while a table grows from empty to `--pages` pages (issue 31,
design.md "The index at fleet scale"), incremental growth against a stop-the-world rehash.

Both modes run the same code in the same process, in alternation (`--repeats` each):
- incremental: `PageTable()` as the gateway builds it (each mutating call migrates
  `MIGRATE_STEP + rate * pages` old slots);
- stop_the_world: `PageTable(migrate_step=2**62)`: the first call after a growth migrates the
  whole old table, which is the cost of the former `_rehash` (one hold of the router's lock).
Batches are `--batch` fresh random pages for one of 8 worker slots, in turn (a live batch is
tens of pages). Reported per run: the worst, p99.9 and p99 call latency, the total time to
insert every page, and the growths; the ratios are incremental / stop_the_world of the medians
over the repeats. The load average is recorded: the machine is shared.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from gateway.core.index_table import PageTable

MODES = {"incremental": {}, "stop_the_world": {"migrate_step": 2**62}}


def _run(mode: str, pages: np.ndarray, batch: int) -> dict:
    table = PageTable(**MODES[mode])
    times, moved, grew = [], [], []
    grows, cap = 0, table.cap
    start = time.perf_counter()
    for i, at in enumerate(range(0, len(pages), batch)):
        hashes = [bytes(k) for k in pages[at:at + batch]]
        before = table.migrated_slots
        t0 = time.perf_counter_ns()
        table.add_many(hashes, i % 8)
        times.append(time.perf_counter_ns() - t0)
        moved.append(table.migrated_slots - before)
        grew.append(table.cap != cap)
        grows += grew[-1]
        cap = table.cap
    total = time.perf_counter() - start
    assert len(table) == len(pages)
    us = np.array(times) / 1e3
    worst = int(us.argmax())
    return {"mode": mode, "pages": len(table), "calls": len(times), "growths": grows,
            "max_call_us": float(us.max()), "p999_call_us": float(np.percentile(us, 99.9)),
            "p99_call_us": float(np.percentile(us, 99)), "p50_call_us": float(np.median(us)),
            "calls_over_10ms": int(np.count_nonzero(us > 10_000)),
            # What the worst call did: a growth (allocating the new arrays) or old slots migrated
            # (a whole table in stop_the_world), or neither (the shared machine's scheduling).
            "worst_call_grew": grew[worst], "worst_call_migrated_slots": moved[worst],
            "max_migrated_slots_per_call": max(moved),
            "total_s": total, "load_average_1m": os.getloadavg()[0]}


def measure(pages: int, batch: int, repeats: int, seed: int = 31) -> dict:
    keys = np.random.default_rng(seed).bytes(16 * pages)
    keys = np.frombuffer(keys, dtype="V16")
    runs = []
    for _ in range(repeats):
        for mode in MODES:
            runs.append(_run(mode, keys, batch))
            print(json.dumps(runs[-1]))

    def median(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["mode"] == mode)

    ratios = {key: median("incremental", key) / median("stop_the_world", key)
              for key in ("max_call_us", "p999_call_us", "p99_call_us", "total_s")}
    return {"config": {"pages": pages, "batch": batch, "repeats": repeats, "seed": seed},
            "cpus": os.cpu_count(), "load_average_1m": os.getloadavg()[0], "runs": runs,
            "incremental_over_stop_the_world": ratios}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=2_000_000)
    ap.add_argument("--batch", type=int, default=32, help="pages per add_many (a live batch)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each mode, alternating")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    result = measure(a.pages, a.batch, a.repeats)
    print(json.dumps(result["incremental_over_stop_the_world"]))
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
