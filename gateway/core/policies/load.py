"""`LoadTracker`: per-worker load as the gateway sees it, from what it routed and from the
workers' own LoadReports."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from itertools import repeat

import numpy as np

from gateway.core.policies.base import WorkerLoad
from prefixcache.v1 import common_pb2

# Half-life of LoadTracker.recent_prefill_tokens: long enough that a relative load is an estimate
# over many prompts per worker, not noise (docs/design.md §6, "Routing policy").
RECENT_HALFLIFE_S = 600.0

# The columns of LoadTracker's table, one row per worker; row 0 stays all "nothing known" (no
# load, no report) and stands for any worker the tracker has not seen.
_PENDING, _INFLIGHT, _REPORT_WHEN, _REPORT_QUEUED, _REPORT_REQUESTS, _RECENT, _RECENT_WHEN = range(7)
_EMPTY_ROW = (0.0, 0.0, -np.inf, 0.0, 0.0, 0.0, 0.0)


class _Rows(dict):
    """worker -> its row; a worker without one reads row 0."""

    def __missing__(self, worker: str) -> int:
        return 0


class LoadTracker:
    """Per-worker load as the gateway sees it.

    Queued prefill = max(this gateway's routed-but-no-first-token prefill, the worker's reported
    queue), not the sum: the report already counts what this gateway routed, and the max is right
    whether the gateway is the worker's only client (its own view is fresher) or one of several
    (the report sees the others). Reports older than report_ttl_s are ignored.

    The numbers live in one float table (a row per worker) so that a routing decision reads all
    candidates' loads with a few array operations (`columns`), not a Python loop over workers.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, report_ttl_s: float = 5.0,
                 recent_halflife_s: float = RECENT_HALFLIFE_S) -> None:
        self._clock = clock
        self.report_ttl_s = report_ttl_s
        self.recent_halflife_s = recent_halflife_s
        self._routed: dict[str, tuple[str, int]] = {}  # request id -> (worker, prefill pending)
        self._rows = _Rows()
        self._free = list(range(7, 0, -1))  # rows not in use, the next one last
        self._table = np.array([_EMPTY_ROW] * 8, dtype=np.float64)
        # The last tuple of workers `columns` was asked for (the router's candidate set, the same
        # object decision after decision) and a copy of its rows, kept in step with the table.
        self._kept: _KeptRows | None = None

    def _row(self, worker: str) -> int:
        row = self._rows.get(worker)
        if row is None:
            if not self._free:
                used = len(self._table)
                self._table = np.concatenate([self._table, np.array([_EMPTY_ROW] * used)])
                self._free = list(range(len(self._table) - 1, used - 1, -1))
            row = self._rows[worker] = self._free.pop()
            if self._kept is not None:
                self._kept.given_row(worker, row)  # an empty row, as row 0 is: no copy
        return row

    def _copy_row(self, row: int) -> None:
        """After a write to the table's row: the same in the kept copy."""
        if self._kept is not None:
            self._kept.copy(row, self._table)

    def report(self, worker: str, load: common_pb2.LoadReport, now: float | None = None) -> None:
        when, row = (self._clock() if now is None else now), self._row(worker)
        self._table[row, _REPORT_WHEN:_RECENT] = (
            when, load.queued_prefill_tokens, load.waiting_requests + load.running_requests)
        self._copy_row(row)

    def on_route(self, worker: str, request_id: str, prefill_tokens: int) -> None:
        self._routed[request_id] = (worker, prefill_tokens)
        row, now = self._row(worker), self._clock()
        t = self._table
        t[row, _PENDING] += prefill_tokens
        t[row, _INFLIGHT] += 1
        t[row, _RECENT] = self._decayed(row, now) + prefill_tokens
        t[row, _RECENT_WHEN] = now
        self._copy_row(row)

    def _decayed(self, row: int, now: float) -> float:
        value, when = self._table[row, _RECENT], self._table[row, _RECENT_WHEN]
        if row == 0 or value == 0.0:
            return 0.0
        return float(value * np.power(0.5, (now - when) / self.recent_halflife_s))

    def on_first_token(self, request_id: str) -> None:
        """Its prefill is done: it no longer counts as queued prefill work."""
        entry = self._routed.get(request_id)
        if entry is not None and entry[1]:
            worker, tokens = entry
            row = self._rows[worker]
            self._table[row, _PENDING] -= tokens
            self._copy_row(row)
            self._routed[request_id] = (worker, 0)

    def on_finish(self, request_id: str) -> None:
        """Finished, failed or aborted."""
        self.on_first_token(request_id)
        entry = self._routed.pop(request_id, None)
        if entry is not None and entry[0] in self._rows:
            row = self._rows[entry[0]]
            self._table[row, _INFLIGHT] -= 1
            self._copy_row(row)

    def remove_worker(self, worker: str) -> None:
        for rid in [r for r, (w, _) in self._routed.items() if w == worker]:
            del self._routed[rid]
        row = self._rows.pop(worker, None)
        self._kept = None
        if row is not None:
            self._table[row] = _EMPTY_ROW
            self._free.append(row)

    def now(self) -> float:
        """The tracker's clock (a decision reads every load at one instant)."""
        return self._clock()

    def columns(self, workers: Sequence[str], now: float | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(queued prefill tokens, requests in flight, recent prefill tokens) of each worker, as
        float arrays in the order given, at one instant (a routing decision's candidates)."""
        now = self._clock() if now is None else now
        cols = self._columns_of(workers)
        fresh = now - cols[_REPORT_WHEN] <= self.report_ttl_s
        queued = np.where(fresh, np.maximum(cols[_PENDING], cols[_REPORT_QUEUED]), cols[_PENDING])
        running = np.where(fresh, np.maximum(cols[_INFLIGHT], cols[_REPORT_REQUESTS]), cols[_INFLIGHT])
        value = cols[_RECENT]
        recent = np.where(value == 0.0, 0.0, value * self._decay(cols, now))
        return queued, running, recent

    def rows(self, workers: Sequence[str], now: float) -> tuple[np.ndarray, int, np.ndarray]:
        """What `columns` is computed from, for the affinity policy's C pick (its numpy twin):
        the workers' rows (column x worker, contiguous), their address, and the decay of each
        one's recent work (numpy's power: the C loop's pow may differ in the last bit)."""
        kept = self._kept
        if kept is not None and kept.workers is workers:
            cols, at = kept.columns, kept.address
        else:
            cols = np.ascontiguousarray(self._columns_of(workers))
            at = cols.ctypes.data
        return cols, at, self._decay(cols, now)

    def _decay(self, cols: np.ndarray, now: float) -> np.ndarray:
        return np.power(0.5, (now - cols[_RECENT_WHEN]) / self.recent_halflife_s)

    def _columns_of(self, workers: Sequence[str]) -> np.ndarray:
        """The workers' rows as columns (column x worker): for the kept tuple its copy, with no
        gather of the table's rows per decision."""
        kept = self._kept
        if kept is not None and kept.workers is workers:
            return kept.columns
        numbers = np.fromiter(map(self._rows.get, workers, repeat(0)), np.intp, len(workers))
        if type(workers) is not tuple:  # a tuple is immutable: the same object, the same workers
            return self._table[numbers].T
        self._kept = _KeptRows(workers, numbers, self._table)
        return self._kept.columns

    def get_many(self, workers: Sequence[str], now: float | None = None) -> list[WorkerLoad]:
        """`get` for each worker, at one instant."""
        queued, running, recent = (c.tolist() for c in self.columns(workers, now))
        return [WorkerLoad(int(q), int(r), v) for q, r, v in zip(queued, running, recent, strict=True)]

    def get(self, worker: str, now: float | None = None) -> WorkerLoad:
        return self.get_many([worker], now)[0]


class _KeptRows:
    """A tuple of workers' rows of LoadTracker's table, copied as contiguous columns (column x
    worker) and kept in step with the table by LoadTracker (`copy` after each write)."""

    def __init__(self, workers: tuple[str, ...], numbers: np.ndarray, table: np.ndarray) -> None:
        self.workers = workers
        self.columns = np.ascontiguousarray(table[numbers].T)
        self.address = self.columns.ctypes.data  # written in place only: it stays
        # row -> position in the tuple (-1: a row of no worker here), filled in numpy: a dict
        # built by a Python loop was ~0.1 ms of a new candidate set at 1,000 workers, paid
        # each time a worker joins the set (a warm-up's ~1,000 times). The workers on row 0
        # (none yet) are found when they get theirs (`given_row`).
        self._position = np.full(len(table), -1, np.int64)
        has_row = numbers > 0
        self._position[numbers[has_row]] = np.flatnonzero(has_row)

    def given_row(self, worker: str, row: int) -> None:
        """A worker's first row (it had none, so if it is here it is on row 0 here): a search
        of the tuple, once in a worker's life, rather than a map of the rowless per tuple."""
        try:
            i = self.workers.index(worker)
        except ValueError:
            return
        if row >= len(self._position):  # the table grew
            grown = np.full(2 * row + 1, -1, np.int64)
            grown[:len(self._position)] = self._position
            self._position = grown
        self._position[row] = i

    def copy(self, row: int, table: np.ndarray) -> None:
        i = int(self._position[row]) if row < len(self._position) else -1
        if i >= 0:
            self.columns[:, i] = table[row]
