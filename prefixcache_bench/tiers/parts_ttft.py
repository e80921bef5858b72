"""ttft and break_even: per model, time to first token of one prompt cold, from L1 (same
worker again), L2 (its pages demoted to the host pool by another prompt, then loaded back) and
L3 (a worker with write-through computed it; another worker, with its own cache service, loads
it from Redis), and cold with write-through on; then cold and L3 TTFT over a few prompt lengths,
to find from which prompt length loading from L3 is cheaper than recomputing."""
from __future__ import annotations

import math
import random
import time

import torch

from cache_service.core import CacheCore
from pagestore.client import L3Client, L3Config
from prefixcache_bench.tiers.params import LEASE_TTL_S, Params
from prefixcache_bench.tiers.parts_redis import BENCH_MAC_KEY
from compute_service.engine import Engine, EngineConfig, SamplingParams
from compute_service.model import ByteTokenizer, CausalLM, build_preset
from prefixcache_bench.harness import log


class Bench:
    """Workers of one model sharing one Redis; each worker has its own cache service."""

    def __init__(self, name: str, p: Params, model: CausalLM, url: str, prefix: str):
        self.name, self.p, self.model, self.url, self.prefix = name, p, model, url, prefix
        self.engines: list[Engine] = []

    def client(self) -> L3Client:
        # The production defaults (socket timeouts included) with the bench's key prefix.
        # With the page MAC on, as the manifests run it (its cost is inside the L3 TTFT), and
        # checked as the services do at start (on a cluster that also learns the slot map).
        client = L3Client(L3Config(self.url, prefix=self.prefix, mac_key=BENCH_MAC_KEY))
        client.check(1.0)
        return client

    def worker(self, tokens: int, host_pages: int = 0, **l3) -> Engine:
        pages = -(-(tokens + 1) // self.p.page_size) + 2
        lookup = l3.get("l3_lookup", False)
        cfg = EngineConfig(pool_id=f"{self.name}-{len(self.engines)}", model_id=self.name,
                           page_size=self.p.page_size, device_pages=pages, host_pages=host_pages,
                           max_running=2, token_budget=self.p.token_budget,
                           max_context=pages * self.p.page_size, lease_ttl_s=LEASE_TTL_S,
                           checkpoint_every_pages=self.p.checkpoint_every_pages, **l3)
        core = CacheCore(remote=cfg.l3 if lookup else None)
        self.engines.append(Engine(self.model, ByteTokenizer(), core, cfg))
        return self.engines[-1]

    def ttft(self, eng: Engine, prompt: list[int]):
        """(TTFT in s, final RequestStats) of a one-token request."""
        outs: list = []
        eng.submit(prompt, SamplingParams(max_tokens=1, ignore_eos=True), outs.append)
        eng.run_until_idle()
        return outs[-1].stats.ttft_s, outs[-1].stats

    def l3_ttft(self, prompt: list[int]) -> tuple[float, object, float]:
        """(TTFT, stats, seconds spent loading L3 pages) on a fresh reader worker."""
        eng = self.worker(len(prompt), l3=self.client(), l3_lookup=True)
        spent = [0.0]
        load = eng.tiers.load_extensions

        def timed_load(matches):
            start = time.perf_counter()
            try:
                return load(matches)
            finally:
                spent[0] += time.perf_counter() - start
        eng.tiers.load_extensions = timed_load
        ttft, stats = self.ttft(eng, prompt)
        return ttft, stats, spent[0]

    def close(self) -> None:
        for eng in self.engines:
            eng.close()


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 255) for _ in range(n)]


