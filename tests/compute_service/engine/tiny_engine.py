"""The engine tests' tiny engine: the tiny transformer (fixed weights) over the byte tokenizer and
an in-process cache core, small pages and a small token budget, so that chunking, paging and
eviction happen within a few dozen tokens."""
from __future__ import annotations

import functools

from cache_service.core import CacheCore
from compute_service.engine import Engine, EngineConfig, SamplingParams
from compute_service.model import ByteTokenizer, build_preset

PROMPT = list(range(40, 80))


@functools.cache
def tiny():
    return build_preset("tiny-transformer", seed=5)


def make(**cfg) -> Engine:
    settings = dict(page_size=4, device_pages=128, token_budget=16, model_id="tiny")
    settings.update(cfg)
    return Engine(tiny(), ByteTokenizer(), CacheCore(), EngineConfig(**settings))


def generate(eng: Engine, prompt=PROMPT, **sampling):
    """Greedy unless `sampling` says otherwise: the output ids and the messages."""
    outs = []
    eng.submit(prompt, SamplingParams(**sampling), outs.append)
    eng.run_until_idle()
    return [t for o in outs for t in o.token_ids], outs
