"""Eviction policies against the offline optimum, on one pooled cache of whole blocks (issue 30).

    python -m prefixcache_bench.sim.eviction [--json PATH] [--capacities 1M,2M,8M]

A request is its chain of 512-token blocks (a Mooncake trace's hash ids): its hit is the leading
run of blocks the cache holds (prefix semantics), then every block is accessed and the missing
ones are inserted, evicting as the policy says. Policies:

- `lru`: the least recently used block goes first (what the cache service does today).
- `frequency`: key t_last + b*log2(1+k), k = the block's accesses, b = 2 x the mean reuse gap
  seen so far (a block used often survives that many gaps longer than one used once).
- `adaptive`: set dueling between the two: two shadow caches of the same size replay the same
  stream, and the live cache evicts by the key of the one that served more hit tokens over the
  last `window` requests (an exponential average; the other takes over when 5% ahead, and the
  live cache is then re-ordered by its key). Adaptive also spots dead blocks (Stats: a
  prompt's last, partial block goes first once such blocks are seen to be rarely reused).
- `belady`: the offline optimum with bypass (evict the block used again furthest in the future;
  do not insert a block whose next use is later than every resident's). No online policy and no
  routing can beat it; each policy is reported as a fraction of it.

Ties (blocks of one request) break deepest first, so a chain is evicted from its tail.
Workloads: the in-repo conversation trace and synthetic ones (trace.py's chat and rollout, and
an agentic multi-turn one and a many-tenant chat one built here).
"""
from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from prefixcache_bench.harness import Goal, columns_table, log, machine_info, report
from prefixcache_bench.sim.trace import SYNTH_KINDS, BLOCK_TOKENS, TraceRequest, load_trace

TRACE = Path(__file__).resolve().parents[1] / "traces" / "conversation_trace.jsonl"
POLICIES = ("lru", "frequency", "adaptive", "belady")
INF = float("inf")


@dataclass(slots=True)
class Result:
    policy: str
    hit_tokens: int
    prompt_tokens: int
    seconds: float = 0.0

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class KeyedCache:
    """Blocks under a capacity, evicted by the smallest key (a lazily updated min-heap: an entry
    whose block's key changed since is pushed again when it surfaces)."""

    def __init__(self, capacity: int, key: Callable[[int], float]):
        self.capacity, self.key = capacity, key
        self.resident: dict[int, tuple] = {}  # block -> (key, depth) as pushed
        self._heap: list = []
        self._tie = itertools.count()

    def __contains__(self, block: int) -> bool:
        return block in self.resident

    def rekey(self, key: Callable[[int], float]) -> None:
        """Orders every resident block by `key` from now on (the heap is rebuilt)."""
        self.key = key
        blocks = [(b, -entry[1]) for b, entry in self.resident.items()]
        self.resident, self._heap = {}, []
        for b, depth in blocks:
            entry = (key(b), -depth)
            self.resident[b] = entry
            self._heap.append((*entry, next(self._tie), b))
        heapq.heapify(self._heap)

    def push(self, block: int, depth: int) -> None:
        entry = (self.key(block), -depth)
        self.resident[block] = entry
        heapq.heappush(self._heap, (*entry, next(self._tie), block))

    def evict(self) -> None:
        heap = self._heap
        while heap:
            key, neg_depth, _, block = heapq.heappop(heap)
            if self.resident.get(block) != (key, neg_depth):
                continue  # stale: gone, or pushed again with a newer key
            now = self.key(block)
            if now != key:
                self.push(block, -neg_depth)
                continue
            del self.resident[block]
            return

    def access(self, blocks: Sequence[int]) -> None:
        for depth, b in enumerate(blocks):
            if b in self.resident:
                self.push(b, depth)  # its key changed: re-keyed lazily
                continue
            while len(self.resident) >= self.capacity:
                self.evict()
            self.push(b, depth)


