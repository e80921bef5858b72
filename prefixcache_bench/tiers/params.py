"""What shapes a tier benchmark run (`Params`, written to the JSON as `params`) and the goals."""
from __future__ import annotations

from dataclasses import dataclass

from prefixcache_bench import CONVERSATION_TRACE
from prefixcache_bench.harness import Goal

TRACE = CONVERSATION_TRACE
SHARED_L3_TOKENS = 32_000_000  # the simulated fleet's shared L3 (see parts_sim)
LEASE_TTL_S = 600.0  # a cold long prefill step on a busy CPU can outlast the default lease

GOALS: dict[str, Goal] = {
    # Loading a prompt's pages from Redis instead of computing them (judged on prompts of at
    # least GOAL_PROMPT_TOKENS: on shorter ones a load's fixed costs weigh more).
    "ttft_l3_over_cold": Goal("<=", 0.3),
    # A shared L3 wastes little of the fleet's pooled capacity (parts_sim).
    "shared_l3_hit_over_bound": Goal(">=", 0.97),
}
GOAL_PROMPT_TOKENS = 4096


def goal_key(metric: str) -> str:
    """The JSON's name of a goal: the metric and its bound, e.g. "ttft_l3_over_cold<=0.3"."""
    return f"{metric}{str(GOALS[metric]).replace(' ', '')}"


@dataclass(slots=True)
class Params:
    models: tuple[str, ...] = ("small-hybrid", "small-transformer")
    prompt_tokens: int = 4096
    lengths: tuple[int, ...] = (256, 1024, 2048)  # break-even points besides prompt_tokens
    page_size: int = 16
    payload_preset: str = "small-hybrid"
    throughput_pages: int = 512  # pages without checkpoint; with checkpoint: a sixteenth
    batch_pages: int = 32
    token_budget: int = 1024
    checkpoint_every_pages: int = 8
    seed: int = 0

    @classmethod
    def quick(cls) -> Params:
        return cls(prompt_tokens=512, lengths=(128, 256), throughput_pages=128)
