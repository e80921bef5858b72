"""The engine's settings and counters, shared by its parts (scheduler, step planner, model
runner), which each read the settings they need and add to the counters they own."""
from __future__ import annotations

from dataclasses import dataclass

from pagestore.client import L3Client


@dataclass(slots=True)
class EngineConfig:
    pool_id: str = "worker-0"
    # False: no prefix caching at all. The engine then ignores any cache service and allocates
    # pages from a local free list (compute_service.engine.local_pages): every prompt is
    # computed, nothing is published, no event is emitted. No host tier, L3 or checkpoints.
    prefix_cache: bool = True
    # CUDA graphs of decode steps on a GPU (compute_service.engine.cuda_graphs); --no-cuda-graphs.
    cuda_graphs: bool = True
    # Send a step's cache call on a thread of its own while the forward runs, when the forward
    # needs none of its answer (compute_service.engine.step_planner, "Overlap").
    overlap_cache_calls: bool = True
    # How often an engine with a remote cache service (a CacheClient) checks it in the
    # background (ListPools): unreachable, the engine serves without it (local pages, no reuse);
    # back, or restarted without this pool, it registers again, idle or not. 0 = never.
    cache_watch_s: float = 0.5
    model_id: str = "model"
    page_size: int = 16
    # Pool sizes; `python -m compute_service` may size them from memory budgets instead
    # (compute_service.sizing: --kv-memory-fraction, --kv-memory-bytes, --host-memory-bytes).
    device_pages: int = 1024
    host_pages: int = 0
    checkpoint_slots: int = 64  # Mamba checkpoint slots (hybrid and Mamba models only)
    # Mamba checkpoints are taken every this many pages of prefill (a hybrid prefix can only be
    # resumed where one exists), plus at every chunk end and at the prompt's last whole page.
    checkpoint_every_pages: int = 1
    max_running: int = 16
    token_budget: int = 512  # tokens computed per step, over all requests
    # Twins take their first token from the logits of the request that completes their prompt
    # (compute_service.engine.scheduler); False makes them wait for a step of their own.
    twin_first_tokens: bool = True
    max_context: int = 8192
    # 0 = the cache service's default. Leases are renewed a quarter TTL after a call last named
    # them (step_planner), so the slowest step must take less than 3/4 of it.
    lease_ttl_s: float = 0.0
    # L3 (Redis) tier: a pagestore.L3Client, or None for no L3. The write policy is one of
    # WRITE_POLICIES (none, write-through, write-back, hot); `l3_lookup` makes the cache service
    # probe L3 at every match (it needs its own L3 client for that).
    l3: L3Client | None = None
    l3_write_policy: str = "none"
    l3_min_hits: int = 1  # hot policy: write a page once it was hit this many times
    l3_lookup: bool = False
    l3_write_queue_bytes: int = 256 << 20  # gathered pages waiting for Redis; beyond: dropped
    l3_batch_pages: int = 32  # pages per Redis round trip, for writes and for loads
    # LoRA: adapters loaded at once (their weights are reserved up front; 0 = no adapters), the
    # largest rank, and how many distinct adapters one step may run (requests beyond wait).
    max_loaded_adapters: int = 4
    max_lora_rank: int = 16
    max_loras: int = 4


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    forward_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # device, host and L3 hits
    remote_loaded_tokens: int = 0  # prompt tokens loaded from L3 instead of computed
    shared_in_flight_tokens: int = 0
    twin_first_tokens: int = 0  # first tokens sampled from a twin's logits (scheduler)
    preemptions: int = 0
    recoveries: int = 0  # times the cache service lost this pool and the engine re-registered
    cache_away: int = 0  # times the cache service was unreachable and the engine went local
    cache_rejoins: int = 0  # times it registered again once the cache service answered
    # Where a step's time goes (Engine.step): all of it, and the part the engine thread spent
    # blocked on the cache (a call's answer it needed before going on).
    step_s: float = 0.0
    cache_wait_s: float = 0.0
    cache_calls: int = 0  # Step calls sent (a step with nothing to say sends none)
    cache_calls_overlapped: int = 0  # of which ran during the step's forward
