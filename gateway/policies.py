"""Routing policies: one interface, `choose(request, candidates, index, load) -> RouteDecision`,
and `preview` with the same arguments: the decision `choose` would make now, without recording
the prompt as routed or advancing a rotation (RoutePreview uses it). For every policy,
`choose(...) == preview(...)` followed by the state change `choose` makes; a preview never
changes a later choice.

- `affinity` (default): score = P x (1 + overload_weight x overload, for a mostly new prompt)
  + queue_weight x its queued prefill tokens + balance_weight x its recent routed prefill above
  the least recent worker + inflight_weight_tokens x its requests in flight. P = the prompt
  tokens the worker would still compute (not on its device, by the index, confidence-weighted;
  host and remote hits priced at their load cost); overload = how far its recent routed prefill
  is above the candidates' mean, as a fraction of that mean (0 at or below it); a prompt is
  mostly new when its longest cached prefix anywhere is shorter than the rest. Lowest wins, and
  near-ties go to the least work, then the least queued, then the least recent work, then round
  robin. Load alone never makes a worker recompute a prefix another worker holds: if the winner
  would, but a holder is within a near-tie of the best score without the queue and in-flight
  terms, and that holder's queue is at most move_queue_tokens, the best-scoring holder wins.
- `approx`: the same score without events: the gateway remembers what it routed where.
- baselines: `round_robin`, `least_loaded`, and `sglang` (SGLang router's cache_aware rule).

Why the default weights (gateway.simulate, 8 workers x 1M tokens, on the Mooncake conversation
trace and the synthetic chat and rollout traces of gateway.trace, seeds 0-5; tables in
docs/results/gateway/):
- queue_weight 0.05: a queued token weighs 0.05 of a prompt token to compute, because moving a
  conversation off the worker that holds it to dodge a queue saves this request's wait but makes
  the cluster recompute the prefix and loses it for the next turns (with weight 1, the
  TTFT-greedy choice, the conversation trace's hit ratio fell from 0.265 to 0.233).
- overload_weight 4, for mostly new prompts only: where a prompt's new work goes is a balance
  decision, where a mostly cached prompt goes is a cache decision (the split Preble's E2
  scheduler makes). Without it a shared header decided the balance: in the rollout trace (RL
  samples: ~6% of tokens computed) every new prompt went to the one worker holding its few-shot
  header, so the header -> worker partition set each worker's share (max/mean prefill 1.24,
  goal <= 1.1; 1.12-1.32 over seeds 0-5), and a hot system prompt did the same in the chat
  trace (1.24). The factor multiplies only the tokens a worker would compute, so an overloaded
  holder still wins a prompt when the header saves more than the overload costs, a cheap header
  gets replicated sooner than a long one, and the term is relative (a fraction of the mean, times
  the work at stake): it means the same at any throughput and averaging window, which an
  absolute token difference does not: balance_weight alone could not be tuned (0.05 left the
  rollout trace at 1.23; 0.1 brought it to 1.09 but left five of six rollout seeds above 1.1 and
  cost the conversation trace 0.5 points of hit ratio, below sglang's). Next turns and a
  burst's later samples (cached by the index or by recent_pages_per_worker) are never moved by
  it, so a busy worker keeps its conversations and a burst still computes its prompt once.
  Measured: rollout 1.24 -> 1.04 (1.02-1.12 over seeds 0-5) and mean TTFT 0.153 -> 0.145 s
  (least_loaded 0.149 s); chat 1.24 -> 1.01; conversation hit ratio 0.2655 -> 0.2668. Weight 2
  left two of six rollout traces above 1.1; 6 replicated headers more often for no better
  balance and a lower hit ratio. The cost: replicating a header computes it again, so on five
  rollout seeds of twelve the hit ratio ends up at or below sglang's, by up to 0.07 point
  (0.9444 vs 0.9451 on seed 5; the TTFT figures above predate the simulator's sibling and twin
  model). sglang stays unbalanced (1.13-1.36) and near the balanced hit ceiling
  (gateway.sim.copy_bound: the fewest header copies any routing within 1.1 needs), on two seeds
  within one short header of it; this policy copies 2.4-16x that minimum. See
  docs/results/gateway/rollout.txt and synthetic_seeds.txt.
- balance_weight 0.02: the absolute term, which also acts on mostly cached prompts (it moves a
  short history off a busy worker). Without it: conversation hit ratio 0.2657 vs 0.2668 (mean
  TTFT 0.561 vs 0.573 s) and rollout imbalance 1.06 vs 1.04.
- LoadTracker.recent_halflife_s 600 s: the window of "recent" prefill. A relative load needs
  enough prompts in the window to be an estimate: the rollout trace computes ~200 tokens/s per
  worker, so a 120 s half-life held about a dozen bursts per worker and chased noise. With
  120 s: rollout imbalance 1.07, chat 1.05, conversation hit ratio 0.2644.
- inflight_weight_tokens 50: sees decode load, which slows a worker's prefill and that queued
  prefill tokens do not show.
- move_queue_tokens 16,384 (two chunked-prefill steps): the load terms pick among the workers
  holding a prompt's prefix, but alone they do not move it to one that would compute the prefix
  again, unless the holders' queue is longer than that. Without the rule the in-flight term
  copied a short few-shot header whenever its holder had a burst decoding: on rollout seeds
  0-11 affinity duplicated 26-38k tokens (now 17-27k; sglang 8-52k) and beat sglang's hit ratio
  on 2 of 12 (now 7), its TTFT still best on all 12. The conversation trace pays a little: hit
  0.2668 -> 0.2655, mean TTFT 0.573 -> 0.576 s, still above every baseline; never letting load
  move a request there costs TTFT instead (0.2676 at 0.594 s).

Load (`LoadTracker`) = what this gateway has in flight per worker combined with the worker's own
LoadReport. Policies are not thread-safe; the gateway calls them under its routing lock.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gateway.index import KvIndex, PrefixMatch, RoutedPrefixes
from prefixcache.v1 import common_pb2


@dataclass(slots=True)
class RouteRequest:
    request_id: str
    # Hashes of the prompt's full pages, computed in the request's namespace (cache_service.hash).
    page_hashes: Sequence[bytes]
    prompt_tokens: int
    page_size: int


@dataclass(slots=True)
class WorkerLoad:
    queued_prefill_tokens: int = 0
    inflight_requests: int = 0
    # Prefill tokens routed to the worker lately (exponentially decayed): the longer-horizon
    # load that spreads new prefixes when every queue is empty.
    recent_prefill_tokens: float = 0.0


@dataclass(slots=True)
class WorkerScore:
    worker: str
    device_tokens: int = 0
    host_tokens: int = 0
    remote_tokens: int = 0
    confidence: float = 1.0
    queued_prefill_tokens: int = 0
    inflight_requests: int = 0
    recent_prefill_tokens: float = 0.0
    # Prompt tokens this worker would still compute (confidence-weighted, load costs included).
    prefill_tokens: float = 0.0
    # Recent routed prefill above the candidates' mean, as a fraction of the mean (>= 0).
    overload: float = 0.0
    score: float = 0.0


@dataclass(slots=True)
class RouteDecision:
    worker: str
    policy: str
    reason: str
    # Estimated prompt tokens the chosen worker computes (what LoadTracker.on_route is told).
    prefill_tokens: int
    scores: list[WorkerScore] = field(default_factory=list)


class Policy(Protocol):
    name: str

    def choose(self, request: RouteRequest, candidates: Sequence[str], index: KvIndex,
               load: LoadTracker) -> RouteDecision:
        """Pick a worker and remember it (routed prefixes, rotation counters)."""
        ...

    def preview(self, request: RouteRequest, candidates: Sequence[str], index: KvIndex,
                load: LoadTracker) -> RouteDecision:
        """The decision `choose` would make now, changing nothing."""
        ...

    def remove_worker(self, worker: str) -> None: ...


# Half-life of LoadTracker.recent_prefill_tokens (see the module docstring).
RECENT_HALFLIFE_S = 600.0


class LoadTracker:
    """Per-worker load as the gateway sees it.

    Queued prefill = max(this gateway's routed-but-no-first-token prefill, the worker's reported
    queue), not the sum: the report already counts what this gateway routed, and the max is right
    whether the gateway is the worker's only client (its own view is fresher) or one of several
    (the report sees the others). Reports older than report_ttl_s are ignored.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, report_ttl_s: float = 5.0,
                 recent_halflife_s: float = RECENT_HALFLIFE_S) -> None:
        self._clock = clock
        self.report_ttl_s = report_ttl_s
        self.recent_halflife_s = recent_halflife_s
        self._recent: dict[str, tuple[float, float]] = {}  # worker -> (decayed tokens, as of when)
        self._routed: dict[str, tuple[str, int]] = {}  # request id -> (worker, prefill pending)
        self._pending: dict[str, int] = {}
        self._inflight: dict[str, int] = {}
        self._reports: dict[str, tuple[float, int, int]] = {}  # worker -> (when, queued, requests)

    def report(self, worker: str, load: common_pb2.LoadReport, now: float | None = None) -> None:
        when = self._clock() if now is None else now
        self._reports[worker] = (when, load.queued_prefill_tokens,
                                 load.waiting_requests + load.running_requests)

    def on_route(self, worker: str, request_id: str, prefill_tokens: int) -> None:
        self._routed[request_id] = (worker, prefill_tokens)
        self._pending[worker] = self._pending.get(worker, 0) + prefill_tokens
        self._inflight[worker] = self._inflight.get(worker, 0) + 1
        now = self._clock()
        self._recent[worker] = (self._decayed(worker, now) + prefill_tokens, now)

    def _decayed(self, worker: str, now: float) -> float:
        value, when = self._recent.get(worker, (0.0, now))
        return value * 0.5 ** ((now - when) / self.recent_halflife_s)

    def on_first_token(self, request_id: str) -> None:
        """Its prefill is done: it no longer counts as queued prefill work."""
        entry = self._routed.get(request_id)
        if entry is not None and entry[1]:
            worker, tokens = entry
            self._pending[worker] -= tokens
            self._routed[request_id] = (worker, 0)

    def on_finish(self, request_id: str) -> None:
        """Finished, failed or aborted."""
        self.on_first_token(request_id)
        entry = self._routed.pop(request_id, None)
        if entry is not None and entry[0] in self._inflight:
            self._inflight[entry[0]] -= 1

    def remove_worker(self, worker: str) -> None:
        for rid in [r for r, (w, _) in self._routed.items() if w == worker]:
            del self._routed[rid]
        for table in (self._pending, self._inflight, self._reports, self._recent):
            table.pop(worker, None)

    def get(self, worker: str, now: float | None = None) -> WorkerLoad:
        now = self._clock() if now is None else now
        queued, inflight = self._pending.get(worker, 0), self._inflight.get(worker, 0)
        rep = self._reports.get(worker)
        if rep is not None and now - rep[0] <= self.report_ttl_s:
            queued, inflight = max(queued, rep[1]), max(inflight, rep[2])
        return WorkerLoad(queued, inflight, self._decayed(worker, now))


