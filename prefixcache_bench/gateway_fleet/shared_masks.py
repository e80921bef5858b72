"""`python -m prefixcache_bench.gateway_fleet.shared_masks --json PATH`: the routing index's
memory a page when pages are held by several workers (issue 31's goal: 64 bytes an indexed page
at 1,000 workers).

A page one worker holds lives in its page table's flat arrays alone (16 bytes a slot, the
holder that worker's slot). A page two hold does too, its holder their pair (since stop 53;
before, a set), and one three hold, its holder their triple (since stop 54). A page four or more
hold does too, its holder the id of its set of holders
(gateway/core/holder_sets.py), where each distinct set is stored once: a Python int mask, whose
size follows the highest worker slot among the holders, not how many they are, and a dict entry
to find it. Until stop 51 such a page also took an entry in a dict by slot position (~85 bytes),
and its own mask unless another page's equalled it. For each case (workers,
holders a page, how they are chosen), either the workers are split into groups of that many,
each group storing its own pages (`--pages` in all; fewer where every worker holds every page,
to keep the holders' additions at 2M), or each page gets its own random set of holders (no two
pages alike: the masks' worst case), and tracemalloc counts what the index allocated, per
page. The arrays' part depends on where the last growth left the table (a table
fresh from one holds about half its slots empty), as in the index's tests. Then the same batches
are applied `--repeats` times more to a fresh index without tracing: the process CPU time of
each, and their median (compared with another commit's by running both, alternated).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

from gateway.core.index import IndexConfig, KvIndex
from prefixcache.v1 import common_pb2, events_pb2
from prefixcache_bench.gateway_fleet.index_memory import traced_apply
from prefixcache_bench.harness import print_and_write

CASES = ((8, 1, "groups"), (8, 2, "groups"), (8, 8, "groups"), (1000, 1, "groups"),
         (1000, 2, "groups"), (1000, 3, "groups"), (1000, 8, "groups"), (1000, 1000, "groups"),
         (1000, 2, "random"), (1000, 3, "random"), (1000, 4, "random"))
_MAX_ADDITIONS = 2_000_000
_GOAL_BYTES_PER_PAGE = 64


def _batch(worker: int, pages: list[bytes]) -> events_pb2.EventBatch:
    stored = events_pb2.BlockStored(block_hashes=pages, block_size=16, model_id="m",
                                    medium=common_pb2.MEDIUM_DEVICE)
    return events_pb2.EventBatch(pool_id=f"w{worker}", epoch=1, seq=0,
                                 events=[events_pb2.KvEvent(stored=stored)])


def _holdings(workers: int, holders: int, pages: int, chosen: str) -> dict[int, list[bytes]]:
    """Each worker's pages: its group's, or (`random`) those whose random holders include it."""
    held: dict[int, list[bytes]] = {w: [] for w in range(workers)}
    if chosen == "random":
        rng = random.Random(31)
        for j in range(pages):
            for w in rng.sample(range(workers), holders):
                held[w].append((1 << 40 | j).to_bytes(16, "little"))
        return held
    groups = workers // holders
    for g in range(groups):
        own = [((g + 1) << 40 | j).to_bytes(16, "little") for j in range(pages // groups)]
        for w in range(g * holders, (g + 1) * holders):
            held[w] = own
    return held


def _index(workers: int) -> KvIndex:
    index = KvIndex(IndexConfig(max_entries=1 << 40))
    for w in range(workers):  # every worker known first: slots 0..workers-1, as in a fleet
        index.add_worker(f"w{w}")
    return index


def _apply_cpu_s(workers: int, batches: list) -> float:
    """Process CPU time of applying the batches to a fresh index."""
    index = _index(workers)
    start = time.process_time()
    for b in batches:
        index.apply(b)
    return time.process_time() - start


def measure_case(workers: int, holders: int, pages: int, chosen: str = "groups",
                 repeats: int = 0) -> dict:
    pages = min(pages, _MAX_ADDITIONS // holders)
    held = _holdings(workers, holders, pages, chosen)
    batches = [_batch(w, own) for w, own in held.items() if own]
    index = _index(workers)
    used = traced_apply(index, batches)
    arrays = sum(t.nbytes(written=True) for t in index._tables)  # noqa: SLF001 (a bench's view)
    shared = index.stats().shared_pages
    distinct = sum(len(t.holder_sets) for t in index._tables)  # noqa: SLF001
    n = len(index)
    times = [_apply_cpu_s(workers, batches) for _ in range(repeats)]
    timed = {"apply_cpu_s": times, "apply_cpu_s_median": statistics.median(times)} if times else {}
    return {"workers": workers, "holders_per_page": holders, "holders_chosen": chosen,
            "pages": n, "shared_pages": shared, "distinct_masks": distinct,
            "bytes_per_page": used / n, "arrays_bytes_per_page": arrays / n,
            "other_bytes_per_page": (used - arrays) / n, **timed}


def table_text(result: dict) -> str:
    rows = [f"{'workers':>8}{'holders':>9}{'chosen':>8}{'pages':>10}{'masks':>8}"
            f"{'bytes/page':>12}{'arrays':>9}{'masks+rest':>12}{'apply CPU s':>12}"]
    for c in result["cases"]:
        rows.append(f"{c['workers']:>8}{c['holders_per_page']:>9}{c['holders_chosen']:>8}"
                    f"{c['pages']:>10,}{c['distinct_masks']:>8,}"
                    f"{c['bytes_per_page']:>12.1f}{c['arrays_bytes_per_page']:>9.1f}"
                    f"{c['other_bytes_per_page']:>12.1f}"
                    + (f"{c['apply_cpu_s_median']:>12.3f}"
                       if "apply_cpu_s_median" in c else f"{'-':>12}"))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=3,
                    help="untraced applies of each case to a fresh index, timed")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.pages < 1000 or a.repeats < 0:
        ap.error("needs --pages >= 1000 (every group of holders gets its own pages) and "
                 "--repeats >= 0")
    cases = [measure_case(w, k, a.pages, chosen, a.repeats) for w, k, chosen in CASES]
    result = {"config": {"pages": a.pages, "repeats": a.repeats, "cases": [list(c) for c in CASES]},
              "goal_bytes_per_page": _GOAL_BYTES_PER_PAGE, "cpus": os.cpu_count(),
              "python": sys.version.split()[0], "cases": cases,
              "load_average_1m": os.getloadavg()[0],
              "command": "python -m prefixcache_bench.gateway_fleet.shared_masks "
                         f"--pages {a.pages} --repeats {a.repeats}"}
    print_and_write(result, table_text(result), a.json)


if __name__ == "__main__":
    main()
