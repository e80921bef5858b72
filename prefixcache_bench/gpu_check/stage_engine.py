"""Stage `engine`: the engine end to end on random-weight models of real shapes, in bf16.

On the Llama-3-8B shape (models.py):
- `decode`: steady decode tokens/s at batch 1, 32 and 128 (distinct random prompts, greedy,
  ignore_eos; the rate after every request has its first token), each in a fresh engine, and
  transformers' `generate` on the same GPU and the same weights (LlamaForCausalLM, SDPA) with
  the same prompts, beside it; the greedy agreement of the two (bf16: informative only);
- `ttft`: time to first token of a 4k-token prompt cold, and with 90% of it (whole pages)
  cached by an earlier request, in a fresh engine each;
- `prefix_cache_overhead`: the engine with prefix caching through the cache service (the
  embedded CacheCore, as `python -m compute_service` runs by default: --cache-service embedded)
  vs `EngineConfig(prefix_cache=False)` (--no-prefix-cache) on a batch of distinct prompts (0%
  hits), alternating rounds; goal: cached / uncached steady decode rate >= 0.98; both must give
  the same greedy tokens (a check).
On the SmolLM2-135M shape: decode at batch 1 and 32, engine vs HF.

The engine's pools are sized explicitly here; the sizing stage sizes them from memory. Every
timed engine is first warmed up on its batch size with short distinct prompts (Triton compiles,
the CUDA graph of that decode batch size: `cuda_graphs` in each row says what was captured and
replayed).
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

import torch

from prefixcache_bench.gpu_check.device import free_memory, memory_report, sync
from prefixcache_bench.gpu_check.models import build, hf_twin
from prefixcache_bench.gpu_check.runner import Context, check, skipped

GOAL_PREFIX_CACHE_RATIO = 0.98
PAGE = 16


@dataclass(slots=True)
class Plan:
    model: str
    small_model: str
    dtype: torch.dtype
    prompt_tokens: int
    new_tokens: int
    batches: tuple[int, ...]
    small_batches: tuple[int, ...]
    ttft_tokens: int
    ttft_frac: float
    ttft_reps: int
    overhead_batch: int
    overhead_rounds: int
    hf_batches: tuple[int, ...] = field(default=())


def plan_for(dry_run: bool, dtype: torch.dtype) -> Plan:
    if dry_run:
        return Plan("dry-llama", "dry-smollm", torch.float32, 16, 6, (1, 4), (1, 2), 96, 0.9,
                    1, 4, 2, (1, 4))
    return Plan("llama3-8b", "smollm2-135m", dtype, 128, 64, (1, 32, 128), (1, 32), 4096, 0.9,
                3, 32, 3, (1, 32, 128))


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]  # byte tokens: every vocabulary has them


def make_engine(model, pages: int, budget: int, max_running: int, prefix_cache: bool = True):
    from cache_service.core import CacheCore
    from compute_service.engine import Engine, EngineConfig
    from compute_service.model import ByteTokenizer

    cfg = EngineConfig(pool_id="gpu-check", model_id="gpu-check", page_size=PAGE,
                       device_pages=pages, token_budget=budget, max_running=max_running,
                       max_context=min(pages * PAGE, model.config.max_position_embeddings),
                       lease_ttl_s=600.0, prefix_cache=prefix_cache, max_loaded_adapters=0)
    return Engine(model, ByteTokenizer(), CacheCore() if prefix_cache else None, cfg)


def graph_stats(engine) -> dict | None:
    """Whether the engine's decode steps replayed CUDA graphs (compute_service.engine.cuda_graphs):
    graphs captured, steps replayed, still enabled (False: a capture failed or differed from
    the eager forward, and decode ran eagerly)."""
    g = getattr(engine.runner, "graphs", None)
    if g is None:
        return None
    return {"enabled": g.enabled, "captured": g.captures, "replays": g.replays,
            "batch_sizes": sorted(g.graphs)}


WARM_TOKENS = 24 + 3


def warm_up(engine, rng: random.Random, b: int) -> None:
    """b distinct 24-token prompts, 3 new tokens each: a prefill, then two decode steps of b
    (the second captures the CUDA graph of batch b). No prefix is shared with what follows."""
    run_batch(engine, [_tokens(rng, WARM_TOKENS - 3) for _ in range(b)], 3)


def pages_for(requests: int, tokens: int) -> int:
    return requests * (-(-tokens // PAGE) + 1)


class Collector:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.times: list[float] = []
        self.stats = None

    def __call__(self, out) -> None:
        if out.token_ids:
            self.tokens.extend(out.token_ids)
            self.times.append(time.perf_counter())
        if out.stats is not None:
            self.stats = out.stats


def run_batch(engine, prompts: list[list[int]], new_tokens: int) -> tuple[list[Collector], float]:
    from compute_service.engine import SamplingParams

    sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    done = [Collector() for _ in prompts]
    t0 = time.perf_counter()
    for i, (p, c) in enumerate(zip(prompts, done, strict=True)):
        engine.submit(p, sampling, c, request_id=f"r{i}")
    engine.run_until_idle()
    wall = time.perf_counter() - t0
    if any(c.stats is None for c in done):
        raise RuntimeError("a request finished without its final stats")
    return done, wall


def steady_rate(done: list[Collector]) -> float | None:
    """Tokens after the moment every request had its first token, over the time after it."""
    start = max(c.times[0] for c in done)
    end = max(c.times[-1] for c in done)
    after = sum(sum(1 for t in c.times if t > start) for c in done)
    return after / (end - start) if end > start and after else None


def hf_generate(hf, prompts: list[list[int]], new_tokens: int, device) -> dict:
    from transformers import GenerationConfig

    from compute_service.model import ByteTokenizer

    gc = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=ByteTokenizer.PAD)
    ids = torch.tensor(prompts, dtype=torch.int64, device=device)
    times: list[float] = []

    class Clock:  # a streamer that only timestamps each step
        def put(self, value) -> None:
            times.append(time.perf_counter())

        def end(self) -> None:
            pass

    with torch.inference_mode():
        sync(device)
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc,
                          streamer=Clock())
        sync(device)
        wall = time.perf_counter() - t0
    steps = times[1:]  # times[0]: the prompt, before the prefill
    steady = (len(prompts) * (len(steps) - 1) / (steps[-1] - steps[0])
              if len(steps) >= 2 and steps[-1] > steps[0] else None)
    return {"tokens": out[:, ids.shape[1]:].tolist(), "wall_s": round(wall, 4),
            "tok_s": round(len(prompts) * new_tokens / wall, 1),
            "steady_tok_s": round(steady, 1) if steady else None}


def agreement(ours: list[list[int]], theirs: list[list[int]], n: int) -> float:
    fracs = []
    for a, b in zip(ours, theirs, strict=True):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b), n))
        fracs.append(min(k, n) / n)
    return round(statistics.fmean(fracs), 4)


def decode_part(ctx: Context, model, p: Plan, batches, hf_batches, seed: int) -> dict:
    out: dict = {"prompt_tokens": p.prompt_tokens, "new_tokens": p.new_tokens, "batches": {}}
    rng = random.Random(seed)
    # Warm-up: Triton compiles and cuBLAS handles stay out of the timings.
    warm = make_engine(model, pages_for(2, 64 + 8), 256, 4)
    try:
        run_batch(warm, [_tokens(rng, 40), _tokens(rng, 56)], 4)
    finally:
        warm.close()
    hf = None
    if hf_batches:
        try:
            hf = hf_twin(model)
            hf_generate(hf, [_tokens(rng, 16)], 2, ctx.device)  # warm-up
            out["hf"] = {"class": type(hf).__name__, "attn": "sdpa",
                         "weights": "the engine's, copied"}
        except Exception as e:  # noqa: BLE001 - the baseline is optional
            out["hf"] = {"error": f"{type(e).__name__}: {e}"[:500]}
            hf = None
    for b in batches:
        row: dict = {}
        if ctx.left() < 10:
            out["batches"][str(b)] = skipped(f"stage budget: {ctx.left():.0f} s left")
            continue
        prompts = [_tokens(rng, p.prompt_tokens) for _ in range(b)]
        pages = pages_for(b, p.prompt_tokens + p.new_tokens)
        budget = max(512, b * p.prompt_tokens)
        # The Triton kernels specialise on the batch (decode splits), and the engine captures
        # a CUDA graph per decode batch size (compute_service.engine.cuda_graphs): warm the
        # same engine up on this batch size with short distinct prompts before the timed run.
        engine = make_engine(model, pages + pages_for(b, WARM_TOKENS), budget, b)
        try:
            warm_up(engine, rng, b)
            done, wall = run_batch(engine, prompts, p.new_tokens)
        finally:
            engine.close()
        rate = steady_rate(done)
        row["engine"] = {"wall_s": round(wall, 4), "tok_s": round(b * p.new_tokens / wall, 1),
                         "steady_tok_s": round(rate, 1) if rate else None,
                         "ttft_median_s": round(statistics.median(c.stats.ttft_s for c in done),
                                                4),
                         "cuda_graphs": graph_stats(engine)}
        row["check"] = check(f"decode b{b}: every request got its tokens",
                             all(len(c.tokens) == p.new_tokens for c in done))
        if hf is not None and b in hf_batches and ctx.left() > 10:
            try:
                h = hf_generate(hf, prompts, p.new_tokens, ctx.device)
                row["hf_generate"] = {k: v for k, v in h.items() if k != "tokens"}
                row["greedy_agreement_with_hf"] = agreement([c.tokens for c in done],
                                                            h["tokens"], p.new_tokens)
                if rate and h["steady_tok_s"]:
                    row["steady_speedup_vs_hf"] = round(rate / h["steady_tok_s"], 3)
            except Exception as e:  # noqa: BLE001
                row["hf_generate"] = {"error": f"{type(e).__name__}: {e}"[:500]}
        out["batches"][str(b)] = row
    del hf
    free_memory(ctx.device)
    return out


def ttft_part(ctx: Context, model, p: Plan, seed: int) -> dict:
    rng = random.Random(seed)
    n = p.ttft_tokens
    shared = int(n * p.ttft_frac) // PAGE * PAGE
    samples: dict[str, list] = {"cold": [], "cached": []}
    for rep in range(p.ttft_reps):
        if ctx.left() < 15:
            break
        for kind in ("cold", "cached"):
            engine = make_engine(model, pages_for(2, n + 32), n + 64, 2)
            try:
                prompt = _tokens(rng, n)
                if kind == "cached":
                    run_batch(engine, [prompt[:shared] + _tokens(rng, 16)], 1)
                (c,), _ = run_batch(engine, [prompt], 1)
            finally:
                engine.close()
            samples[kind].append(c.stats)
    if not samples["cold"] or not samples["cached"]:
        return skipped(f"stage budget: {ctx.left():.0f} s left")
    cold = statistics.median(s.ttft_s for s in samples["cold"])
    cached = statistics.median(s.ttft_s for s in samples["cached"])
    hit = min(s.cached_tokens_device for s in samples["cached"])
    return {"prompt_tokens": n, "cached_fraction": p.ttft_frac, "shared_tokens": shared,
            "reps": len(samples["cold"]), "ttft_cold_s": round(cold, 5),
            "ttft_90_s": round(cached, 5), "ttft_ratio_90": round(cached / cold, 4),
            "cached_tokens_device": hit,
            "computed_tokens": max(s.computed_prompt_tokens for s in samples["cached"]),
            "samples_s": {k: [round(s.ttft_s, 5) for s in v] for k, v in samples.items()},
            "check": check("ttft: the 90% prefix was hit", hit >= shared)}


def overhead_part(ctx: Context, model, p: Plan, seed: int) -> dict:
    rng = random.Random(seed)
    b = p.overhead_batch
    rounds: list[dict] = []
    identical = True
    for r in range(p.overhead_rounds):
        if ctx.left() < 10:
            break
        prompts = [_tokens(rng, p.prompt_tokens) for _ in range(b)]  # distinct: 0% hits
        order = ("prefix_cache", "no_prefix_cache") if r % 2 == 0 else \
            ("no_prefix_cache", "prefix_cache")
        row: dict = {}
        toks: dict = {}
        for mode in order:
            engine = make_engine(model, pages_for(b, p.prompt_tokens + p.new_tokens)
                                 + pages_for(b, WARM_TOKENS), max(512, b * p.prompt_tokens), b,
                                 mode == "prefix_cache")
            try:
                warm_up(engine, rng, b)  # distinct prompts: the timed run still has 0% hits
                stats = engine.stats
                cached0, wait0 = stats.cached_prompt_tokens, stats.cache_wait_s
                done, wall = run_batch(engine, prompts, p.new_tokens)
                row[mode] = {"steady_tok_s": round(steady_rate(done) or 0.0, 1),
                             "wall_s": round(wall, 4),
                             "cached_prompt_tokens": stats.cached_prompt_tokens - cached0,
                             "cache_wait_s": round(stats.cache_wait_s - wait0, 4),
                             "cuda_graphs": graph_stats(engine)}
            finally:
                engine.close()
            toks[mode] = [c.tokens for c in done]
        identical &= toks["prefix_cache"] == toks["no_prefix_cache"]
        no = row["no_prefix_cache"]["steady_tok_s"]
        row["ratio"] = round(row["prefix_cache"]["steady_tok_s"] / no, 4) if no else None
        rounds.append(row)
    if not rounds:
        return skipped(f"stage budget: {ctx.left():.0f} s left")
    ratios = [r["ratio"] for r in rounds if r["ratio"]]
    ratio = round(statistics.median(ratios), 4) if ratios else None
    return {"batch": b, "prompt_tokens": p.prompt_tokens, "new_tokens": p.new_tokens,
            "cache_service": "embedded CacheCore (compute_service --cache-service embedded)",
            "rounds": rounds, "decode_prefix_cache_ratio": ratio,
            "goal": f">= {GOAL_PREFIX_CACHE_RATIO}",
            "goal_met": ratio is not None and ratio >= GOAL_PREFIX_CACHE_RATIO,
            "check": check("prefix cache on/off: identical greedy tokens", identical)}


def run(ctx: Context) -> dict:
    dtype = torch.bfloat16
    if ctx.device.type == "cuda" and not torch.cuda.is_bf16_supported():
        dtype = torch.float16
    p = plan_for(ctx.dry_run, dtype)
    result: dict = {"dtype": str(p.dtype).removeprefix("torch.")}
    t0 = time.perf_counter()
    model = build(p.model, p.dtype, ctx.device, seed=1)
    sync(ctx.device)
    cfg = model.config
    result["model"] = {"shape": p.model, "weights": "random (initialised on the device)",
                       "parameters": cfg.num_parameters(), "init_s":
                       round(time.perf_counter() - t0, 2), "memory": memory_report(ctx.device)}
    parts = (("decode", lambda: decode_part(ctx, model, p, p.batches, p.hf_batches, 11)),
             ("ttft", lambda: ttft_part(ctx, model, p, 12)),
             ("prefix_cache_overhead", lambda: overhead_part(ctx, model, p, 13)))
    for name, fn in parts:
        if ctx.left() < 10:
            result[name] = skipped(f"stage budget: {ctx.left():.0f} s left")
            continue
        try:
            result[name] = fn()
        except Exception as e:  # noqa: BLE001
            import traceback
            result[name] = {"error": f"{type(e).__name__}: {e}"[:500],
                            "traceback": traceback.format_exc(limit=10)[-3000:]}
            result.setdefault("part_errors", []).append(name)
    ctx.shared["model"] = model  # the sizing stage sizes the pools of this model
    del model
    free_memory(ctx.device)
    small = {"shape": p.small_model, "weights": "random: SmolLM2-135M's shape (the demo's trained "
             "GGUF is 93 MB, over the 64 MiB a device call carries)"}
    if ctx.left() < 15:
        result["smollm2_135m_shape"] = small | skipped(f"stage budget: {ctx.left():.0f} s left")
    else:
        try:
            sm = build(p.small_model, p.dtype, ctx.device, seed=2)
            small["parameters"] = sm.config.num_parameters()
            small |= decode_part(ctx, sm, p, p.small_batches, p.small_batches, 21)
            del sm
        except Exception as e:  # noqa: BLE001
            small["error"] = f"{type(e).__name__}: {e}"[:500]
            result.setdefault("part_errors", []).append("smollm2_135m_shape")
        result["smollm2_135m_shape"] = small
    free_memory(ctx.device)
    head: dict = {}
    for b, row in result.get("decode", {}).get("batches", {}).items():
        if "engine" in row:
            head[f"b{b}_tok_s"] = row["engine"]["steady_tok_s"]
            if "steady_speedup_vs_hf" in row:
                head[f"b{b}_vs_hf"] = row["steady_speedup_vs_hf"]
    if "ttft_ratio_90" in result.get("ttft", {}):
        head["ttft_cold_s"] = result["ttft"]["ttft_cold_s"]
        head["ttft_ratio_90"] = result["ttft"]["ttft_ratio_90"]
    if result.get("prefix_cache_overhead", {}).get("decode_prefix_cache_ratio") is not None:
        head["prefix_cache_ratio"] = result["prefix_cache_overhead"]["decode_prefix_cache_ratio"]
    result["headline"] = head
    return result
