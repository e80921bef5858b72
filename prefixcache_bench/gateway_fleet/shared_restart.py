"""`python -m prefixcache_bench.gateway_fleet.shared_restart --json PATH`: a gateway replica
restarting against the shared Redis index (issue 31, design.md "Many gateway replicas"), with 4
replicas and 1M pages (`--pages 200`: 1.6M page events, 1M distinct pages): how long until it
routes with the whole index's knowledge.

Four replica processes (spawn) share one throwaway redis-server; replica i holds the leases of
the pools with index % 4 == i and writes their batches (shared.py's batches: `--pools` pools of
`--batches` batches of `--pages` pages, groups of 4 pools sharing half of each batch). Then the
replicas route (lookups in a loop) while replica 3 is SIGKILLed and a new process takes its
place. From the kill, that process: imports the gateway and connects (`connected_s`); answers a
lookup of every pool's first pages and finds each pool among the holders
(`restart_to_warm_s`: it routes with every pool's pages known); takes over the dead replica's
leases once they expire (`lease_takeover_s`, bounded by the lease, `lease_ms`: until then those
pools' new events wait, their pages written so far are all known); and finds each stream's
resume point at its last written batch (`resumed_from_seq`: no snapshot needed).

The same run times the in-process index's restart for comparison: a new process applies every
pool's batches to a KvIndex (`memory_rebuild_s`, in process, no gRPC: a lower bound; the
`--checkpoint` bench of __main__.py times the real feeds, and the checkpoint that avoids them).
On this 2-core machine the 4 replicas, redis-server and the restarted process share 2 cores with
whatever else runs (load average recorded).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

from prefixcache_bench.gateway_fleet.shared import GROUP, _page, _redis, batches_of

REPLICAS = 4
PROBE_PAGES = 4  # of the shared half and of the pool's own half, each


def _probe(pool: int) -> list[bytes]:
    """A prompt every pool holds whole: the start of its first batch's shared and own pages."""
    return [_page(-1, pool // GROUP, 0, k) for k in range(PROBE_PAGES)] + \
           [_page(pool, 0, k) for k in range(PROBE_PAGES)]


def _config(url: str, lease_ms: int):
    from gateway.core.shared_index import SharedIndexConfig
    return SharedIndexConfig(url=url, namespace="bench", lease_ms=lease_ms)


def replica(index: int, args: dict, url: str, out, stop) -> None:
    """Writes its pools' batches under their leases, then routes until `stop`."""
    from gateway.core.shared_index import SharedIndexStore, SharedIndexView
    from gateway.core.shared_indexer import StreamWriter
    store = SharedIndexStore(_config(url, args["lease_ms"]))
    start, events = time.perf_counter(), 0
    for p in range(index, args["pools"], REPLICAS):
        pool = f"w{p:04d}"
        assert store.try_lease(pool, f"replica-{index}")
        writer = StreamWriter(store, pool, f"replica-{index}")
        for batch in batches_of(p, args["batches"], args["pages"]):
            events += writer.apply(batch)
    out.put({"replica": index, "ingest_s": time.perf_counter() - start, "page_events": events})
    view, lookups = SharedIndexView(store), 0
    while not stop.value:
        view.lookup(_probe(lookups % args["pools"]))
        lookups += 1


def restarted(args: dict, url: str, killed_at: float, out) -> None:
    """The new replica 3: the times from `killed_at` (time.monotonic, the same clock in every
    process here) until it is connected, routes warm, holds the dead replica's leases."""
    from gateway.core.shared_index import SharedIndexStore, SharedIndexView
    from gateway.core.shared_indexer import StreamWriter
    store = SharedIndexStore(_config(url, args["lease_ms"]))
    view = SharedIndexView(store)
    view.refresh()
    connected = time.monotonic()
    missing = list(range(args["pools"]))
    while missing:  # every pool found holding its pages (a Redis outage would answer {})
        missing = [p for p in missing if f"w{p:04d}" not in view.lookup(_probe(p))]
    warm = time.monotonic()
    mine = [f"w{p:04d}" for p in range(REPLICAS - 1, args["pools"], REPLICAS)]
    waiting = set(mine)
    while waiting:
        waiting = {pool for pool in waiting if not store.try_lease(pool, "replica-3-restarted")}
        if waiting:
            time.sleep(0.02)
    leased = time.monotonic()
    last = args["batches"] - 1
    resumed = sum(StreamWriter(store, pool, "replica-3-restarted").resume_point()[1] == last
                  for pool in mine)
    out.put({"connected_s": connected - killed_at, "restart_to_warm_s": warm - killed_at,
             "lease_takeover_s": leased - killed_at, "resumed_from_seq": resumed,
             "pools_taken_over": len(mine)})


def memory_rebuild(args: dict, out) -> None:
    """The in-process index's cold restart, as a lower bound: every batch applied again."""
    from gateway.core.index import KvIndex
    work = [batches_of(p, args["batches"], args["pages"]) for p in range(args["pools"])]
    start, index = time.perf_counter(), KvIndex()
    for pool_batches in work:
        for batch in pool_batches:
            index.apply(batch)
    out.put({"memory_rebuild_s": time.perf_counter() - start, "distinct_pages": len(index)})


def run(args: dict) -> dict:
    import redis
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        server, url = _redis(tmp)
        try:
            # A flag without a lock: replica 3 is killed while it reads it.
            out, stop = ctx.Queue(), ctx.RawValue("b", 0)
            procs = [ctx.Process(target=replica, args=(i, args, url, out, stop)) for i in range(REPLICAS)]
            for p in procs:
                p.start()
            ingest = [out.get(timeout=1200) for _ in procs]
            client = redis.Redis.from_url(url)
            used_mb, keys = client.info("memory")["used_memory"] / 2**20, client.dbsize()
            time.sleep(0.5)  # the replicas routing
            procs[-1].kill()  # a crash: its leases stay until they expire
            killed_at = time.monotonic()
            new = ctx.Process(target=restarted, args=(args, url, killed_at, out))
            new.start()
            result = out.get(timeout=600)
            new.join()
            stop.value = 1
            for p in procs:
                p.join(30)
        finally:
            server.terminate()
            server.wait(10)
    rebuild = ctx.Process(target=memory_rebuild, args=(args, out))
    rebuild.start()
    result |= out.get(timeout=1200)
    rebuild.join()
    return {"config": args, "replicas": REPLICAS,
            "page_events_written": sum(i["page_events"] for i in ingest), "redis_keys": keys,
            "redis_used_mb": used_mb, "ingest_s_per_replica": max(i["ingest_s"] for i in ingest),
            **result, "load_average_1m": os.getloadavg()[0], "cpus": os.cpu_count()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pools", type=int, default=1000)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--pages", type=int, default=125, help="stored pages per batch")
    ap.add_argument("--lease-ms", type=int, default=5000, help="the indexers' lease (the default's)")
    ap.add_argument("--json", type=Path, help="write the result here")
    a = ap.parse_args()
    command = " ".join(["python -m prefixcache_bench.gateway_fleet.shared_restart", *sys.argv[1:]])
    load_start = os.getloadavg()
    result = {"command": command, "load_average_start": load_start,
              **run({"pools": a.pools, "batches": a.batches, "pages": a.pages, "lease_ms": a.lease_ms})}
    print(json.dumps(result, indent=1))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
