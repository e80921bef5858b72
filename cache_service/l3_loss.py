"""Noticing that the L3 store lost its data (FLUSHALL, a Redis restarted empty, a failover to a
replica that never had it), so that pools write their pages again.

A pool writes each run to L3 once (`placement.Placement.write_remote`) and remembers it in
`Node.in_remote`. Without this, a store that lost its pages stayed empty of everything the
trees already held: after a FLUSHALL only a conversation's new pages came back, and the other
workers computed its whole prefix (issue 25, finding 7).

`StoreWatch` keeps a sentinel key of its own in the store (`<prefix>:sentinel:<random id>`, one
per cache service process, so several cache services sharing one Redis each notice a loss) and
checks it with one GET every `interval_s`. A missing sentinel, or one whose value is not the
random one it wrote (a store whose values were overwritten: a restart from a damaged or foreign
dump, a writer that replaced every key: the fault drill's redis-garbage), means the store lost
its data: the watch writes it again and bumps the store's *generation*. `Node.in_remote` holds the
generation in which the run was written (0: never), so a bump makes every run of every pool
"not written" at once; at its next step each pool queues again the writes of every run still on
the worker that its policy had written (l3_refill.Refill), so the next turn after a FLUSHALL
finds them in L3 instead of computing them. A Redis that cannot be asked changes nothing: the
check runs again once it answers. `answered` counts the checks that got an answer: a pool
retries the writes its worker reported failed once the store answered after the report.

Not covered: pages evicted one by one by Redis's maxmemory policy (the sentinel may survive
them), pages corrupted one by one with the sentinel intact (a worker that loads one rejects and
deletes it, computes the pages and writes them through; a pool that still holds such a page
writes it again only once it left the worker and was computed again), and on a Redis Cluster
the loss of a master other than the sentinel's.
"""
from __future__ import annotations

import logging
import secrets
import threading

log = logging.getLogger("cache_service.l3_loss")

FIRST_GENERATION = 1  # Node.in_remote == 0 means never written


def generation(remote) -> int:
    """The current store generation of an L3 client (FIRST_GENERATION without a watch)."""
    watch = getattr(remote, "store_watch", None)
    return watch.generation if watch is not None else FIRST_GENERATION


def answers(remote) -> int | None:
    """How many sentinel checks the store answered so far; None without a watch."""
    watch = getattr(remote, "store_watch", None)
    return watch.answered if watch is not None else None


class StoreWatch:
    # 5 GETs a second: a loss is known within 0.2 s, well before a conversation's next turn
    # (0.7 s apart or more in the fault drill), so its pages are back in L3 by then.
    def __init__(self, remote, interval_s: float = 0.2):
        """`remote`: a pagestore.L3Client (its `redis` client and `cfg.prefix`). Attaches
        itself to it (`remote.store_watch`), where the pools' tier policy reads the generation."""
        self.remote = remote
        self.interval_s = interval_s
        self.key = f"{remote.cfg.prefix}:sentinel:{secrets.token_hex(8)}"
        self.value = secrets.token_bytes(16)  # overwritten values show as a loss too
        self.generation = FIRST_GENERATION
        self.losses = 0  # times the store was found to have lost its data
        self.answered = 0  # checks the store answered (present or lost)
        self._armed = False  # the sentinel was written at least once
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        remote.store_watch = self

    def check(self) -> bool | None:
        """One check: True when the store lost its data since the last one (the generation was
        bumped), False when it did not, None when Redis could not be asked."""
        try:
            conn = self.remote.redis
            if not self._armed:
                conn.set(self.key, self.value)
                self._armed = True
                self.answered += 1
                return False
            if conn.get(self.key) == self.value:
                self.answered += 1
                return False
            conn.set(self.key, self.value)
        except Exception as exc:  # unreachable, timed out, a cluster without a master: later
            log.debug("event=l3_sentinel_unknown cause=%r", exc)
            return None
        self.answered += 1
        self.generation += 1
        self.losses += 1
        log.warning("event=l3_data_lost generation=%d: pools write their pages to L3 again",
                    self.generation)
        return True

    def start(self) -> StoreWatch:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="l3-store-watch", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        self.check()
        while not self._stop.wait(self.interval_s):
            self.check()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
