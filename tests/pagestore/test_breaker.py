"""pagestore/breaker.py: the per-node circuit breaker of the L3 client."""
from __future__ import annotations

from pagestore.breaker import CircuitBreaker


def test_breaker_half_open_lets_one_trial_through():
    now = [0.0]
    b = CircuitBreaker(failure_threshold=2, reset_after_s=1.0, clock=lambda: now[0])
    b.record(False)
    assert b.allow()
    b.record(False)
    assert b.state == "open" and not b.allow()
    now[0] = 1.5
    assert b.state == "half-open" and b.allow() and not b.allow()
    b.record(False)
    assert b.state == "open"
    now[0] = 3.0
    assert b.allow()
    b.record(True)
    assert b.state == "closed" and b.allow()
