"""Part `memory`: tracemalloc bytes per cached page of the index, a Pool filled with multi-turn
chats, and where those bytes go."""
from __future__ import annotations

import gc
import os
import sys
import time
import tracemalloc

import numpy as np

from prefixcache_bench.cache.params import MODEL, Params
from prefixcache_bench.cache.workloads import Tokens, serve_on_pool
from cache_service.pool import Pool, PoolConfig
from cache_service.tree import DEVICE, nodes_below
from prefixcache_bench.harness import Progress


def bench_memory(p: Params) -> dict:
    """Bytes of index per cached page: tracemalloc growth while a Pool fills with multi-turn
    chats (32 system prompts picked Zipf-like, 1-6 turns each, every turn's prompt the whole
    history), divided by the pages cached. Leases are released and events dropped, so what
    remains is the tree, its eviction heap and its bookkeeping."""
    slack = 64 * 1024  # pages beyond the target: no eviction while filling
    gc.collect()
    tracemalloc.start()
    try:
        before_pool = tracemalloc.get_traced_memory()[0]
        pool = Pool(PoolConfig("mem", 1, p.page_size, p.mem_pages + slack, 0, 0, MODEL, 600.0), 1,
                    time.monotonic)
        gc.collect()
        base = tracemalloc.get_traced_memory()[0]
        requests = _fill_with_chats(pool, p)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
        cached = pool.cached[DEVICE]
        growth = _growth_per_hit(pool, p, p.mem_hits)
    finally:
        tracemalloc.stop()
    out = {
        "bytes_per_page": round((after - base) / cached, 1),
        "mem_cached_pages": cached,
        "mem_requests": requests,
        "mem_pool_bytes_per_device_page": round((base - before_pool) / pool.cfg.device_pages, 1),
        "mem_growth_bytes_per_hit": growth,
    }
    out.update(_memory_breakdown(pool, cached))
    return out


def _fill_with_chats(pool: Pool, p: Params) -> int:
    tok = Tokens(p.seed + 4, p.vocab)
    systems = [tok.random(tok.uniform(256, 2048)) for _ in range(32)]
    weights = np.array([1 / (i + 1) for i in range(len(systems))])
    weights /= weights.sum()
    requests = 0
    progress = Progress("memory", p.mem_pages)
    while pool.cached[DEVICE] < p.mem_pages:
        history = systems[int(tok.rng.choice(len(systems), p=weights))]
        for _ in range(tok.uniform(1, 6)):
            prompt = np.concatenate([history, tok.random(tok.uniform(64, 1024))])
            serve_on_pool(pool, f"mem{requests}", prompt.tobytes())
            requests += 1
            history = np.concatenate([prompt, tok.random(tok.uniform(64, 512))])
            if pool.cached[DEVICE] >= p.mem_pages:
                break
        progress.update(pool.cached[DEVICE])
    return requests


def _growth_per_hit(pool: Pool, p: Params, hits: int) -> float:
    """Memory kept per request that only hits (match + release of a cached prompt whose every
    full page is matched): nothing is cached anew, so anything kept is bookkeeping that grows
    with traffic rather than with the cache (e.g. stale eviction-heap entries). Only blocks
    allocated by the cache service's own code count: tracemalloc sees every thread, and an
    earlier part's threads (gRPC's, the ZMQ publisher's) may still allocate or free meanwhile."""
    data = Tokens(p.seed + 5, p.vocab).random(128 * p.page_size + 1).tobytes()
    serve_on_pool(pool, "growth", data)
    gc.collect()
    start = _cache_service_bytes()
    for i in range(hits):
        pool.match("r", f"g{i}", "", "", data, 600.0, False, False)
        pool.release(pool.leases[f"g{i}"])
    gc.collect()
    return round((_cache_service_bytes() - start) / hits, 1)


def _cache_service_bytes() -> int:
    """Traced bytes whose allocating line is in cache_service/ (tracemalloc keeps one frame)."""
    only = tracemalloc.Filter(True, f"*{os.sep}cache_service{os.sep}*")
    return sum(t.size for t in tracemalloc.take_snapshot().filter_traces([only]).traces)


def _memory_breakdown(pool: Pool, cached: int) -> dict:
    """Shallow sizes of the index's parts per cached page, to show where the bytes go: the runs
    (node object, token run, hash run, page array), the child dicts, the LRU heap."""
    nodes, dicts, branch, runs = 0, 0, 0, 0
    for root in pool.roots.values():
        for node in nodes_below(root):
            runs += 1
            nodes += (sys.getsizeof(node) + sys.getsizeof(node.tokens)
                      + sys.getsizeof(node.hashes) + sys.getsizeof(node.pages))
            if node.children:
                dicts += sys.getsizeof(node.children)
                branch += len(node.children) > 1
    heap_entries = pool.pages.heap_entries()
    heap = heap_entries * (sys.getsizeof((0.0, 0, None)) + sys.getsizeof(1 << 40) + 8)
    return {
        "mem_runs": runs,
        "mem_run_bytes_per_page": round(nodes / cached, 1),
        "mem_child_dict_bytes_per_page": round(dicts / cached, 1),
        "mem_branch_nodes": branch,
        "mem_lru_heap_entries": heap_entries,
        "mem_lru_heap_bytes_per_page": round(heap / cached, 1),
    }
