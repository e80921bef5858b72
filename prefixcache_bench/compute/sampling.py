"""Decode tokens/s with logprobs on, with penalties and logit_bias on, and with both, each over
plain decoding in the same run (compute_service/engine/logits_ops.py: the batched processing).

    .venv/bin/python -m prefixcache_bench.compute.sampling [--preset small-transformer] \\
        [--vocab 32000] [--batch 8] [--tokens 64] [--json docs/results/compute/sampling.json]

The engine on CPU with the in-process cache service, `--batch` greedy requests of `--tokens`
output tokens each (ignore_eos), the preset's model with its vocabulary widened to `--vocab`
(the presets' 512 ids would make per-vocabulary work look free; 32,000 is Llama 2's). Modes run
in rotation, `--reps` times each, so they see the same machine; each mode's figure is the median
(nearest rank) of its runs' decode tokens/s (output tokens after the first, over the time from
the first token to the last); each ratio is the median over reps of the mode's run over the
plain run of the same rep (and `_ratio_of_medians` the ratio of the medians). On a shared
machine those rates move by 10% between runs; `*_sampler_ms_per_step` times the sampler alone
on one step's logits, the steadier figure of what each mode adds.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

from cache_service.core import CacheCore
from compute_service.engine import Engine, EngineConfig, SamplingParams
from compute_service.engine.logits_ops import TokenHistory
from compute_service.engine.sampling import sample_batch
from compute_service.model import ByteTokenizer
from compute_service.model.model import CausalLM
from compute_service.model.presets import init_random_, preset_config
from prefixcache_bench.harness import Goal, choose_threads, machine_info, percentile, report

PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                 logit_bias={5: 2.0, 17: -3.0, 99: 1.0})
MODES = {"plain": {}, "logprobs": {"logprobs": 5}, "penalties": PENALTIES,
         "logprobs_and_penalties": {"logprobs": 5, **PENALTIES}}
GOALS = {"logprobs_ratio": Goal(">=", 0.9), "penalties_ratio": Goal(">=", 0.9)}


def build(preset: str, vocab: int) -> CausalLM:
    cfg = dataclasses.replace(preset_config(preset), vocab_size=vocab).validate()
    return init_random_(CausalLM.empty(cfg, torch.float32, "cpu"), seed=0).eval()


def decode_tok_s(model: CausalLM, extra: dict, batch: int, tokens: int, rep: int) -> float:
    eng = Engine(model, ByteTokenizer(), CacheCore(), EngineConfig(
        page_size=16, device_pages=1024, token_budget=2048, max_running=batch, model_id="m"))
    firsts: list[float] = []
    outs: list[list] = [[] for _ in range(batch)]
    for i, out in enumerate(outs):
        prompt = [(13 * j + 7 * i + rep) % 250 + 1 for j in range(64)]  # distinct prompts
        eng.submit(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True, **extra),
                   out.append)
    # Prefill first (not measured), then the decode steps to the end.
    while not all(out for out in outs):
        eng.step()
    firsts.append(time.perf_counter())
    eng.run_until_idle()
    elapsed = time.perf_counter() - firsts[0]
    decoded = sum(len([t for o in out for t in o.token_ids]) - 1 for out in outs)
    assert all(o.logprobs is not None for out in outs for o in out if o.token_ids) == \
        ("logprobs" in extra)
    return decoded / elapsed


def sampler_ms(vocab: int, batch: int, tokens: int, extra: dict, iters: int = 200) -> float:
    """The sampler alone on one step's logits [batch, vocab]: milliseconds per call (median of
    5 timings of `iters` calls), histories of a 64-token prompt and `tokens` outputs. Steadier
    than the decode rates on a shared machine: it is the cost they differ by."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, vocab, generator=g)
    params = [SamplingParams(**extra)] * batch
    history = [TokenHistory(torch.randint(0, vocab, (64,), generator=g).tolist()).update(
        torch.randint(0, vocab, (tokens,), generator=g).tolist()) for _ in range(batch)]
    args = (logits, params, [None] * batch, [()] * batch, history)
    for _ in range(20):
        sample_batch(*args)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(iters):
            sample_batch(*args)
        times.append((time.perf_counter() - t) / iters * 1e3)
    return percentile(times, 0.5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small-transformer")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    threads, why = choose_threads(args.threads, torch.get_num_threads())
    torch.set_num_threads(threads)
    model = build(args.preset, args.vocab)
    decode_tok_s(model, {}, args.batch, 8, 0)  # warm-up
    runs: dict[str, list[float]] = {m: [] for m in MODES}
    names = list(MODES)
    for rep in range(args.reps):
        # The order rotates, so no mode always runs first (or right after another one).
        for mode in names[rep % len(names):] + names[:rep % len(names)]:
            runs[mode].append(decode_tok_s(model, MODES[mode], args.batch, args.tokens, rep))
    med = {m: percentile(v, 0.5) for m, v in runs.items()}
    results: dict = {f"{m}_decode_tok_s": round(v, 1) for m, v in med.items()}
    for m in names[1:]:
        # Paired: each rep's mode over the plain run of the same rep (a shared machine's load
        # drifts between reps more than within one), the median of those.
        results[f"{m}_ratio"] = round(percentile(
            [x / y for x, y in zip(runs[m], runs["plain"], strict=True)], 0.5), 4)
        results[f"{m}_ratio_of_medians"] = round(med[m] / med["plain"], 4)
    for m in names:
        results[f"{m}_sampler_ms_per_step"] = round(sampler_ms(args.vocab, args.batch,
                                                               args.tokens, MODES[m]), 3)
    results.update(preset=args.preset, vocab=args.vocab, batch=args.batch,
                   output_tokens=args.tokens, reps=args.reps, threads=threads,
                   threads_why=why, runs={m: [round(x, 1) for x in v] for m, v in runs.items()})
    command = "python -m prefixcache_bench.compute.sampling " + " ".join(sys.argv[1:] if argv is None
                                                                          else argv)
    ok = report(results, GOALS, f"decode tokens/s by sampling mode ({args.preset}, vocab "
                f"{args.vocab}, batch {args.batch})", command.strip(),
                machine_info({"torch": torch.__version__}), args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
