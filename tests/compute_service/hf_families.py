"""Families checked against transformers on the engine's cache paths: a tiny random-weight
checkpoint built and saved by transformers itself (norm weights and biases perturbed, see
model/hf_reference.py), loaded by our `load_model`, and its greedy continuation computed by
transformers (one uncached forward per token, the plainest use of its model).

The names are engine/tier test ids, beside the presets (tests/compute_service/engine/
references.py and tiers/helpers.py dispatch on them). Without transformers there are none.
"""
from __future__ import annotations

import atexit
import functools
import importlib.util
import shutil
import tempfile
from pathlib import Path

import torch

from compute_service.model import CausalLM, load_model

# test id -> case of model/hf_reference.HF_CASES
HF_FAMILY_CASES = {"hf-qwen3": "qwen3-tied-bias-sliding", "hf-qwen3-moe": "qwen3_moe"}
HF_FAMILIES = list(HF_FAMILY_CASES) if importlib.util.find_spec("transformers") else []


@functools.cache
def _built(name: str) -> tuple[torch.nn.Module, CausalLM, Path]:
    from tests.compute_service.model.hf_reference import build_hf_model

    path = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    hf = build_hf_model(HF_FAMILY_CASES[name], path, seed=3)
    return hf, load_model(path), path


def hf_family_checkpoint(name: str) -> Path:
    """The directory of the transformers-written checkpoint of family `name`."""
    return _built(name)[2]


def hf_family_model(name: str) -> CausalLM:
    """Our model loaded from the transformers-written checkpoint of family `name`."""
    return _built(name)[1]


@functools.cache
def hf_greedy(name: str, prompt: tuple[int, ...], new: int) -> list[int]:
    """transformers' greedy continuation of `prompt`: `new` tokens."""
    hf = _built(name)[0]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            logits = hf(torch.tensor([ids]), use_cache=False).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]
