"""The engine's own per-step host time, without a GPU: the gpu_check engine workload (batch 32,
128-token distinct prompts, 64 new greedy tokens) on the dry run's tiny llama with the model's
forward stubbed out (zero logits), so what is timed is the scheduler, the step planner, the
cache calls, the model runner's batch building and sampling, emit and detokenize.

    python -m prefixcache_bench.gpu_check.host_overhead [--reps 9] [--profile]

Prints the median steady milliseconds per step with the prefix cache on and off (and, with
--profile, the top functions of one run of each). NOTES.md in docs/results/gpu records runs.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import statistics

import torch

from prefixcache_bench.gpu_check.models import build
from prefixcache_bench.gpu_check.stage_engine import (_tokens, make_engine, pages_for, run_batch,
                                                      steady_rate)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    from compute_service.model import ForwardOutput

    torch.set_num_threads(1)
    model = build("dry-llama", torch.float32, torch.device("cpu"), seed=1)
    vocab = model.config.vocab_size
    model.forward = lambda ids, pos, fb: ForwardOutput(logits=torch.zeros(fb.batch_size, vocab))
    rng = random.Random(13)
    b, prompt, new = args.batch, 128, 64

    def once(on: bool, prof: cProfile.Profile | None = None) -> float:
        eng = make_engine(model, pages_for(b, prompt + new), max(512, b * prompt), b, on)
        prompts = [_tokens(rng, prompt) for _ in range(b)]
        try:
            if prof:
                prof.enable()
            done, _ = run_batch(eng, prompts, new)
            if prof:
                prof.disable()
        finally:
            eng.close()
        return 1000 * b / steady_rate(done)

    once(True), once(False)
    for on in (True, False):
        ms = [once(on) for _ in range(args.reps)]
        print(f"prefix cache {'on ' if on else 'off'}: {statistics.median(ms):.3f} ms/step "
              f"(median of {args.reps}, min {min(ms):.3f})")
    if args.profile:
        for on in (True, False):
            prof = cProfile.Profile()
            once(on, prof)
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(20)
            print(f"--- prefix cache {'on' if on else 'off'}\n{s.getvalue()}")


if __name__ == "__main__":
    main()
