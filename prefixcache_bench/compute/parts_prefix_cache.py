"""prefix_cache_overhead (only when named in --parts): what prefix caching costs a decode that
hits nothing. The same batch of distinct random prompts (0% hits) through two engines on the
same weights, in alternating rounds (the order flips every round, so that load drift on a shared
machine hits both alike):

- `prefix_cache`: the engine with prefix caching through a real cache service: a
  `python -m cache_service` child process on loopback, reached through `CacheClient` (gRPC),
  as a worker runs beside its sidecar;
- `no_prefix_cache`: the engine with `EngineConfig.prefix_cache=False` (a local page allocator:
  no tree, no matches, no publishes, no events).

Within a round both engines hold the same batch and are stepped in turn (one step of each, then
the next), each step timed on its own: whatever else a shared machine does hits both alike,
which back-to-back runs do not achieve on a 2-core machine. Per engine: the steady decode rate
(the tokens of the steps after every request got its first token, over those steps' own time),
and the fraction of that time the engine thread spent blocked on the cache
(`EngineStats.cache_wait_s`) and its cache calls per step. `decode_prefix_cache_ratio` is the
median over rounds of cached / uncached steady rates. Both engines' greedy tokens must be
identical (`prefix_cache_outputs_identical`): caching a cold prompt changes nothing it computes.
"""
from __future__ import annotations

import contextlib
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from prefixcache_bench.compute.engine_runs import Finished, pages_for, random_tokens, rounded
from prefixcache_bench.compute.params import Params
from compute_service.engine import Engine, EngineConfig, SamplingParams
from compute_service.model import ByteTokenizer, CausalLM
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache_bench.harness import REPO, log
from prefixcache_client.cache import CacheClient

POOL_ID = "bench-prefix-cache"
MODES = ("prefix_cache", "no_prefix_cache")


@contextlib.contextmanager
def cache_service_process(timeout_s: float = 60.0) -> Iterator[str]:
    """A `python -m cache_service` child on 127.0.0.1 and a free port; yields its address."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "cache_service", "--host", "127.0.0.1", "--port", "0",
         "--log-level", "WARNING", "--grace-s", "0"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + timeout_s
        line = proc.stdout.readline().strip()  # "listening on HOST:PORT"
        if not line.startswith("listening on ") or time.monotonic() > deadline:
            raise RuntimeError(f"cache service did not start: {line!r} (exit {proc.poll()})")
        yield line.removeprefix("listening on ")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def overhead_engine(model: CausalLM, name: str, p: Params, cache: CacheClient | None) -> Engine:
    """A fresh engine (a new epoch of the pool: nothing cached) holding every request at once,
    whose token budget prefills them all in one step; prefix caching off when `cache` is None."""
    n, tokens = p.overhead_requests, p.overhead_prompt_tokens + p.overhead_new_tokens
    pages = pages_for(p, n, tokens)
    cfg = EngineConfig(pool_id=POOL_ID, model_id=name, page_size=p.page_size, device_pages=pages,
                       token_budget=max(p.decode_token_budget, n * p.overhead_prompt_tokens),
                       max_running=n, checkpoint_slots=p.checkpoint_slots,
                       max_context=pages * p.page_size, lease_ttl_s=p.lease_ttl_s,
                       prefix_cache=cache is not None)
    return Engine(model, ByteTokenizer(), cache, cfg)


@dataclass(slots=True)
class OverheadRun:
    """One engine's share of a round."""
    engine: Engine
    done: list[Finished]
    # The steady window: the steps after every request got its first token, through the last
    # step that streamed a token. Their own wall time, tokens, cache wait, calls.
    window_s: float = 0.0
    window_tokens: int = 0
    window_wait_s: float = 0.0
    window_steps: int = 0
    window_calls: int = 0

    @property
    def tokens(self) -> list[list[int]]:
        return [f.tokens for f in self.done]

    @property
    def steady_tok_s(self) -> float:
        return self.window_tokens / self.window_s

    @property
    def cache_wait_frac(self) -> float:
        return self.window_wait_s / self.window_s

    @property
    def cache_calls_per_step(self) -> float:
        return self.window_calls / max(1, self.window_steps)

    @property
    def cached_tokens(self) -> int:
        return sum(f.stats.cached_tokens_device for f in self.done)

    def step(self) -> None:
        """One step of its engine, timed on its own; counted in the window once every request
        has its first token."""
        engine, stats = self.engine, self.engine.stats
        steady = all(f.tokens for f in self.done)
        tokens, wait, calls = sum(len(f.tokens) for f in self.done), stats.cache_wait_s, \
            stats.cache_calls
        started = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - started
        new = sum(len(f.tokens) for f in self.done) - tokens
        if steady and new:
            self.window_s += elapsed
            self.window_tokens += new
            self.window_wait_s += stats.cache_wait_s - wait
            self.window_steps += 1
            self.window_calls += stats.cache_calls - calls


