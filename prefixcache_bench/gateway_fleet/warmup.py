"""`--warmup-compare`: routing during a cold warm-up, the gateway's affinity routing against
load-only routing, decision by decision on the same requests.

The gateway routes only to workers whose snapshot is applied (`synced`; all of them, by load
alone, while none is). At each decision of the bench's routing thread (`_Router`'s requests: a
pool's conversation, its holder known, or a system prompt) the real `Router.route` decides (a),
and a `least_loaded` policy over every worker that is up decides (b) on a load tracker of its
own, so that each policy sees the load its own choices made. Requests stay in flight for
`inflight` decisions (one per pool: a worker's fair share is one), so that load counts.
Decisions are tallied by phase: the share of pools synced when the decision was made.
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


class WarmupTally:
    """Each policy's choices per phase: the share routed to the known holder, and the load
    spread (max over mean of decisions per worker, over every worker of the fleet: 1.0 is even),
    and the most requests one worker had in flight."""

    def __init__(self, workers: list[str]):
        self.workers = workers
        self.counts = [{"affinity": Counter(), "load_only": Counter()} for _ in PHASES]
        self.held = [[0, 0, 0] for _ in PHASES]  # requests with a holder; to it: affinity, load-only
        self.peak = [[0, 0] for _ in PHASES]  # most in flight on one worker: affinity, load-only

    def record(self, synced_share: float, affinity: str, load_only: str, holder: str | None,
               inflight: tuple[int, int] = (0, 0)) -> None:
        """One decision; `inflight`: what each policy's chosen worker has in flight with it."""
        p = phase_of(synced_share)
        self.counts[p]["affinity"][affinity] += 1
        self.counts[p]["load_only"][load_only] += 1
        self.peak[p] = [max(a, b) for a, b in zip(self.peak[p], inflight)]
        if holder is not None:
            held = self.held[p]
            held[0] += 1
            held[1] += affinity == holder
            held[2] += load_only == holder

    def _spread(self, counts: Counter) -> float:
        total = sum(counts.values())
        return max(counts.values()) / (total / len(self.workers)) if total else 0.0

    def summary(self) -> list[dict]:
        rows = []
        for p, name in enumerate(PHASE_NAMES):
            c, (held, aff, lo) = self.counts[p], self.held[p]
            decisions = sum(c["affinity"].values())
            rows.append({
                "synced_share": name, "decisions": decisions,
                "affinity_to_holder": aff / held if held else None,
                "load_only_to_holder": lo / held if held else None,
                "affinity_load_spread": self._spread(c["affinity"]),
                "load_only_load_spread": self._spread(c["load_only"]),
                "affinity_max_inflight": self.peak[p][0], "load_only_max_inflight": self.peak[p][1],
                "affinity_workers_used": len(c["affinity"]), "load_only_workers_used": len(c["load_only"]),
            })
        return rows


def compare_run(timed, router: Router, workers: list[str], stop_after_warm) -> None:
    """The routing thread's loop of `--warmup-compare` (it replaces `_Router._run`): until
    `stop_after_warm` is set. `timed` is the `_Router` whose requests and samples it uses."""
    rng, n = random.Random(1), 0
    shadow, load_only = LoadTracker(), make_policy("least_loaded")
    inflight: deque[tuple[str, str, str]] = deque()  # (request, affinity's worker, load-only's)
    on = {"affinity": Counter(), "load_only": Counter()}  # requests in flight per worker
    tally = timed.tally = WarmupTally(workers)
    while not timed.stop.is_set() and not stop_after_warm.is_set():
        req, holder = timed._request(rng, n)
        with router.lock:  # the synced share and (b)'s choice on the state (a) sees
            synced = sum(w.synced for w in router._workers.values()) / len(workers)
            other = load_only.choose(req, workers, router.index, shadow).worker
        start = time.perf_counter()
        route = router.route(req)
        timed.samples.append((start, time.perf_counter() - start))
        if route is not None:
            chosen = route.worker.name
            shadow.on_route(other, req.request_id, req.prompt_tokens)
            inflight.append((req.request_id, chosen, other))
            on["affinity"][chosen] += 1
            on["load_only"][other] += 1
            tally.record(synced, chosen, other, holder, (on["affinity"][chosen], on["load_only"][other]))
            if len(inflight) > len(workers):
                done, a, b = inflight.popleft()
                router.finish(done)
                shadow.on_finish(done)
                on["affinity"][a] -= 1
                on["load_only"][b] -= 1
        n += 1
        time.sleep(0.001)
    for rid, _, _ in inflight:
        router.finish(rid)
