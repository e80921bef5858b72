"""Ingest below routing on a busy core (design.md §6, "Where a decision's time goes").

The FeedLoop thread (gateway/core/feeds.py) decodes and applies page events nonstop under load,
on the core that answers routing decisions. Two things decide how long a decision then waits
for that core and for the GIL:

- The kernel's run queue. Niced (+10), the loop thread still ran out its time slice when a
  request thread woke, and a decision's wall time was twice its CPU time in the tail (p99 hold
  0.79 ms for 0.51 ms of CPU at 1.4M page events/s). `idle` (SCHED_IDLE) runs it only when no
  other thread wants the core: hold and CPU time then agree (p99 0.50 / 0.46 ms; a scratch
  probe), and ingest is faster (docs/results/gateway/fleet/ingest_p99/: 1.20-1.43M page
  events/s against 1.17-1.24M niced, route() p99 0.50-0.84 against 0.80-1.01 ms). The price:
  a core that other threads keep 100% busy applies no events until they pause (the index goes
  stale and its workers' scores count less: `--stale-after-s`). The gateway's own request
  threads keep a floor under it (decisions_first.py: a decision that finds the loop's pulse
  stale and its thread starved of the CPU since sleeps 2 ms first, ~a tenth of the core), but
  without a cgroup of its own (a Kubernetes pod has one) those threads may be any process's: a
  compute service beside the gateway, as `stack/` runs them. So `nice` (the loop +10: ~10% of a
  busy core kept) is the default, `idle` what deploy/kubernetes sets; `normal` shares the core
  evenly.
- The GIL. A thread that wakes (a request arrives) waits for the loop thread to release it,
  up to the interpreter's switch interval (5 ms by default): decisions were p99 ~6 ms from
  their wake-up although ~1 ms inside the router. `--switch-interval-ms` (0.5 by default) makes
  the gateway process hand it over ten times sooner (p99 ~2 ms from wake-up).
"""
from __future__ import annotations

import logging
import os
import sys
import threading

from service_shell import kv

log = logging.getLogger("gateway.feeds")

PRIORITIES = ("idle", "nice", "normal")
INGEST_NICE = 10  # `nice`: the loop thread's niceness above the process's
SWITCH_INTERVAL_S = 0.0005
_priority = "nice"


def configure(priority: str = "nice", switch_interval_s: float | None = SWITCH_INTERVAL_S) -> None:
    """The gateway's settings (--ingest-priority, --switch-interval-ms), at start: the priority
    of FeedLoop threads started after, and the process's switch interval (None: left as is)."""
    global _priority
    if priority not in PRIORITIES:
        raise ValueError(f"ingest priority {priority!r}: expected one of {', '.join(PRIORITIES)}")
    _priority = priority
    if switch_interval_s is not None:
        sys.setswitchinterval(switch_interval_s)


def lower_thread_priority() -> str:
    """Lowers the calling thread's scheduling priority as configured; the threads it starts
    inherit it. Linux only (elsewhere these calls apply to the whole process, request threads
    included, so it is left alone). Returns what was applied ("normal" when nothing was)."""
    if _priority == "normal" or not sys.platform.startswith("linux"):
        return "normal"
    try:
        if _priority == "idle":
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
        else:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + INGEST_NICE)
    except OSError as err:  # a sandbox refusing it: ingest then shares the CPU evenly
        log.warning(kv("ingest_priority_failed", priority=_priority, error=str(err)))
        return "normal"
    return _priority
