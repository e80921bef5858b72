"""`--warmup-compare`: routing during a cold warm-up, the gateway's affinity routing against
load-only routing, decision by decision on the same requests.

The gateway routes to workers whose snapshot is applied (`synced`) or whose stream is live
(`streaming`: the snapshot in progress, scored by what the index holds so far), and to every
worker up while none of those is synced (it routed to `synced` workers alone before, to every
worker up while none was: `docs/results/gateway/fleet/before_warmup_candidates/`). At each
decision of the bench's routing thread (`_Router`'s requests: a pool's conversation, its holder
known, or a system prompt) the real `Router.route` decides (a), and a `least_loaded` policy over
every worker that is up decides (b) on a load tracker of its own, so that each policy sees the
load its own choices made. Requests stay in flight for `inflight` decisions (one per pool: a
worker's fair share is one), so that load counts. Decisions are tallied by phase: the share of pools synced when the decision was made.
"""
from __future__ import annotations

import random
import time
from collections import Counter, deque

from gateway.core.policies import LoadTracker, make_policy
from gateway.core.router import Router

# Upper bounds of the synced share: none (every worker routed to by load alone), then (0-25%),
# [25-50%), ... [75-100%].
PHASES = (0.0, 0.25, 0.5, 0.75, 1.0)
PHASE_NAMES = ("none", "0-25%", "25-50%", "50-75%", "75-100%")


def phase_of(synced_share: float) -> int:
    """The phase a decision falls in; a fully synced fleet is the last one."""
    if synced_share <= 0:
        return 0
    return next(i for i, top in enumerate(PHASES) if i and (synced_share < top or top == PHASES[-1]))


POLICIES = ("affinity", "load_only", "affinity_all")


class WarmupTally:
    """Each policy's choices per phase: the share routed to the known holder, the load spread
    (max over mean of decisions per worker, over every worker of the fleet: 1.0 is even), and
    the most requests one worker had in flight."""

    def __init__(self, workers: list[str], policies: tuple[str, ...] = POLICIES):
        self.workers, self.policies = workers, policies
        self.counts = [{k: Counter() for k in policies} for _ in PHASES]
        self.held = [0 for _ in PHASES]  # requests whose holder is known
        self.to_holder = [Counter() for _ in PHASES]  # of those, routed to it, per policy
        self.peak = [Counter() for _ in PHASES]  # most in flight on one worker, per policy

    def record(self, synced_share: float, chosen: dict[str, str], holder: str | None,
               inflight: dict[str, int] | None = None) -> None:
        """One decision: each policy's worker; `inflight`: what that worker then has in flight."""
        p = phase_of(synced_share)
        for policy, worker in chosen.items():
            self.counts[p][policy][worker] += 1
            self.peak[p][policy] = max(self.peak[p][policy], (inflight or {}).get(policy, 0))
            self.to_holder[p][policy] += worker == holder
        self.held[p] += holder is not None

    def _spread(self, counts: Counter) -> float:
        total = sum(counts.values())
        return max(counts.values()) / (total / len(self.workers)) if total else 0.0

    def summary(self) -> list[dict]:
        rows = []
        for p, name in enumerate(PHASE_NAMES):
            held = self.held[p]
            row = {"synced_share": name, "decisions": sum(self.counts[p][self.policies[0]].values())}
            for k in self.policies:
                row[f"{k}_to_holder"] = self.to_holder[p][k] / held if held else None
            for k in self.policies:
                row[f"{k}_load_spread"] = self._spread(self.counts[p][k])
            for k in self.policies:
                row[f"{k}_max_inflight"] = self.peak[p][k]
            for k in self.policies:
                row[f"{k}_workers_used"] = len(self.counts[p][k])
            rows.append(row)
        return rows


class _Shadow:
    """A policy deciding beside the router on a load tracker of its own (its choices change
    neither the router's load nor its policy's state)."""

    def __init__(self, policy: str):
        self.policy, self.load = make_policy(policy), LoadTracker()

    def choose(self, req, workers: list[str], router: Router) -> str:
        worker = self.policy.choose(req, workers, router.index, self.load).worker
        self.load.on_route(worker, req.request_id, req.prompt_tokens)
        return worker


def compare_run(timed, router: Router, workers: list[str], stop_after_warm) -> None:
    """The routing thread's loop of `--warmup-compare` (it replaces `_Router._run`): until
    `stop_after_warm` is set. `timed` is the `_Router` whose requests and samples it uses.
    `affinity`: the gateway's `Router.route`; `load_only`: least_loaded over every worker;
    `affinity_all`: the affinity policy over every worker (a worker still in its snapshot a
    candidate, scored by what the index holds of it so far; what the gateway now does, on a
    load tracker of its own that counts the whole prompt where `Router.route` counts the
    prefill the chosen worker computes)."""
    rng, n = random.Random(1), 0
    shadows = {"load_only": _Shadow("least_loaded"), "affinity_all": _Shadow("affinity")}
    inflight: deque[tuple[str, dict[str, str]]] = deque()
    on = {k: Counter() for k in POLICIES}  # requests in flight per worker, per policy
    tally = timed.tally = WarmupTally(workers)
    while not timed.stop.is_set() and not stop_after_warm.is_set():
        req, holder = timed._request(rng, n)
        n += 1
        with router.lock:  # the synced share and the shadows' choices on the state route sees
            synced = sum(w.synced for w in router._workers.values()) / len(workers)
            chosen = {k: s.choose(req, workers, router) for k, s in shadows.items()}
        start = time.perf_counter()
        route = router.route(req)
        took = time.perf_counter() - start
        timed.samples.append((start, took, took, took))  # no schedule here: route()'s own time
        time.sleep(0.001)
        if route is None:
            continue
        chosen["affinity"] = route.worker.name
        inflight.append((req.request_id, chosen))
        for k, w in chosen.items():
            on[k][w] += 1
        tally.record(synced, chosen, holder, {k: on[k][w] for k, w in chosen.items()})
        if len(inflight) > len(workers):
            _finish(router, shadows, on, *inflight.popleft())
    for rid, chosen in inflight:
        _finish(router, shadows, on, rid, chosen)


def _finish(router: Router, shadows: dict[str, _Shadow], on: dict[str, Counter], rid: str,
            chosen: dict[str, str]) -> None:
    router.finish(rid)
    for s in shadows.values():
        s.load.on_finish(rid)
    for k, w in chosen.items():
        on[k][w] -= 1
