"""Part `match`: in-process latency of matching a fully cached prompt, on the Pool itself and
through `CacheCore.step` with one MatchOp."""
from __future__ import annotations

import time

import numpy as np

from prefixcache_bench.cache.params import MODEL, Params, register
from prefixcache_bench.cache.workloads import CoreSteps, Tokens, serve_on_pool
from cache_service.core import CacheCore
from cache_service.pool import Pool, PoolConfig
from prefixcache.v1 import cache_service_pb2 as pb
from prefixcache_bench.harness import summarize


def bench_match(p: Params) -> dict:
    """Latency of matching a fully cached `match_tokens` prompt (every full page but the last:
    the last token is always computed), among siblings that share its first
    `match_shared_tokens`; on the Pool (match + release of the lease) and through CacheCore.step
    (one MatchOp; the release runs in an untimed step). Every match is cold: it walks the tree
    from the namespace root, and nothing of the previous call is kept to start it from."""
    tok = Tokens(p.seed, p.vocab)
    prompt = tok.random(p.match_tokens)
    siblings = [np.concatenate([prompt[:p.match_shared_tokens],
                                tok.random(p.match_tokens - p.match_shared_tokens)])
                for _ in range(p.match_siblings)]
    pages = p.match_tokens // p.page_size + 1
    data = prompt.tobytes()

    cfg = PoolConfig("match", 1, p.page_size, pages * (p.match_siblings + 2), 0, 0, MODEL, 600.0)
    pool = Pool(cfg, 1, time.monotonic)
    for i, other in enumerate([prompt, *siblings]):
        serve_on_pool(pool, f"fill{i}", other.tobytes())
    expected = (p.match_tokens - 1) // p.page_size
    samples = []
    for i in range(p.warmup + p.match_iters):
        lease_id = f"l{i}"
        start = time.perf_counter()
        result = pool.match("r", lease_id, "", "", data, 600.0, False, False)
        pool.release(pool.leases[lease_id])
        elapsed = time.perf_counter() - start
        if len(result.device_pages) != expected:
            raise RuntimeError(f"match hit {len(result.device_pages)} pages, expected {expected}")
        if i >= p.warmup:
            samples.append(elapsed)
    out = summarize("match_4k_us", samples, 1e6)
    out["match_4k_pages"] = expected

    core = CacheCore()
    core.register_pool(register("match", p, cfg.device_pages))
    steps = CoreSteps(core.step, "match", p.page_size)
    for other in [prompt, *siblings]:
        steps.serve(pb.MatchOp(token_ids=other.tolist()), len(other))
    req = steps.req(matches=[pb.MatchOp(request_id="r", token_ids=prompt.tolist())])
    samples = []
    for i in range(p.warmup + p.match_iters):
        start = time.perf_counter()
        resp = core.step(req)
        elapsed = time.perf_counter() - start
        core.step(steps.req(releases=[pb.ReleaseOp(lease_id=resp.matches[0].lease_id)]))
        if i >= p.warmup:
            samples.append(elapsed)
    out.update(summarize("match_4k_core_step_us", samples, 1e6))
    return out
