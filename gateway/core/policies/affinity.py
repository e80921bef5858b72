"""The default routing policy, `affinity`, and its event-less twin `approx`.

score = P x (1 + overload_weight x overload, for a mostly new prompt)
        + queue_weight x queued prefill tokens
        + balance_weight x recent routed prefill above the least recent worker
        + inflight_weight_tokens x requests in flight

P = the prompt tokens the worker would still compute (not on its device by the index,
confidence-weighted; host and remote hits priced at their load cost); overload = how far the
worker's recent routed prefill is above the candidates' mean, as a fraction of that mean (0 at or
below it); a prompt is mostly new when its longest cached prefix anywhere is shorter than the
rest. Lowest score wins; near-ties go to the least work, then the least queued, then the least
recent work, then round robin. Load alone never makes a worker recompute a prefix another worker
holds: if the winner would, but a holder is within a near-tie of the best balance score and its
queue is at most move_queue_tokens, the best-scoring holder wins.

Why each term and weight is what it is: docs/design.md §6 "Routing policy"; the measurements
behind them are the committed results of `prefixcache_bench.sim.simulate` (docs/results/).
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from itertools import repeat

import numpy as np

from gateway.core import index_native
from gateway.core.index import Holders, KvIndex, PrefixMatch
from gateway.core.policies.affinity_arrays import (Buffers, Weights, overload_of, pick_in_c,
                                                   pick_on_arrays, prefill_of, sum_in_order)
from gateway.core.policies.base import RouteDecision, RouteRequest, WorkerScore, require_candidates
from gateway.core.policies.load import LoadTracker
from gateway.core.routed_prefixes import RoutedPrefixes


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
    # From this many candidates on, the router's decisions are scored on arrays in numpy
    # (`_decide_fast`): below it the fixed cost of a few dozen numpy calls is more than a loop
    # over the workers. In C (the next flag, when the gateway's library is there:
    # affinity_arrays.py) the arrays cost less than the loop from 2 candidates on (stop 55,
    # in-process at 2-64 workers), so they serve every routed decision.
    array_min_candidates = 64
    # The arrays scored in C; off, in numpy (the benchmark times both on the same decisions).
    pick_in_c = True

    def __init__(self, config: AffinityConfig | None = None) -> None:
        self.config = config or AffinityConfig()
        self._rr = 0
        self.recent = RoutedPrefixes(self.config.recent_pages_per_worker)
        self._positions_of: tuple[tuple[str, ...], dict[str, int]] | None = None
        self._buffers = Buffers()  # the C pick's (affinity_arrays.py)

    def remove_worker(self, worker: str) -> None:
        self.recent.remove_worker(worker)

    def settle(self) -> None:
        self.recent.settle()

    def remembered(self) -> tuple[int, int]:
        return self.recent.remembered()

    def _matches(self, request: RouteRequest, candidates: Sequence[str],
                 index: KvIndex) -> dict[str, PrefixMatch]:
        return self._holders(request, candidates, index).matches()

    def _holders(self, request: RouteRequest, candidates: Sequence[str], index: KvIndex) -> Holders:
        """The index's holders of the prompt's prefix, runs extended by the pages this policy
        routed lately (RoutedPrefixes)."""
        holders = index.holders(request.page_hashes)
        hashes = request.page_hashes
        if not (self.config.recent_pages_per_worker and hashes):
            return holders
        # Only a worker remembering the page its run stops at can extend it (`_extenders`).
        found = self._extenders(holders, hashes, self._positions(candidates))
        if not found:
            return holders
        at = dict(zip(holders.workers, range(len(holders.workers))))
        ends = self.recent.extend_many([w for w, _ in found], hashes, [s for _, s in found])
        added = [(w, end) for (w, _), end in zip(found, ends) if w not in at]
        extended = [(at[w], end) for (w, _), end in zip(found, ends) if w in at]
        dev, host, rem = holders.device_pages, holders.host_pages, holders.remote_pages
        if extended:  # recent pages extend the device run; host/remote cover what is left
            i, end = (np.array(column, np.int64) for column in zip(*extended))
            d, h, r = dev[i], host[i], rem[i]
            host_end = np.maximum(d + h, end)
            rem_end = np.maximum(d + h + r, host_end)
            dev[i], host[i], rem[i] = end, host_end - end, rem_end - host_end
        if not added:
            return holders
        k = len(added)
        return Holders(holders.workers + [w for w, _ in added],
                       np.concatenate([dev, np.fromiter((e for _, e in added), np.int64, k)]),
                       np.concatenate([host, np.zeros(k, np.int64)]),
                       np.concatenate([rem, np.zeros(k, np.int64)]),
                       np.concatenate([holders.confidence, np.ones(k)]))

    def _extenders(self, holders: Holders, hashes: Sequence[bytes],
                   allowed: Collection[str]) -> list[tuple[str, int]]:
        """(worker, where its device run stops) for each allowed worker that remembers the page
        its run stops at, the only ones a remembered page can extend (a worker the index does
        not match starts at page 0). Grouped by that page: O(matches + such workers), not a
        remembered-pages walk per match (a shared prompt's ~100 holders all stop at one page
        nobody remembers). Matched workers come first, in the index's order, as before."""
        n, stops = len(hashes), dict.fromkeys([0, *holders.device_pages.tolist()])
        device: dict[str, int] | None = None  # the holders' device runs, once one is needed
        found: dict[str, int] = {}
        for stop in stops:
            if stop < n:
                for worker in self.recent.holders(hashes[stop]):
                    if device is None:
                        device = dict(zip(holders.workers, holders.device_pages.tolist()))
                    if device.get(worker, 0) == stop and worker in allowed:
                        found[worker] = stop
        if not found:
            return []
        ordered = [(w, found[w]) for w in holders.workers if w in found]
        return ordered + [(w, s) for w, s in found.items() if w not in device]

    def choose(self, request: RouteRequest, candidates: Sequence[str], index: KvIndex,
               load: LoadTracker, all_scores: bool = True) -> RouteDecision:
        """`all_scores`: the decision lists every candidate's score (as `preview` does); off
        (the router's request path), the candidates are scored on arrays (`_decide_fast`: in C
        however many, in numpy from `array_min_candidates` on) and the decision lists the chosen
        worker's score alone."""
        fast = not all_scores and (self._in_c() or len(candidates) >= self.array_min_candidates)
        decide = self._decide_fast if fast else self._decide
        decision, match, tied = decide(request, candidates, index, load)
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
        require_candidates(candidates)
        cfg, total = self.config, request.prompt_tokens
        matches = self._matches(request, candidates, index)
        scores = self._score(request, candidates, matches, load)
        # A prompt whose best cached prefix is shorter than the work it brings anyway is mostly
        # new: where that work goes is a balance decision, so overloaded workers pay for it. A
        # prompt that is mostly cached somewhere (a next turn, a burst's later samples) is a
        # cache decision: the overload term leaves it alone.
        new = min(s.prefill_tokens for s in scores)
        overload_weight = cfg.overload_weight if total - new < new else 0.0
        balance = self._weigh(scores, overload_weight)
        tie = max(cfg.tie_abs_tokens, cfg.tie_rel * total)
        pick, reason, rotated = self._pick(scores, tie, overload_weight > 0.0)
        if scores[pick].prefill_tokens > new:
            holder = self._holder_to_keep(scores, balance, new, tie)
            if holder is not None:
                pick = holder
                reason = (f"kept on a holder of its prefix: load alone does not pay for recomputing "
                          f"{total - new:.0f} tokens")
        chosen = scores[pick]
        decision = RouteDecision(chosen.worker, self.name, reason, round(chosen.prefill_tokens), scores)
        return decision, matches.get(chosen.worker), rotated

    def _decide_fast(self, request: RouteRequest, candidates: Sequence[str], index: KvIndex,
                     load: LoadTracker) -> tuple[RouteDecision, PrefixMatch | None, bool]:
        """`_decide`'s decision, the same float operations in the same order, over arrays (in C
        when the gateway's library is there: affinity_arrays.py): a WorkerScore is built for
        the chosen worker alone. The property test in tests/gateway/test_policy_fast.py holds
        the two equal."""
        require_candidates(candidates)
        cfg, total, page = self.config, request.prompt_tokens, request.page_size
        held = self._holders(request, candidates, index)
        weights = Weights(total, cfg.prefill_weight, cfg.overload_weight, cfg.balance_weight,
                          cfg.queue_weight, cfg.inflight_weight_tokens,
                          max(cfg.tie_abs_tokens, cfg.tie_rel * total), cfg.move_queue_tokens,
                          self._rr)
        if held.workers:  # only the holders' prefill differs from the whole prompt's
            position = self._positions(candidates)
            at = np.fromiter(map(position.get, held.workers, repeat(-1)), np.intp,
                             len(held.workers))
            saved = self._saved_many(held, page)
        else:
            at, saved = np.zeros(0, np.intp), np.zeros(0)
        if self._in_c():
            now = load.now()
            columns, address, decay = load.rows(candidates, now)
            p = pick_in_c(weights, columns, address, decay, now, load.report_ttl_s, at, saved,
                          self._buffers)
        else:
            p = pick_on_arrays(weights, *load.columns(candidates),
                               prefill_of(total, len(candidates), at, saved))
        if p.kept:
            reason = (f"kept on a holder of its prefix: load alone does not pay for recomputing "
                      f"{total - p.new:.0f} tokens")
        elif p.tied > 1:
            reason = (f"near-tie of {p.tied} workers within {p.best + weights.tie - p.best:.0f} "
                      f"tokens: least work, then load")
        else:
            reason = ("lowest score (uncached prefill weighted by overload, new prompt + load)"
                      if total - p.new < p.new and cfg.overload_weight > 0.0
                      else "lowest score (uncached prefill + load)")
        worker = candidates[p.index]
        # `_score`'s WorkerScore, from the arrays (`get_many`'s conversions of the same columns)
        chosen = WorkerScore(worker, queued_prefill_tokens=int(p.queued),
                             inflight_requests=int(p.running), recent_prefill_tokens=p.recent,
                             prefill_tokens=p.prefill, overload=p.overload, score=p.score)
        m = held.match(held.workers.index(worker)) if worker in held.workers else None
        if m is not None:
            chosen.device_tokens, chosen.host_tokens = m.device_pages * page, m.host_pages * page
            chosen.remote_tokens, chosen.confidence = m.remote_pages * page, m.confidence
        decision = RouteDecision(worker, self.name, reason, round(chosen.prefill_tokens), [chosen])
        return decision, m, p.tied > 1

    def _in_c(self) -> bool:
        return self.pick_in_c and index_native.kernel() is not None

    def _positions(self, candidates: Sequence[str]) -> dict[str, int]:
        """worker -> its index in `candidates`; kept for a tuple (the router's candidate set,
        the same object decision after decision)."""
        kept = self._positions_of
        if kept is not None and kept[0] is candidates:
            return kept[1]
        position = dict(zip(candidates, range(len(candidates))))
        if type(candidates) is tuple:
            self._positions_of = (candidates, position)
        return position

    def _saved(self, m: PrefixMatch, page: int) -> float:
        """Prompt tokens a worker with this match does not compute (confidence-weighted)."""
        cfg = self.config
        return m.confidence * (m.device_pages * page + m.host_pages * page * (1.0 - cfg.host_cost)
                               + m.remote_pages * page * (1.0 - cfg.remote_cost))

    def _saved_many(self, holders: Holders, page: int) -> np.ndarray:
        """`_saved` of each holder, in numpy: the same operations in the same order, so the
        same floats."""
        cfg = self.config
        return holders.confidence * (holders.device_pages * page
                                     + holders.host_pages * page * (1.0 - cfg.host_cost)
                                     + holders.remote_pages * page * (1.0 - cfg.remote_cost))

    def _score(self, request: RouteRequest, candidates: Sequence[str],
               matches: dict[str, PrefixMatch], load: LoadTracker) -> list[WorkerScore]:
        """Each worker's load, overload and the prefill it would still do (its `score` is set
        by `_weigh`)."""
        page = request.page_size
        loads = load.get_many(candidates)
        recent = np.array([wl.recent_prefill_tokens for wl in loads])
        mean_recent = sum_in_order(recent) / len(loads)
        scores = []
        for worker, wl in zip(candidates, loads, strict=True):
            s = WorkerScore(worker, queued_prefill_tokens=wl.queued_prefill_tokens,
                            inflight_requests=wl.inflight_requests,
                            recent_prefill_tokens=wl.recent_prefill_tokens,
                            overload=overload_of(wl.recent_prefill_tokens, mean_recent))
            m = matches.get(worker)
            saved = 0.0
            if m is not None:
                s.device_tokens, s.host_tokens = m.device_pages * page, m.host_pages * page
                s.remote_tokens, s.confidence = m.remote_pages * page, m.confidence
                saved = self._saved(m, page)
            s.prefill_tokens = max(request.prompt_tokens - saved, 0.0)
            scores.append(s)
        return scores

    def _weigh(self, scores: list[WorkerScore], overload_weight: float) -> list[float]:
        """Sets every score; returns the balance part of each (prefill weighted by overload plus
        the long-horizon balance term: what the instant load terms are added to)."""
        cfg = self.config
        least_recent = min(s.recent_prefill_tokens for s in scores)
        balance = [cfg.prefill_weight * s.prefill_tokens * (1.0 + overload_weight * s.overload)
                   + cfg.balance_weight * (s.recent_prefill_tokens - least_recent) for s in scores]
        for s, b in zip(scores, balance, strict=True):
            s.score = (b + cfg.queue_weight * s.queued_prefill_tokens
                       + cfg.inflight_weight_tokens * s.inflight_requests)
        return balance

    def _pick(self, scores: list[WorkerScore], tie: float,
              overloaded: bool) -> tuple[int, str, bool]:
        """(the lowest score's index, why, whether a near-tie used the rotation)."""
        best = min(s.score for s in scores)
        band = best + tie
        tied = [i for i, s in enumerate(scores) if s.score <= band]
        if len(tied) == 1:
            return tied[0], ("lowest score (uncached prefill weighted by overload, new prompt + load)"
                             if overloaded else "lowest score (uncached prefill + load)"), False
        # Among near-ties the least work wins (a burst of one prompt stays where it is being
        # computed), then the least queued, then the least recent work (so new prefixes even out
        # the load over minutes, not only the instant queue), then rotation.
        n, rr = len(scores), self._rr
        pick = min(tied, key=lambda i: (scores[i].prefill_tokens, scores[i].queued_prefill_tokens,
                                        scores[i].recent_prefill_tokens, (i - rr) % n))
        return pick, (f"near-tie of {len(tied)} workers within {band - best:.0f} tokens: "
                      f"least work, then load"), True

    def _holder_to_keep(self, scores: list[WorkerScore], balance: list[float], new: float,
                        tie: float) -> int | None:
        """The pick would recompute a prefix that a holder has. Fine if balance asks for it (no
        holder within a near-tie of the best balance score) or the best holder's queue is long;
        not for requests in flight or a short queue alone: then the best-scoring holder."""
        holders = [i for i, s in enumerate(scores) if s.prefill_tokens == new]
        holder = min(holders, key=lambda i: scores[i].score)
        if (scores[holder].queued_prefill_tokens <= self.config.move_queue_tokens
                and min(balance[i] for i in holders) <= min(balance) + tie):
            return holder
        return None

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

    def settle(self) -> None:
        super().settle()
        self.routed.settle()

    def remembered(self) -> tuple[int, int]:
        recent, routed = super().remembered(), self.routed.remembered()
        return recent[0] + routed[0], recent[1] + routed[1]

    def _holders(self, request: RouteRequest, candidates: Sequence[str], index: KvIndex) -> Holders:
        return Holders.from_matches({w: PrefixMatch(n, 0, 0, 1.0)
                                     for w, n in self.routed.match(request.page_hashes).items()})

    def _record(self, request: RouteRequest, worker: str, match: PrefixMatch | None) -> None:
        self.routed.record(worker, request.page_hashes)