@dataclass(slots=True)
class AffinityConfig:
    # Cost of loading one token's KV from host / remote, as a fraction of computing it
    # (8B model: ~128 KiB KV/token; PCIe ~25 GB/s vs ~30 us/token prefill -> ~0.15).
    host_cost: float = 0.15
    remote_cost: float = 0.35
    prefill_weight: float = 1.0
    queue_weight: float = 0.05
    # For a mostly new prompt (its longest cached prefix shorter than its uncached rest), the
    # prefill a worker would compute counts (1 + overload_weight x overload) times, where
    # overload = its recent routed prefill above the candidates' mean, as a fraction of the mean:
    # new work goes to workers at or below the mean unless one holds enough of it to be worth the
    # imbalance. Prompts that are mostly cached somewhere are routed as before.
    overload_weight: float = 4.0
    # Per token of recent routed prefill (LoadTracker.recent_prefill_tokens) above the least
    # such worker among the candidates: the long-horizon balance that makes a hot prefix
    # replicate instead of pulling every request to the one worker that holds it.
    balance_weight: float = 0.02
    # Per request in flight on the worker (decoding ones slow its prefill down).
    inflight_weight_tokens: float = 50.0
    # Instant load (queued prefill, requests in flight) moves a request off the workers holding
    # its longest cached prefix only when their queue is above this many tokens (two chunked-
    # prefill steps), or when the balance terms alone would move it too. Decoding slows a holder
    # by a few percent for seconds; recomputing the prefix elsewhere is paid in full, for good.
    move_queue_tokens: float = 16384.0
    # Scores within max(tie_abs_tokens, tie_rel * prompt tokens) of the best are near-ties.
    tie_abs_tokens: float = 16.0
    tie_rel: float = 0.01
    # Pages per worker of recently routed prompts, counted as on device until events say more.
    # Covers the gap between routing a prompt and its pages' BlockStored reaching the index, in
    # which a burst of same-prefix requests would otherwise be spread and computed N times.
    # Keep it well below the worker's KV capacity; 0 disables it.
    recent_pages_per_worker: int = 4096