def bench_model(name: str, p: Params, url: str, prefix: str, device: str,
                dtype: torch.dtype) -> tuple[dict, dict]:
    """(ttft, break_even) of one model: cold is the mean of two prompts' cold TTFT."""
    rng = random.Random(p.seed)
    model = build_preset(name, seed=p.seed, dtype=dtype, device=device)
    b = Bench(name, p, model, url, prefix)
    try:
        b.ttft(b.worker(64), tokens(rng, 64))  # warm-up: lazy initialisation is not TTFT
        n = p.prompt_tokens
        x, y = tokens(rng, n), tokens(rng, n)
        c = b.worker(n, host_pages=-(-n // p.page_size) + 16)
        log(f"{name}: cold {n} tokens ...")
        cold_x, _ = b.ttft(c, x)
        l1, s1 = b.ttft(c, x)
        cold_y, _ = b.ttft(c, y)  # needs the whole device pool: x's pages go to the host
        l2, s2 = b.ttft(c, x)
        log(f"{name}: cold with write-through ...")
        writer = b.worker(n, l3=b.client(), l3_write_policy="write-through")
        cold_wt, _ = b.ttft(writer, x)
        if not writer.flush_l3(120):
            log(f"{name}: L3 writes did not finish in 120 s")
        l3, s3, load_s = b.l3_ttft(x)
        cold = (cold_x + cold_y) / 2
        ttft = {
            "prompt_tokens": n, "ttft_cold_s": cold, "ttft_cold_samples_s": [cold_x, cold_y],
            "ttft_l1_s": l1, "ttft_l2_s": l2, "ttft_l3_s": l3,
            "ttft_cold_write_through_s": cold_wt,
            "ttft_l1_over_cold": l1 / cold, "ttft_l2_over_cold": l2 / cold,
            "ttft_l3_over_cold": l3 / cold, "write_through_over_cold": cold_wt / cold,
            "l1_hit_tokens": s1.cached_tokens_device, "l2_hit_tokens": s2.cached_tokens_host,
            "l3_hit_tokens": s3.cached_tokens_remote,
            "l3_computed_tokens": s3.computed_prompt_tokens,
            "l3_load_s": load_s, "l3_written_pages": writer.tier_metrics()["l3_write_pages_ok"],
        }
        log(f"{name}: cold {cold:.3f}s L1 {l1:.3f}s L2 {l2:.3f}s L3 {l3:.3f}s")
        points = [{"prompt_tokens": n, "ttft_cold_s": cold_x, "ttft_l3_s": l3, "l3_load_s": load_s,
                   "l3_pages": s3.cached_tokens_remote // p.page_size}]
        for length in sorted(set(p.lengths) - {n}):
            cold_n, _ = b.ttft(b.worker(length), x[:length])
            l3_n, s, load_n = b.l3_ttft(x[:length])
            points.append({"prompt_tokens": length, "ttft_cold_s": cold_n, "ttft_l3_s": l3_n,
                           "l3_load_s": load_n, "l3_pages": s.cached_tokens_remote // p.page_size})
        be = break_even(sorted(points, key=lambda q: q["prompt_tokens"]), p.page_size)
        if model.config.mamba_layer_ids:  # a hybrid prefix resumes only at a checkpoint
            be["resume_granularity_tokens"] = p.checkpoint_every_pages * p.page_size
        return ttft, be
    finally:
        b.close()


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    return my - slope * mx, slope


def break_even(points: list[dict], page_size: int) -> dict:
    """Recompute cost per token vs L3 load cost per page. The recompute rate is the lowest
    cold TTFT per token over the points (attention makes short prompts cheapest per token, so
    this favours recomputing); the load cost is fitted as fixed + per_page x pages over the
    measured loads (get + validate + copy). A prefix of n pages is cheaper to load once
    fixed + per_page x n < rate x page_size x n: the break-even is the smallest such n."""
    per_token = min(q["ttft_cold_s"] / q["prompt_tokens"] for q in points)
    fixed, per_page = fit([q["l3_pages"] for q in points], [q["l3_load_s"] for q in points])
    fixed = max(fixed, 0.0)  # a negative intercept is fit noise: a load has no negative cost
    saving = per_token * page_size - per_page
    pages = max(1, math.floor(fixed / saving) + 1) if saving > 0 else None
    faster = [q["prompt_tokens"] for q in points if q["ttft_l3_s"] < q["ttft_cold_s"]]
    return {"points": points, "compute_s_per_token": per_token, "load_s_per_page": per_page,
            "load_fixed_s": fixed, "break_even_tokens": pages * page_size if pages else None,
            "shortest_measured_l3_faster_tokens": min(faster) if faster else None}
