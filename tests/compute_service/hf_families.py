"""Engine, tier and server tests over checkpoints that transformers itself built, with
transformers' own greedy output as the reference, so that every cache path those tests cover is
a parity test against transformers: qwen3 and qwen3_moe, and the hybrid families with no preset
(nemotron_h, granitemoehybrid dense and MoE, falcon_h1).

A family is named "hf:<case>" with <case> a key of `model/hf_reference.HF_CASES`; its weights
are the perturbed random ones `build_hf_model` makes (norm weights, biases, A_log, D, dt_bias all
away from their initial values), saved by transformers and loaded by our `load_model`. The names
are engine/tier/server test ids beside the presets (tests/compute_service/engine/references.py
and tiers/helpers.py dispatch on `is_hf`). Without transformers there are none.
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

PREFIX = "hf:"
_CASES = [
    "qwen3-tied-bias-sliding", "qwen3_moe", "nemotron_h", "granitemoehybrid-rope",
    "granitemoehybrid-moe", "falcon_h1",
]
HF_FAMILIES = [PREFIX + c for c in _CASES] if importlib.util.find_spec("transformers") else []


def is_hf(name: str) -> bool:
    return name.startswith(PREFIX)


@functools.cache
def _built(name: str) -> tuple[torch.nn.Module, CausalLM, Path]:
    """(transformers' model, ours loaded from the checkpoint transformers saved, its directory)."""
    from tests.compute_service.model.hf_reference import build_hf_model

    path = Path(tempfile.mkdtemp(prefix=f"{name.removeprefix(PREFIX)}-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    hf = build_hf_model(name.removeprefix(PREFIX), path, seed=3)
    return hf, load_model(path), path


def hf_checkpoint(name: str) -> Path:
    """The directory of the transformers-written checkpoint of family `name`."""
    return _built(name)[2]


def hf_model(name: str) -> CausalLM:
    """Our model loaded from the transformers-written checkpoint of family `name`."""
    return _built(name)[1]


@functools.cache
def hf_greedy(name: str, prompt: tuple[int, ...], new: int) -> list[int]:
    """transformers' greedy continuation: argmax of an uncached forward over the whole sequence
    for each new token (no cache of transformers' own in the way)."""
    from tests.compute_service.model.hf_reference import hf_logits

    hf, ids = _built(name)[0], list(prompt)
    for _ in range(new):
        ids.append(int(hf_logits(hf, ids)[-1].argmax()))
    return ids[len(prompt):]
