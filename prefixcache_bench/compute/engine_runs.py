"""What every part does with the engine: build one around a preset with the embedded cache
service, submit a batch of greedy requests, and time what they stream."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from cache_service.core import CacheCore
from prefixcache_bench.compute.params import Params
from compute_service.engine import Engine, EngineConfig, Output, RequestStats, SamplingParams
from compute_service.model import ByteTokenizer, CausalLM
from prefixcache.v1 import cache_service_pb2 as pb


def random_tokens(rng: random.Random, n: int) -> list[int]:
    """Byte tokens (0-255): every preset's vocabulary has them, and none is a special id."""
    return [rng.randrange(256) for _ in range(n)]


def rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


class _LongLeaseCache(CacheCore):
    """The embedded cache service, registering pools with a long lease TTL (see Params)."""

    def __init__(self, lease_ttl_s: float):
        super().__init__()
        self._lease_ttl_s = lease_ttl_s

    def register_pool(self, req: pb.RegisterPoolRequest) -> pb.RegisterPoolResponse:
        req.lease_ttl_s = self._lease_ttl_s
        return super().register_pool(req)


def make_engine(model: CausalLM, name: str, p: Params, token_budget: int, pages: int,
                max_running: int = 16, **lora: int) -> Engine:
    """`lora`: EngineConfig's max_loaded_adapters / max_lora_rank / max_loras (defaults:
    EngineConfig's)."""
    cfg = EngineConfig(model_id=name, page_size=p.page_size, device_pages=pages,
                       token_budget=token_budget, max_running=max_running,
                       checkpoint_slots=p.checkpoint_slots, max_context=pages * p.page_size,
                       **lora)
    return Engine(model, ByteTokenizer(), _LongLeaseCache(p.lease_ttl_s), cfg)


def pages_for(p: Params, requests: int, tokens: int) -> int:
    """Device pages for `requests` of `tokens` each with no sharing at all, plus a page each
    of slack: preemption must never shape a measurement."""
    return requests * (-(-tokens // p.page_size) + 1)


@dataclass(slots=True)
class Finished:
    """What one request streamed: tokens, the time of each Output with tokens, final stats."""
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    stats: RequestStats | None = None

    def sink(self, out: Output) -> None:
        if out.token_ids:
            self.tokens.extend(out.token_ids)
            self.token_times.append(time.perf_counter())
        if out.stats is not None:
            self.stats = out.stats


def run_requests(engine: Engine, prompts: list[list[int]], new_tokens: int,
                 adapters: list[str] | None = None) -> list[Finished]:
    """Submits every prompt at once (greedy, ignore_eos; prompt i under adapters[i] when
    given), steps the engine until idle."""
    done = [Finished() for _ in prompts]
    sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    adapters = adapters or [""] * len(prompts)
    for i, (prompt, f) in enumerate(zip(prompts, done, strict=True)):
        engine.submit(prompt, sampling, f.sink, request_id=f"bench-{i}", adapter=adapters[i])
    engine.run_until_idle()
    missing = [i for i, f in enumerate(done) if f.stats is None]
    if missing:
        raise RuntimeError(f"requests {missing} finished without final stats")
    return done


def warm_up(model: CausalLM, name: str, p: Params) -> None:
    """One short request through a throwaway engine: first-call costs stay out of timings."""
    engine = make_engine(model, name, p, token_budget=256, pages=64)
    run_requests(engine, [random_tokens(random.Random(p.seed), 48)], 4)


@dataclass(slots=True)
class DecodeRun:
    tokens: list[list[int]]
    wall_s: float
    decode_tok_s: float | None  # steady-state rate after every request has its first token


def timed_run(engine: Engine, prompts: list[list[int]], new_tokens: int,
              adapters: list[str] | None = None) -> DecodeRun:
    started = time.perf_counter()
    done = run_requests(engine, prompts, new_tokens, adapters)
    ended = time.perf_counter()
    # The decode-only window starts when the last request got its first token.
    start = max(f.token_times[0] for f in done)
    after = sum(sum(1 for t in f.token_times if t > start) for f in done)
    rate = after / (ended - start) if ended > start and after else None
    return DecodeRun([f.tokens for f in done], ended - started, rate)
