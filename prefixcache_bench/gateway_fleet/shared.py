"""`python -m prefixcache_bench.gateway_fleet.shared --json PATH`: the shared Redis index against
the in-process one, for 1 and 4 gateway replicas (issue 31, design.md "Many gateway replicas").

Each replica is its own process (multiprocessing, spawn); all of them share one throwaway
redis-server started here. The same deterministic event batches (`--pools` workers, each
`--batches` live batches of `--pages` stored pages; pools in groups of 4 share their first
half-batch, as conversations on one system prompt do) are used by both backends:
- memory: every replica applies every worker's batches to its own KvIndex (today's design: N
  replicas, N x the ingest and the memory);
- redis: replica i takes the leases of the workers with index % N == i and writes their batches
  with `StreamWriter` (one Lua round trip per batch); the others only read.
Then every replica times `--requests` routing lookups (32 page hashes, half of them known) at
once: KvIndex.lookup vs SharedIndexView.lookup (one pipelined round trip). Memory per replica is
the process's RSS growth over the run; Redis's own used_memory is reported beside it (paid once).

With `--cluster`, the redis backend runs a second time against a throwaway 3-master Redis
Cluster (prefixcache_bench/local_redis.py; backend `redis-cluster`): its batches are a page
pipeline plus the lease script (two round trips), its lookups one pipelined round trip per
master (gateway/core/shared_index.py's module doc).

What this does not measure: the gRPC Subscribe path (the batches are built in process; the
feeds' cost is the same for both backends, once per worker for redis and once per worker per
replica for memory). On this 2-core machine 4 replicas and redis-server
share 2 cores with whatever else runs (the load average is recorded): per-replica rates at 4
replicas are lower bounds.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GROUP = 4


def _page(*parts: int) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def batches_of(pool: int, batches: int, pages: int):
    from prefixcache.v1 import common_pb2, events_pb2
    out = []
    for b in range(batches):
        shared = [_page(-1, pool // GROUP, b, k) for k in range(pages // 2)]
        own = [_page(pool, b, k) for k in range(pages - pages // 2)]
        ev = events_pb2.KvEvent(stored=events_pb2.BlockStored(block_hashes=shared + own,
                                                              medium=common_pb2.MEDIUM_DEVICE))
        out.append(events_pb2.EventBatch(pool_id=f"w{pool:04d}", epoch=1, seq=b, events=[ev]))
    return out


def _requests(n: int, pools: int, batches: int, pages: int) -> list[list[bytes]]:
    import random
    rng = random.Random(7)
    reqs = []
    for i in range(n):
        p, b = rng.randrange(pools), rng.randrange(batches)
        known = [_page(-1, p // GROUP, b, k) for k in range(pages // 2)] + \
                [_page(p, b, k) for k in range(pages - pages // 2)]
        reqs.append(known + [_page(-2, i, k) for k in range(32 - len(known))])
    return reqs


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def replica(backend: str, index: int, replicas: int, args: dict, url: str, barrier, out) -> None:
    from gateway.core.index import KvIndex
    from gateway.core.shared_index import SharedIndexConfig, SharedIndexStore, SharedIndexView
    from gateway.core.shared_indexer import StreamWriter

    pools, nb, pages = args["pools"], args["batches"], args["pages"]
    mine = range(pools) if backend == "memory" else range(index, pools, replicas)
    store_config = dict(url=url, namespace="bench")
    work = [batches_of(p, nb, pages) for p in mine]
    requests = _requests(args["requests"], pools, nb, pages)
    rss0 = _rss()
    barrier.wait()
    t0 = time.perf_counter()
    if backend == "memory":
        idx = KvIndex()
        for pool_batches in work:
            for batch in pool_batches:
                idx.apply(batch)
        lookup = idx.lookup
    else:
        store = SharedIndexStore(SharedIndexConfig(**store_config, lease_ms=60000))
        for p, pool_batches in zip(mine, work):
            pool = f"w{p:04d}"
            assert store.try_lease(pool, f"replica-{index}")
            writer = StreamWriter(store, pool, f"replica-{index}")
            for batch in pool_batches:
                writer.apply(batch)
        lookup = SharedIndexView(SharedIndexStore(SharedIndexConfig(**store_config))).lookup
    ingest_s = time.perf_counter() - t0
    events = sum(len(b.events[0].stored.block_hashes) for w in work for b in w)
    barrier.wait()  # every replica's ingest done: lookups see the whole fleet
    lat, holders = [], 0
    for hashes in requests:
        s = time.perf_counter()
        got = lookup(hashes)
        lat.append(time.perf_counter() - s)
        holders += bool(got)
    lat.sort()
    out.put({"backend": backend, "replica": index, "page_events": events, "ingest_s": ingest_s,
             "page_events_per_s": events / ingest_s,
             "routing_p50_us": lat[len(lat) // 2] * 1e6, "routing_p99_us": lat[int(len(lat) * 0.99)] * 1e6,
             "requests_with_holders": holders / len(requests), "rss_growth_bytes": _rss() - rss0})


def _redis(tmp: str) -> tuple[subprocess.Popen, str]:
    """A throwaway redis-server (local_redis.start_redis) and its URL."""
    import redis

    from prefixcache_bench.local_redis import start_redis
    proc, port = start_redis(
        lambda port: ["--port", str(port), "--save", "", "--appendonly", "no", "--dir", tmp],
        lambda port: redis.Redis(port=port).ping())
    return proc, f"redis://127.0.0.1:{port}/0"


def run(args: dict) -> dict:
    import redis

    from prefixcache_bench.local_redis import RedisClusterServers
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        (proc, url), cluster = _redis(tmp), None
        try:
            if args.get("cluster"):
                (Path(tmp) / "cluster").mkdir()
                cluster = RedisClusterServers(Path(tmp) / "cluster")
            for replicas in (1, 4):
                rows.append(_backend_run("memory", replicas, args, url, None))
                rows.append(_backend_run("redis", replicas, args, url, [redis.Redis.from_url(url)]))
                if cluster is not None:
                    rows.append(_backend_run("redis-cluster", replicas, args, cluster.url,
                                             [cluster.node(p) for p in cluster.ports]))
        finally:
            proc.terminate()
            proc.wait(10)
            if cluster is not None:
                cluster.stop()
    return {"config": args, "load_average_1m": os.getloadavg()[0], "cpus": os.cpu_count(),
            "rows": rows, "ratios": _ratios(rows)}


def _backend_run(backend: str, replicas: int, args: dict, url: str, nodes) -> dict:
    """`replicas` processes of one backend; `nodes`: a client of each Redis (cluster master)
    whose memory and keys are counted, emptied first."""
    for node in nodes or ():
        node.flushall()
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(replicas), ctx.Queue()
    procs = [ctx.Process(target=replica, args=(backend, i, replicas, args, url, barrier, out))
             for i in range(replicas)]
    for p in procs:
        p.start()
    got = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    used = sum(n.info("memory")["used_memory"] for n in nodes or ())
    row = _row(backend, replicas, got, used, sum(n.dbsize() for n in nodes or ()))
    print(json.dumps(row), file=sys.stderr)
    return row


def _row(backend: str, replicas: int, got: list[dict], redis_used: int, redis_keys: int) -> dict:
    return {"backend": backend, "replicas": replicas,
            "page_events_per_s_per_replica": statistics.mean(g["page_events_per_s"] for g in got),
            "page_events_applied_per_replica": statistics.mean(g["page_events"] for g in got),
            "routing_p50_us": statistics.median(g["routing_p50_us"] for g in got),
            "routing_p99_us": max(g["routing_p99_us"] for g in got),
            "requests_with_holders": min(g["requests_with_holders"] for g in got),
            "rss_growth_mb_per_replica": statistics.mean(g["rss_growth_bytes"] for g in got) / 2**20,
            "redis_used_mb": redis_used / 2**20, "redis_keys": redis_keys,
            "load_average_1m": os.getloadavg()[0]}


def _ratios(rows: list[dict]) -> dict:
    by = {(r["backend"], r["replicas"]): r for r in rows}
    out = {}
    for n in (1, 4):
        m = by[("memory", n)]
        for backend in ("redis", "redis-cluster"):
            r = by.get((backend, n))
            if r is None:
                continue
            tag = "" if backend == "redis" else "_cluster"
            out[f"replicas_{n}{tag}"] = {
                f"routing_p99_{backend}_over_memory": r["routing_p99_us"] / m["routing_p99_us"],
                f"events_applied_per_replica_{backend}_over_memory":
                    r["page_events_applied_per_replica"] / m["page_events_applied_per_replica"],
                f"rss_growth_{backend}_over_memory":
                    r["rss_growth_mb_per_replica"] / max(m["rss_growth_mb_per_replica"], 1e-9)}
    return out


def table(result: dict) -> str:
    cols = ("backend", "replicas", "page_events_applied_per_replica", "page_events_per_s_per_replica",
            "routing_p50_us", "routing_p99_us", "rss_growth_mb_per_replica", "redis_used_mb",
            "requests_with_holders")
    lines = ["  ".join(cols)]
    for r in result["rows"]:
        lines.append("  ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    lines.append(f"load average (1 min) at the end: {result['load_average_1m']:.2f} on "
                 f"{result['cpus']} CPUs; 4 replicas = 4 processes + redis-server on these CPUs")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pools", type=int, default=64)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--pages", type=int, default=16, help="stored pages per live batch")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--cluster", action="store_true",
                    help="also the redis backend on a local 3-master Redis Cluster")
    ap.add_argument("--json", type=Path, help="write the result here (and a .txt table beside it)")
    a = ap.parse_args()
    command = " ".join(["python -m prefixcache_bench.gateway_fleet.shared", *sys.argv[1:]])
    result = {"command": command, **run({"pools": a.pools, "batches": a.batches, "pages": a.pages,
                                         "requests": a.requests, "cluster": a.cluster})}
    print(table(result), end="")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1) + "\n")
        a.json.with_suffix(".txt").write_text(table(result))


if __name__ == "__main__":
    main()
