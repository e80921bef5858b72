"""The eviction limits (prefixcache_bench/sim/eviction_limits.py): the dead-block oracle sits
between LRU and Belady and is LRU when told too late; one class ranked by last use is LRU; the
offset search never ends below where it started; turn gaps bucket a conversation's pace."""
from __future__ import annotations

from prefixcache_bench.sim.eviction import BLOCK_TOKENS, agentic_trace, run_belady, run_online
from prefixcache_bench.sim.eviction_limits import (best_offsets, by_uses, next_uses,
                                                   run_classes, run_oracle_dead, turn_gaps)
from prefixcache_bench.sim.trace import TraceRequest


def req(t: float, *blocks: int) -> TraceRequest:
    return TraceRequest(0, t, len(blocks) * BLOCK_TOKENS, 1, tuple(blocks))


def test_oracle_lies_between_lru_and_belady_and_is_lru_when_told_too_late():
    trace, cap = agentic_trace(sessions=60, turns=6), 60  # LRU 0.80, Belady 0.84
    used_again = next_uses(trace)
    lru, opt = run_online(trace, cap, "lru").hit_ratio, run_belady(trace, cap).hit_ratio
    told_at_once = run_oracle_dead(trace, cap, 0, used_again)
    assert lru < told_at_once <= opt + 1e-9
    assert run_oracle_dead(trace, cap, 1e9, used_again) == lru


def test_one_class_ranked_by_last_use_is_lru():
    trace, cap = agentic_trace(sessions=60, turns=6), 150
    one_class = run_classes(trace, cap, {0: 0.0}, lambda uses, request, depth: 0)
    assert one_class == run_online(trace, cap, "lru").hit_ratio


def test_offsets_for_uses_keep_a_prefix_used_often_and_the_search_only_climbs():
    trace = []  # a prefix (block 1) every 10 s, one-off prompts flooding the cache between
    for i in range(40):
        trace.append(req(10 * i, 1, 1000 + i))
        trace += [req(10 * i + 1 + k, 2000 + 3 * i + k) for k in range(3)]
    flat = {c: 0 for c in range(1, 5)}
    lru = run_classes(trace, 3, flat, by_uses)
    assert run_classes(trace, 3, {**flat, 2: 100, 3: 100, 4: 100}, by_uses) > lru
    best, _, runs = best_offsets(trace, 3, flat, by_uses)
    assert best > lru and runs > 1


def test_turn_gaps():
    trace = [req(0, 1, 2), req(30, 1, 2, 3), req(130, 1, 2, 3, 4), req(400, 1, 2, 3, 4, 5),
             req(401, 1, 9)]  # a new conversation sharing only the first block
    assert turn_gaps(trace) == [0, 1, 2, 3, 0]


def test_turn_size_classes():
    from prefixcache_bench.sim.eviction_limits import by_uses_and_turn_size
    first = TraceRequest(0, 0, 8 * BLOCK_TOKENS - 100, 1, tuple(range(8)))  # 8 new, partial
    nxt = TraceRequest(1, 60, 9 * BLOCK_TOKENS, 1, (*range(7), 100, 101))  # 2 new, full
    classify = by_uses_and_turn_size([first, nxt])
    assert classify(1, 0, 3) == (1, "long first")
    assert classify(1, 0, 7) == (1, "partial tail")
    assert classify(1, 1, 8) == (1, "short")  # the second turn's last block is full
    assert classify(2, 1, 3) == (2, "short") and classify(5, 0, 0) == (4, "long")


def test_learned_offsets_rank_a_class_used_again_above_one_that_is_not():
    from prefixcache_bench.sim.eviction_limits import LearnedOffsets
    learned = LearnedOffsets(kappa=4.0)
    for _ in range(10):
        learned.used("often", None, 0.0)
        learned.used("often", "often", 100.0)  # used again 100 s later
        learned.used("once", None, 0.0)
    assert learned["once"] == 0.0 < learned["often"] == 4.0 * 100.0 * 0.5
