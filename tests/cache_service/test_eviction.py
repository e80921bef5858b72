"""Eviction as a strategy (cache_service/eviction.py): LRU, the default, is what the tree always
did; `frequency` keeps a run used often over a newer run used once, where LRU does the opposite.
The core's state machine and its event stream == tree invariant run under every policy
(test_core_properties.py)."""
from __future__ import annotations

import pytest

from cache_service.core import CacheCore
from cache_service.eviction import (POLICIES, Adaptive, Frequency, LruShadow, Shadow,
                                    make_policy)
from cache_service.tree import Node
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


def test_frequency_weighs_gaps_by_pages():
    """A one-page run every request passes through does not drag b to the inter-arrival
    time when a ten-page run returns after a long gap."""
    policy, shared, long = Frequency(), node(b"\x01" * 16), node(b"\x02" * 160)
    for t in (0.0, 1.0, 2.0):
        policy.use(shared, t)
    policy.use(long, 0.0)
    policy.use(long, 100.0)
    assert policy.weight == pytest.approx(2 * (2 * 1.0 + 10 * 100.0) / 12)


def test_frequency_remembers_the_uses_of_dropped_pages():
    policy, run = Frequency(), node(b"\x07" * 16)
    for t in (0.0, 1.0, 2.0):
        policy.use(run, t)
    policy.dropped(b"\x07" * 16 + b"\x08" * 16, run.uses, run.used_at)
    again = node(b"\x07" * 16)  # published again from the first dropped page
    policy.use(again, 3.0)
    assert again.uses == 4
    assert policy.gaps == 3 and policy.gap_sum == 3.0  # its return is a reuse gap too (1 s)
    other = node(b"\x09" * 16)
    policy.use(other, 3.0)
    assert other.uses == 1


def test_the_history_of_dropped_runs_is_bounded(monkeypatch):
    """At most GHOSTS dropped runs are remembered, the least recently dropped forgotten
    first: a run they left returns with no history."""
    monkeypatch.setattr(Frequency, "GHOSTS", 3)
    policy = Frequency()
    for i in range(5):
        policy.dropped(bytes([i]) * 32, i + 1, float(i))
    assert list(policy._ghosts) == [bytes([i]) * 16 for i in (2, 3, 4)]
    forgotten, kept = node(bytes([0]) * 16), node(bytes([4]) * 16)
    policy.use(forgotten, 9.0)
    policy.use(kept, 9.0)
    assert (forgotten.uses, kept.uses) == (1, 6)


@pytest.mark.parametrize("name", ["frequency", "adaptive"])
def test_a_run_dropped_and_published_again_resumes_its_uses(name):
    """Through the core: a run used 3 times, dropped whole to make room, and published again
    from the same first page starts at 4 uses, not 1 (the ghost history LRU does not keep)."""
    clock = Clock()
    core = CacheCore(clock=clock, eviction=name)
    w = Worker(core, device=5)
    policy = core._pools["w"].eviction
    a = [100 + i for i in range(2 * P + 1)]
    for t in (0, 10, 20):
        clock.now = t
        w.run(a)
    clock.now = 30
    w.run([300 + i for i in range(4 * P + 1)])  # needs all 5 pages: a's run is dropped
    assert list(policy._ghosts.values()) == [(3, 20.0)]
    uses, use = [], policy.use
    policy.use = lambda run, now: (use(run, now), uses.append(run.uses))
    clock.now = 40
    assert w.run(a).cached_tokens == 0
    assert uses == [4]
    assert policy.gaps == 2 * (2 + 1)  # its return (20 s) counted per page, as a reuse gap


def test_the_policy_is_named_and_checked():
    assert set(POLICIES) == {"lru", "frequency", "adaptive"}
    with pytest.raises(ValueError, match="not one of lru, frequency, adaptive"):
        make_policy("clock")
    with pytest.raises(ValueError, match="not one of"):
        CacheCore(eviction="fifo")


def test_the_flag(monkeypatch):
    from cache_service.__main__ import parse_args
    assert parse_args([]).eviction_policy == "lru"
    monkeypatch.setenv("PREFIXCACHE_EVICTION_POLICY", "frequency")
    assert parse_args([]).eviction_policy == "frequency"


def test_adaptive_starts_as_lru():
    assert scenario("adaptive") == scenario("lru")


def hot_and_scan(core_policy: str) -> tuple[float, CacheCore]:
    """Where frequency clearly wins: 4 hot conversations' prefixes (3 pages each) asked again
    every step, between them (after a warm-up) a scan of prompts asked once, 6 pages each, in
    a pool of 24 pages: LRU lets the scan push the hot prefixes out, frequency keeps them. The hit ratio of
    the second half (after the adaptive policy had time to choose)."""
    clock = Clock()
    core = CacheCore(clock=clock, eviction=core_policy)
    w = Worker(core, device=24)
    hot = [[1000 * (h + 1) + i for i in range(3 * P + 1)] for h in range(4)]
    hits = asked = 0
    for step in range(200):
        for h, tokens in enumerate(hot):
            clock.now += 1.0
            cached = w.run(tokens).cached_tokens
            if step >= 100:
                hits, asked = hits + cached, asked + 3 * P
            clock.now += 1.0
            if step >= 5:  # after a warm-up that shows the hot prefixes' reuse
                w.run([10_000_000 + 10_000 * step + 1000 * h + i for i in range(6 * P + 1)])
    return hits / asked, core


def test_adaptive_follows_frequency_where_it_clearly_wins():
    lru, _ = hot_and_scan("lru")
    frequency, _ = hot_and_scan("frequency")
    adaptive, core = hot_and_scan("adaptive")
    assert frequency > lru + 0.3  # the stream is one where frequency clearly wins
    assert core._pools["w"].eviction.choice == "frequency"
    assert adaptive >= frequency - 0.05


