"""Shared pieces of the tier tests: tiny models, references, workers, Redis clients."""
from __future__ import annotations

import functools
import itertools
import random

from cache_service.core import CacheCore
from compute_service.engine import Engine, EngineConfig, SamplingParams
from compute_service.model import ByteTokenizer, build_preset
from pagestore.client import L3Client, L3Config
from tests.compute_service.hf_families import hf_greedy, hf_model, is_hf
from tests.compute_service.paged_driver import PagedDriver

PAGE = 4
NEW = 4
_ids = itertools.count()


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 255) for _ in range(n)]


PROMPT = prompt_of(1, 33)  # 8 whole pages can be reused, the 33rd token is always computed


@functools.cache
def model(name: str):
    return hf_model(name) if is_hf(name) else build_preset(name, seed=3)


@functools.cache
def reference(name: str, prompt: tuple[int, ...]) -> list[int]:
    """Greedy tokens from PagedDriver: the independent cold computation (transformers' own for
    the "hf:" families)."""
    if is_hf(name):
        return hf_greedy(name, prompt, NEW)
    return PagedDriver(model(name), num_pages=64, page_size=PAGE, num_slots=2).generate_greedy(
        list(prompt), NEW)


def l3_client(url: str, clock=None, **overrides) -> L3Client:
    """Short timeouts and a quick breaker so that fault tests stay fast; `clock` drives the
    breaker's cool-down (a test that must not race it on a loaded machine passes its own)."""
    settings = dict(timeout_s=0.1, connect_timeout_s=0.1, failure_threshold=2, reset_after_s=0.3)
    settings.update(overrides)
    return L3Client(L3Config(url, **settings), **({"clock": clock} if clock else {}))


class ProbeAll:
    """A cache service L3 probe that reports every page present, as a probe does that ran just
    before Redis was flushed, stopped or paused: the engine's own load then meets the fault."""

    def probe(self, model_id: str, hashes: list[bytes]) -> int:
        return len(hashes)


def make_worker(name: str, l3: L3Client | None = None, *, lookup: bool = False, probe=None,
                **cfg) -> Engine:
    """A worker with its own CacheCore (as separate machines have); `probe` replaces the cache
    service's L3 client for lookups. EngineConfig fields override the tiny defaults."""
    settings = dict(pool_id=f"w{next(_ids)}", page_size=PAGE, device_pages=64, token_budget=16,
                    max_running=4, checkpoint_slots=32, model_id=name, l3=l3, l3_lookup=lookup)
    settings.update(cfg)
    core = CacheCore(remote=(probe or l3) if lookup else None)
    return Engine(model(name), ByteTokenizer(), core, EngineConfig(**settings))


def generate(eng: Engine, prompt: list[int]) -> tuple[list[int], object]:
    """Greedy tokens and final stats of one request run to completion."""
    outs: list = []
    eng.submit(prompt, SamplingParams(max_tokens=NEW, ignore_eos=True), outs.append)
    eng.run_until_idle()
    return [t for o in outs for t in o.token_ids], outs[-1].stats


def generate_many(eng: Engine, prompts: list[list[int]]) -> list[tuple[list[int], object]]:
    outs: list[list] = [[] for _ in prompts]
    for prompt, sink in zip(prompts, outs, strict=True):
        eng.submit(prompt, SamplingParams(max_tokens=NEW, ignore_eos=True), sink.append)
    eng.run_until_idle()
    return [([t for o in out for t in o.token_ids], out[-1].stats) for out in outs]
