"""The affinity policy's pick over many candidates (`AffinityPolicy._decide_fast`), two ways that
give the same answer to the last bit: `pick_on_arrays` in numpy (the reference, and what serves
without the gateway's C library), and `pick_in_c` (csrc/affinity_pick.c), one call where numpy
makes ~30 of a few µs each (issue 31: a decision's cost decides how much of the gateway's core
is left for ingest). Both compute `_decide`'s floats with the same operations in the same order;
tests/gateway/test_policy_fast.py holds the three equal."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from gateway.core import index_native


@dataclass(slots=True)
class Pick:
    """The chosen candidate and its figures: its position, how many candidates were within the
    near-tie band (more than one: the rotation moves), whether it was kept on a holder of the
    prefix against load, the best score and the least prefill of all, then its own load,
    prefill, overload and score."""
    index: int
    tied: int
    kept: bool
    best: float
    new: float
    queued: float
    running: float
    recent: float
    prefill: float
    overload: float
    score: float


@dataclass(slots=True)
class Weights:
    """The scalars of a pick: the prompt's tokens, the policy's weights (AffinityConfig), the
    near-tie band, and the rotation's place."""
    total: float
    prefill: float
    overload: float
    balance: float
    queue: float
    inflight: float
    tie: float
    move_queue: float
    rotation: int


def prefill_of(total: float, n: int, at: np.ndarray, saved: np.ndarray) -> np.ndarray:
    """The prompt tokens each of n candidates would compute: the whole prompt, but for the
    holders at `at` (their candidate positions, -1: not a candidate), less what they save."""
    prefill = np.full(n, max(total - 0.0, 0.0))
    if len(at):
        if at.min() < 0:  # holders that are not candidates
            saved, at = saved[at >= 0], at[at >= 0]
        prefill[at] = np.maximum(total - saved, 0.0)
    return prefill


def pick_on_arrays(w: Weights, queued: np.ndarray, running: np.ndarray, recent: np.ndarray,
                   prefill: np.ndarray) -> Pick:
    """The pick in numpy, from the candidates' load columns (LoadTracker.columns) and prefill."""
    n, total, tie = len(prefill), w.total, w.tie
    new = float(prefill.min())
    overload_weight = w.overload if total - new < new else 0.0
    mean_recent = sum_in_order(recent) / n
    # Passes that would multiply by exactly 1 are skipped: x * 1.0 is x, and so is
    # x * (1.0 + 0.0 * overload) (overload is finite: at most n).
    weighted = prefill if w.prefill == 1.0 else w.prefill * prefill
    if overload_weight:
        overload = (np.maximum(recent / mean_recent - 1.0, 0.0) if mean_recent > 0.0
                    else np.zeros(n))
        weighted = weighted * (1.0 + overload_weight * overload)
    balance = weighted + w.balance * (recent - recent.min())
    score = balance + w.queue * queued + w.inflight * running
    best = score.min()
    tied = np.flatnonzero(score <= best + tie)
    if len(tied) == 1:
        pick = int(tied[0])
    else:  # least work, queued, recent, then rotation (lexsort: last key first)
        rotation = (tied - w.rotation) % n
        pick = int(tied[np.lexsort((rotation, recent[tied], queued[tied], prefill[tied]))[0]])
    kept = False
    if prefill[pick] > new:
        holders = np.flatnonzero(prefill == new)
        holder = int(holders[np.argmin(score[holders])])
        if queued[holder] <= w.move_queue and balance[holders].min() <= balance.min() + tie:
            pick, kept = holder, True
    return Pick(pick, len(tied), kept, float(best), new, float(queued[pick]),
                float(running[pick]), float(recent[pick]), float(prefill[pick]),
                overload_of(float(recent[pick]), mean_recent), float(score[pick]))


def overload_of(recent: float, mean_recent: float) -> float:
    """One worker's overload: how far its recent work is above the candidates' mean, as a
    fraction of it (0 at or below it, or when the mean is 0); every scoring path's."""
    return max(recent / mean_recent - 1.0, 0.0) if mean_recent > 0.0 else 0.0


def sum_in_order(values: np.ndarray) -> float:
    """The sum of the values added first to last (what `sum` of a list of floats does before
    Python 3.12), in numpy: every scoring path uses it, so they agree to the last bit."""
    return float(np.cumsum(values)[-1]) if len(values) else 0.0


class Buffers:
    """The C call's scratch (6 doubles a candidate) and answer, kept between a policy's calls (a
    numpy array's address costs ~1 µs to read): the policy's own, as it is used under the
    router's lock."""

    def __init__(self) -> None:
        self.n = 0
        self.scratch = np.zeros(0)
        self.scratch_at = 0
        self.out = (ctypes.c_double * 11)()

    def reserve(self, n: int) -> int:
        if n > self.n:
            self.n = max(n, 2 * self.n)
            self.scratch = np.zeros(6 * self.n)
            self.scratch_at = self.scratch.ctypes.data
        return self.scratch_at


_NO_HOLDERS = np.zeros(0, np.int64)


def pick_in_c(w: Weights, columns: np.ndarray, columns_at: int, decay: np.ndarray, now: float,
              report_ttl_s: float, at: np.ndarray, saved: np.ndarray, buffers: Buffers) -> Pick:
    """The pick in C, from the candidates' rows of LoadTracker's table (`columns`, contiguous,
    column x candidate; `columns_at` its address), each one's decay of its recent work, and the
    holders' candidate positions and saved tokens (as `prefill_of` takes them)."""
    n = columns.shape[1]
    at = np.ascontiguousarray(at, np.int64) if len(at) else _NO_HOLDERS
    saved = np.ascontiguousarray(saved, np.float64)
    params = (ctypes.c_double * 10)(w.total, w.prefill, w.overload, w.balance, w.queue,
                                    w.inflight, w.tie, w.move_queue, now, report_ttl_s)
    out = buffers.out
    index_native.kernel().af_pick(columns_at, decay.ctypes.data, n, at.ctypes.data,
                                  saved.ctypes.data, len(at), params, w.rotation,
                                  buffers.reserve(n), out)
    pick, tied, kept, best, new, queued, running, recent, prefill, overload, score = out
    return Pick(int(pick), int(tied), kept != 0.0, best, new, queued, running, recent, prefill,
                overload, score)
