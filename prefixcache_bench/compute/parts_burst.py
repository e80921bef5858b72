"""burst: requests sharing a long prefix (distinct short suffixes) submitted at once; the
prefill tokens computed over all of them, against one prompt's tokens."""
from __future__ import annotations

import random
import statistics
import time

from prefixcache_bench.compute.engine_runs import make_engine, pages_for, random_tokens, run_requests
from prefixcache_bench.compute.params import Params
from compute_service.model import CausalLM


def bench_burst(model: CausalLM, name: str, p: Params) -> dict:
    rng = random.Random(p.seed + 2)
    prefix = random_tokens(rng, p.burst_prefix_tokens)
    prompts = [prefix + random_tokens(rng, p.burst_suffix_tokens) for _ in range(p.burst_requests)]
    prompt_len = len(prompts[0])
    engine = make_engine(model, name, p, p.burst_token_budget,
                         pages_for(p, p.burst_requests, prompt_len + p.burst_new_tokens),
                         max_running=max(16, p.burst_requests))
    started = time.perf_counter()
    done = run_requests(engine, prompts, p.burst_new_tokens)
    wall = time.perf_counter() - started
    computed = sum(f.stats.computed_prompt_tokens for f in done)
    # Best case: the prefix's whole pages once, then every suffix (and the rest of the first).
    cacheable = min(p.burst_prefix_tokens, prompt_len - 1) // p.page_size * p.page_size
    ideal = cacheable + p.burst_requests * (prompt_len - cacheable)
    return {
        "burst_prefill_ratio": round(computed / prompt_len, 4),
        "burst_ideal_ratio": round(ideal / prompt_len, 4),
        "burst_wall_s": round(wall, 4),
        "burst_computed_prompt_tokens": computed,
        "burst_cached_tokens": sum(f.stats.cached_tokens_device for f in done),
        "burst_shared_in_flight_tokens": engine.stats.shared_in_flight_tokens,
        "burst_mean_ttft_s": round(statistics.fmean(f.stats.ttft_s for f in done), 4),
        "burst_steps": engine.stats.steps,
        "burst_preemptions": engine.stats.preemptions,
    }
