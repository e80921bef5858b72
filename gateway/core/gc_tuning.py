"""The garbage collector and the gateway's warm heap (issue 31, `--gc-freeze-after-warmup`).

CPython's cyclic collector walks every tracked container object of a generation when it
collects it; a full collection walks them all, and on a gateway holding a thousand workers' state
(their feeds, index bookkeeping, policy memory) that took up to ~140 ms, inside whichever routing
decision allocated the object that triggered it. `gc.freeze()` moves the objects alive at that
moment to a permanent generation that no collection walks again. Done once the index is warm
(every worker that is up has delivered a complete view), it leaves the collector the objects
allocated since: short-lived ones per request, and what the fleet adds later.

What it costs: a reference cycle among frozen objects that later becomes garbage is never
collected (objects freed by reference counting, the common case, are freed as before). The
young generations are collected first (`gc.collect(1)`), so cycles of garbage alive at the
freeze are not kept; what is left is the warm state itself, which the gateway keeps anyway.
"""
from __future__ import annotations

import gc
import logging
from collections.abc import Callable

from service_shell import kv

log = logging.getLogger("gateway.gc")


def freeze_warm_heap() -> int:
    """Collects the young generations, then freezes every object alive; how many are frozen."""
    gc.collect(1)
    gc.freeze()
    return gc.get_freeze_count()


class FreezeAfterWarmup:
    """Calls `freeze_warm_heap` once, the first time `warm()` is true (polled by the gateway's
    readiness loop); nothing when disabled."""

    def __init__(self, enabled: bool, warm: Callable[[], bool]) -> None:
        self.enabled = enabled
        self._warm = warm
        self.frozen = False

    def poll(self) -> bool:
        """True when this call froze the heap."""
        if not self.enabled or self.frozen or not self._warm():
            return False
        self.frozen = True
        count = freeze_warm_heap()
        log.info(kv("gc_frozen_after_warmup", frozen_objects=count))
        return True
