"""Part `step`: batched Step RPCs over loopback gRPC (CacheClient -> server), timed end to end."""
from __future__ import annotations

import time

import numpy as np

from prefixcache_bench.cache.params import Params, ceil_div, register
from prefixcache_bench.cache.serving import ServerHandle
from prefixcache_bench.cache.workloads import CoreSteps, Tokens
from prefixcache.v1 import cache_service_pb2 as pb
from prefixcache_bench.harness import Progress, summarize
from prefixcache_client.cache import CacheClient


def bench_step_rpc(p: Params, server: ServerHandle) -> dict:
    """Two kinds of `step_batch`-request engine steps over loopback gRPC (client.step, request
    built beforehand; serialisation, transport and the server's work are timed).

    - step_rpc_32: MatchOps of fully cached prompts (a shared `step_prefix_tokens` system prefix
      plus a `step_tail_tokens` tail), plus the ReleaseOps of the previous step's leases.
    - step_rpc_32_mixed: requests in four phases of a pipeline, a quarter each: new prompts
      matched (the cached prefix plus new tokens ending one past a page boundary), allocations
      for those of the step before, publishes of those allocated before, releases.
    """
    tok = Tokens(p.seed + 1, p.vocab)
    out: dict = {"step_rpc_32_batch": p.step_batch}
    with CacheClient(server.target, timeout_s=30) as client:
        client.wait_until_ready(30)
        client.register_pool(register("step", p, p.step_pool_pages))
        prefix = tok.random(p.step_prefix_tokens)
        prompts = [np.concatenate([prefix, tok.random(tok.uniform(*p.step_tail_tokens))])
                   for _ in range(p.step_prompts)]
        # As the engine sends them: token ids packed as u32 bytes, no page hashes back.
        ops = [pb.MatchOp(request_id=f"r{i}", packed_token_ids=t.astype("<u4").tobytes(),
                          omit_page_hashes=True) for i, t in enumerate(prompts)]
        steps = CoreSteps(client.step, "step", p.page_size)
        for op, t in zip(ops, prompts):
            steps.serve(op, len(t))
        out.update(_timed_match_steps(p, client, steps, ops, server))
        client.register_pool(register("mixed", p, p.step_pool_pages))
        out.update(_timed_mixed_steps(p, client, tok, prefix, server))
    return out


def _timed_match_steps(p: Params, client: CacheClient, steps: CoreSteps, ops: list[pb.MatchOp],
                       server: ServerHandle) -> dict:
    pick = np.random.default_rng(p.seed + 2)
    held: list[str] = []
    samples, hit_pages, cpu0 = [], 0, None
    progress = Progress("step_rpc_32", p.warmup + p.step_iters)
    for i in range(p.warmup + p.step_iters):
        chosen = pick.choice(len(ops), p.step_batch, replace=False)
        req = steps.req(matches=[ops[j] for j in chosen],
                        releases=[pb.ReleaseOp(lease_id=lease) for lease in held])
        if i == p.warmup:
            cpu0 = server.cpu_s()
        start = time.perf_counter()
        resp = client.step(req)
        elapsed = time.perf_counter() - start
        held = [m.lease_id for m in resp.matches]
        if i >= p.warmup:
            samples.append(elapsed)
            hit_pages += sum(len(m.device_pages) for m in resp.matches)
        progress.update(i + 1)
    cpu1 = server.cpu_s()
    client.step(steps.req(releases=[pb.ReleaseOp(lease_id=lease) for lease in held]))
    out = summarize("step_rpc_32_ms", samples, 1e3)
    out["step_rpc_32_hit_pages_per_request"] = round(hit_pages / (p.step_iters * p.step_batch), 1)
    out["step_rpc_32_request_bytes"] = req.ByteSize()
    out["step_rpc_32_server_cpu_ms"] = (None if cpu0 is None or cpu1 is None
                                        else round((cpu1 - cpu0) / p.step_iters * 1e3, 3))
    return out


def _timed_mixed_steps(p: Params, client: CacheClient, tok: Tokens, prefix: np.ndarray,
                       server: ServerHandle) -> dict:
    quarter = p.step_batch // 4
    tail = 512 + 1  # one token past a page boundary: 33 pages to allocate, 96 to publish
    n_tokens = len(prefix) + tail
    steps = CoreSteps(client.step, "mixed", p.page_size)
    steps.serve(pb.MatchOp(token_ids=np.concatenate([prefix, tok.random(tail)]).tolist()),
                n_tokens)
    to_allocate: list[tuple[str, int]] = []  # (lease, pages it still needs)
    to_publish: list[str] = []
    to_release: list[str] = []
    samples, cpu0, failed = [], None, 0
    for i in range(p.warmup + p.step_iters):
        matches = [pb.MatchOp(request_id=f"m{i}.{k}", omit_page_hashes=True,
                              packed_token_ids=np.concatenate([prefix, tok.random(tail)])
                              .astype("<u4").tobytes()) for k in range(quarter)]
        req = steps.req(
            matches=matches,
            allocations=[pb.AllocateOp(lease_id=lease, num_pages=need)
                         for lease, need in to_allocate],
            publishes=[pb.PublishOp(lease_id=lease, computed_pages=n_tokens // p.page_size)
                       for lease in to_publish],
            releases=[pb.ReleaseOp(lease_id=lease) for lease in to_release])
        if i == p.warmup:
            cpu0 = server.cpu_s()
        start = time.perf_counter()
        resp = client.step(req)
        elapsed = time.perf_counter() - start
        # A lease whose allocation failed cannot publish: it goes straight to release.
        failed_now = [a.lease_id for a in resp.allocations if not a.ok]
        failed += len(failed_now)
        to_release = to_publish + failed_now
        to_publish = [a.lease_id for a in resp.allocations if a.ok]
        to_allocate = [(m.lease_id, ceil_div(n_tokens, p.page_size) - len(m.device_pages))
                       for m in resp.matches]
        if i >= p.warmup:
            samples.append(elapsed)
    cpu1 = server.cpu_s()
    client.step(steps.req(releases=[pb.ReleaseOp(lease_id=lease)
                                    for lease in [*(a for a, _ in to_allocate), *to_publish,
                                                  *to_release]]))
    out = summarize("step_rpc_32_mixed_ms", samples, 1e3)
    out["step_rpc_32_mixed_failed_allocations"] = failed
    out["step_rpc_32_mixed_server_cpu_ms"] = (None if cpu0 is None or cpu1 is None
                                              else round((cpu1 - cpu0) / p.step_iters * 1e3, 3))
    return out
