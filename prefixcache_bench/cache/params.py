"""What shapes a benchmark run (`Params`), the goals the design sets, and the small helpers every
part shares."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prefixcache.v1 import cache_service_pb2 as pb
from prefixcache_bench import CONVERSATION_TRACE
from prefixcache_bench.harness import Goal

REPO = Path(__file__).resolve().parents[2]
MODEL = "bench-model"
TRACE_BLOCK_TOKENS = 512  # Mooncake traces: one hash id = 512 prompt tokens
PARTS = ("match", "step", "events", "zmq", "memory", "trace")


@dataclass(slots=True)
class Params:
    """Everything that shapes a run; written to the JSON as `params`."""
    seed: int = 20240611
    page_size: int = 16
    vocab: int = 128_000
    server: str = "process"  # where the gRPC server runs: "process" (its own GIL) or "thread"
    # match: one `match_tokens` prompt, plus siblings sharing its first `match_shared_tokens`.
    match_tokens: int = 4096
    match_siblings: int = 63
    match_shared_tokens: int = 1024
    match_iters: int = 5000
    # step: `step_batch` requests per Step; prompts = a shared system prefix + a per-request tail.
    step_batch: int = 32
    step_prefix_tokens: int = 1024
    step_tail_tokens: tuple[int, int] = (512, 1024)
    step_prompts: int = 256
    step_iters: int = 2000
    step_pool_pages: int = 65_536
    # events: rounds of `event_requests` new prompts of `event_prompt_pages` pages, in a pool
    # small enough that eviction (BlockRemoved) runs as much as publishing (BlockStored).
    event_pages: int = 500_000
    event_requests: int = 16
    event_prompt_pages: int = 64
    event_pool_pages: int = 8192
    # memory: multi-turn chats over shared system prompts until this many pages are cached.
    mem_pages: int = 50_000
    mem_hits: int = 5000  # then this many pure hits, for memory kept per request
    # trace replay
    trace_path: str = str(CONVERSATION_TRACE)
    trace_requests: int | None = None  # None = the whole trace
    trace_device_tokens: int = 1_000_000
    trace_host_tokens: int = 0
    trace_rounds: int = 1  # replays per policy, alternated (parts_trace.bench_trace)
    warmup: int = 50
    parts: tuple[str, ...] = PARTS
    profile: bool = False

    @classmethod
    def quick(cls) -> Params:
        return cls(match_iters=1000, step_iters=300, event_pages=60_000, mem_hits=2000,
                   trace_requests=2000, warmup=20)


GOALS: dict[str, Goal] = {
    "match_4k_us_p50": Goal("<=", 200),
    "step_rpc_32_ms_p50": Goal("<=", 2),
    "events_per_s": Goal(">=", 50_000),
    "events_lost": Goal("==", 0),
    "events_index_mismatch": Goal("==", 0),
    # The vLLM-format ZMQ stream (part zmq), with the gRPC stream running too.
    "zmq_events_per_s": Goal(">=", 150_000),
    "zmq_events_lost": Goal("==", 0),
    "zmq_index_mismatch": Goal("==", 0),
    "zmq_step_rpc_32_p50_ratio": Goal("<=", 1.1),
    "bytes_per_page": Goal("<=", 300),
}


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def register(pool_id: str, p: Params, device_pages: int,
             host_pages: int = 0) -> pb.RegisterPoolRequest:
    return pb.RegisterPoolRequest(pool_id=pool_id, epoch=1, page_size=p.page_size,
                                  device_pages=device_pages, host_pages=host_pages,
                                  model_id=MODEL, lease_ttl_s=600)
