"""Benchmarks of the cache service, against the goals the design sets for it.

    python -m prefixcache_bench.cache [--quick] --json PATH [--trace PATH] [--server process|thread]

Parts (each a function returning a flat dict of metrics; `run` merges them):

- match:  in-process match + release of a fully cached prompt, on the Pool itself and through
          `CacheCore.step` with one MatchOp (parts_match).
- step:   batched Step RPCs over loopback gRPC (CacheClient -> server) (parts_step).
- events: page events delivered end to end to a gRPC subscriber (CacheClient.subscribe), and a
          check that the stream, applied to an empty set, reproduces the pool's page set
          (parts_events).
- zmq:    the same page events over the vLLM-format ZMQ stream to a SUB consumer while a gRPC
          subscriber follows too (events/s, lost, replayed), and step_rpc_32 with that stream off
          and on (parts_zmq).
- memory: tracemalloc bytes per cached page of the index (Pool filled with multi-turn chats)
          (parts_memory).
- trace:  replay of a Mooncake conversation trace through CacheCore (match, allocate, publish,
          release per request): requests per second and hit ratio, every eviction policy
          replaying side by side; --trace-rounds N repeats it and reports the median of the
          rounds' speed ratios to LRU (parts_trace).

The sizes of each part are `Params` (params.py); the goals are `GOALS` there. It prints a table
(metric, value, goal, pass/fail) and writes every metric, the parameters and the machine to
--json (prefixcache_bench.harness). Progress goes to stderr. Everything random comes from one
seed. The committed results are docs/results/cache/bench.{json,txt}.
"""
from prefixcache_bench.cache.cli import SIZE_FLAGS, main, parse_args, run
from prefixcache_bench.cache.params import GOALS, MODEL, PARTS, TRACE_BLOCK_TOKENS, Params
from prefixcache_bench.cache.parts_events import EventIndex, bench_events, snapshot_pages
from prefixcache_bench.cache.parts_match import bench_match
from prefixcache_bench.cache.parts_memory import bench_memory
from prefixcache_bench.cache.parts_step import bench_step_rpc
from prefixcache_bench.cache.parts_trace import bench_trace
from prefixcache_bench.cache.parts_zmq import bench_zmq
from prefixcache_bench.cache.serving import ServerHandle, cache_server
from prefixcache_bench.cache.workloads import (CoreSteps, Tokens, block_tokens, ideal_hit_tokens,
                                           load_trace, serve_on_pool)

__all__ = ["GOALS", "MODEL", "PARTS", "SIZE_FLAGS", "TRACE_BLOCK_TOKENS", "CoreSteps", "EventIndex",
           "Params", "ServerHandle", "Tokens", "bench_events", "bench_match", "bench_memory",
           "bench_step_rpc", "bench_trace", "bench_zmq", "block_tokens", "cache_server",
           "ideal_hit_tokens", "load_trace", "main", "parse_args", "run", "serve_on_pool",
           "snapshot_pages"]
