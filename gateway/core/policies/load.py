"""`LoadTracker`: per-worker load as the gateway sees it, from what it routed and from the
workers' own LoadReports."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from gateway.core.policies.base import WorkerLoad
from prefixcache.v1 import common_pb2

# Half-life of LoadTracker.recent_prefill_tokens: long enough that a relative load is an estimate
# over many prompts per worker, not noise (docs/design.md §6, "Routing policy").
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

    def get_many(self, workers: Sequence[str], now: float | None = None) -> list[WorkerLoad]:
        """`get` for each worker, at one instant (a routing decision's candidates)."""
        now = self._clock() if now is None else now
        pending, inflight, reports, recent = self._pending, self._inflight, self._reports, self._recent
        ttl, halflife = self.report_ttl_s, self.recent_halflife_s
        out = []
        for worker in workers:
            queued, running = pending.get(worker, 0), inflight.get(worker, 0)
            rep = reports.get(worker)
            if rep is not None and now - rep[0] <= ttl:
                queued, running = max(queued, rep[1]), max(running, rep[2])
            value, when = recent.get(worker, (0.0, now))
            out.append(WorkerLoad(queued, running, value * 0.5 ** ((now - when) / halflife)))
        return out

    def get(self, worker: str, now: float | None = None) -> WorkerLoad:
        now = self._clock() if now is None else now
        queued, inflight = self._pending.get(worker, 0), self._inflight.get(worker, 0)
        rep = self._reports.get(worker)
        if rep is not None and now - rep[0] <= self.report_ttl_s:
            queued, inflight = max(queued, rep[1]), max(inflight, rep[2])
        return WorkerLoad(queued, inflight, self._decayed(worker, now))
