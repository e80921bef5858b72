"""Part `trace`: replay of a Mooncake conversation trace through CacheCore (match, allocate,
publish, release per request): requests per second, and the hit ratio beside the one an
unbounded cache would reach, once per eviction policy. The core's clock is the trace's (each
request arrives at its timestamp), so the policies' reuse gaps are the trace's think times.

The same metrics as the peer harness's `project-core` (prefixcache_bench/peer_radix.py): ops/s
over the timed cache calls only, by wall clock and by this thread's CPU time, with the match
sent as the engine sends it (packed tokens, page hashes left out)."""
from __future__ import annotations

import statistics
import time

import numpy as np

from prefixcache_bench.cache.params import Params, register
from prefixcache_bench.cache.workloads import (BlockCache, CoreSteps, ideal_hit_tokens,
                                               load_arrivals, load_trace)
from cache_service.core import CacheCore
from prefixcache.v1 import cache_service_pb2 as pb
from prefixcache_bench.harness import Progress, load_average

POLICIES = ("lru", "frequency", "adaptive")  # the default first: the others' ratios are to it


CHUNK = 200  # requests a policy serves before the next policy serves the same ones


def bench_trace(p: Params) -> dict:
    """Replays the trace one request at a time through CacheCore.step: match, allocate the
    uncached pages, publish every full prompt page with the release. Only the three steps are
    timed (building the prompts is not). Once per eviction policy (cache_service/eviction.py):
    the default's figures are `trace_*`, the others' `trace_<policy>_*`, from the same run.

    The policies replay the trace side by side, each its own core: every CHUNK requests are
    served by one policy, then by the next (the order reversed every other chunk), so each
    policy's time is measured over the same minutes as the others' (a shared machine's load
    weighs on all alike) and the prompts are built once. With `p.trace_rounds` > 1 the whole
    replay runs that many times: a policy's speed over LRU's (`trace_<policy>_ops_over_lru`)
    is the median of the rounds' ratios, its ops/s figures the median of its rounds; the
    rounds' ratios and the load average before each round are in the JSON too."""
    trace = load_trace(p.trace_path, p.trace_requests)
    arrivals = load_arrivals(p.trace_path, p.trace_requests)
    block = BlockCache(p.vocab)  # shared: the prompts are the same in every round
    rounds: list[dict[str, dict]] = []
    loads: list[list[float]] = []
    for _ in range(max(1, p.trace_rounds)):
        loads.append(load_average())
        rounds.append(_replay_side_by_side(p, trace, arrivals, block))
    ideal = round(ideal_hit_tokens(trace, p.page_size) / sum(n for n, _ in trace), 4)
    out: dict = {}
    for policy in POLICIES:
        figures = _median_round(rounds, policy)
        figures["ideal_hit_ratio"] = ideal
        prefix = "trace_" if policy == "lru" else f"trace_{policy}_"
        out.update({prefix + k: v for k, v in figures.items()})
    for policy in POLICIES[1:]:
        ratios = [round(f[policy]["cpu_ops_per_s"] / f["lru"]["cpu_ops_per_s"], 3)
                  for f in rounds]
        out[f"trace_{policy}_ops_over_lru"] = round(statistics.median(ratios), 3)
        out[f"trace_{policy}_hit_over_lru"] = round(
            out[f"trace_{policy}_hit_ratio"] / out["trace_hit_ratio"], 3)
        if len(rounds) > 1:
            out[f"trace_{policy}_ops_over_lru_rounds"] = ratios
    if len(rounds) > 1:
        out["trace_rounds"] = len(rounds)
        out["trace_round_load_avg"] = loads
    return out


SPEED = ("ops_per_s", "cpu_ops_per_s", "ms_per_request", "cpu_ms_per_request")


def _median_round(rounds: list[dict[str, dict]], policy: str) -> dict:
    """One policy's figures over the rounds: the speeds their median, the rest (the same in
    every round: the replay is deterministic, which this checks) as measured."""
    figures = dict(rounds[0][policy])
    for key, value in figures.items():
        values = [r[policy][key] for r in rounds]
        if key in SPEED:
            figures[key] = statistics.median(values)
        elif any(v != value for v in values):
            raise RuntimeError(f"trace replay ({policy}): {key} differs between rounds: {values}")
    return figures


class TraceClock:
    """The core's clock: the arrival time of the request being replayed."""
    now = 0.0

    def __call__(self) -> float:
        return self.now


class PolicyReplay:
    """One policy's core, and the time its steps took."""

    def __init__(self, p: Params, policy: str):
        self.clock = TraceClock()
        self.core = CacheCore(clock=self.clock, eviction=policy)
        self.device_pages = p.trace_device_tokens // p.page_size
        self.core.register_pool(register("trace", p, self.device_pages,
                                         p.trace_host_tokens // p.page_size))
        self.steps = CoreSteps(self.core.step, "trace", p.page_size)
        self.busy = self.cpu = 0.0
        self.requests = self.failed = 0

    def serve(self, requests: list[tuple[float, pb.MatchOp, int]]) -> None:
        """Each (arrival, match, prompt tokens) in turn, timed (wall and this thread's CPU)."""
        clock, serve = self.clock, self.steps.serve
        for arrival, op, n in requests:
            clock.now = arrival
            start, start_cpu = time.perf_counter(), time.thread_time()
            _, ok = serve(op, n)
            self.busy += time.perf_counter() - start
            # CPU time too: on a shared machine, wall time also counts waiting for a core.
            self.cpu += time.thread_time() - start_cpu
            self.failed += not ok
        self.requests += len(requests)

    def figures(self, prompt_tokens: int) -> dict:
        stats = self.core.get_stats(pb.GetStatsRequest(pool_id="trace")).pools[0]
        hits = stats.hit_tokens_device + stats.hit_tokens_host
        n = self.requests
        return {
            "requests": n,
            "ops_per_s": round(n / self.busy, 1),
            "cpu_ops_per_s": round(n / self.cpu, 1),
            "ms_per_request": round(self.busy / n * 1e3, 3),
            "cpu_ms_per_request": round(self.cpu / n * 1e3, 3),
            "prompt_tokens": prompt_tokens,
            "hit_ratio": round(hits / stats.queried_tokens, 4) if stats.queried_tokens else 0.0,
            "device_pages": self.device_pages,
            "evictions": sum(m.evictions for m in stats.media),
            "failed_allocations": self.failed,
        }


def _replay_side_by_side(p: Params, trace, arrivals: list[float],
                         block: BlockCache) -> dict[str, dict]:
    """One replay of the trace by every policy, CHUNK requests at a time each (see
    bench_trace): policy -> its figures."""
    replays = [PolicyReplay(p, policy) for policy in POLICIES]
    progress = Progress("trace (" + ", ".join(POLICIES) + ")", len(trace))
    for first in range(0, len(trace), CHUNK):
        requests = []
        for i in range(first, min(first + CHUNK, len(trace))):
            n, ids = trace[i]
            tokens = np.concatenate([block(h) for h in ids])[:n]
            requests.append((arrivals[i], pb.MatchOp(
                request_id=str(i), packed_token_ids=tokens.astype("<u4").tobytes(),
                omit_page_hashes=True), n))
        for replay in (replays if (first // CHUNK) % 2 == 0 else replays[::-1]):
            replay.serve(requests)
        progress.update(first + len(requests))
    prompt_tokens = sum(n for n, _ in trace)
    return {policy: r.figures(prompt_tokens) for policy, r in zip(POLICIES, replays)}
