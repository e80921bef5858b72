"""The balanced hit ceiling: the best hit ratio any routing can reach while keeping prefill balanced.

    python -m prefixcache_bench.sim.copy_bound --trace T.jsonl [--workers 8] [--imbalance 1.1] [--json OUT]
        [--results SIMULATE.json]

The pooled bound of prefixcache_bench.sim.simulate asks nothing of balance. On a trace whose prompts share a
few prefixes (RL rollouts: a few-shot header plus a new task, prefixcache_bench.sim.trace --synth rollout), a
router that sends every prompt to the one worker holding its header computes each header once
and hits the pooled bound, but then each worker's share of the work is its headers' share of the
traffic. Balance needs some headers on more than one worker, and each extra holder computes the
header again. This module computes the fewest such tokens that any placement needs to keep
max / mean prefill per worker <= --imbalance, and so the highest hit ratio a balanced router can
reach on the trace. With --results (a prefixcache_bench.sim.simulate --json file), it puts each policy's hit
ratio, imbalance and duplicated tokens beside it.

The model (a relaxation, so the ceiling is an upper bound for every policy):
- Each prompt is one shared prefix (its *anchor*: the longest run of leading blocks it shares
  with another distinct prompt of the trace) plus a rest no other prompt has. Traces with nested
  prefixes (conversations, whose turns extend each other) do not fit and are refused.
- Work that is not an anchor is counted as in one pooled, unbounded cache (the least any routing
  computes), and an anchor's work may be split in any proportion among the workers holding it.
- Each worker holding an anchor computes it once. Any other waste (a burst split over two
  workers, an eviction) is allowed on any worker, counts as duplicated, and may only raise the
  mean: a placement cannot buy balance with waste more cheaply than the bound says.
- Minimise anchor copies + waste subject to every worker <= imbalance x mean: a small
  mixed-integer program (anchors x workers binaries), solved exactly with scipy's HiGHS.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from prefixcache_bench.sim.trace import BLOCK_TOKENS, TraceRequest, load_trace


@dataclass(slots=True)
class Anchor:
    blocks: tuple[int, ...]
    tokens: int  # computed once per worker that holds it
    work_tokens: int  # the rest of its prompts, as one pooled cache computes it
    prompts: int  # distinct prompts that extend it


@dataclass(slots=True)
class CopyBound:
    workers: int
    imbalance: float
    prompt_tokens: int
    # Prompt tokens one pooled, unbounded cache computes (every page once): the unbalanced floor.
    pooled_computed_tokens: int
    # The fewest tokens computed again (anchor copies + waste) by any placement within imbalance.
    min_duplicate_tokens: int
    anchors: list[Anchor] = field(default_factory=list)

    @property
    def pooled_hit_ratio(self) -> float:
        return 1.0 - self.pooled_computed_tokens / self.prompt_tokens

    @property
    def ceiling_hit_ratio(self) -> float:
        return 1.0 - (self.pooled_computed_tokens + self.min_duplicate_tokens) / self.prompt_tokens


def anchors_of(requests: Sequence[TraceRequest], page: int = 16,
               block_tokens: int = BLOCK_TOKENS) -> tuple[list[Anchor], int, int]:
    """(the anchors with their work, prompt tokens, tokens one pooled unbounded cache computes).

    Raises ValueError when the trace's prompts are not one shared prefix plus a unique rest.
    """
    if block_tokens % page:
        raise ValueError(f"page {page} must divide the block of {block_tokens} tokens")
    distinct = {(r.input_length, r.hash_ids) for r in requests}
    sharing: dict[tuple[int, ...], int] = defaultdict(int)  # block prefix -> distinct prompts with it
    for _, ids in distinct:
        for k in range(1, len(ids) + 1):
            sharing[ids[:k]] += 1

    def anchor_blocks(ids: tuple[int, ...]) -> int:
        k = 0
        while k < len(ids) and sharing[ids[:k + 1]] >= 2:
            k += 1
        return k

    anchor_of = {ids: ids[:anchor_blocks(ids)] for _, ids in distinct}
    keys = set(anchor_of.values())
    for length, ids in distinct:
        k = len(anchor_of[ids])
        if k * block_tokens >= length:
            raise ValueError(f"a prompt of {length} tokens is all shared prefix (blocks {list(ids[:3])}...): "
                             "prompts extend each other, which this bound does not model")
        if any(ids[:j] in keys for j in range(1, k)):
            raise ValueError("nested shared prefixes (a prompt's shared prefix extends another one's), "
                             "as in conversations: this bound models one shared prefix per prompt")
    anchors = {key: Anchor(key, len(key) * block_tokens, 0, 0) for key in keys}
    for _, ids in distinct:
        anchors[anchor_of[ids]].prompts += 1
    seen: set[tuple[tuple[int, ...], int]] = set()
    prompt_tokens = computed = 0
    for req in requests:
        ids = req.hash_ids
        pages = req.input_length // page
        # A full page is named by the blocks up to and including the one it lies in.
        names = [(ids[:j * page // block_tokens + 1], j) for j in range(pages)]
        hit = 0
        while hit < pages and names[hit] in seen:
            hit += 1
        seen.update(names)
        a = anchors[anchor_of[ids]]
        a.work_tokens += req.input_length - max(hit, a.tokens // page) * page
        prompt_tokens += req.input_length
        computed += req.input_length - hit * page
    return sorted(anchors.values(), key=lambda a: a.blocks), prompt_tokens, computed


def min_duplicates(anchors: Sequence[Anchor], workers: int, imbalance: float,
                   time_limit_s: float = 120.0) -> int:
    """The fewest tokens computed again so that max / mean per worker <= imbalance (see the
    module docstring for the model)."""
    try:
        import numpy as np
        from scipy.optimize import Bounds, LinearConstraint, milp
    except ImportError as exc:  # scipy is a dev extra, not a serving dependency
        raise RuntimeError("the copy bound needs scipy: pip install scipy (or the dev extra)") from exc
    if workers < 1 or imbalance < 1.0:
        raise ValueError(f"need workers >= 1 and imbalance >= 1, got {workers} and {imbalance}")
    n, m = len(anchors), workers
    # Variables: y[a, w] (a holds w: binary), x[a, w] (a's work on w), e[w] (waste on w).
    ny = n * m
    nv = 2 * ny + m
    y = lambda a, w: a * m + w  # noqa: E731
    x = lambda a, w: ny + a * m + w  # noqa: E731
    cost = np.zeros(nv)
    rows, lo, hi = [], [], []

    def row(entries: dict[int, float], low: float, high: float) -> None:
        r = np.zeros(nv)
        for i, v in entries.items():
            r[i] += v
        rows.append(r)
        lo.append(low)
        hi.append(high)

    for a, anc in enumerate(anchors):
        for w in range(m):
            cost[y(a, w)] = anc.tokens
            row({x(a, w): 1.0, y(a, w): -float(anc.work_tokens)}, -np.inf, 0.0)  # work only where held
        row({x(a, w): 1.0 for w in range(m)}, anc.work_tokens, anc.work_tokens)
        row({y(a, w): 1.0 for w in range(m)}, 1.0, np.inf)
    cost[2 * ny:] = 1.0
    total_work = float(sum(anc.work_tokens for anc in anchors))
    for w in range(m):  # load_w <= imbalance x (work + anchors held + waste) / workers
        entries: dict[int, float] = defaultdict(float)
        for a, anc in enumerate(anchors):
            entries[x(a, w)] += 1.0
            entries[y(a, w)] += anc.tokens
            for v in range(m):
                entries[y(a, v)] -= imbalance * anc.tokens / m
        entries[2 * ny + w] += 1.0
        for v in range(m):
            entries[2 * ny + v] -= imbalance / m
        row(entries, -np.inf, imbalance * total_work / m)
    upper = np.r_[np.ones(ny), np.full(ny + m, np.inf)]
    res = milp(cost, constraints=LinearConstraint(np.array(rows), lo, hi),
               integrality=np.r_[np.ones(ny), np.zeros(ny + m)], bounds=Bounds(np.zeros(nv), upper),
               options={"time_limit": time_limit_s})
    if res.x is None:
        raise RuntimeError(f"the copy bound's program did not solve: {res.message}")
    if res.status != 0:  # a time limit: res.fun is a feasible placement, not the optimum
        raise RuntimeError(f"the copy bound's program stopped before optimality: {res.message}")
    return round(res.fun - sum(anc.tokens for anc in anchors))


def copy_bound(requests: Sequence[TraceRequest], workers: int, imbalance: float, page: int = 16) -> CopyBound:
    anchors, prompt_tokens, computed = anchors_of(requests, page)
    return CopyBound(workers, imbalance, prompt_tokens, computed, min_duplicates(anchors, workers, imbalance),
                     anchors)


def _report(bound: CopyBound, results: dict | None) -> str:
    lines = [f"{bound.workers} workers, imbalance <= {bound.imbalance}: {len(bound.anchors)} shared prefixes",
             f"pooled hit ratio (no balance asked): {bound.pooled_hit_ratio:.4f}",
             f"fewest tokens computed again to stay balanced: {bound.min_duplicate_tokens:,}",
             f"balanced hit ceiling: {bound.ceiling_hit_ratio:.4f}"]
    if results:
        lines.append(f"{'policy':14} {'hit':>7} {'imbal':>6} {'duplicated tokens':>18}  vs ceiling")
        for name, p in results["policies"].items():
            dup = sum(p["computed_prefill_tokens_per_worker"]) - bound.pooled_computed_tokens
            lines.append(f"{name:14} {p['hit_ratio']:7.4f} {p['imbalance']:6.3f} {dup:18,}  "
                         f"{(p['hit_ratio'] - bound.ceiling_hit_ratio) * 1e4:+.1f} bp")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixcache_bench.sim.copy_bound", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", required=True, help="Mooncake-format .jsonl trace")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--imbalance", type=float, default=1.1,
                   help="max / mean prefill tokens per worker allowed")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-requests", type=int)
    p.add_argument("--results", help="a prefixcache_bench.sim.simulate --json file of the same trace, to compare against")
    p.add_argument("--json", help="write the bound here")
    args = p.parse_args(argv)
    try:
        bound = copy_bound(load_trace(args.trace, args.max_requests), args.workers,
                           args.imbalance, args.page_size)
    except (ValueError, RuntimeError) as exc:
        print(f"copy_bound: {exc}", file=sys.stderr)
        return 2
    results = None
    if args.results:
        with open(args.results, encoding="utf-8") as f:
            results = json.load(f)
    print(_report(bound, results))
    if args.json:
        out = asdict(bound) | {"pooled_hit_ratio": bound.pooled_hit_ratio,
                               "ceiling_hit_ratio": bound.ceiling_hit_ratio}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