class AffinityPolicy:
    name = "affinity"

    def __init__(self, config: AffinityConfig | None = None) -> None:
        self.config = config or AffinityConfig()
        self._rr = 0
        self.recent = RoutedPrefixes(self.config.recent_pages_per_worker)

    def remove_worker(self, worker: str) -> None:
        self.recent.remove_worker(worker)

    def _matches(self, request: RouteRequest, candidates: Sequence[str],
                 index: KvIndex) -> dict[str, PrefixMatch]:
        matches = index.lookup(request.page_hashes)
        if self.config.recent_pages_per_worker:
            hashes = request.page_hashes
            for worker in candidates:
                m = matches.get(worker)
                start = m.device_pages if m is not None else 0
                end = self.recent.extend(worker, hashes, start)
                if end == start:
                    continue
                if m is None:
                    matches[worker] = PrefixMatch(end, 0, 0, 1.0)
                else:  # recent pages extend the device run; host/remote cover what is left
                    host_end = max(m.device_pages + m.host_pages, end)
                    rem_end = max(m.device_pages + m.host_pages + m.remote_pages, host_end)
                    matches[worker] = PrefixMatch(end, host_end - end, rem_end - host_end, m.confidence)
        return matches

    def choose(self, request: RouteRequest, candidates: Sequence[str], index: KvIndex,
               load: LoadTracker) -> RouteDecision:
        decision, match, tied = self._decide(request, candidates, index, load)
        if tied:
            self._rr += 1
        self._record(request, decision.worker, match)
        return decision

    def preview(self, request: RouteRequest, candidates: Sequence[str], index: KvIndex,
                load: LoadTracker) -> RouteDecision:
        return self._decide(request, candidates, index, load)[0]

    def _decide(self, request: RouteRequest, candidates: Sequence[str], index: KvIndex,
                load: LoadTracker) -> tuple[RouteDecision, PrefixMatch | None, bool]:
        """(the decision, the chosen worker's match, whether a near-tie used the rotation);
        reads the policy's state, changes none of it."""
        if not candidates:
            raise ValueError("candidates: no worker to route to")
        cfg, page, total = self.config, request.page_size, request.prompt_tokens
        matches = self._matches(request, candidates, index)
        loads = [load.get(worker) for worker in candidates]
        least_recent = min(wl.recent_prefill_tokens for wl in loads)
        mean_recent = sum(wl.recent_prefill_tokens for wl in loads) / len(loads)
        scores = []
        for worker, wl in zip(candidates, loads):
            s = WorkerScore(worker, queued_prefill_tokens=wl.queued_prefill_tokens,
                            inflight_requests=wl.inflight_requests,
                            recent_prefill_tokens=wl.recent_prefill_tokens)
            if mean_recent > 0.0:
                s.overload = max(wl.recent_prefill_tokens / mean_recent - 1.0, 0.0)
            m = matches.get(worker)
            saved = 0.0
            if m is not None:
                s.device_tokens, s.host_tokens = m.device_pages * page, m.host_pages * page
                s.remote_tokens, s.confidence = m.remote_pages * page, m.confidence
                saved = m.confidence * (s.device_tokens + s.host_tokens * (1.0 - cfg.host_cost)
                                        + s.remote_tokens * (1.0 - cfg.remote_cost))
            s.prefill_tokens = max(total - saved, 0.0)
            scores.append(s)
        # A prompt whose best cached prefix is shorter than the work it brings anyway is mostly
        # new: where that work goes is a balance decision, so overloaded workers pay for it. A
        # prompt that is mostly cached somewhere (a next turn, a burst's later samples) is a
        # cache decision: the overload term leaves it alone.
        new = min(s.prefill_tokens for s in scores)
        overload_weight = cfg.overload_weight if total - new < new else 0.0
        balance = [cfg.prefill_weight * s.prefill_tokens * (1.0 + overload_weight * s.overload)
                   + cfg.balance_weight * (s.recent_prefill_tokens - least_recent) for s in scores]
        for s, b in zip(scores, balance):
            s.score = (b + cfg.queue_weight * s.queued_prefill_tokens
                       + cfg.inflight_weight_tokens * s.inflight_requests)
        tie = max(cfg.tie_abs_tokens, cfg.tie_rel * total)
        best = min(s.score for s in scores)
        band = best + tie
        tied = [i for i, s in enumerate(scores) if s.score <= band]
        if len(tied) == 1:
            pick = tied[0]
            reason = ("lowest score (uncached prefill weighted by overload, new prompt + load)"
                      if overload_weight else "lowest score (uncached prefill + load)")
        else:
            # Among near-ties the least work wins (a burst of one prompt stays where it is being
            # computed), then the least queued, then the least recent work (so new prefixes even
            # out the load over minutes, not only the instant queue), then rotation.
            n, rr = len(scores), self._rr
            pick = min(tied, key=lambda i: (scores[i].prefill_tokens, scores[i].queued_prefill_tokens,
                                            scores[i].recent_prefill_tokens, (i - rr) % n))
            reason = f"near-tie of {len(tied)} workers within {band - best:.0f} tokens: least work, then load"
        if scores[pick].prefill_tokens > new:
            # The pick would recompute a prefix that a holder has. Fine if balance asks for it
            # (no holder within a near-tie of the best balance score) or the best holder's queue
            # is long; not for requests in flight or a short queue alone.
            holders = [i for i, s in enumerate(scores) if s.prefill_tokens == new]
            holder = min(holders, key=lambda i: scores[i].score)
            if (scores[holder].queued_prefill_tokens <= cfg.move_queue_tokens
                    and min(balance[i] for i in holders) <= min(balance) + tie):
                pick = holder
                reason = (f"kept on a holder of its prefix: load alone does not pay for recomputing "
                          f"{total - new:.0f} tokens")
        chosen = scores[pick]
        decision = RouteDecision(chosen.worker, self.name, reason, round(chosen.prefill_tokens), scores)
        return decision, matches.get(chosen.worker), len(tied) > 1

    def _record(self, request: RouteRequest, worker: str, match: PrefixMatch | None) -> None:
        # Only the pages the worker will compute: what it holds already has been reported.
        if self.config.recent_pages_per_worker:
            held = match.device_pages if match is not None else 0
            self.recent.record(worker, request.page_hashes[held:])


