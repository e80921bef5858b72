"""Writing a pool's pages to L3 again when the writes it listed did not stay there (issue 25,
finding 7): the store lost its data (a FLUSHALL, a Redis restarted empty: l3_loss), or the
worker could not do them (skipped while its circuit breaker was open, failed, dropped from its
full write queue: `StepRequest.failed_remote_writes`).

A run is marked written (`Node.in_remote`) when its write is listed, so that no write is listed
twice while it is in flight. Before this module the mark was never taken back: a write lost while
Redis was paused stayed "written" for good, and after a FLUSHALL a run came back to L3 only when
a match of this pool used it again, so the next turn of a conversation on another worker found
its history nowhere and computed it. Now, once per step (after the step's write-through):

- after a store generation bump, every run still on the worker (device or host) that the pool's
  write policy wrote (write-through: all; hot: those with enough hits; write-back: none, its
  runs are written when they leave) is queued for writing again, parents before children (an L3
  prefix is only as long as its first missing page);
- the worker's failure reports are remembered by page hash; once the store answered a check
  after the first of them (the store watch's `answered`; without a watch, `RETRY_S` later) the
  runs still holding such a page are marked unwritten and queued. A worker whose writes keep
  failing is thus asked again at most once per answered check, never in a loop of steps.
  Pages that left the worker meanwhile are gone for L3 (nothing holds their bytes any more).

The queue is drained `PAGES_PER_STEP` pages a step, so that refilling a large pool never makes
one huge StepResponse or floods the worker's write queue.
"""
from __future__ import annotations

import collections
from collections.abc import Callable

from cache_service.l3_loss import answers, generation
from cache_service.tree import HASH, Node, Root, nodes_below, size

PAGES_PER_STEP = 512  # writes listed again per step, at most (plus the last run's tail)
MAX_FAILED = 65536  # failed page hashes remembered; beyond, every resident run is retried
RETRY_S = 0.5  # without a store watch, failed writes are retried at most this often


class Refill:
    def __init__(self, placement, roots: dict[tuple[str, str], Root], remote,
                 clock: Callable[[], float]):
        """`placement`: the pool's Placement (its write_remote and policy); `roots`: the
        pool's namespaces (the dict itself, which the pool keeps up to date); `remote`: the
        cache service's L3 client (its store watch), or None."""
        self.placement, self.roots, self.remote, self.clock = placement, roots, remote, clock
        self.seen = generation(remote)  # the store generation this pool last refilled for
        self.failed: set[bytes] = set()
        self.failed_all = False  # more failures than MAX_FAILED: retry every resident run
        self.failed_mark: float | None = None  # answers() (or the clock) at the first report
        self.queue: collections.deque[Node] = collections.deque()
        self.failed_pages = 0  # page writes the worker reported failed (monotonic)
        self.queued_runs = 0  # runs queued to be written again (monotonic)

    def report_failed(self, hashes: bytes) -> None:
        """The worker could not write these pages (16-byte hashes, concatenated)."""
        n = len(hashes) // HASH
        self.failed_pages += n
        if self.failed_mark is None:
            self.failed_mark = self._mark()
        if self.failed_all:
            return
        self.failed.update(hashes[i:i + HASH] for i in range(0, n * HASH, HASH))
        if len(self.failed) > MAX_FAILED:  # a long outage: cheaper to retry everything
            self.failed_all, self.failed = True, set()

    def step(self) -> None:
        """Queues what must be written again (see the module docstring) and lists the writes
        of up to PAGES_PER_STEP queued pages."""
        gen = generation(self.remote)
        if gen != self.seen:
            self.seen = gen
            self._enqueue(self.placement.policy_wrote)
        if self.failed_mark is not None and self._answered_since(self.failed_mark):
            failed, every = self.failed, self.failed_all
            self.failed, self.failed_all, self.failed_mark = set(), False, None
            self._enqueue(lambda node: every or _holds_any(node, failed), unmark=True)
        budget = PAGES_PER_STEP
        queue = self.queue
        while queue and budget > 0:
            node = queue.popleft()
            if node.parent is None or node.pages is None or node.in_remote == gen:
                continue  # dropped, its namespace evicted, or written since it was queued
            self.placement.write_remote(node)
            budget -= size(node)

    def _enqueue(self, wanted: Callable[[Node], bool], unmark: bool = False) -> None:
        for root in list(self.roots.values()):
            for node in nodes_below(root):
                if wanted(node):
                    if unmark:
                        node.in_remote = 0
                    self.queue.append(node)
                    self.queued_runs += 1

    def _mark(self) -> float:
        answered = answers(self.remote)
        return self.clock() if answered is None else answered

    def _answered_since(self, mark: float) -> bool:
        answered = answers(self.remote)
        if answered is None:
            return self.clock() - mark >= RETRY_S
        return answered > mark


def _holds_any(node: Node, hashes: set[bytes]) -> bool:
    data = node.hashes
    return any(data[i:i + HASH] in hashes for i in range(0, len(data), HASH))
