"""Mean TTFT of N samples of one prompt on the engine, twins off and on (Scheduler.twins).

    .venv/bin/python -m prefixcache_bench.compute.twin_ttft [--preset small-transformer] [--samples 8] [--prompt 1000]

CPU, one thread, the in-process cache service; rounds alternate off/on and each prints the
median (nearest rank) over --reps runs, so the two settings see the same machine.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from cache_service.core import CacheCore
from compute_service.engine import Engine, EngineConfig, SamplingParams
from compute_service.model import ByteTokenizer, build_preset
from prefixcache_bench.harness import percentile


def group_ttft(model, twins: bool, samples: int, prompt_len: int, reps: int) -> float:
    means = []
    for rep in range(reps):
        eng = Engine(model, ByteTokenizer(), CacheCore(), EngineConfig(
            page_size=16, device_pages=1024, token_budget=2048, max_running=max(16, samples),
            model_id="m", twin_first_tokens=twins))
        prompt = [(7 * i + rep) % 250 + 1 for i in range(prompt_len)]  # a fresh prompt per run
        outs: list[list] = [[] for _ in range(samples)]
        for out in outs:
            eng.submit(prompt, SamplingParams(max_tokens=4, ignore_eos=True), out.append)
        eng.run_until_idle()
        means.append(statistics.mean(out[-1].stats.ttft_s for out in outs))
    return percentile(means, 0.5)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small-transformer")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt", type=int, default=1000, help="prompt tokens")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    model = build_preset(args.preset, seed=0)
    for _ in range(args.rounds):
        off = group_ttft(model, False, args.samples, args.prompt, args.reps)
        on = group_ttft(model, True, args.samples, args.prompt, args.reps)
        print(f"{args.samples} samples of a {args.prompt}-token prompt ({args.preset}): mean TTFT "
              f"{off * 1e3:.0f} ms without twins, {on * 1e3:.0f} ms with them ({on / off:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
