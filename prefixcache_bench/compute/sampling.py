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

import sys

import torch

from compute_service.engine import SamplingParams
from compute_service.engine.logits_ops import TokenHistory
from compute_service.engine.sampling import sample_batch
from compute_service.model import ByteTokenizer
from compute_service.model.model import CausalLM
from prefixcache_bench.compute.decode_modes import (arguments, build, decode_tok_s, in_rotation,
                                                    median_ms, rates_and_ratios, set_threads)
from prefixcache_bench.harness import Goal, machine_info, report

PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                 logit_bias={5: 2.0, 17: -3.0, 99: 1.0})
MODES = {"plain": {}, "logprobs": {"logprobs": 5}, "penalties": PENALTIES,
         "logprobs_and_penalties": {"logprobs": 5, **PENALTIES}}
GOALS = {"logprobs_ratio": Goal(">=", 0.9), "penalties_ratio": Goal(">=", 0.9)}


def mode_tok_s(model: CausalLM, extra: dict, batch: int, tokens: int, rep: int) -> float:
    """Greedy requests of `tokens` outputs (ignore_eos) in one sampling mode."""
    rate, outs = decode_tok_s(model, ByteTokenizer(), lambda i: SamplingParams(
        max_tokens=tokens, ignore_eos=True, **extra), batch, rep)
    assert all(o.logprobs is not None for out in outs for o in out if o.token_ids) == \
        ("logprobs" in extra)
    return rate


def sampler_ms(vocab: int, batch: int, tokens: int, extra: dict, iters: int = 200) -> float:
    """The sampler alone on one step's logits of `batch` requests (median ms per call over
    5 timings of `iters` calls), histories of a 64-token prompt and `tokens` outputs. Steadier
    than the decode rates on a shared machine: it is the cost they differ by."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, vocab, generator=g)
    params = [SamplingParams(**extra)] * batch
    history = [TokenHistory(torch.randint(0, vocab, (64,), generator=g).tolist()).update(
        torch.randint(0, vocab, (tokens,), generator=g).tolist()) for _ in range(batch)]
    args = (logits, params, [None] * batch, [()] * batch, history)
    return median_ms(lambda: sample_batch(*args), iters, warmup=20)


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__).parse_args(argv)
    threads, why = set_threads(args.threads)
    model = build(args.preset, args.vocab)
    mode_tok_s(model, {}, args.batch, 8, 0)  # warm-up
    runs = in_rotation(list(MODES), args.reps, lambda mode, rep: mode_tok_s(
        model, MODES[mode], args.batch, args.tokens, rep))
    results: dict = rates_and_ratios(runs)
    for m in MODES:
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
