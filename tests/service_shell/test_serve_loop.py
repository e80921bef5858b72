"""ServiceShell.announce and ServiceShell.serve_until_signal: the end of every service's main."""
from __future__ import annotations

import logging
import os
import signal
from types import SimpleNamespace

import pytest

from service_shell import ServiceShell, ShutdownSignal
from service_shell import shell as shell_module


@pytest.fixture
def restore_handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_announce_prints_the_lines_scripts_read(capsys) -> None:
    server = SimpleNamespace(address="h:1", metrics_port=2, health_port=None)
    ServiceShell.announce(server, "h", first=["kv events on x"], last=["http on h:3"])
    assert capsys.readouterr().out.splitlines() == ["listening on h:1", "kv events on x",
                                                    "metrics on h:2", "http on h:3"]


def test_serve_until_signal_drains_on_sigterm_under_an_exit_guard(monkeypatch,
                                                                  restore_handlers) -> None:
    events: list[str] = []

    class Guard:  # the real one ends the process once drained
        def __init__(self, log, grace_s):
            events.append(f"guard {grace_s}")

        def drained(self):
            events.append("drained")

    monkeypatch.setattr(shell_module, "ExitGuard", Guard)
    log = logging.getLogger("test")
    shutdown = ShutdownSignal(log)
    os.kill(os.getpid(), signal.SIGTERM)
    status = ServiceShell.serve_until_signal(shutdown, lambda: events.append("drain"),
                                             grace_s=7.0, log=log)
    assert status == 0 and events == ["guard 7.0", "drain", "drained"]
