"""What the engine tests compare against: the tiny model of each family (fixed weights) and its
greedy continuation computed by the plain paged driver, with no cache, engine or scheduler; for
the "hf:" families (built by transformers) the greedy continuation is transformers' own."""
from __future__ import annotations

import functools

import torch

from compute_service.model import build_preset
from tests.compute_service.hf_families import HF_FAMILIES, hf_greedy, hf_model, is_hf
from tests.compute_service.paged_driver import PagedDriver

FAMILIES = ["tiny-transformer", "tiny-sliding", "tiny-mamba2", "tiny-hybrid", *HF_FAMILIES]
PAGE = 4
NEW = 6


@functools.cache
def model(name: str):
    if is_hf(name):
        return hf_model(name)
    torch.manual_seed(0)
    return build_preset(name, seed=3)


@functools.cache
def reference(name: str, prompt: tuple[int, ...], new: int = NEW) -> list[int]:
    if is_hf(name):
        return hf_greedy(name, prompt, new)
    driver = PagedDriver(model(name), num_pages=96, page_size=PAGE, num_slots=2)
    return driver.generate_greedy(list(prompt), new)