class ApproxPolicy(AffinityPolicy):
    """Affinity scoring over what the gateway itself routed (for engines that publish no events).

    The memory per worker is an LRU set of page hashes bounded by max_pages_per_worker; set it
    to the worker's KV capacity so that what the gateway assumes cached ages out about as fast
    as the worker's own LRU evicts it.
    """
    name = "approx"

    def __init__(self, config: AffinityConfig | None = None, max_pages_per_worker: int = 65536) -> None:
        super().__init__(config)
        self.routed = RoutedPrefixes(max_pages_per_worker)

    def remove_worker(self, worker: str) -> None:
        self.routed.remove_worker(worker)

    def _matches(self, request: RouteRequest, candidates: Sequence[str],
                 index: KvIndex) -> dict[str, PrefixMatch]:
        return {w: PrefixMatch(n, 0, 0, 1.0) for w, n in self.routed.match(request.page_hashes).items()}

    def _record(self, request: RouteRequest, worker: str, match: PrefixMatch | None) -> None:
        self.routed.record(worker, request.page_hashes)


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def remove_worker(self, worker: str) -> None:
        return None

    def choose(self, request: RouteRequest, candidates: Sequence[str], index: KvIndex,
               load: LoadTracker) -> RouteDecision:
        decision = self.preview(request, candidates, index, load)
        self._next += 1
        return decision

    def preview(self, request: RouteRequest, candidates: Sequence[str], index: KvIndex,
                load: LoadTracker) -> RouteDecision:
        if not candidates:
            raise ValueError("candidates: no worker to route to")
        worker = candidates[self._next % len(candidates)]
        return RouteDecision(worker, self.name, "round robin", request.prompt_tokens)


