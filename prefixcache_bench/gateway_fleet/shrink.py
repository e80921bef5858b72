"""`python -m prefixcache_bench.gateway_fleet.shrink --pages 2000000 --json PATH`: a routing index
whose fleet is scaled down (issue 31's 64 bytes an indexed page; the shrink:
gateway/core/index_table.py `_shrink_some`).

A `KvIndex` is fed `--pages` pages by `--workers` workers (one snapshot batch each), its growths
migrated; then all but `--keep` workers leave (`remove_worker`, as the gateway does when a pool
goes). The feed loop's idle steps follow as the loop runs them (feeds.BatchApplier): steps
(`migrate_some`, sized as the loop sizes them, `IdleMigration`, each one hold of the router's
lock), and once they are done, writes without the lock (`prepare_growth(IDLE_SPARE_SLOTS)`,
timed apart): the removed pages' tombstones swept, the smaller arrays planned and written, then
the table migrated into them a step at a time; after each step, as the router does after its
lock, the arrays a migration retired are given back (`KvIndex.give_back_retired`, timed apart).
The modes alternate in one process: `shrink` (as the gateway runs) and `no_shrink` (the idle
steps sweep only: the table before the shrink, which never got smaller).

Reported per mode: the bytes a page of the table's arrays (written) before the workers left,
once they left, at the peak of the idle steps and at the end; the steps, their longest and p99
hold, the last one's (it ends the migration), the longest write without the lock and the longest
give-back; and whether the pages left are all found afterwards.
"""
from __future__ import annotations

import argparse
import os
import time

from gateway.core.index import IndexConfig, KvIndex
from gateway.core.ingest_slices import IDLE_SPARE_SLOTS, IdleMigration
from prefixcache.v1 import common_pb2, events_pb2
from prefixcache_bench.harness import columns_table, percentile, print_and_write

MODES = ("shrink", "no_shrink")


def _page(i: int) -> bytes:
    return (1 << 100 | i).to_bytes(16, "little")


def _fleet(workers: int, pages: int) -> KvIndex:
    index = KvIndex(IndexConfig(max_entries=1 << 40))
    index.defer_frees()  # as the router's: a migration's old arrays wait for give_back_retired
    each = pages // workers
    for w in range(workers):
        stored = events_pb2.BlockStored(
            block_hashes=[_page(w * each + j) for j in range(each)], block_size=16,
            model_id="m", medium=common_pb2.MEDIUM_DEVICE)
        index.apply(events_pb2.EventBatch(pool_id=f"w{w}", epoch=1, seq=0,
                                          events=[events_pb2.KvEvent(stored=stored)]))
    while index.migrate_some(1 << 20):
        pass
    index.give_back_retired()
    return index


def _bytes_per_page(index: KvIndex) -> float:
    table = index._tables[0]  # noqa: SLF001 (a bench's view: the device medium's table)
    return table.nbytes(written=True) / max(len(table), 1)


def run_mode(mode: str, workers: int, keep: int, pages: int) -> dict:
    index = _fleet(workers, pages)
    table = index._tables[0]  # noqa: SLF001
    if mode == "no_shrink":
        table._shrink_some = lambda: False  # noqa: SLF001 (the baseline)
    before = _bytes_per_page(index)
    for w in range(keep, workers):
        index.remove_worker(f"w{w}")
    left = _bytes_per_page(index)
    idle, holds, writes, give_backs, peak = IdleMigration(), [], [0.0], [], left
    while True:
        start = time.perf_counter()
        more = idle.step(index.migrate_some)
        holds.append(time.perf_counter() - start)
        peak = max(peak, _bytes_per_page(index))
        start = time.perf_counter()
        index.give_back_retired()
        give_backs.append(time.perf_counter() - start)
        if not more:
            start = time.perf_counter()
            more = index.prepare_growth(IDLE_SPARE_SLOTS)
            writes.append(time.perf_counter() - start)
            peak = max(peak, _bytes_per_page(index))
            if not more:
                break
    each = pages // workers
    sample = range(0, keep * each, max(1, keep * each // 2000))  # pages of the workers kept
    found = table.masks([_page(j) for j in sample])  # each one's holders, worker w's slot w
    return {"mode": mode, "pages_left": len(table), "slots_at_end": table.cap,
            "bytes_per_page_before": before, "bytes_per_page_after_leave": left,
            "bytes_per_page_peak": peak, "bytes_per_page_end": _bytes_per_page(index),
            "idle_steps": len(holds), "hold_max_ms": max(holds) * 1e3,
            "hold_p99_ms": percentile(holds, 0.99) * 1e3,
            # the step that ends the migration (the old arrays' free was in it until stop 53)
            "hold_last_ms": holds[-1] * 1e3,
            "write_max_ms": max(writes) * 1e3, "writes": len(writes) - 1,
            "give_back_max_ms": max(give_backs) * 1e3,
            "shrinks": index.stats().shrinks,
            "pages_left_found": all(m == 1 << (j // each) for m, j in zip(found, sample))}


def table_text(result: dict) -> str:
    keys = ("mode", "pages_left", "bytes_per_page_before", "bytes_per_page_after_leave",
            "bytes_per_page_peak", "bytes_per_page_end", "idle_steps", "hold_p99_ms",
            "hold_max_ms", "hold_last_ms", "write_max_ms", "give_back_max_ms")
    header = ("mode", "pages left", "before", "left", "peak", "end", "steps", "hold p99 ms",
              "max ms", "last ms", "write max ms", "give-back max ms")
    return ("bytes a page of the table's arrays, as written\n"
            + columns_table(header, [[r[k] for k in keys] for r in result["runs"]]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=2_000_000)
    ap.add_argument("--workers", type=int, default=100)
    ap.add_argument("--keep", type=int, default=10, help="workers that stay")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if not 0 < a.keep < a.workers or a.pages < 100 * a.workers or a.repeats < 1:
        ap.error("needs 0 < --keep < --workers, --pages >= 100 x --workers, --repeats >= 1")
    runs = [run_mode(mode, a.workers, a.keep, a.pages) for _ in range(a.repeats) for mode in MODES]
    result = {"config": vars(a) | {"json": None}, "runs": runs, "goal_bytes_per_page": 64,
              "cpus": os.cpu_count(), "load_average_1m": os.getloadavg()[0],
              "command": "python -m prefixcache_bench.gateway_fleet.shrink "
                         f"--pages {a.pages} --workers {a.workers} --keep {a.keep} "
                         f"--repeats {a.repeats}"}
    print_and_write(result, table_text(result), a.json)


if __name__ == "__main__":
    main()
