"""SIGTERM/SIGINT as an event the main thread waits on (or, for the demos, as the
KeyboardInterrupt that ends a sleep), and a bound on how long the process may take to end after
it."""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from typing import NoReturn

from service_shell.logs import kv

# How long the main thread sleeps at most before it runs a signal handler another thread took.
POLL_S = 0.2


class ShutdownSignal:
    """SIGTERM/SIGINT as an event. Installed early (before a slow model load) so a signal during
    startup still drains instead of killing the process; `wait` runs the drain on the main
    thread, outside the handler, so it may block. Main thread only."""

    def __init__(self, log: logging.Logger):
        self._log = log
        self._event = threading.Event()
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if self._event.is_set():
            self._log.info(kv("signal_ignored", signal=name, reason="drain already in progress"))
            return
        self._log.info(kv("signal_received", signal=name))
        self._event.set()

    @property
    def received(self) -> bool:
        return self._event.is_set()

    def wait(self) -> None:
        # In slices, not one plain wait: the kernel may hand a process's SIGTERM to any thread
        # that does not block it (gRPC's own threads do not), and CPython then runs the handler
        # only when the main thread next wakes up. A plain Event.wait never wakes, so the drain
        # never started (seen as a server ignoring SIGTERM in about one test run in twenty).
        while not self._event.wait(POLL_S):
            pass


def sleep_until_interrupted() -> NoReturn:
    """Parks the main thread until a signal handler raises (Ctrl-C's KeyboardInterrupt), in
    slices for the reason ShutdownSignal.wait gives: signal.sigwait on signals other threads do
    not block may never return."""
    while True:
        time.sleep(POLL_S)


class ExitGuard:
    """Makes sure a draining process ends. Started when the drain starts, with the time running
    calls get (`grace_s`) plus `slack_s` for the rest (aborts, closing ports, unregistering);
    `drained()` then gives the interpreter `exit_within_s` more to exit. Past either deadline
    it logs which, writes every thread's stack to stderr (so the hang can be found), and ends
    the process: exit code 1 if the drain itself overran, 0 if only the interpreter's exit did
    (a non-daemon thread, such as a gRPC handler stuck in a call, holds it open). Without it
    such a process lingers until Kubernetes kills it at terminationGracePeriodSeconds."""

    POLL_S = 0.1

    def __init__(self, log: logging.Logger, grace_s: float, slack_s: float = 30.0):
        self._log = log
        self._deadline = time.monotonic() + grace_s + slack_s
        self._drained = False
        threading.Thread(target=self._watch, name="exit-guard", daemon=True).start()

    def drained(self, exit_within_s: float = 5.0) -> None:
        self._drained = True
        self._deadline = time.monotonic() + exit_within_s

    def _watch(self) -> None:
        while time.monotonic() < self._deadline:
            time.sleep(self.POLL_S)
        alive = sorted(t.name for t in threading.enumerate() if t is not threading.current_thread())
        event = "exit_overran" if self._drained else "drain_overran"
        self._log.warning(kv(event, threads=",".join(alive)))
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(0 if self._drained else 1)
