"""Ingest below routing on a busy core (design.md §6, "Where a decision's time goes").

The FeedLoop thread (gateway/core/feeds.py) decodes and applies page events nonstop under load;
on the same core a routing decision then waited in the kernel's run queue behind it (run-queue
wait p99 2.8 ms at 1M+ page events/s, docs/results/gateway/fleet/ingest_p99/). Running the loop
thread nicer than the process makes the scheduler hand the core to a request thread first,
while ingest still takes whatever CPU is left (0.5 ms; live page events/s unchanged).
"""
from __future__ import annotations

import logging
import os
import sys
import threading

from service_shell import kv

log = logging.getLogger("gateway.feeds")

# The loop thread's niceness above the process's; the threads it starts inherit it.
INGEST_NICE = 10


def lower_thread_priority(nice: int) -> None:
    """Raises the calling thread's niceness by `nice` (Linux only: elsewhere setpriority
    applies to the whole process, request threads included, so it is left alone)."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
    except OSError as err:  # a sandbox refusing it: ingest then shares the CPU evenly
        log.warning(kv("ingest_nice_failed", error=str(err)))