class Stats:
    """What the online policies know of a block: last use, accesses, and the mean reuse gap.

    With `spot_dead`, also which blocks are likely dead: a prompt's last, partial block (its
    request's tokens end inside it) is rarely asked again (the next turn's prompt extends it,
    which makes a different block). Once at least DEAD_AFTER such blocks were seen and fewer
    than DEAD_BELOW of them were used again, a block whose last use was as a partial last block
    ranks below every other (the least recent of them first); where they are reused (RL
    rollouts: N samples of one prompt) the rule stays off."""
    DEAD_AFTER, DEAD_BELOW = 200, 0.1

    def __init__(self, spot_dead: bool = False) -> None:
        self.last: dict[int, float] = {}
        self.count: dict[int, int] = {}
        self.gap_sum, self.gaps = 0.0, 0
        self.spot_dead = spot_dead
        self.partial: set[int] = set()  # blocks last used as a partial last block
        self.partials = self.partials_reused = 0

    def see(self, blocks: Sequence[int], now: float, partial_last: bool = False) -> None:
        for b in blocks:
            prev = self.last.get(b)
            if prev is not None:
                self.gap_sum += now - prev
                self.gaps += 1
            self.last[b] = now
            self.count[b] = self.count.get(b, 0) + 1
        if self.spot_dead:
            partial = self.partial
            for b in blocks:
                if b in partial:
                    partial.discard(b)
                    self.partials_reused += 1
            if partial_last and blocks:
                partial.add(blocks[-1])
                self.partials += 1

    def dead(self, b: int) -> bool:
        return (b in self.partial and self.partials >= self.DEAD_AFTER
                and self.partials_reused < self.DEAD_BELOW * self.partials)

    def lru_key(self, b: int) -> float:
        return self.last[b] - (1e12 if self.spot_dead and self.dead(b) else 0.0)

    def frequency_key(self, b: int) -> float:
        if self.spot_dead and self.dead(b):
            return self.last[b] - 1e12
        weight = 2.0 * (self.gap_sum / self.gaps if self.gaps else 0.0)
        return self.last[b] + weight * math.log2(1 + self.count[b])


def leading_hits(cache, blocks: Sequence[int]) -> int:
    d = 0
    while d < len(blocks) and blocks[d] in cache:
        d += 1
    return d


def hit_tokens(req: TraceRequest, blocks_hit: int) -> int:
    return min(blocks_hit * BLOCK_TOKENS, req.input_length)


def run_online(requests: Sequence[TraceRequest], capacity: int, policy: str,
               window: int = 200) -> Result:
    stats = Stats(spot_dead=policy == "adaptive")
    if policy in ("lru", "frequency"):
        cache = KeyedCache(capacity, stats.lru_key if policy == "lru" else stats.frequency_key)
        caches = {policy: cache}
    else:  # adaptive: the live cache plus both shadows
        choice = "lru"
        keys = {"lru": stats.lru_key, "frequency": stats.frequency_key}
        caches = {"lru": KeyedCache(capacity, stats.lru_key),
                  "frequency": KeyedCache(capacity, stats.frequency_key)}
        cache = KeyedCache(capacity, keys[choice])
        score = {"lru": 0.0, "frequency": 0.0}
        decay = 1.0 - 1.0 / window
    hits = total = 0
    for req in requests:
        blocks = req.hash_ids
        hits += hit_tokens(req, leading_hits(cache, blocks))
        total += req.input_length
        stats.see(blocks, req.arrival_s, req.input_length < len(blocks) * BLOCK_TOKENS)
        if policy == "adaptive":
            for name, shadow in caches.items():
                score[name] = score[name] * decay + hit_tokens(req, leading_hits(shadow, blocks))
                shadow.access(blocks)
            # The other policy takes over only when clearly ahead (5%): no flapping.
            best = max(score, key=lambda n: (score[n], n == "lru"))
            if best != choice and score[best] > 1.05 * score[choice]:
                choice = best
                cache.rekey(keys[choice])
        cache.access(blocks)
    return Result(policy, hits, total)