class LeastLoadedPolicy:
    name = "least_loaded"

    def __init__(self) -> None:
        self._rr = 0

    def remove_worker(self, worker: str) -> None:
        return None

    def choose(self, request: RouteRequest, candidates: Sequence[str], index: KvIndex,
               load: LoadTracker) -> RouteDecision:
        decision = self.preview(request, candidates, index, load)
        self._rr += 1
        return decision

    def preview(self, request: RouteRequest, candidates: Sequence[str], index: KvIndex,
                load: LoadTracker) -> RouteDecision:
        if not candidates:
            raise ValueError("candidates: no worker to route to")
        scores = []
        for worker in candidates:
            wl = load.get(worker)
            scores.append(WorkerScore(worker, queued_prefill_tokens=wl.queued_prefill_tokens,
                                      inflight_requests=wl.inflight_requests,
                                      prefill_tokens=request.prompt_tokens,
                                      score=wl.queued_prefill_tokens))
        n, rr = len(scores), self._rr
        pick = min(range(n), key=lambda i: (scores[i].queued_prefill_tokens, scores[i].inflight_requests,
                                             (i - rr) % n))
        return RouteDecision(scores[pick].worker, self.name, "least queued prefill tokens",
                             request.prompt_tokens, scores)


@dataclass(slots=True)
class SglangConfig:
    # sglang-router's command-line defaults (launch_router).
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    # Its max_tree_size is 2**26 characters (~2**24 tokens); here in pages of the request.
    max_tree_pages: int = 2**24 // 16


