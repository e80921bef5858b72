"""`python -m prefixcache_bench.gateway_fleet.growth --pages 2000000 --json PATH`: the worst single
call of a table that grows from empty to `--pages` pages, then sees as many pages stored and
removed (`--churn-pages`: a fleet at its steady state, where the tombstones of removed pages fill
the table and its growths are rebuilds of about the same size) (issue 31, design.md "The index at
fleet scale"): a growth made ready ahead, incremental growth, and a stop-the-world rehash.

The modes run the same code in the same process, in alternation (`--repeats` each):
- spare: `PageTable()` as the gateway's feed loop drives it: after every call, the arrays a
  migration retired are given back (`give_back_retired`, outside the router's lock, untimed) and
  `prepare_growth()` writes on the next growth's arrays (outside the lock too, timed apart:
  `prepare_s`), so the growth takes them ready (gateway/core/table_arrays.py);
- incremental: the same table with no `prepare_growth` call (as before the spare; a table no
  feed loop serves): each growth writes its new arrays in the call that starts it;
- stop_the_world: `PageTable(migrate_step=2**62)`, no spare: the first call after a growth
  migrates the whole old table, which is the cost of the former `_rehash`.
Calls are `--batch` fresh random pages for one of 8 worker slots, in turn (`add_many`, a live
batch is tens of pages), then in the churn phase `--batch` pages stored and as many of the oldest
removed (`index_bulk.apply_ops`, the feed loop's slice call). Reported per run and phase: the
worst, p99.9 and p99 call latency, calls over 10 ms, the growths; the ratios are each mode over
incremental, of the medians over the repeats. The load average is recorded: the machine is shared.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from gateway.core.index_bulk import apply_ops
from gateway.core.index_table import PageTable

MODES = {"spare": {}, "incremental": {}, "stop_the_world": {"migrate_step": 2**62}}
PHASES = ("grow", "churn")
_SAMPLE_FROM = 65_536
_GOAL_BYTES_PER_PAGE = 64  # issue 31's goal for an indexed page


class _Calls:
    """One phase's call times, what each did, and the time of the spare's writes between them."""

    def __init__(self, table: PageTable, prepare: bool) -> None:
        self.table, self.prepare = table, prepare
        self.growths_before = table.growths()  # (written ahead, partly, fresh ones: Spare.take)
        self.times, self.moved, self.grew, self.prepare_ns = [], [], [], 0
        self.bytes_per_page: list[float] = []  # after each call, once the table is not tiny
        self.written_per_page: list[float] = []  # the same, less the spare's part not yet written

    def call(self, fn, *args) -> None:
        table, before, mem = self.table, self.table.migrated_slots, self.table._mem
        t0 = time.perf_counter_ns()
        fn(*args)
        self.times.append(time.perf_counter_ns() - t0)
        self.moved.append(table.migrated_slots - before)
        self.grew.append(table._mem is not mem)
        table.give_back_retired()  # a migration's old arrays (spare), as the router after its lock
        if self.prepare:
            t0 = time.perf_counter_ns()
            table.prepare_growth()
            self.prepare_ns += time.perf_counter_ns() - t0
        if len(table) >= _SAMPLE_FROM:
            # The spare is allocated whole, faulted in as the feed loop writes it.
            self.bytes_per_page.append(table.nbytes() / len(table))
            self.written_per_page.append(table.nbytes(written=True) / len(table))

    def summary(self) -> dict:
        us = np.array(self.times) / 1e3
        worst = int(us.argmax())
        ready, partial, unready = (n - before for n, before in zip(self.table.growths(),
                                                                    self.growths_before))
        return {"calls": len(us), "growths": int(sum(self.grew)),
                # of those of SPARE_MIN_SLOTS or more (table_arrays.Spare.take)
                "growths_ready": ready, "growths_partial": partial, "growths_unready": unready,
                "max_call_us": float(us.max()), "p999_call_us": float(np.percentile(us, 99.9)),
                "p99_call_us": float(np.percentile(us, 99)), "p50_call_us": float(np.median(us)),
                "calls_over_10ms": int(np.count_nonzero(us > 10_000)),
                # What the worst call did: a growth (the new arrays taken or written) or old slots
                # migrated (a whole table in stop_the_world), or neither (the machine's scheduling).
                "worst_call_grew": self.grew[worst], "worst_call_migrated_slots": self.moved[worst],
                "max_migrated_slots_per_call": max(self.moved),
                "calls_s": float(us.sum() / 1e6), "prepare_s": self.prepare_ns / 1e9,
                # The arrays' bytes a page (an old table and the spare included), from
                # _SAMPLE_FROM pages on: the peak is a growth's, old and new arrays together.
                "bytes_per_page_max": max(self.bytes_per_page, default=0.0),
                "bytes_per_page_mean": statistics.fmean(self.bytes_per_page or [0.0]),
                "share_over_goal_bytes": _share_over_goal(self.bytes_per_page),
                # Written memory (what the process holds resident): the spare as far as written.
                "written_bytes_per_page_max": max(self.written_per_page, default=0.0),
                "written_share_over_goal_bytes": _share_over_goal(self.written_per_page)}


def _share_over_goal(bytes_per_page: list[float]) -> float:
    """The share of the samples over issue 31's goal (0 with none)."""
    return float(np.mean(np.array(bytes_per_page or [0.0]) > _GOAL_BYTES_PER_PAGE))


