"""What limits an eviction policy on the conversation trace (issue 30): an oracle and rankings
by block classes beside prefixcache_bench/sim/eviction.py's policies, on the same pooled cache
of 512-token blocks.

    python -m prefixcache_bench.sim.eviction_limits [--json PATH] [--capacities 8M] [--no-search]

- `oracle_dead_<X>s`: LRU that is told, X seconds after a block's last use, that the block is
  dead (never used again; known from the future): from then it goes before every live block.
  How soon dead blocks must be spotted for LRU to reach Belady.
- `use_classes_best`: the best ranking by recency and use count alone: a block is in class
  min(uses, 4), ranked by last use + offset[class] (per-class LRU lists: frequency is one such
  ranking, b * log2(1 + uses) its offsets), the offsets searched (coordinate descent, steps
  200/100/50 s) for the highest hit ratio on the trace itself: optimistic for any online
  ranking by these two features, since it is fitted to the very trace it is scored on.
- `use_classes_turn_gap`: the same with a block first seen in a request split further by that
  request's turn gap (seconds since its conversation's previous turn: none, < 60, 60-180,
  180+), to test whether the conversation's pace tells a dead tail from a live one.
- `use_classes_turn_size`: the same with classes by uses and by the size of the turn that last
  used the block (by_uses_and_turn_size: a turn adding at most 5 new blocks is a chat's next
  turn, and its blocks are used again about twice as often as a long turn's), a prompt's
  partial last block apart. The best ranking found.
- `learned_turn_size`: those classes with offsets learned online (LearnedOffsets: kappa x the
  mean reuse gap x the class's observed share of uses followed by another), nothing fitted to
  the trace but kappa; also run on eviction.py's other workloads beside LRU.

A request's hit is its leading run of cached blocks, as in eviction.py; ties (the blocks of one
request) leave deepest first.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path

from prefixcache_bench.harness import Goal, columns_table, log, machine_info, report
from prefixcache_bench.sim.eviction import (CAPACITIES, TRACE, hit_tokens, leading_hits,
                                            load_trace, parse_tokens, run_belady, run_online,
                                            workloads)
from prefixcache_bench.sim.trace import BLOCK_TOKENS, TraceRequest

DELAYS = (0, 60, 120, 180, 240, 300)  # seconds after a block's last use the oracle tells
USE_CLASSES = 4  # uses 1, 2, 3, 4+
SHORT_TURN = 5  # blocks a request adds at most to count as a short turn
# A block's class: (uses so far, index of its request in the trace, depth in it) -> a key.
Classify = Callable[[int, int, int], Hashable]


def next_uses(requests: Sequence[TraceRequest]) -> list[list[bool]]:
    """For each request, for each of its blocks: whether a later request uses the block."""
    seen: set[int] = set()
    out: list[list[bool]] = [[] for _ in requests]
    for i in range(len(requests) - 1, -1, -1):
        blocks = requests[i].hash_ids
        out[i] = [b in seen for b in blocks]
        seen.update(blocks)
    return out


def run_oracle_dead(requests: Sequence[TraceRequest], capacity: int, delay: float,
                    used_again: list[list[bool]]) -> float:
    """Hit ratio of LRU whose blocks, once idle `delay` seconds after a use that is their last,
    go before every other block (the oldest of them first); before that they rank by LRU."""
    live: OrderedDict[int, float] = OrderedDict()  # block -> last use, least recent first
    dead: OrderedDict[int, float] = OrderedDict()  # blocks used for the last time
    hits = total = 0
    for i, req in enumerate(requests):
        now, blocks = req.arrival_s, req.hash_ids
        hits += hit_tokens(req, _leading(live, dead, blocks))
        total += req.input_length
        for b in blocks:
            live.pop(b, None)
            dead.pop(b, None)
        for depth in range(len(blocks) - 1, -1, -1):  # deepest first: a chain leaves from its tail
            while len(live) + len(dead) >= capacity:
                _drop_one(live, dead, now - delay)
            (live if used_again[i][depth] else dead)[blocks[depth]] = now
    return hits / total if total else 0.0


def _leading(live: dict, dead: dict, blocks: Sequence[int]) -> int:
    d = 0
    while d < len(blocks) and (blocks[d] in live or blocks[d] in dead):
        d += 1
    return d


def _drop_one(live: OrderedDict, dead: OrderedDict, spotted_before: float) -> None:
    """A dead block idle since before `spotted_before` if any, else the least recent block."""
    oldest_dead = next(iter(dead.items()), None)
    if oldest_dead and oldest_dead[1] <= spotted_before:
        dead.popitem(last=False)
        return
    oldest_live = next(iter(live.items()), None)
    if oldest_live is None or (oldest_dead and oldest_dead[1] <= oldest_live[1]):
        dead.popitem(last=False)
    else:
        live.popitem(last=False)


class LearnedOffsets:
    """Offsets learned online: offset[class] = kappa x the mean reuse gap x the share of the
    class's uses followed by another use (so far). A class's rank thus grows with how likely
    its blocks are to be used again; kappa was fitted on the conversation trace (3 to 6 moved
    8M by 0.002)."""

    def __init__(self, kappa: float = 4.0):
        self.kappa = kappa
        self.entered: dict[Hashable, int] = {}
        self.reused: dict[Hashable, int] = {}
        self.gap_sum, self.gaps = 0.0, 0
        self._cache: dict[Hashable, float] = {}

    def __getitem__(self, cls: Hashable) -> float:
        offset = self._cache.get(cls)
        if offset is None:
            share = self.reused.get(cls, 0) / self.entered[cls] if self.entered.get(cls) else 0.0
            offset = self._cache[cls] = self.kappa * self.gap_sum / max(1, self.gaps) * share
        return offset

    def used(self, cls: Hashable, previous: Hashable | None, gap: float) -> None:
        """A block enters `cls`, from `previous` (its class at its last use, if any) `gap`
        seconds after that use."""
        self.entered[cls] = self.entered.get(cls, 0) + 1
        if previous is not None:
            self.reused[previous] = self.reused.get(previous, 0) + 1
            self.gap_sum += gap
            self.gaps += 1
        self._cache.clear()


def run_classes(requests: Sequence[TraceRequest], capacity: int, offsets,
                classify: Classify) -> float:
    """Hit ratio of the ranking last use + offsets[class] (a dict, or LearnedOffsets): one LRU
    list per class, the victim the class head with the smallest rank (O(classes) per
    eviction)."""
    lists: dict[Hashable, OrderedDict[int, float]] = {}
    where: dict[int, Hashable] = {}
    last: dict[int, tuple[float, Hashable]] = {}  # every block seen: last use, class then
    uses: dict[int, int] = {}
    learn = offsets.used if isinstance(offsets, LearnedOffsets) else None
    hits = total = 0
    for i, req in enumerate(requests):
        now, blocks = req.arrival_s, req.hash_ids
        hits += hit_tokens(req, leading_hits(where, blocks))
        total += req.input_length
        for depth in range(len(blocks) - 1, -1, -1):  # deepest first: a chain leaves from its tail
            b = blocks[depth]
            held = where.pop(b, None)
            if held is not None:
                del lists[held][b]
            else:
                while len(where) >= capacity:
                    victim = min((c for c, lst in lists.items() if lst),
                                 key=lambda c: lists[c][next(iter(lists[c]))] + offsets[c])
                    where.pop(lists[victim].popitem(last=False)[0])
            uses[b] = uses.get(b, 0) + 1
            cls = classify(uses[b], i, depth)
            if learn:
                at, was = last.get(b, (now, None))
                learn(cls, was, now - at)
            last[b] = (now, cls)
            lists.setdefault(cls, OrderedDict())[b] = now
            where[b] = cls
    return hits / total if total else 0.0


def by_uses(uses: int, _request: int, _depth: int) -> int:
    return min(uses, USE_CLASSES)


def turn_gaps(requests: Sequence[TraceRequest]) -> list[int]:
    """Per request, its conversation's pace: 0 for a first turn (no block past the first seen
    before), else the seconds since the last use of its deepest block seen before, bucketed
    1 (< 60 s), 2 (60-180 s), 3 (180 s and more)."""
    last: dict[int, float] = {}
    out = []
    for req in requests:
        gap = None
        for depth, b in enumerate(req.hash_ids):
            if depth and b in last:
                gap = req.arrival_s - last[b]
        out.append(0 if gap is None else 1 if gap < 60 else 2 if gap < 180 else 3)
        for b in req.hash_ids:
            last[b] = req.arrival_s
    return out


def by_uses_and_turn_gap(gaps: list[int]) -> Classify:
    return lambda uses, request, _: (1, gaps[request]) if uses == 1 else (min(uses, USE_CLASSES), 0)


def turn_sizes(requests: Sequence[TraceRequest]) -> list[tuple[int, int]]:
    """Per request: (blocks no earlier request had, blocks some earlier request had)."""
    seen: set[int] = set()
    out = []
    for req in requests:
        new = sum(b not in seen for b in req.hash_ids)
        out.append((new, len(req.hash_ids) - new))
        seen.update(req.hash_ids)
    return out


def by_uses_and_turn_size(requests: Sequence[TraceRequest]) -> Classify:
    """Classes by uses (1, 2, 3, 4+) and the size of the turn that last used the block: short
    (it added at most SHORT_TURN blocks: a chat's next turn, or a short first prompt) or long.
    A block first seen in a long turn is split by that turn's kind: a first turn (it shared at
    most the first block, a system prompt) or a later one. A prompt's last, partial block
    first seen is its own class (the next turn re-hashes it: rarely used again)."""
    sizes = turn_sizes(requests)
    partial = [r.input_length < len(r.hash_ids) * BLOCK_TOKENS for r in requests]

    def classify(uses: int, request: int, depth: int) -> Hashable:
        new, old = sizes[request]
        short = new <= SHORT_TURN
        if uses > 1:
            return (min(uses, USE_CLASSES), "short" if short else "long")
        if partial[request] and depth == len(requests[request].hash_ids) - 1:
            return (1, "partial tail")
        return (1, "short" if short else "long first" if old <= 1 else "long later")
    return classify


def best_offsets(requests: Sequence[TraceRequest], capacity: int, offsets: dict,
                 classify: Classify) -> tuple[float, dict, int]:
    """Coordinate descent over the offsets (seconds) from `offsets`: (best hit ratio, its
    offsets, runs made)."""
    best, runs = run_classes(requests, capacity, offsets, classify), 1
    for step in (200, 100, 50):
        improved = True
        while improved:
            improved = False
            for cls in list(offsets):
                for delta in (step, -step):
                    trial = {**offsets, cls: offsets[cls] + delta}
                    hit, runs = run_classes(requests, capacity, trial, classify), runs + 1
                    if hit > best + 1e-4:
                        best, offsets, improved = hit, trial, True
                        break
    return best, offsets, runs


def measure(requests: Sequence[TraceRequest], cap_text: str, search: bool = True) -> list[dict]:
    """The rows at one pooled capacity: belady, lru, frequency, the oracles, the learned
    ranking, and the class searches if `search` (minutes each)."""
    blocks = max(1, parse_tokens(cap_text) // BLOCK_TOKENS)
    rows: list[dict] = []

    def row(policy: str, hit: float, start: float, **extra) -> None:
        rows.append({"capacity": cap_text, "policy": policy, "hit_ratio": round(hit, 4),
                     "of_belady": round(hit / rows[0]["hit_ratio"], 3) if rows else 1.0,
                     "seconds": round(time.perf_counter() - start, 2), **extra})
        log(f"{cap_text} {policy}: hit {hit:.4f}")

    start = time.perf_counter()
    row("belady", run_belady(requests, blocks).hit_ratio, start)
    for policy in ("lru", "frequency"):
        start = time.perf_counter()
        row(policy, run_online(requests, blocks, policy).hit_ratio, start)
    used_again = next_uses(requests)
    for delay in DELAYS:
        start = time.perf_counter()
        row(f"oracle_dead_{delay}s", run_oracle_dead(requests, blocks, delay, used_again), start)
    searches = {"use_classes_best": ({c: 200 * c for c in range(1, USE_CLASSES + 1)}, by_uses)}
    gaps = turn_gaps(requests)
    searches["use_classes_turn_gap"] = (
        {**{(1, g): 200 for g in range(4)},
         **{(c, 0): 200 * c for c in range(2, USE_CLASSES + 1)}}, by_uses_and_turn_gap(gaps))
    searches["use_classes_turn_size"] = (
        {**{(1, kind): 200 for kind in ("short", "long first", "long later", "partial tail")},
         **{(c, kind): 200 * c for c in range(2, USE_CLASSES + 1) for kind in ("short", "long")}},
        by_uses_and_turn_size(requests))
    start = time.perf_counter()
    row("learned_turn_size", run_classes(requests, blocks, LearnedOffsets(),
                                         by_uses_and_turn_size(requests)), start)
    for name, (start_offsets, classify) in (searches.items() if search else ()):
        start = time.perf_counter()
        hit, offsets, runs = best_offsets(requests, blocks, start_offsets, classify)
        row(name, hit, start, offsets={str(k): v for k, v in offsets.items()}, runs=runs)
    return rows


def other_workloads() -> list[dict]:
    """The learned turn-size ranking beside LRU and frequency on eviction.py's other workloads,
    at their capacities: whether it could stand alone (issue 30 asks for no workload more than
    a point below LRU)."""
    rows = []
    for name, requests in workloads(TRACE).items():
        if name == "conversation":
            continue
        for cap_text in CAPACITIES[name].split(","):
            blocks = max(1, parse_tokens(cap_text) // BLOCK_TOKENS)
            lru = run_online(requests, blocks, "lru").hit_ratio
            learned = run_classes(requests, blocks, LearnedOffsets(),
                                  by_uses_and_turn_size(requests))
            rows.append({"workload": name, "capacity": cap_text, "lru": round(lru, 4),
                         "frequency": round(run_online(requests, blocks, "frequency").hit_ratio, 4),
                         "learned_turn_size": round(learned, 4),
                         "learned_minus_lru_points": round(100 * (learned - lru), 2)})
            log(f"{name} {cap_text}: lru {lru:.4f} learned {learned:.4f}")
    return rows


def headline(rows: list[dict]) -> dict:
    at = {(r["capacity"], r["policy"]): r["of_belady"] for r in rows}
    out = {}
    for (cap, policy), of in at.items():
        if policy in ("frequency", "use_classes_best", "use_classes_turn_gap", "oracle_dead_120s",
                      "use_classes_turn_size", "learned_turn_size"):
            out[f"conversation_{cap}_{policy}_of_belady"] = of
    return out


# No goals: these are experiments on what a policy could reach (issue 30's goals are judged in
# eviction.py's figures).
GOALS: dict[str, Goal] = {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixcache_bench.sim.eviction_limits",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--capacities", default="8M", help="pooled tokens, comma separated")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--no-search", action="store_true", help="leave out the fitted rankings "
                   "(the offset searches: minutes each)")
    args = p.parse_args(argv)
    machine = machine_info()
    requests = load_trace(args.trace)
    rows = [r for cap in args.capacities.split(",")
            for r in measure(requests, cap, not args.no_search)]
    print(columns_table(["capacity", "policy", "hit ratio", "of Belady", "s"],
                        [[r["capacity"], r["policy"], r["hit_ratio"], r["of_belady"],
                          r["seconds"]] for r in rows]))
    others = other_workloads()
    print(columns_table(["workload", "capacity", "lru", "frequency", "learned", "minus lru"],
                        [list(r.values()) for r in others]))
    results = {**headline(rows), "rows": rows, "other_workloads": others}
    command = "python -m prefixcache_bench.sim.eviction_limits" + (
        " " + " ".join(argv) if argv else "")
    report(results, GOALS, "what limits eviction on the conversation trace", command, machine,
           str(args.json) if args.json else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
