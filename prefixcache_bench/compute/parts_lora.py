"""lora: steady decode throughput of concurrent greedy requests on the base model only, and
with several distinct LoRA adapters mixed in one batch (request i uses adapter i mod k; random
adapters on every projection, ranks alternating, max_loras the largest k so that all of them run
in every step), interleaved in the same run. No goal: it is the cost of serving mixed adapters in
one batch (the batched LoRA kernel against the plain forward)."""
from __future__ import annotations

import random
import statistics
import tempfile
from pathlib import Path

from prefixcache_bench.compute.engine_runs import (DecodeRun, make_engine, pages_for, random_tokens,
                                               rounded, timed_run)
from prefixcache_bench.compute.params import Params
from compute_service.lora import write_random_adapter
from compute_service.model import CausalLM
from prefixcache_bench.harness import log


def write_bench_adapters(name: str, p: Params, root: Path) -> list[tuple[str, str]]:
    """max(lora_adapter_counts) random adapters for preset `name` in PEFT format under `root`:
    (adapter name, directory)."""
    out = []
    for i in range(max(p.lora_adapter_counts)):
        rank = p.lora_ranks[i % len(p.lora_ranks)]
        path = root / f"lora-{i}"
        write_random_adapter(path, name, rank=rank, alpha=2.0 * rank, seed=p.seed + 100 + i)
        out.append((f"lora-{i}", str(path)))
    return out


def lora_run(model: CausalLM, name: str, p: Params, adapters: list[tuple[str, str]], k: int,
             rng: random.Random) -> tuple[DecodeRun, int]:
    """One timed run in a fresh engine with every adapter loaded: request i uses adapter
    i mod k (k = 0: the base model). Returns the run and the most distinct adapters that one
    forward call mixed."""
    engine = make_engine(model, name, p, p.lora_token_budget,
                         pages_for(p, p.lora_requests, p.lora_prompt_tokens + p.lora_new_tokens),
                         max_running=max(16, p.lora_requests), max_loaded_adapters=len(adapters),
                         max_lora_rank=max(p.lora_ranks), max_loras=max(p.lora_adapter_counts))
    for adapter, path in adapters:
        engine.load_adapter(adapter, path)
    mixed = [0]
    build = engine.adapters.lora_batch

    def counting(seq_slots, num_tokens):
        mixed[0] = max(mixed[0], len({s for s in seq_slots if s >= 0}))
        return build(seq_slots, num_tokens)

    engine.adapters.lora_batch = counting
    prompts = [random_tokens(rng, p.lora_prompt_tokens) for _ in range(p.lora_requests)]
    names = [adapters[i % k][0] if k else "" for i in range(p.lora_requests)]
    return timed_run(engine, prompts, p.lora_new_tokens, names), mixed[0]


def bench_lora(model: CausalLM, name: str, p: Params) -> dict:
    """`lora_tok_s_{base,k}`, `lora_ratio_{k}` = adapters / base, and
    `lora_max_adapters_per_step_{k}`: that the batches really mixed k adapters."""
    rng = random.Random(p.seed + 4)
    generated = p.lora_requests * p.lora_new_tokens
    configs = (0, *p.lora_adapter_counts)
    label = {k: str(k) if k else "base" for k in configs}
    runs: dict[int, list[DecodeRun]] = {k: [] for k in configs}
    mixed: dict[int, int] = dict.fromkeys(configs, 0)
    with tempfile.TemporaryDirectory(prefix="cbench-lora-") as tmp:
        adapters = write_bench_adapters(name, p, Path(tmp))
        lora_run(model, name, p, adapters, max(p.lora_adapter_counts), rng)  # warm-up
        for rep in range(1, p.lora_reps + 1):
            for k in configs:  # interleaved, so that load drift touches every mix alike
                run, most = lora_run(model, name, p, adapters, k, rng)
                runs[k].append(run)
                mixed[k] = max(mixed[k], most)
                log(f"  lora rep {rep}/{p.lora_reps} adapters {label[k]}: "
                    f"{run.decode_tok_s or 0:.1f} tok/s steady, {generated / run.wall_s:.1f} "
                    f"tok/s overall")
    out: dict = {}
    rates = {}
    for k in configs:
        steady = [r.decode_tok_s for r in runs[k] if r.decode_tok_s]
        rates[k] = statistics.median(steady) if steady else None
        out[f"lora_tok_s_{label[k]}"] = rounded(rates[k], 2)
        out[f"lora_wall_tok_s_{label[k]}"] = round(
            generated / statistics.median(r.wall_s for r in runs[k]), 2)
    for k in p.lora_adapter_counts:
        out[f"lora_ratio_{k}"] = (rounded(rates[k] / rates[0]) if rates[k] and rates[0]
                                  else None)
        out[f"lora_max_adapters_per_step_{k}"] = mixed[k]
    out["lora_samples_tok_s"] = {label[k]: [rounded(r.decode_tok_s, 2) for r in runs[k]]
                                 for k in configs}
    out["lora_ranks"] = [p.lora_ranks[i % len(p.lora_ranks)]
                         for i in range(max(p.lora_adapter_counts))]
    return out
