"""What the decode-mode benchmarks share (sampling.py: logprobs and penalties; structured.py: a
JSON schema): the widened preset model, one engine run's decode rate, modes in rotation with
paired ratios over plain decoding, and the median time of a step-sized call."""
from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Sequence

import torch

from cache_service.core import CacheCore
from compute_service.engine import Engine, EngineConfig, SamplingParams
from compute_service.model.model import CausalLM
from compute_service.model.presets import init_random_, preset_config
from prefixcache_bench.harness import choose_threads, percentile


def arguments(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--preset", default="small-transformer")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    return p


def set_threads(requested: int | None) -> tuple[int, str]:
    threads, why = choose_threads(requested, torch.get_num_threads())
    torch.set_num_threads(threads)
    return threads, why


def build(preset: str, vocab: int) -> CausalLM:
    """The preset's model with its vocabulary widened to `vocab` (the presets' 512 ids would make
    per-vocabulary work look free)."""
    cfg = dataclasses.replace(preset_config(preset), vocab_size=vocab).validate()
    return init_random_(CausalLM.empty(cfg, torch.float32, "cpu"), seed=0).eval()


def decode_tok_s(model: CausalLM, tokenizer, params: Callable[[int], SamplingParams],
                 batch: int, rep: int, first_id: int = 1) -> tuple[float, list[list]]:
    """One engine, `batch` distinct 64-token prompts (`params(i)` each): output tokens after the
    first over the time from the first token to the last (prefill is not measured), and each
    request's output messages."""
    eng = Engine(model, tokenizer, CacheCore(), EngineConfig(
        page_size=16, device_pages=1024, token_budget=2048, max_running=batch, model_id="m"))
    outs: list[list] = [[] for _ in range(batch)]
    for i, out in enumerate(outs):
        prompt = [(13 * j + 7 * i + rep) % 250 + first_id for j in range(64)]
        eng.submit(prompt, params(i), out.append)
    while not all(outs):
        eng.step()
    first = time.perf_counter()
    eng.run_until_idle()
    elapsed = time.perf_counter() - first
    counts = [len([t for o in out for t in o.token_ids]) for out in outs]
    return sum(c - 1 for c in counts) / elapsed, outs


def in_rotation(modes: Sequence[str], reps: int,
                run: Callable[[str, int], float]) -> dict[str, list[float]]:
    """`run(mode, rep)` for every mode, `reps` times, the order rotating so that no mode always
    runs first (or right after another one)."""
    runs: dict[str, list[float]] = {m: [] for m in modes}
    names = list(modes)
    for rep in range(reps):
        for mode in names[rep % len(names):] + names[:rep % len(names)]:
            runs[mode].append(run(mode, rep))
    return runs


def rates_and_ratios(runs: dict[str, list[float]], base: str = "plain") -> dict[str, float]:
    """Each mode's median rate; each other mode's ratio over `base`, paired (the median of each
    rep's run over the base run of the same rep: a shared machine's load drifts between reps
    more than within one) and of the medians."""
    med = {m: percentile(v, 0.5) for m, v in runs.items()}
    out: dict[str, float] = {f"{m}_decode_tok_s": round(v, 1) for m, v in med.items()}
    for m in runs:
        if m != base:
            out[f"{m}_ratio"] = round(percentile(
                [x / y for x, y in zip(runs[m], runs[base], strict=True)], 0.5), 4)
            out[f"{m}_ratio_of_medians"] = round(med[m] / med[base], 4)
    return out


def median_ms(call: Callable[[], object], iters: int, warmup: int) -> float:
    """The median over 5 timings of `iters` calls, after `warmup` calls, in ms per call."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(iters):
            call()
        times.append((time.perf_counter() - t) / iters * 1e3)
    return percentile(times, 0.5)