def run_belady(requests: Sequence[TraceRequest], capacity: int) -> Result:
    """The offline optimum with bypass, block by block in request order."""
    order = [(i, b) for i, req in enumerate(requests) for b in req.hash_ids]
    next_use = [INF] * len(order)
    seen: dict[int, int] = {}
    for pos in range(len(order) - 1, -1, -1):
        i, b = order[pos]
        nxt = seen.get(b)
        next_use[pos] = order[nxt][0] if nxt is not None else INF
        seen[b] = pos
    resident: dict[int, float] = {}
    heap: list = []  # (-next use, depth tie, block), lazy
    hits = total = pos = 0
    for i, req in enumerate(requests):
        blocks = req.hash_ids
        hits += hit_tokens(req, leading_hits(resident, blocks))
        total += req.input_length
        for depth, b in enumerate(blocks):
            nu = next_use[pos]
            pos += 1
            if b in resident or len(resident) < capacity:
                resident[b] = nu
                heapq.heappush(heap, (-nu, -depth, b))
                continue
            while True:  # the resident used again furthest away
                neg, _, victim = heap[0]
                if resident.get(victim) == -neg:
                    break
                heapq.heappop(heap)
            if nu >= -heap[0][0]:
                continue  # bypass: the newcomer is needed later than anything held
            heapq.heappop(heap)
            del resident[victim]
            resident[b] = nu
            heapq.heappush(heap, (-nu, -depth, b))
    return Result("belady", hits, total)


def agentic_trace(sessions: int = 300, turns: int = 12, seed: int = 1) -> list[TraceRequest]:
    """Agent sessions: a shared tool preamble, then a context that grows by tool calls and their
    results each turn; sessions overlap in time, with think/tool gaps of seconds to minutes."""
    rng = random.Random(seed)
    preamble = [10_000_000 + i for i in range(6)]  # 3k tokens of tools shared by every session
    out, ids = [], itertools.count(20_000_000)
    for s in range(sessions):
        t = rng.uniform(0, 3600)
        context = list(preamble) + [next(ids) for _ in range(rng.randint(1, 3))]
        for _ in range(turns):
            context += [next(ids) for _ in range(rng.randint(1, 4))]
            out.append(TraceRequest(0, t, len(context) * BLOCK_TOKENS - rng.randint(0, 400),
                                    200, tuple(context)))
            t += rng.expovariate(1 / 40.0)
    return _in_arrival_order(out)


def _in_arrival_order(requests: list[TraceRequest]) -> list[TraceRequest]:
    """The requests sorted by arrival, each indexed by its place."""
    requests.sort(key=lambda r: r.arrival_s)
    for i, r in enumerate(requests):
        r.index = i
    return requests


def many_tenant_trace(tenants: int = 400, conversations: int = 2500,
                      seed: int = 4) -> list[TraceRequest]:
    """Many tenants' chats: each tenant has its own system prompt (1-8 blocks), tenants'
    popularity is Zipf-like (a few busy, a long tail of rare ones), each conversation 1-8
    turns with ~60 s of thinking between them."""
    rng = random.Random(seed)
    ids = itertools.count(30_000_000)
    systems = [[next(ids) for _ in range(rng.randint(1, 8))] for _ in range(tenants)]
    weights = [1.0 / (rank + 1) ** 1.1 for rank in range(tenants)]
    out = []
    for tenant in rng.choices(range(tenants), weights, k=conversations):
        t = rng.uniform(0, 3600)
        context = list(systems[tenant])
        for _ in range(rng.randint(1, 8)):
            context += [next(ids) for _ in range(rng.randint(1, 3))]
            out.append(TraceRequest(0, t, len(context) * BLOCK_TOKENS - rng.randint(1, 500),
                                    300, tuple(context)))
            t += rng.expovariate(1 / 60.0)
    return _in_arrival_order(out)


def synthetic(kind: str, n: int, seed: int) -> list[TraceRequest]:
    rows = sorted(SYNTH_KINDS[kind](n, random.Random(seed)), key=lambda r: r["timestamp"])
    return [TraceRequest(i, r["timestamp"] / 1000.0, r["input_length"], r["output_length"],
                         tuple(r["hash_ids"])) for i, r in enumerate(rows)]


