"""ExitGuard: a draining process ends even when a non-daemon thread or the drain itself hangs."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

SCRIPT = textwrap.dedent("""
    import logging, sys, threading, time
    from service_shell import ExitGuard
    logging.basicConfig(level=logging.INFO)
    log = logging.getLogger("t")
    guard = ExitGuard(log, grace_s=0.0, slack_s={slack})
    if "{case}" == "drain_hangs":
        time.sleep(60)
    threading.Thread(target=time.sleep, args=(60,), name="stuck-handler").start()  # non-daemon
    guard.drained(exit_within_s=0.5)
    print("drained", flush=True)
""")


@pytest.mark.parametrize("case,code,event", [("exit_hangs", 0, "exit_overran"),
                                             ("drain_hangs", 1, "drain_overran")])
def test_exit_guard_ends_a_hung_process(case: str, code: int, event: str) -> None:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(case=case, slack=1.0)],
                          capture_output=True, text=True, timeout=30)
    assert time.monotonic() - started < 20
    assert done.returncode == code, done.stderr
    assert f"event={event}" in done.stderr
    assert "stuck-handler" in done.stderr or case == "drain_hangs"
    assert "Thread 0x" in done.stderr or "Current thread" in done.stderr  # the stacks


def test_a_clean_exit_is_left_alone() -> None:
    script = ("import logging; from service_shell import ExitGuard; "
              "g = ExitGuard(logging.getLogger('t'), grace_s=0.0, slack_s=5.0); g.drained(5.0)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0 and "overran" not in done.stderr
