"""SIGTERM/SIGINT as an event the main thread waits on."""
from __future__ import annotations

import logging
import signal
import threading

from service_shell.logs import kv


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
        self._event.wait()