# Pooled capacities (tokens) per workload: around where each one's policies part ways (the
# synthetic ones are smaller than the trace).
CAPACITIES = {"conversation": "1M,2M,8M", "agentic": "256K,512K,1M", "chat": "256K,512K,1M",
              "rollout": "16K,32K,64K", "many_tenant": "256K,512K,1M"}


def workloads(trace_path: Path) -> dict[str, list[TraceRequest]]:
    return {"conversation": load_trace(trace_path),
            "agentic": agentic_trace(),
            "chat": synthetic("chat", 6000, seed=2),
            "rollout": synthetic("rollout", 6000, seed=3),
            "many_tenant": many_tenant_trace()}


def parse_tokens(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1_000, "M": 1_000_000}.get(text[-1:], 1)
    return int(float(text.rstrip("KM")) * scale)


def headline(rows: list[dict]) -> dict:
    """The figures the issue's goals are stated on, flat (harness.report judges them)."""
    at = {(r["workload"], r["capacity"], r["policy"]): r["hit_ratio"] for r in rows}
    out: dict = {}
    for cap in ("1M", "2M", "8M"):
        lru, ada = at.get(("conversation", cap, "lru")), at.get(("conversation", cap, "adaptive"))
        opt = at.get(("conversation", cap, "belady"))
        if lru and ada and opt:
            out[f"conversation_{cap}_adaptive_over_lru"] = round(ada / lru, 3)
            out[f"conversation_{cap}_adaptive_of_belady"] = round(ada / opt, 3)
    worst = [at[(w, c, "adaptive")] - at[(w, c, "lru")] for (w, c, p) in at if p == "lru"
             and (w, c, "adaptive") in at]
    if worst:
        out["adaptive_minus_lru_worst_points"] = round(100 * min(worst), 2)
    return out


GOALS = {"conversation_1M_adaptive_over_lru": Goal(">=", 1.7),
         "conversation_2M_adaptive_over_lru": Goal(">=", 1.7),
         "conversation_8M_adaptive_of_belady": Goal(">=", 0.8),
         "adaptive_minus_lru_worst_points": Goal(">=", -1.0)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixcache_bench.sim.eviction",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--capacities", default=None, help="pooled tokens, comma separated "
                   "(default: per workload, CAPACITIES)")
    p.add_argument("--only", default=None, help="one workload")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    machine = machine_info()
    rows = []
    for name, requests in workloads(args.trace).items():
        if args.only and name != args.only:
            continue
        for cap_text in (args.capacities or CAPACITIES[name]).split(","):
            rows += compare(name, requests, cap_text)
    print(columns_table(["workload", "capacity", "policy", "hit ratio", "of Belady", "s"],
                        [[r["workload"], r["capacity"], r["policy"], r["hit_ratio"],
                          r["of_belady"], r["seconds"]] for r in rows]))
    results = {**headline(rows), "rows": rows}
    command = "python -m prefixcache_bench.sim.eviction" + (
        " " + " ".join(argv) if argv else "")
    ok = report(results, GOALS, "eviction policies against Belady", command, machine,
                str(args.json) if args.json else None)
    return 0 if ok else 1


def compare(name: str, requests: Sequence[TraceRequest], cap_text: str) -> list[dict]:
    """One row per policy at one pooled capacity."""
    blocks = max(1, parse_tokens(cap_text) // BLOCK_TOKENS)
    rows, opt = [], None
    for policy in ("belady", "lru", "frequency", "adaptive"):
        start = time.perf_counter()
        r = run_belady(requests, blocks) if policy == "belady" else run_online(
            requests, blocks, policy)
        opt = opt or r
        rows.append({"workload": name, "capacity": cap_text, "policy": policy,
                     "hit_ratio": round(r.hit_ratio, 4),
                     "of_belady": round(r.hit_ratio / opt.hit_ratio, 3) if opt.hit_ratio else None,
                     "seconds": round(time.perf_counter() - start, 2)})
        log(f"{name} {cap_text} {policy}: hit {r.hit_ratio:.3f}")
    return rows


if __name__ == "__main__":
    sys.exit(main())