def run(key: int) -> Node:
    """A one-page run at the top of its tree (the shadows walk real nodes' parents)."""
    return Node(b"", bytes([key]) * 16, None, None, None, 0, 0.0)


def test_adaptive_goes_back_to_lru_when_recency_wins():
    """Runs used often early, never again, then a working set that fits only without them:
    frequency's shadow keeps the stale runs and misses, LRU's holds the new set."""
    policy = Adaptive(capacity_pages=8)
    t = 0.0
    stale = [run(k) for k in range(8)]
    for _ in range(20):  # used often: frequency wins here
        for r in stale:
            t += 1.0
            policy.use(r, t)
    policy.choice = "frequency"
    fresh = [run(100 + k) for k in range(8)]
    for _ in range(40):
        for r in fresh:
            t += 1.0
            policy.use(r, t)
    assert policy.choice == "lru"


def test_a_shadow_holds_its_capacity_by_its_rank_a_chain_from_its_tail():
    shadow = Shadow(capacity=3, frequency=False)
    assert [shadow.access(k, d, 1.0, 0.0) for d, k in enumerate((b"a", b"b", b"c"))] == [False] * 3
    assert shadow.access(b"a", 0, 2.0, 0.0)
    assert not shadow.access(b"x", 0, 3.0, 0.0)  # over capacity: c, the deepest of the oldest, goes
    assert set(shadow.entries) == {b"a", b"b", b"x"}


def test_the_lru_shadow_drops_the_least_recent_page():
    shadow = LruShadow(capacity=2)
    assert not shadow.access(b"b", 1, 1.0, 0.0) and not shadow.access(b"a", 0, 1.0, 0.0)
    assert shadow.access(b"b", 1, 2.0, 0.0)
    assert not shadow.access(b"c", 0, 3.0, 0.0)  # over capacity: a goes
    assert list(shadow.entries) == [b"b", b"c"]


def test_large_pools_shadow_a_sample_of_the_pages():
    assert Adaptive(500).shadows["lru"].capacity == 500  # small: every page
    big = Adaptive(500_000).shadows
    assert 400 <= big["lru"].capacity == big["frequency"].capacity < 4000


def test_a_path_s_sampled_pages_are_its_pages_deepest_first():
    policy = Adaptive(500_000)  # 1 page in 256: those whose hash starts with byte 0
    page = [bytes([0 if d in (1, 3, 4) else 1, d]) * 8 for d in range(6)]  # sampled: 1, 3, 4
    top = Node(b"", b"".join(page[:3]), None, None, None, 0, 0.0)
    below = Node(b"", b"".join(page[3:]), None, top, None, 0, 0.0)
    assert policy._sampled_pages(below, True) == [(page[4], 4), (page[3], 3), (page[1], 1)]
    assert policy._sampled_pages(below, False) == [(page[4], 4), (page[3], 3)]
    assert policy._sampled_pages(top, True) == [(page[1], 1)]


def turns_then_filler(policy: str, monkeypatch, tail_reused: bool = False) -> tuple[int, int, Adaptive]:
    """Four conversations of two turns: turn 1 publishes 3 pages, turn 2 shares its first 2 and
    branches off (its 2 new pages beside turn 1's last page: that page, a prompt's tail, is
    superseded). With `tail_reused`, turn 1 is asked again after turn 2 (the tail was not dead).
    Then a new prompt needs 3 more pages than are free (a pool of 22). Returns the tokens still
    cached for conversation 0's turn 2 and for conversation 3's turn 1, and the policy."""
    monkeypatch.setattr(Adaptive, "DEAD_AFTER", 3)
    clock = Clock()
    core = CacheCore(clock=clock, eviction=policy)
    w = Worker(core, device=22)
    turns = []
    for c in range(4):
        base = 1000 * (c + 1)
        first = [base + i for i in range(3 * P + 1)]
        second = first[:2 * P] + [base + 500 + i for i in range(2 * P + 1)]
        for tokens in (first, second) + ((first,) if tail_reused else ()):
            clock.now += 1.0
            w.run(tokens)
        turns.append((first, second))
    clock.now += 1.0
    w.run([9_000_000 + i for i in range(4 * P + 1)])
    clock.now += 1.0
    cached = []
    for tokens in (turns[0][1], turns[3][0]):
        m = w.match(tokens)
        w.step(releases=[pb.ReleaseOp(lease_id=m.lease_id)])
        cached.append(m.cached_tokens)
    return cached[0], cached[1], core._pools["w"].eviction


def test_adaptive_evicts_superseded_prompt_tails_first_once_seen_dead(monkeypatch):
    """The live tree tells a prompt's tail the next turn did not extend (a leaf a sibling
    branched off beside) and, once such tails are seen rarely used again, evicts them first:
    conversation 3's tail (the newest run) goes before conversation 0's turn 2 (the oldest),
    where LRU does the opposite."""
    turn2, turn1, policy = turns_then_filler("adaptive", monkeypatch)
    assert (policy.superseded, policy.superseded_reused) == (4, 0)
    assert (turn2, turn1) == (4 * P, 2 * P)
    assert turns_then_filler("lru", monkeypatch)[:2] == (2 * P, 3 * P)


def test_superseded_tails_used_again_keep_their_rank(monkeypatch):
    """Where the tails are used again (N samples of one prompt), the rule stays off: the same
    victims as LRU's."""
    *adaptive, policy = turns_then_filler("adaptive", monkeypatch, tail_reused=True)
    assert (policy.superseded, policy.superseded_reused) == (4, 4)
    assert adaptive == list(turns_then_filler("lru", monkeypatch, tail_reused=True)[:2])
