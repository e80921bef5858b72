"""The fault drill's split of lost reuse (drill_tally.Tally.computed_history_new): the computed
tokens of a prompt are its tail, so they fall first in its part new since the conversation's
previous turn, then in its history; and the drill's count of that new part per prompt."""
from __future__ import annotations

from prefixcache_bench.stack.drill_reach import split_prompt
from prefixcache_bench.stack.drill_tally import Tally
from prefixcache_bench.stack.fault_drill import conversation_prompts, new_since_previous_turn


def sources(device: int = 0, l3: int = 0, computed: int = 0) -> dict[str, int]:
    return {"device": device, "host": 0, "l3": l3, "shared": 0, "computed": computed}


def test_computed_tokens_fall_in_the_new_part_first_then_in_the_history():
    t = Tally(recovered=10.0)
    t.turns = [
        (9.0, 0, sources(computed=50), 5, "p"),  # before the recovery: not counted
        (11.0, 0, sources(device=60, computed=40), 30, "p"),  # turn 1: 30 new computed, 10 history
        (12.0, 0, sources(device=80, l3=10, computed=10), 20, "q"),  # turn 2: 10 of 20 new
        (11.5, 1, sources(device=90, computed=10), 10, "r"),  # another conversation's turn 1
        (13.0, 0, sources(device=95, computed=5), 5, "s"),  # later
    ]
    split = t.computed_history_new()
    assert split == {"turn1": {"history": round(10 / 160, 3), "new": 1.0},
                     "turn2": {"history": 0.0, "new": 0.5},
                     "later": {"history": 0.0, "new": 1.0}}
    t.recovered = None  # the baseline: every request
    assert set(t.computed_history_new()) == {"all"}


def test_every_turn_after_the_recovery_is_reported_even_when_none_ran():
    t = Tally(recovered=1.0)
    assert t.computed_history_new() == {name: {"history": 0.0, "new": 0.0}
                                        for name in ("turn1", "turn2", "later")}


def test_the_new_part_of_a_turn_is_what_its_previous_turn_did_not_send():
    prompts = conversation_prompts(conversations=2, turns=3)
    new = new_since_previous_turn(prompts, 3)
    for c in range(2):
        first, second, third = prompts[3 * c:3 * c + 3]
        assert new[second] == len(second) - len(first)  # turn 1 resends turn 0 whole
        assert new[third] == len(third) - len(second)
        assert new[first] == 0  # after the last turn the first comes again: a prefix of it


def test_the_history_and_new_parts_split_reuse_in_prompt_order():
    # 100 tokens: history 70 (device 40, then L3 30), new 30 (L3 10, then computed 20).
    split = split_prompt(sources(device=40, l3=40, computed=20), new=30, held=85)
    assert split == {"history": 70, "l3_history": 30, "new": 30, "l3_new": 10, "reused_new": 10,
                     "computed_history": 0, "held_new": 15, "computed_held": 5}
    assert "held_new" not in split_prompt(sources(device=100), new=0, held=None)


def test_the_reach_judges_the_history_and_tells_what_a_worker_held_at_the_recovery():
    t = Tally(recovered=10.0, held={"a": 64, "b": 0})
    t.turns = [
        (11.0, 0, sources(device=32, computed=68), 48, "a"),  # turn 1: history half computed
        (12.0, 0, sources(device=32, l3=48, computed=20), 20, "b"),  # turn 2: history from L3
    ]
    reach = t.reach_by_turn()
    assert reach["turn1"] == {"l3_hit_ratio_history": 0.0, "l3_of_history": 0.0, "l3_of_new": 0.0, "reused_of_new": 0.0,
                              "held_of_new": round(12 / 48, 3),
                              "computed_though_held": round(32 / 100, 3)}
    assert reach["turn2"]["l3_of_history"] == 0.6 and reach["turn2"]["held_of_new"] == 0.0
    assert reach["turn2"]["l3_hit_ratio_history"] == 1.0  # what the device lacked, L3 gave
    assert reach["later"]["l3_of_history"] == 0.0
    t.recovered, t.held = None, None  # the baseline: every request, nothing held measured
    assert set(t.reach_by_turn()) == {"all"} and "held_of_new" not in t.reach_by_turn()["all"]
