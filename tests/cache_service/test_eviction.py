"""Eviction as a strategy (cache_service/eviction.py): LRU, the default, is what the tree always
did; `frequency` keeps a run used often over a newer run used once, where LRU does the opposite.
The core's state machine and its event stream == tree invariant run under every policy
(test_core_properties.py)."""
from __future__ import annotations

import pytest

from cache_service.core import CacheCore
from cache_service.eviction import POLICIES, Frequency, make_policy
from prefixcache.v1 import cache_service_pb2 as pb
from tests.cache_service.test_core import P, Worker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scenario(policy: str) -> tuple[bool, bool]:
    """A (2 pages) used at t=0, 10, 20; B (2 pages) once at t=25; at t=30 C needs the room:
    which of A and B is still cached?"""
    clock = Clock()
    w = Worker(CacheCore(clock=clock, eviction=policy), device=5)
    a, b, c = ([base + i for i in range(2 * P + 1)] for base in (100, 200, 300))
    for t in (0, 10, 20):
        clock.now = t
        w.run(a)
    clock.now = 25
    w.run(b)
    clock.now = 30
    w.run(c)
    clock.now = 31
    out = []
    for tokens in (a, b):
        m = w.match(tokens)
        w.step(releases=[pb.ReleaseOp(lease_id=m.lease_id)])
        out.append(m.cached_tokens > 0)
    return tuple(out)


def test_lru_evicts_the_older_run_frequency_the_run_used_once():
    assert scenario("lru") == (False, True)
    assert scenario("frequency") == (True, False)


def node(first_page: bytes = b"\x01" * 16):
    return type("N", (), {"uses": 0, "used_at": 0.0, "rank": 0.0, "hashes": first_page})()


def test_frequency_ranks_by_reuse_gap_and_uses():
    policy, run = Frequency(), node()
    policy.use(run, 0.0)
    assert (run.uses, run.rank) == (1, 0.0)  # no reuse seen yet: plain LRU
    policy.use(run, 10.0)
    assert policy.weight == 20.0 and run.rank == pytest.approx(10.0 + 20.0 * 1.584962, 1e-5)
    policy.refresh(run, 12.0)  # the same request again: recency, not a use
    assert run.uses == 2 and policy.gaps == 1


def test_frequency_remembers_the_uses_of_dropped_pages():
    policy, run = Frequency(), node(b"\x07" * 16)
    for t in (0.0, 1.0, 2.0):
        policy.use(run, t)
    policy.dropped(b"\x07" * 16 + b"\x08" * 16, run.uses)
    again = node(b"\x07" * 16)  # published again from the first dropped page
    policy.use(again, 3.0)
    assert again.uses == 4
    other = node(b"\x09" * 16)
    policy.use(other, 3.0)
    assert other.uses == 1


def test_the_policy_is_named_and_checked():
    assert set(POLICIES) == {"lru", "frequency"}
    with pytest.raises(ValueError, match="not one of lru, frequency"):
        make_policy("clock")
    with pytest.raises(ValueError, match="not one of"):
        CacheCore(eviction="fifo")


def test_the_flag(monkeypatch):
    from cache_service.__main__ import parse_args
    assert parse_args([]).eviction_policy == "lru"
    monkeypatch.setenv("PREFIXCACHE_EVICTION_POLICY", "frequency")
    assert parse_args([]).eviction_policy == "frequency"