class SglangPolicy:
    """SGLang router's cache_aware rule, over page hashes instead of characters.

    Load = requests in flight. If max - min > balance_abs_threshold and max > min *
    balance_rel_threshold, route to the least loaded worker. Otherwise route to the worker whose
    approximate tree matches the longest prefix if matched / prompt > cache_threshold, else to
    the worker with the smallest tree. Either way the prompt is inserted into the chosen
    worker's tree. (SGLang evicts its trees periodically; here the LRU bound applies on insert.)
    """
    name = "sglang"

    def __init__(self, config: SglangConfig | None = None) -> None:
        self.config = config or SglangConfig()
        self.routed = RoutedPrefixes(self.config.max_tree_pages)

    def remove_worker(self, worker: str) -> None:
        self.routed.remove_worker(worker)

    def choose(self, request: RouteRequest, candidates: Sequence[str], index: KvIndex,
               load: LoadTracker) -> RouteDecision:
        decision = self.preview(request, candidates, index, load)
        self.routed.record(decision.worker, request.page_hashes)
        return decision

    def preview(self, request: RouteRequest, candidates: Sequence[str], index: KvIndex,
                load: LoadTracker) -> RouteDecision:
        if not candidates:
            raise ValueError("candidates: no worker to route to")
        cfg = self.config
        loads = [load.get(w).inflight_requests for w in candidates]
        hi, lo = max(loads), min(loads)
        matched = self.routed.match(request.page_hashes)
        scores = [WorkerScore(w, device_tokens=matched.get(w, 0) * request.page_size,
                              inflight_requests=loads[i], score=loads[i])
                  for i, w in enumerate(candidates)]
        if hi - lo > cfg.balance_abs_threshold and hi > lo * cfg.balance_rel_threshold:
            pick = loads.index(lo)
            reason = f"imbalanced (in flight {lo}..{hi}): shortest queue"
        else:
            pick = max(range(len(candidates)), key=lambda i: (scores[i].device_tokens, -loads[i]))
            rate = scores[pick].device_tokens / max(request.prompt_tokens, 1)
            if rate > cfg.cache_threshold:
                reason = f"match rate {rate:.2f} > {cfg.cache_threshold}: longest prefix"
            else:
                pick = min(range(len(candidates)), key=lambda i: self.routed.size(candidates[i]))
                reason = f"match rate {rate:.2f} <= {cfg.cache_threshold}: smallest tree"
        worker = candidates[pick]
        return RouteDecision(worker, self.name, reason,
                             request.prompt_tokens - scores[pick].device_tokens, scores)


POLICY_NAMES = ("affinity", "approx", "round_robin", "least_loaded", "sglang")


def make_policy(name: str, *, affinity: AffinityConfig | None = None, sglang: SglangConfig | None = None,
                approx_max_pages: int = 65536) -> Policy:
    """A policy by name (see POLICY_NAMES)."""
    if name == "affinity":
        return AffinityPolicy(affinity)
    if name == "approx":
        return ApproxPolicy(affinity, approx_max_pages)
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_loaded":
        return LeastLoadedPolicy()
    if name == "sglang":
        return SglangPolicy(sglang)
    raise ValueError(f"policy: unknown {name!r}, expected one of {', '.join(POLICY_NAMES)}")
