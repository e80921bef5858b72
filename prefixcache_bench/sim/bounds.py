"""Hit-ratio ceilings of a trace that no routing policy can beat: one pooled LRU over every
worker's capacity, and a cache that never forgets. They need no simulation, only the trace in
arrival order, so they live apart from the discrete-event model in engine.py."""
from __future__ import annotations

from collections.abc import Sequence

from prefixcache_bench.sim.cache import PageCache
from prefixcache_bench.sim.engine import SimConfig, split_hashes
from prefixcache_bench.sim.trace import TraceRequest


def bound_hit_ratio(requests: Sequence[TraceRequest], blobs: Sequence[bytes], cfg: SimConfig) -> float:
    """Hit ratio of one pooled LRU of workers x capacity tokens serving the trace in arrival order."""
    return pooled_lru_hit_ratio(requests, blobs, cfg.workers * cfg.capacity_tokens, cfg.page_size)


def l3_bound_hit_ratio(requests: Sequence[TraceRequest], blobs: Sequence[bytes], cfg: SimConfig) -> float:
    """The bound with every tier pooled: one LRU of workers x (device + host) + L3 tokens."""
    total = cfg.workers * (cfg.capacity_tokens + cfg.host_capacity_tokens) + cfg.l3_capacity_tokens
    return pooled_lru_hit_ratio(requests, blobs, total, cfg.page_size)


def unbounded_hit_ratio(requests: Sequence[TraceRequest], source_blobs: Sequence[bytes], page: int) -> float:
    """Prompt tokens whose page was seen before (leading run): the ceiling of any cache.

    `source_blobs[r.source]` are the original requests' page hashes. Copies of a scaled trace
    share no page, and the requests of a copy present are the first of the original's, in its
    order, so a copy's hits are the original's: counted once per original request, not over a
    set of every copy's pages (125 copies of the conversation trace: ~730M pages)."""
    originals = max((r.source for r in requests), default=-1) + 1
    seen: set[bytes] = set()
    hits = []
    for blob in source_blobs[:originals]:
        hashes = split_hashes(blob)
        d = 0
        while d < len(hashes) and hashes[d] in seen:
            d += 1
        seen.update(hashes[d:])
        hits.append(d * page)
    hit = sum(hits[r.source] for r in requests)
    total = sum(r.input_length for r in requests)
    return hit / total if total else 0.0


def pooled_lru_hit_ratio(requests: Sequence[TraceRequest], blobs: Sequence[bytes], capacity_tokens: int,
                         page: int) -> float:
    """Hit ratio of one LRU of `capacity_tokens` serving the trace in arrival order."""
    cache = PageCache(max(capacity_tokens // page, 1), 0, page)
    hit = total = 0
    for req, blob in zip(requests, blobs):
        hashes = split_hashes(blob)
        d, _ = cache.match(hashes)
        cache.commit(hashes, d, 0, emit=False)
        hit += d * page
        total += req.input_length
    return hit / total if total else 0.0
