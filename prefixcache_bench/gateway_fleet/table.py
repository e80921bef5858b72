"""`python -m prefixcache_bench.gateway_fleet.table --json PATH`: the routing index's page table
alone, its C kernel against a baseline (gateway/core/index_native.py, issue 31): the numpy table
(`--baseline numpy`, the default), or the kernel built without its prefetch
(`--baseline c_no_prefetch`: -DPREFETCH_AHEAD=0), in the same process, in alternation
(`--repeats` each), on the shapes of
docs/results/gateway/fleet/ingest_profile.txt's table-alone lines:
- apply_ops: `--slices` mixed slices of 256 / 1,024 / 4,096 events (batches of 64 stores of new
  pages and 64 removals of pages the batch's worker holds, one random worker a batch) on a table
  of `--pages` pages held by `--workers` workers; events/s (at 1M pages the 4,096-event slices
  add enough pages to pass 70% load: their time includes a growth and its migration, as in the
  gateway, and the row says so);
- add_many: snapshot slices of 1,024 / 4,096 pages of one worker each into a table growing from
  empty to 2 x `--pages` pages; pages/s;
- masks: a routing lookup of 64 / 2,048 pages (half of them held) on the full table; lookups/s.
Times are `time.process_time` (this process's CPU: the machine is shared); the ratios are c /
baseline of the medians over the repeats; the load average is recorded before and after.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from gateway.core import index_native
from gateway.core.index_bulk import apply_ops
from gateway.core.index_table import PageTable
from prefixcache_bench.harness import print_and_write

# What each implementation is: the kernel's mode and its build's -D flags.
IMPLS = {"c": ("on", ()), "numpy": ("off", ()), "c_no_prefetch": ("on", ("-DPREFETCH_AHEAD=0",))}
BASELINES = ("numpy", "c_no_prefetch")


@contextmanager
def serving(impl: str) -> Iterator[None]:
    """The page tables served by `impl` meanwhile (a variant build swapped in for the kernel)."""
    mode, defines = IMPLS[impl]
    kernel = index_native.TABLE
    if defines:
        index_native.TABLE = index_native.table_library(defines)
    try:
        index_native.configure(mode, kernel.cache_dir)
        yield
    finally:
        index_native.TABLE = kernel
        index_native.configure("on", kernel.cache_dir)


def _filled(keys: np.ndarray, workers: int) -> PageTable:
    """A table of the keys, key i held by worker i % workers (built with the C kernel: fast)."""
    table = PageTable()
    per = len(keys) // workers
    with serving("c"):
        for w in range(workers):
            table.add_many(keys[w * per:(w + 1) * per], w)
    return table


def _mixed_slices(rng: np.random.Generator, held: list[list[int]], fresh: iter, size: int,
                  slices: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Event slices (key ids, worker slots, store flags) of batches of 64 stores of new pages
    and 64 removals of pages the worker holds (the bookkeeping `held` follows them)."""
    out = []
    for _ in range(slices):
        ids, slots, stores = [], [], []
        for _ in range(size // 128):
            w = int(rng.integers(len(held)))
            mine = held[w]
            gone = [mine.pop(int(rng.integers(len(mine)))) for _ in range(64)]
            new = [next(fresh) for _ in range(64)]
            mine.extend(new)
            ids += new + gone
            slots += [w] * 128
            stores += [True] * 64 + [False] * 64
        out.append((np.array(ids), np.array(slots, dtype=np.int32), np.array(stores)))
    return out


def _apply_run(keys: np.ndarray, workers: int, size: int, slices: int, seed: int,
               impls: tuple[str, str]) -> dict:
    rng = np.random.default_rng(seed)
    pages = len(keys) // 2
    per = pages // workers
    held = [list(range(w * per, (w + 1) * per)) for w in range(workers)]
    work = _mixed_slices(rng, held, iter(range(pages, len(keys))), size, slices)
    out = {}
    for impl in impls:
        table = _filled(keys[:pages], workers)
        cap = table.cap
        with serving(impl):
            t0 = time.process_time()
            for ids, slots, stores in work:
                apply_ops(table, keys[ids], slots, stores)
            cpu = time.process_time() - t0
        # A growth inside the timed slices: its allocation and the old table's migration count.
        out[impl] = {"events_per_s": size * slices / cpu, "ms_per_slice": cpu * 1e3 / slices,
                     "pages_after": len(table), "slots_before": cap, "slots_after": table.cap}
    assert out[impls[0]]["pages_after"] == out[impls[1]]["pages_after"]
    return out


def _add_many_run(keys: np.ndarray, workers: int, size: int, impls: tuple[str, str]) -> dict:
    out = {}
    for impl in impls:
        table = PageTable()
        with serving(impl):
            t0 = time.process_time()
            for i, at in enumerate(range(0, len(keys), size)):
                table.add_many(keys[at:at + size], i % workers)
            cpu = time.process_time() - t0
        out[impl] = {"pages_per_s": len(keys) / cpu, "pages_after": len(table)}
    return out


def _masks_run(keys: np.ndarray, workers: int, size: int, lookups: int, seed: int,
               impls: tuple[str, str]) -> dict:
    rng = np.random.default_rng(seed)
    pages = len(keys) // 2
    table = _filled(keys[:pages], workers)
    # Half held, half not: a prompt's cached prefix, then pages nobody holds.
    prompts = [[bytes(k) for k in np.concatenate([keys[rng.integers(pages, size=size // 2)],
                                                  keys[pages + rng.integers(pages, size=size // 2)]])]
               for _ in range(lookups)]
    out = {}
    for impl in impls:
        with serving(impl):
            t0 = time.process_time()
            for hashes in prompts:
                table.masks(hashes)
            cpu = time.process_time() - t0
        out[impl] = {"lookups_per_s": lookups / cpu, "us_per_lookup": cpu * 1e6 / lookups}
    return out


def _median(runs: list[dict], impl: str, key: str) -> float:
    return statistics.median(r[impl][key] for r in runs)


def _row(what: str, size: int, unit: str, key: str, runs: list[dict], base: str) -> dict:
    c, b = _median(runs, "c", key), _median(runs, base, key)
    return {"what": what, "size": size, "unit": unit, "c": c, base: b,
            f"ratio_c_over_{base}": c / b, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pages", type=int, default=1_000_000)
    p.add_argument("--workers", type=int, default=1000)
    p.add_argument("--slices", type=int, default=60, help="apply_ops slices timed per size")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline", choices=BASELINES, default="numpy",
                   help="what the kernel is compared with")
    p.add_argument("--json", help="write the results here (and a text table beside it)")
    args = p.parse_args(argv)
    base, impls = args.baseline, ("c", args.baseline)
    index_native.configure("on")  # refuse to compare without the kernel
    load_before = os.getloadavg()
    rng = np.random.default_rng(31)
    keys = rng.integers(0, 2**63, size=(2 * args.pages, 2), dtype=np.uint64).view("V16").ravel()
    rows = []
    for size in (256, 1024, 4096):
        runs = [_apply_run(keys, args.workers, size, args.slices, seed, impls)
                for seed in range(args.repeats)]
        grew = runs[0]["c"]["slots_after"] != runs[0]["c"]["slots_before"]
        rows.append(_row("apply_ops mixed slice" + (", a growth inside" if grew else ""), size,
                         "events/s", "events_per_s", runs, base))
    for size in (1024, 4096):
        runs = [_add_many_run(keys, args.workers, size, impls) for _ in range(args.repeats)]
        rows.append(_row(f"add_many snapshot slices, growing to {len(keys):,} pages", size,
                         "pages/s", "pages_per_s", runs, base))
    for size in (64, 2048):
        runs = [_masks_run(keys, args.workers, size, 2000 if size == 64 else 200, seed, impls)
                for seed in range(args.repeats)]
        rows.append(_row("masks (routing lookup, half the pages held)", size, "lookups/s",
                         "lookups_per_s", runs, base))
    index_native.configure()
    result = {"command": "python -m prefixcache_bench.gateway_fleet.table " + " ".join(sys.argv[1:]),
              "pages": args.pages, "workers": args.workers, "repeats": args.repeats,
              "baseline": base, "timer": "time.process_time", "load_average_before": load_before,
              "load_average_after": os.getloadavg(), "rows": rows}
    print_and_write(result, _table(result), args.json)
    return 0


def _table(result: dict) -> str:
    base = result.get("baseline", "numpy")
    lines = [f"# {result['command']}",
             f"# {result['pages']:,} pages held by {result['workers']:,} workers; medians of "
             f"{result['repeats']} runs, process CPU time; load average "
             f"{result['load_average_before'][0]:.1f} before, {result['load_average_after'][0]:.1f} after",
             f"{'what':<58} {'size':>6} {'c':>12} {base:>14} {'c/' + base:>16}"]
    for r in result["rows"]:
        lines.append(f"{r['what'] + ' (' + r['unit'] + ')':<58} {r['size']:>6} {r['c']:>12,.0f} "
                     f"{r[base]:>14,.0f} {r['ratio_c_over_' + base]:>15.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
