"""The fault drill's split of lost reuse (drill_tally.Tally.computed_history_new): the computed
tokens of a prompt are its tail, so they fall first in its part new since the conversation's
previous turn, then in its history; and the drill's count of that new part per prompt."""
from __future__ import annotations

from prefixcache_bench.stack.drill_tally import Tally
from prefixcache_bench.stack.fault_drill import conversation_prompts, new_since_previous_turn


def sources(device: int = 0, l3: int = 0, computed: int = 0) -> dict[str, int]:
    return {"device": device, "host": 0, "l3": l3, "shared": 0, "computed": computed}


def test_computed_tokens_fall_in_the_new_part_first_then_in_the_history():
    t = Tally(recovered=10.0)
    t.turns = [
        (9.0, 0, sources(computed=50), 5),  # before the recovery: not counted
        (11.0, 0, sources(device=60, computed=40), 30),  # turn 1: 30 new computed, 10 history
        (12.0, 0, sources(device=80, l3=10, computed=10), 20),  # turn 2: 10 of 20 new
        (11.5, 1, sources(device=90, computed=10), 10),  # another conversation's turn 1
        (13.0, 0, sources(device=95, computed=5), 5),  # later
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
