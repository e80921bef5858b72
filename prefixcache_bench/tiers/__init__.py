"""Benchmarks of the KV tiers (L1 device, L2 host, L3 Redis) against the goals they are held to.

    python -m prefixcache_bench.tiers [--quick] [--json PATH] [--redis-url URL]
        [--models small-hybrid,small-transformer] [--prompt-tokens N] [--threads N]

Starts its own redis-server on a free port unless --redis-url is given; keys are written under a
private prefix and deleted at the end.

- redis:  Redis write and read throughput of page payloads, with and without a Mamba checkpoint,
          pipelined vs one page per round trip; payload encode and decode+validate (parts_redis).
- ttft:   per model, TTFT of one prompt cold, from L1, L2 and L3, and cold with write-through
          on; ratios to cold (parts_ttft).
- break_even: from which prompt length loading from L3 is cheaper than recomputing, from cold
          and L3 TTFT over a few prompt lengths (parts_ttft).
- shared_l3_sim: the gateway simulator's hit ratio with a shared L3 against the pooled bound of
          all the fleet's capacity (parts_sim).

Sizes are `Params` and the goals `GOALS` (params.py). Prints tables, writes every number, the
command, the parameters and the machine to --json (prefixcache_bench.harness). Progress goes to
stderr.
"""
from prefixcache_bench.tiers.cli import goal_l3, main, parse_args, render, run
from prefixcache_bench.tiers.params import (GOAL_PROMPT_TOKENS, GOALS, SHARED_L3_TOKENS,
                                                TRACE, Params, goal_key)
from prefixcache_bench.tiers.parts_redis import bench_redis, rate, redis_at
from prefixcache_bench.tiers.parts_sim import bench_shared_l3_sim
from prefixcache_bench.tiers.parts_ttft import Bench, bench_model, break_even, fit, tokens

__all__ = ["GOALS", "GOAL_PROMPT_TOKENS", "SHARED_L3_TOKENS", "TRACE", "Bench", "Params",
           "bench_model", "bench_redis", "bench_shared_l3_sim", "break_even", "fit", "goal_key",
           "goal_l3", "main", "parse_args", "rate", "redis_at", "render", "run", "tokens"]
