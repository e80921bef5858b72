"""The workers a routing decision may choose from, kept between decisions (issue 31).

A worker is eligible when it is up, its event stream delivered a complete view (`synced`) or is
live (`streaming`: during a warm-up, its snapshot in progress, scored by what the index holds of
it so far), and its last event is at most `dead_after_s` old (`scan`, `Router._eligible`). While
no eligible worker's view is complete, the set is every worker up ("blind", not kept). Scanning
every worker for that on each decision was the largest part of a decision at 1,000 workers;
`CandidateSets` keeps each tokenizer's set (a tuple: the load tracker and the affinity policy
key their per-candidate arrays on that object) and answers from it while it is known to be
right:

- the `Router` clears it on any change of membership or state that may change them: a worker
  joins or leaves, is marked up or down, loses `synced`, loses `streaming` while not synced;
- a worker outside the kept sets whose event or live stream makes it eligible (a stale worker
  whose stream came back, a warm-up's worker whose stream went live) joins each kept set of its
  tokenizer in name order (`_join`), which is what a rescan would find: at 1,000 workers a
  warm-up had ~1,000 rescans of ~0.3-0.6 ms each, one a worker joining;
- events of workers in the sets only make them fresher, so a set stays right until its least
  recently seen worker turns stale; it is recomputed then.

The shared index (gateway/core/shared_index.py) reads `last_seen` from Redis, refreshed
periodically: there nothing is kept, each decision scans.
"""
from __future__ import annotations

from bisect import insort
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from gateway.core.index_types import IndexConfig
    from gateway.core.router import Worker


class _Index(Protocol):
    config: IndexConfig

    def last_seen(self, pool_id: str) -> float | None: ...


# (the candidates sorted by name, blind, the least recently seen one's last event)
_Set = tuple[tuple[str, ...], bool, float]


def eligible_since(w: Worker, index: _Index, now: float) -> float | None:
    """The worker's last event when it is eligible (the rule above, design.md "Routing during
    warm-up"), else None."""
    if not (w.up and (w.synced or w.streaming)):
        return None
    t = index.last_seen(w.name)
    return t if t is not None and max(0.0, now - t) <= index.config.dead_after_s else None