def _run(mode: str, pages: np.ndarray, churn: np.ndarray, batch: int) -> dict:
    table = PageTable(**MODES[mode])
    table.retire = mode == "spare"  # as the router's index (KvIndex.defer_frees)
    out = {"mode": mode}
    calls = _Calls(table, mode == "spare")
    for i, at in enumerate(range(0, len(pages), batch)):
        calls.call(table.add_many, [bytes(k) for k in pages[at:at + batch]], i % 8)
    out["grow"] = calls.summary()
    calls = _Calls(table, mode == "spare")
    for i, at in enumerate(range(0, len(churn), batch)):
        gone, new = pages[at:at + batch], churn[at:at + batch]  # the oldest out, new ones in
        keys = np.concatenate([gone, new])
        slots = np.concatenate([np.arange(at, at + len(gone)) // batch % 8, np.full(len(new), i % 8)])
        calls.call(apply_ops, table, keys, slots, np.arange(len(keys)) >= len(gone))
    out["churn"] = calls.summary()
    out.update(pages=len(table), memory_bytes=table.nbytes(), load_average_1m=os.getloadavg()[0])
    return out


def measure(pages: int, churn_pages: int, batch: int, repeats: int, seed: int = 31,
            modes: tuple[str, ...] = tuple(MODES)) -> dict:
    rng = np.random.default_rng(seed)
    keys = np.frombuffer(rng.bytes(16 * pages), dtype="V16")
    churn = np.frombuffer(rng.bytes(16 * min(churn_pages, pages)), dtype="V16")
    runs = []
    for _ in range(repeats):
        for mode in modes:
            runs.append(_run(mode, keys, churn, batch))
            print(json.dumps(runs[-1]))

    def median(mode: str, phase: str, key: str) -> float:
        return statistics.median(r[phase][key] for r in runs if r["mode"] == mode)

    ratios = {f"{mode}_over_incremental": {
        f"{phase}_{key}": median(mode, phase, key) / max(median("incremental", phase, key), 1e-9)
        for phase in PHASES for key in ("max_call_us", "p999_call_us", "p99_call_us", "calls_s")}
        for mode in modes if mode != "incremental" and "incremental" in modes}
    return {"config": {"pages": pages, "churn_pages": len(churn), "batch": batch, "repeats": repeats,
                       "seed": seed, "modes": list(modes)},
            "cpus": os.cpu_count(), "load_average_1m": os.getloadavg()[0], "runs": runs, **ratios}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=2_000_000)
    ap.add_argument("--churn-pages", type=int, default=None,
                    help="pages stored (and as many removed) after the growth; default --pages")
    ap.add_argument("--batch", type=int, default=32, help="pages per call (a live batch)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each mode, alternating")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                    help="which modes to run (the ratios need incremental)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    result = measure(a.pages, a.pages if a.churn_pages is None else a.churn_pages, a.batch, a.repeats,
                     modes=tuple(a.modes))
    print(json.dumps({k: v for k, v in result.items() if k.endswith("_over_incremental")}))
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