def overhead_round(engines: dict[str, Engine], prompts: list[list[int]],
                   new_tokens: int) -> dict[str, OverheadRun]:
    """The same prompts (greedy, every one at once) through each engine, stepping the engines
    in turn, in the dict's order: one step of each, then the next, so that whatever else the
    machine does hits them alike. Each step is timed on its own, so neither engine's rate
    includes the other's steps."""
    sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    runs = {}
    for mode, engine in engines.items():
        runs[mode] = run = OverheadRun(engine, [Finished() for _ in prompts])
        for i, (prompt, f) in enumerate(zip(prompts, run.done, strict=True)):
            engine.submit(prompt, sampling, f.sink, request_id=f"overhead-{i}")
    while any(e.has_work() for e in engines.values()):
        for run in runs.values():
            if run.engine.has_work():
                run.step()
    return runs


def bench_prefix_cache_overhead(model: CausalLM, name: str, p: Params) -> dict:
    rng = random.Random(p.seed + 5)
    runs: dict[str, list[OverheadRun]] = {m: [] for m in MODES}
    identical = True
    with cache_service_process() as target, CacheClient(target) as client:
        client.wait_until_ready(30)

        def one_round(order: tuple[str, ...], prompts: list[list[int]],
                      new_tokens: int) -> dict[str, OverheadRun]:
            engines = {mode: overhead_engine(model, name, p,
                                             client if mode == "prefix_cache" else None)
                       for mode in order}
            try:
                return overhead_round(engines, prompts, new_tokens)
            finally:
                for engine in engines.values():
                    engine.close()

        def batch() -> list[list[int]]:  # fresh random prompts: nothing to hit
            return [random_tokens(rng, p.overhead_prompt_tokens)
                    for _ in range(p.overhead_requests)]

        one_round(MODES, batch()[:4], 4)  # warm-up: first-call costs (gRPC channel) stay out
        for rnd in range(1, p.overhead_rounds + 1):
            got = one_round(MODES if rnd % 2 else MODES[::-1], batch(), p.overhead_new_tokens)
            identical &= got["prefix_cache"].tokens == got["no_prefix_cache"].tokens
            for mode in MODES:
                runs[mode].append(got[mode])
            c, o = got["prefix_cache"], got["no_prefix_cache"]
            log(f"  prefix_cache_overhead round {rnd}/{p.overhead_rounds}: cached "
                f"{c.steady_tok_s:.1f} tok/s (cache wait {c.cache_wait_frac:.2%}), off "
                f"{o.steady_tok_s:.1f} tok/s, ratio {c.steady_tok_s / o.steady_tok_s:.4f}")
        with contextlib.suppress(Exception):
            client.unregister_pool(cpb.UnregisterPoolRequest(pool_id=POOL_ID))
    cached, off = runs["prefix_cache"], runs["no_prefix_cache"]
    ratios = [c.steady_tok_s / o.steady_tok_s for c, o in zip(cached, off, strict=True)]
    med = statistics.median
    return {
        "decode_prefix_cache_ratio": round(med(ratios), 4),
        "decode_prefix_cache_tok_s": round(med(r.steady_tok_s for r in cached), 2),
        "decode_no_prefix_cache_tok_s": round(med(r.steady_tok_s for r in off), 2),
        "decode_prefix_cache_ratio_of_medians": round(
            med(r.steady_tok_s for r in cached) / med(r.steady_tok_s for r in off), 4),
        "prefix_cache_wait_frac": rounded(med(r.cache_wait_frac for r in cached)),
        "prefix_cache_calls_per_step": rounded(med(r.cache_calls_per_step for r in cached)),
        "no_prefix_cache_wait_frac": rounded(med(r.cache_wait_frac for r in off)),
        "prefix_cache_outputs_identical": identical,
        "prefix_cache_hit_tokens": sum(r.cached_tokens for r in cached),
        "prefix_cache_samples": {
            "ratio": [round(x, 4) for x in ratios],
            **{f"{m}_tok_s": [round(r.steady_tok_s, 2) for r in runs[m]] for m in MODES},
            "prefix_cache_wait_frac": [round(r.cache_wait_frac, 5) for r in cached]},
        "prefix_cache_transport": "gRPC, python -m cache_service child on loopback",
    }
