"""ShutdownSignal: a SIGTERM starts the drain whichever thread the kernel hands it to.
ExitGuard: a draining process ends even when a non-daemon thread or the drain itself hangs."""
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


WAIT_SCRIPT = textwrap.dedent("""
    import logging, signal, sys, threading, time
    from service_shell import ShutdownSignal, sleep_until_interrupted
    logging.basicConfig(level=logging.INFO)
    shutdown = ShutdownSignal(logging.getLogger("t"))
    if "{wait}" == "sleep":  # the demos: Ctrl-C or SIGTERM as KeyboardInterrupt
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    def other():  # as when the kernel picks a gRPC thread for a process-directed SIGTERM
        time.sleep(0.2)
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
        time.sleep(60)
    threading.Thread(target=other, daemon=True).start()
    started = time.monotonic()
    try:
        shutdown.wait() if "{wait}" == "event" else sleep_until_interrupted()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
    print(f"woke {{time.monotonic() - started:.2f}}", flush=True)
""")


@pytest.mark.parametrize("wait,trace", [("event", "event=signal_received signal=SIGTERM"),
                                        ("sleep", "interrupted")])
def test_a_sigterm_handled_on_another_thread_still_ends_the_wait(wait: str, trace: str) -> None:
    """A plain Event.wait (or signal.sigwait) on the main thread never woke for it: the servers
    ignored SIGTERM."""
    try:
        done = subprocess.run([sys.executable, "-c", WAIT_SCRIPT.format(wait=wait)], capture_output=True,
                              text=True, timeout=20)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the main thread never woke for a SIGTERM taken by another thread: {e.stderr!r}")
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.split()[1]) < 5.0
    assert trace in done.stderr
