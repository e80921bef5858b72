"""decode: concurrent greedy requests (ignore_eos) through the engine vs Hugging Face
transformers' `generate` on the same weights (saved with `save_model`, loaded with
AutoModelForCausalLM), same prompts, interleaved in the same run; and whether the engine's greedy
tokens agree with HF's."""
from __future__ import annotations

import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from prefixcache_bench.compute.engine_runs import (DecodeRun, make_engine, pages_for, random_tokens,
                                               rounded, timed_run)
from prefixcache_bench.compute.params import Params
from compute_service.model import ByteTokenizer, CausalLM, save_model
from prefixcache_bench.harness import log


def engine_decode(model: CausalLM, name: str, p: Params, prompts: list[list[int]]) -> DecodeRun:
    engine = make_engine(model, name, p, p.decode_token_budget,
                         pages_for(p, len(prompts), p.decode_prompt_tokens + p.decode_new_tokens))
    return timed_run(engine, prompts, p.decode_new_tokens)


def load_hf(model: CausalLM, path: Path):
    """The same weights through transformers (imported here: a slow, optional dependency)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its "falls back to the PyTorch path" notes are expected
    save_model(model, path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=model.dtype).eval()


class _StepClock:
    """A `generate` streamer that only timestamps: `put` is called once with the prompt, then once
    per decoding step with that step's new tokens (of every row)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_generate(hf, prompts: list[list[int]], new_tokens: int
                ) -> tuple[list[list[int]], float, float | None]:
    """Greedy generation of the whole batch (equal-length prompts: no padding); only
    `generate` is timed. EOS is disabled so that, like the engine's ignore_eos, every row
    produces `new_tokens` (an EOS would otherwise turn the rest of a row into padding).
    Returns the new tokens, the wall time, and the steady decode rate in tokens/s: the tokens
    after the first step's over the time after it (None below two tokens), as the engine's."""
    from transformers import GenerationConfig

    hf.generation_config = GenerationConfig(
        max_new_tokens=new_tokens, min_new_tokens=0, do_sample=False, eos_token_id=None,
        pad_token_id=ByteTokenizer.PAD, bos_token_id=ByteTokenizer.BOS)
    ids = torch.tensor(prompts, dtype=torch.int64)
    clock = _StepClock()
    with torch.inference_mode():
        started = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids),
                          generation_config=hf.generation_config, streamer=clock)
        wall = time.perf_counter() - started
    steps = clock.times[1:]  # after each step; times[0] is the prompt, before the prefill
    steady = None
    if len(steps) >= 2 and steps[-1] > steps[0]:
        steady = len(prompts) * (len(steps) - 1) / (steps[-1] - steps[0])
    return out[:, ids.shape[1]:].tolist(), wall, steady


def agreement(ours: list[list[int]], theirs: list[list[int]], n: int) -> tuple[float, int]:
    """Mean fraction of each request's tokens before the first disagreement (later tokens
    follow different contexts, so they say nothing more), and how many agree entirely."""
    prefixes = []
    for a, b in zip(ours, theirs, strict=True):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefixes.append(min(k, n))
    return statistics.fmean(k / n for k in prefixes), sum(k == n for k in prefixes)


@dataclass(slots=True)
class HFRun:
    tokens: list[list[int]]
    wall_s: float
    steady_tok_s: float | None  # after the first step, as DecodeRun.decode_tok_s


def timed_decode_runs(model: CausalLM, name: str, p: Params,
                      prompts: list[list[int]]) -> tuple[list[DecodeRun], list[HFRun]]:
    """`decode_reps` engine runs and, unless disabled, as many HF runs, interleaved so that
    load drift on a shared machine hits both sides alike."""
    generated = len(prompts) * p.decode_new_tokens
    runs: list[DecodeRun] = []
    hf_runs: list[HFRun] = []
    with tempfile.TemporaryDirectory(prefix="cbench-hf-") as tmp:
        hf = None
        if p.hf:
            log("  loading the HF model")
            hf = load_hf(model, Path(tmp))
            hf_generate(hf, [pr[:16] for pr in prompts], 2)  # warm-up
        for rep in range(1, p.decode_reps + 1):
            runs.append(engine_decode(model, name, p, prompts))
            log(f"  decode rep {rep}/{p.decode_reps}: engine "
                f"{generated / runs[-1].wall_s:.1f} tok/s")
            if hf is not None:
                hf_runs.append(HFRun(*hf_generate(hf, prompts, p.decode_new_tokens)))
                log(f"  decode rep {rep}/{p.decode_reps}: HF "
                    f"{generated / hf_runs[-1].wall_s:.1f} tok/s")
    return runs, hf_runs


def bench_decode(model: CausalLM, name: str, p: Params) -> dict:
    """`throughput_vs_hf` compares steady decode throughput, once every request is decoding
    (after the prompts' prefill, which both sides do alike); `throughput_vs_hf_end_to_end` is
    the ratio of whole runs, prefill included."""
    rng = random.Random(p.seed + 3)
    prompts = [random_tokens(rng, p.decode_prompt_tokens) for _ in range(p.decode_requests)]
    generated = p.decode_requests * p.decode_new_tokens
    runs, hf_runs = timed_decode_runs(model, name, p, prompts)
    wall = statistics.median(r.wall_s for r in runs)
    steady = [r.decode_tok_s for r in runs if r.decode_tok_s]
    out: dict = {
        "decode_generated_tokens": generated,
        "decode_wall_s": round(wall, 4),
        "decode_tok_s": round(generated / wall, 2),
        "decode_steady_tok_s": round(statistics.median(steady), 2) if steady else None,
        "decode_samples_tok_s": [round(generated / r.wall_s, 2) for r in runs],
    }
    if not hf_runs:
        return out | {"hf_decode_tok_s": None, "throughput_vs_hf": None, "greedy_match_frac": None,
                      "greedy_exact_requests": None, "hf_skipped_reason": "disabled (--no-hf)"}
    hf_wall = statistics.median(r.wall_s for r in hf_runs)
    hf_rates = [r.steady_tok_s for r in hf_runs if r.steady_tok_s]
    hf_steady = statistics.median(hf_rates) if hf_rates else None
    ours_steady = out["decode_steady_tok_s"]
    frac, exact = agreement(runs[0].tokens, hf_runs[0].tokens, p.decode_new_tokens)
    return out | {
        "hf_decode_wall_s": round(hf_wall, 4),
        "hf_decode_tok_s": round(generated / hf_wall, 2),
        "hf_decode_steady_tok_s": rounded(hf_steady, 2),
        "hf_decode_samples_tok_s": [round(generated / r.wall_s, 2) for r in hf_runs],
        "throughput_vs_hf": (round(ours_steady / hf_steady, 4)
                             if ours_steady and hf_steady else None),
        "throughput_vs_hf_end_to_end": round(hf_wall / wall, 4),
        "greedy_match_frac": round(frac, 4),
        "greedy_exact_requests": exact,
    }
