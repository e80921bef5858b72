"""ttft: time to first token of one prompt cold, and with its first fractions cached by an
earlier request sharing exactly those tokens (a fresh engine per measurement, so nothing else
is cached)."""
from __future__ import annotations

import random
import statistics

from prefixcache_bench.compute.engine_runs import make_engine, pages_for, random_tokens, run_requests
from prefixcache_bench.compute.params import Params
from compute_service.engine import RequestStats
from compute_service.model import CausalLM
from prefixcache_bench.harness import log


def shared_tokens(p: Params, frac: float) -> int:
    """The cached part of a `frac`-cached prompt: `frac` of it, down to whole pages (only whole
    pages are cached, so the warming request shares exactly what can be hit)."""
    return int(p.ttft_prompt_tokens * frac) // p.page_size * p.page_size


def ttft_once(model: CausalLM, name: str, p: Params, rng: random.Random,
              frac: float) -> RequestStats:
    """TTFT of a fresh prompt with its first `frac` placed in the cache by an earlier request
    (the shared tokens plus a tail of its own), in a fresh engine."""
    n = p.ttft_prompt_tokens
    engine = make_engine(model, name, p, p.ttft_token_budget, pages_for(p, 2, n + 1))
    prompt = random_tokens(rng, n)
    shared = shared_tokens(p, frac)
    if shared:
        run_requests(engine, [prompt[:shared] + random_tokens(rng, p.ttft_tail_tokens)], 1)
    (result,) = run_requests(engine, [prompt], 1)
    return result.stats


def bench_ttft(model: CausalLM, name: str, p: Params) -> dict:
    rng = random.Random(p.seed + 1)
    fracs = (0.0, *p.ttft_fracs)
    samples: dict[float, list[RequestStats]] = {f: [] for f in fracs}
    for rep in range(p.ttft_reps):
        for frac in fracs:  # interleaved, so that load drift touches every fraction alike
            s = ttft_once(model, name, p, rng, frac)
            samples[frac].append(s)
            log(f"  ttft rep {rep + 1}/{p.ttft_reps} cached {frac:.0%}: {s.ttft_s:.3f} s "
                f"(cached {s.cached_tokens_device}, computed {s.computed_prompt_tokens})")
    out: dict = {}
    cold = statistics.median(s.ttft_s for s in samples[0.0])
    out["ttft_cold_s"] = round(cold, 6)  # ms-scale on tiny models: keep the ratio exact
    for frac in p.ttft_fracs:
        key = f"{round(frac * 100)}"
        ttft = statistics.median(s.ttft_s for s in samples[frac])
        out[f"ttft_{key}_s"] = round(ttft, 6)
        out[f"ttft_ratio_{key}"] = round(ttft / cold, 4)
        # What was actually hit: a shortfall here (e.g. no Mamba checkpoint) explains a ratio.
        out[f"ttft_{key}_cached_tokens"] = min(s.cached_tokens_device for s in samples[frac])
        out[f"ttft_{key}_computed_tokens"] = max(s.computed_prompt_tokens for s in samples[frac])
    out["ttft_cold_computed_tokens"] = max(s.computed_prompt_tokens for s in samples[0.0])
    out["ttft_samples_s"] = {f"{round(f * 100)}": [round(s.ttft_s, 4) for s in samples[f]]
                             for f in fracs}
    return out
