"""The eviction simulator (prefixcache_bench/sim/eviction.py): Belady with bypass is an upper
bound of every online policy and is right on a hand-checked case; frequency keeps a reused
prefix that LRU loses; adaptive follows the better of its two shadows."""
from __future__ import annotations

from prefixcache_bench.sim.eviction import (BLOCK_TOKENS, agentic_trace, run_belady, run_online,
                                            synthetic)
from prefixcache_bench.sim.trace import TraceRequest


def req(t: float, *blocks: int) -> TraceRequest:
    return TraceRequest(0, t, len(blocks) * BLOCK_TOKENS, 1, tuple(blocks))


def test_belady_by_hand():
    # Capacity 2: A B, then C (used never again: bypassed), then A B again -> both hits.
    trace = [req(0, 1, 2), req(1, 3), req(2, 1, 2)]
    assert run_belady(trace, 2).hit_tokens == 2 * BLOCK_TOKENS
    # LRU takes C in and drops B (the deeper of the two oldest): only A hits.
    assert run_online(trace, 2, "lru").hit_tokens == BLOCK_TOKENS


def test_frequency_keeps_a_prefix_used_often():
    # A system prompt (block 1) used every ten seconds; one-off prompts in between fill the
    # cache: LRU loses it under the flood, frequency keeps it.
    trace = []
    for i in range(40):
        trace.append(req(10 * i, 1, 1000 + i))
        trace += [req(10 * i + 1 + k, 2000 + 3 * i + k) for k in range(3)]
    lru, freq = (run_online(trace, 3, p).hit_tokens for p in ("lru", "frequency"))
    assert freq > lru


def test_belady_bounds_every_online_policy_and_adaptive_follows_the_better():
    for trace, cap in ((agentic_trace(sessions=40, turns=6), 200),
                       (synthetic("rollout", 600, seed=5), 40),
                       (synthetic("chat", 600, seed=5), 150)):
        opt = run_belady(trace, cap).hit_ratio
        got = {p: run_online(trace, cap, p).hit_ratio for p in ("lru", "frequency", "adaptive")}
        assert all(v <= opt + 1e-9 for v in got.values()), (got, opt)
        assert got["adaptive"] >= min(got["lru"], got["frequency"]) - 0.01, got


def test_dead_partial_blocks_are_spotted_only_where_they_are_not_reused():
    from prefixcache_bench.sim.eviction import Stats
    stats = Stats(spot_dead=True)
    for i in range(Stats.DEAD_AFTER):  # every prompt ends in a partial block never seen again
        stats.see([1, 1000 + i], float(i), partial_last=True)
    assert stats.dead(1000 + Stats.DEAD_AFTER - 1) and not stats.dead(1)
    assert stats.lru_key(1000 + Stats.DEAD_AFTER - 1) < stats.lru_key(1)
    reused = Stats(spot_dead=True)
    for i in range(Stats.DEAD_AFTER):  # rollouts: the same prompt, its partial block, again
        reused.see([1, 2], float(i), partial_last=True)
    assert not reused.dead(2)


def test_many_tenant_workload_never_leaves_adaptive_below_lru():
    from prefixcache_bench.sim.eviction import many_tenant_trace
    trace = many_tenant_trace(tenants=100, conversations=600)
    lru = run_online(trace, 500, "lru").hit_ratio
    assert run_online(trace, 500, "frequency").hit_ratio < lru - 0.03  # frequency loses here
    assert run_online(trace, 500, "adaptive").hit_ratio >= lru - 0.01
