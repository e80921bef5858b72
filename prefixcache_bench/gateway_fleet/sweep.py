"""`python -m prefixcache_bench.gateway_fleet.sweep --pages 2000000 --json PATH`: a page table at
a fleet's steady state, with its tombstones swept in place and without (issue 31; the sweep:
gateway/core/index_sweep.py).

A table is filled with `--pages` pages in live batches, then sees `--churn` times as many pages
stored and as many removed, the oldest first (workers evicting their least recently used), in
calls of `--batch` stores and `--batch` removals (`index_bulk.apply_ops`, the feed loop's slice
call). After every call the table gets what the feed loop gives it between slices and while
idle: the spare's writes (`prepare_growth`, outside the lock) and one idle step
(`migrate_some`, a growth's migration or, with the sweep, a sweep step; sized like the loop's,
`IdleMigration`, under the lock). The modes alternate in one process: `sweep` (as the gateway
runs) and `no_sweep` (the idle steps migrate only: the table before the sweep).

Reported per run: the table's bytes per page (`nbytes()`, the spare's and an old table's
arrays included) sampled after every call (mean, max, at the end; the max also with the spare
only as far as written, what the process holds), its rebuilds, the calls'
p50 / p99 / worst, the idle steps' total and longest hold, the spare's writes, and the
used slots' share at the end.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from gateway.core.index_bulk import apply_ops
from gateway.core.index_sweep import Sweep
from gateway.core.index_table import PageTable
from gateway.core.ingest_slices import IdleMigration
from prefixcache_bench.harness import percentile, print_and_write

MODES = ("sweep", "no_sweep")


class NoSweep(Sweep):
    """A table's sweep that never begins a round: its idle steps migrate only, as before the
    sweep (the bench's baseline; tests/gateway/test_index_sweep.py's too)."""

    def due(self, table: PageTable) -> bool:
        return False


def _run(mode: str, keys: np.ndarray, pages: int, batch: int) -> dict:
    table, idle = PageTable(), IdleMigration()
    table.retire = True  # as the router's index (KvIndex.defer_frees): given back after each step
    if mode == "no_sweep":
        table.sweep = NoSweep()
    for i, at in enumerate(range(0, pages, batch)):
        table.add_many(keys[at:at + batch].tobytes(), i % 8)
        table.prepare_growth()
    while table.migrate_some(1 << 20):
        pass
    table.give_back_retired()
    caps, calls, holds, per_page, written_per_page, prepare_s = 1, [], [], [], [], 0.0
    stored, start = pages, table._mem
    while stored + batch <= len(keys):
        gone, new = keys[stored - pages:stored - pages + batch], keys[stored:stored + batch]
        slots = np.concatenate([np.arange(stored - pages, stored - pages + batch) // batch % 8,
                                np.full(batch, stored // batch % 8)])
        t0 = time.perf_counter()
        apply_ops(table, np.concatenate([gone, new]), slots, np.arange(2 * batch) >= batch)
        t1 = time.perf_counter()
        table.prepare_growth()
        t2 = time.perf_counter()
        idle.step(table.migrate_some)
        t3 = time.perf_counter()
        table.give_back_retired()  # a migration's old arrays, as the router after its lock
        calls.append(t1 - t0)
        prepare_s += t2 - t1
        holds.append(t3 - t2)
        per_page.append(table.nbytes() / len(table))
        written_per_page.append(table.nbytes(written=True) / len(table))
        if table._mem is not start:
            caps, start = caps + 1, table._mem
        stored += batch
    us = np.array(calls) * 1e6
    return {"mode": mode, "pages": len(table), "cap": table.cap,
            "rebuilds": caps - 1, "sweep_rounds": table.sweep.rounds,
            "bytes_per_page_mean": float(np.mean(per_page)),
            "bytes_per_page_max": float(np.max(per_page)), "bytes_per_page_end": per_page[-1],
            # the spare as far as written: what the process holds
            "written_bytes_per_page_max": float(np.max(written_per_page)),
            "used_share_end": (table._used) / table.cap,
            "call_p50_us": percentile(us.tolist(), 0.5),
            "call_p99_us": percentile(us.tolist(), 0.99),
            "call_max_us": float(us.max()), "calls_s": float(us.sum() / 1e6),
            "idle_steps_s": float(sum(holds)), "idle_step_max_ms": max(holds) * 1e3,
            "spare_writes_s": prepare_s, "load_average_1m": os.getloadavg()[0]}


def measure(pages: int, churn: float, batch: int, repeats: int, seed: int = 31) -> dict:
    rng = np.random.default_rng(seed)
    keys = np.frombuffer(rng.bytes(16 * int(pages * (1 + churn))), dtype="V16")
    runs = [_run(mode, keys, pages, batch) for _ in range(repeats) for mode in MODES]

    def median(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["mode"] == mode)

    keys_shown = ("bytes_per_page_mean", "bytes_per_page_max", "bytes_per_page_end",
                  "written_bytes_per_page_max", "rebuilds",
                  "call_p99_us", "call_max_us", "calls_s", "idle_steps_s", "idle_step_max_ms",
                  "spare_writes_s", "used_share_end")
    return {"config": {"pages": pages, "churn": churn, "batch": batch, "repeats": repeats,
                       "seed": seed},
            "cpus": os.cpu_count(), "runs": runs,
            "medians": {m: {k: median(m, k) for k in keys_shown} for m in MODES}}


def table_text(result: dict) -> str:
    medians = result["medians"]
    rows = [f"{'median over runs':<28}" + "".join(f"{m:>14}" for m in MODES)]
    for key in medians["sweep"]:
        rows.append(f"{key:<28}" + "".join(f"{medians[m][key]:>14.3f}" for m in MODES))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=2_000_000)
    ap.add_argument("--churn", type=float, default=3.0,
                    help="pages stored (and as many removed) after the fill, in table contents")
    ap.add_argument("--batch", type=int, default=32, help="pages stored (and removed) per call")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each mode, alternating")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.batch < 1 or a.pages < a.batch or a.churn * a.pages < a.batch or a.repeats < 1:
        ap.error("needs --batch >= 1, --pages >= --batch, at least one call of churn "
                 "(--churn x --pages >= --batch) and --repeats >= 1")
    result = measure(a.pages, a.churn, a.batch, a.repeats)
    result["command"] = ("python -m prefixcache_bench.gateway_fleet.sweep --pages "
                         f"{a.pages} --churn {a.churn} --batch {a.batch} --repeats {a.repeats}")
    print_and_write(result, table_text(result), a.json)


if __name__ == "__main__":
    main()
