"""Engine and tier tests over checkpoints that transformers itself built (the hybrid families
with no preset: nemotron_h, granitemoehybrid, falcon_h1), with transformers' own greedy output as the
reference, so that every cache path those tests cover is a parity test against transformers.

A family is named "hf:<case>" with <case> a key of `hf_reference.HF_CASES`; its weights are the
perturbed random ones `build_hf_model` makes (norm weights, biases, A_log, D, dt_bias all away
from their initial values).
"""
from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import torch

from compute_service.model import CausalLM, load_model
from tests.compute_service.model.hf_reference import build_hf_model, hf_logits

HF_FAMILIES = ["hf:nemotron_h", "hf:granitemoehybrid-rope", "hf:falcon_h1"]
PREFIX = "hf:"


def is_hf(name: str) -> bool:
    return name.startswith(PREFIX)


@functools.cache
def _pair(name: str) -> tuple[torch.nn.Module, CausalLM]:
    """(transformers' model, ours loaded from the checkpoint transformers saved)."""
    with tempfile.TemporaryDirectory() as tmp:
        hf = build_hf_model(name.removeprefix(PREFIX), Path(tmp), seed=3)
        return hf, load_model(tmp)


def hf_model(name: str) -> CausalLM:
    return _pair(name)[1]


@functools.cache
def hf_greedy(name: str, prompt: tuple[int, ...], new: int) -> list[int]:
    """transformers' greedy continuation: argmax of an uncached forward over the whole sequence
    for each new token (no cache of transformers' own in the way)."""
    hf, ids = _pair(name)[0], list(prompt)
    for _ in range(new):
        ids.append(int(hf_logits(hf, ids)[-1].argmax()))
    return ids[len(prompt):]