class CandidateSets:
    def __init__(self, workers: dict[str, Worker], index: _Index, clock: Callable[[], float],
                 keep: bool = True) -> None:
        self._workers = workers  # the router's own dict: read, never changed here
        self._index = index
        self._clock = clock
        self._keep = keep
        self._sets: dict[str, _Set] = {}  # tokenizer fingerprint -> its set
        # Every worker in a kept set: an event from any other may make it eligible.
        self._names: set[str] = set()
        self._members: tuple[tuple[str, ...], frozenset[str]] | None = None
        self._sorted: list[Worker] | None = None  # `_by_name`

    def get(self, exclude: Collection[str], fingerprint: str,
            now: float) -> tuple[Sequence[str], bool]:
        """(the candidates, blind: no eligible worker's view is complete, so the candidates are
        the workers up, to be routed to by load and what the index holds so far)."""
        kept = self._kept(fingerprint, now)
        if kept is None:
            kept = self.scan(fingerprint, now)
            if self._keep and not kept[1]:  # a blind set is not kept: any event may end it
                self._sets[fingerprint] = kept
                self._names.update(kept[0])
        names, blind = kept[0], kept[1]
        if not exclude:
            return names, blind
        rest = [n for n in names if n not in exclude]
        if blind or any(self._workers[n].synced for n in rest):  # (a retry: rare)
            return rest, blind
        return self.scan(fingerprint, now, exclude)[:2]  # the blind set without them

    def _kept(self, fingerprint: str, now: float) -> _Set | None:
        kept = self._sets.get(fingerprint)
        if kept is None:
            return None
        # `scan`'s test on the least recently seen worker: every other one passes it too.
        if max(0.0, now - kept[2]) <= self._index.config.dead_after_s:
            return kept
        self.clear()  # a worker went stale: the names must not hold it (its next event clears)
        return None

    def scan(self, fingerprint: str, now: float, exclude: Collection[str] = ()) -> _Set:
        """The set from every worker's state (what each decision computed before it was kept).
        `eligible_since`'s test, written out in one loop: at 1,000 workers a call per worker
        took ~0.3 of the ~0.6 ms of a rescan, which a warm-up pays once for each worker
        joining the set (~1,000 rescans; the fleet bench's route() tail during warm-up)."""
        dead, seen = self._index.config.dead_after_s, self._index.last_seen
        alive = 0.0 <= dead  # max(0.0, now - t) <= dead: both terms are tested apart
        usable, eligible, oldest, complete = [], [], float("inf"), False
        for w in self._by_name():
            if w.name in exclude or (fingerprint and w.info.tokenizer_fingerprint != fingerprint):
                continue
            usable.append(w)
            if not (w.up and (w.synced or w.streaming)):
                continue
            t = seen(w.name)
            if t is not None and alive and now - t <= dead:
                eligible.append(w.name)
                if t < oldest:
                    oldest = t
                complete = complete or w.synced
        if complete:
            return tuple(eligible), False, oldest
        # No eligible worker's view is complete (the cache services are unreachable, say, or a
        # cold start has applied no snapshot yet): route over every worker up, on what the index
        # holds so far (nothing, or parts of snapshots), rather than refuse work the workers may
        # still do or pile it on the few streams that delivered first.
        return tuple(w.name for w in usable if w.up), True, float("inf")

    def _by_name(self) -> list[Worker]:
        """The router's workers sorted by name, kept until one joins or leaves
        (`joined_or_left`)."""
        if self._sorted is None:
            self._sorted = [w for _, w in sorted(self._workers.items())]
        return self._sorted

    def members(self, candidates: Sequence[str]) -> Collection[str]:
        """`candidates` as a set; kept for the last tuple asked (a kept set, decision after
        decision)."""
        kept = self._members
        if kept is not None and kept[0] is candidates:
            return kept[1]
        members = frozenset(candidates)
        if type(candidates) is tuple:
            self._members = (candidates, members)
        return members

    def on_item(self, name: str, was_synced: bool, synced: bool) -> None:
        """A worker's stream delivered an item (its last event is now). A worker of the kept
        sets that gains `synced` stays eligible, and the sets stay what they are (kept sets
        are not blind: they hold a synced worker already); at 1,000 workers that was half a
        warm-up's rescans (each worker clears the sets when its stream goes live and when its
        snapshot completes). Losing it may end its eligibility, or a set's only synced one.
        A worker outside the sets joins them if it is eligible now."""
        if was_synced and not synced:
            self.clear()
        elif name not in self._names:
            self._join(name)

    def on_streaming(self, worker: Worker) -> None:
        """A worker's stream went live or ended: a synced worker is eligible either way; one
        whose stream went live joins the sets if its last event is fresh."""
        if worker.synced:
            return
        if worker.streaming:
            if worker.name not in self._names:
                self._join(worker.name)
        else:
            self.clear()

    def _join(self, name: str) -> None:
        """Adds an eligible worker outside the kept sets to those of its tokenizer (each stays
        sorted; its least recently seen worker is not this one, whose event is the latest)."""
        if not self._sets:
            return
        w = self._workers.get(name)
        seen = None if w is None else eligible_since(w, self._index, self._clock())
        if seen is None:
            return
        for fingerprint, (names, blind, oldest) in self._sets.items():  # values replaced only
            if fingerprint and w.info.tokenizer_fingerprint != fingerprint:
                continue
            joined = list(names)
            insort(joined, name)
            self._sets[fingerprint] = (tuple(joined), blind, min(oldest, seen))
        self._names.add(name)

    def joined_or_left(self) -> None:
        """A worker joined the router's workers or left them."""
        self._sorted = None
        self.clear()

    def clear(self) -> None:
        if self._sets:
            self._sets.clear()
            self._names.clear()
