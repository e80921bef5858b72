"""The routing goals on synthetic traces over many seeds, with the balanced hit ceiling.

    .venv/bin/python -m prefixcache_bench.sim.seeds [--rollout-seeds 0-11] [--chat-seeds 0-5] \\
        [--out docs/results/gateway/synthetic_seeds.txt] [--jobs 2] [--requests 4000]

For each seed: python -m prefixcache_bench.sim.trace --synth KIND --seed S (4000 requests), then
python -m prefixcache_bench.sim.simulate --workers 8 --capacity-tokens 1000000 --policy all on it. For rollout
traces also prefixcache_bench.sim.copy_bound: the highest hit ratio any routing can reach while keeping
max / mean prefill <= 1.1. Prints one row per trace: affinity's figures, the best baseline's, the
ceiling, and the goals that fail.
"""
from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from contextlib import redirect_stdout
from pathlib import Path

from prefixcache_bench.sim.copy_bound import copy_bound
from prefixcache_bench.sim.simulate import main as simulate
from prefixcache_bench.sim.trace import load_trace, write_synthetic
from prefixcache_bench.harness import log

BASELINES = ("round_robin", "least_loaded", "sglang")


def _seeds(spec: str) -> list[int]:
    if not spec:
        return []
    lo, _, hi = spec.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def run_one(kind: str, seed: int, workdir: str, requests: int = 4000) -> dict:
    trace, out = Path(workdir) / f"{kind}_{seed}.jsonl", Path(workdir) / f"{kind}_{seed}.json"
    write_synthetic(kind, trace, requests, seed)
    with redirect_stdout(io.StringIO()):
        simulate(["--trace", str(trace), "--workers", "8", "--capacity-tokens", "1000000", "--policy", "all",
                  "--json", str(out), "--quiet"])
    result = json.loads(out.read_text())
    pol = result["policies"]
    row = {"kind": kind, "seed": seed, "affinity": pol["affinity"], "goals": result["goals"],
           "best_hit": max(BASELINES, key=lambda n: pol[n]["hit_ratio"]),
           "best_ttft": min(BASELINES, key=lambda n: pol[n]["mean_ttft_s"]), "policies": pol}
    if kind == "rollout":
        bound = copy_bound(load_trace(trace), 8, 1.1)
        row["ceiling"] = bound.ceiling_hit_ratio
        row["dup"] = {n: sum(p["computed_prefill_tokens_per_worker"]) - bound.pooled_computed_tokens
                      for n, p in pol.items()}
        row["min_dup"] = bound.min_duplicate_tokens
    return row


def _fails(g: dict) -> str:
    names = (("hit_vs_bound_ok", "bound"), ("imbalance_ok", "imbal"), ("beats_baselines_hit", "hit"),
             ("beats_baselines_ttft", "ttft"))
    bad = [name for key, name in names if not g[key]]
    return "-".join(bad) or "ok"


def render(rows: list[dict]) -> str:
    lines = [f"{'trace':8}{'seed':>5} | {'affinity: hit':>13}{'imbal':>7}{'TTFT':>8} | "
             f"{'best base hit':>20}{'best base TTFT':>22} | "
             f"{'ceiling':>7}{'dup: aff':>10}{'sglang':>8}{'min':>7} | goals"]
    for r in rows:
        a, pol = r["affinity"], r["policies"]
        ceiling = (f"{r['ceiling']:7.4f}{r['dup']['affinity']:10,}{r['dup']['sglang']:8,}{r['min_dup']:7,}"
                   if "ceiling" in r else f"{'':7}{'':10}{'':8}{'':7}")
        lines.append(f"{r['kind']:8}{r['seed']:>5} | {a['hit_ratio']:13.4f}{a['imbalance']:7.3f}"
                     f"{a['mean_ttft_s']:7.3f}s | {pol[r['best_hit']]['hit_ratio']:7.4f} {r['best_hit']:<12}"
                     f"{pol[r['best_ttft']]['mean_ttft_s']:8.4f}s {r['best_ttft']:<12} | {ceiling} | "
                     f"{_fails(r['goals'])}")
    ok = sum(_fails(r["goals"]) == "ok" for r in rows)
    lines.append(f"all goals: {ok} of {len(rows)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rollout-seeds", default="0-11", help="a seed or a range, e.g. 0-11; empty for none")
    p.add_argument("--chat-seeds", default="0-5")
    p.add_argument("--requests", type=int, default=4000, help="requests per trace")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", help="also write the table here")
    args = p.parse_args(argv)
    jobs = ([("rollout", s) for s in _seeds(args.rollout_seeds)]
            + [("chat", s) for s in _seeds(args.chat_seeds)])
    rows = []
    # Spawned, not forked, as the fleet benches' processes: a fork of a process whose other
    # threads run gRPC or an event loop (a test worker's) segfaulted in the child (CI, stop 53).
    spawn = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(args.jobs, spawn) as pool:
        futures = [pool.submit(run_one, kind, seed, tmp, args.requests) for kind, seed in jobs]
        for i, fut in enumerate(futures, 1):
            rows.append(fut.result())
            row = rows[-1]
            log(f"[{i}/{len(jobs)}] {row['kind']} seed {row['seed']}: {_fails(row['goals'])}")
    text = render(rows)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
