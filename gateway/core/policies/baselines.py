"""The baselines the affinity policy is measured against: round robin, least loaded, and SGLang
router's cache_aware rule."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.core.index import KvIndex
from gateway.core.policies.base import RouteDecision, RouteRequest, WorkerScore, require_candidates
from gateway.core.policies.load import LoadTracker
from gateway.core.routed_prefixes import RoutedPrefixes


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def remove_worker(self, worker: str) -> None:
        return None

    def settle(self) -> None:
        return None

    def remembered(self) -> tuple[int, int]:
        return 0, 0

    def choose(self, request: RouteRequest, candidates: Sequence[str], index: KvIndex,
               load: LoadTracker, all_scores: bool = True) -> RouteDecision:
        decision = self.preview(request, candidates, index, load)
        self._next += 1
        return decision

    def preview(self, request: RouteRequest, candidates: Sequence[str], index: KvIndex,
                load: LoadTracker) -> RouteDecision:
        require_candidates(candidates)
        worker = candidates[self._next % len(candidates)]
        return RouteDecision(worker, self.name, "round robin", request.prompt_tokens)


class LeastLoadedPolicy:
    name = "least_loaded"

    def __init__(self) -> None:
        self._rr = 0

    def remove_worker(self, worker: str) -> None:
        return None

    def settle(self) -> None:
        return None

    def remembered(self) -> tuple[int, int]:
        return 0, 0

    def choose(self, request: RouteRequest, candidates: Sequence[str], index: KvIndex,
               load: LoadTracker, all_scores: bool = True) -> RouteDecision:
        decision = self.preview(request, candidates, index, load)
        self._rr += 1
        return decision

    def preview(self, request: RouteRequest, candidates: Sequence[str], index: KvIndex,
                load: LoadTracker) -> RouteDecision:
        require_candidates(candidates)
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

    def settle(self) -> None:
        self.routed.settle()

    def remembered(self) -> tuple[int, int]:
        return self.routed.remembered()

    def choose(self, request: RouteRequest, candidates: Sequence[str], index: KvIndex,
               load: LoadTracker, all_scores: bool = True) -> RouteDecision:
        decision = self.preview(request, candidates, index, load)
        self.routed.record(decision.worker, request.page_hashes)
        return decision

    def preview(self, request: RouteRequest, candidates: Sequence[str], index: KvIndex,
                load: LoadTracker) -> RouteDecision:
        require_candidates(candidates)
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
