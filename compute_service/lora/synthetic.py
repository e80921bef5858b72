"""Random-weight LoRA adapters for a preset or config, reproducible from a seed (tests, demos).

Unlike PEFT's initialisation (B = 0, a no-op until trained), both factors are random, sized so
that the update moves a projection's output by about `strength` of its own scale: A rows have
unit-RMS projections of a unit-RMS input, and B is scaled by strength / (scaling * sqrt(r)).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from compute_service.lora.adapter import LoraAdapter, LoraModule, save_adapter
from compute_service.lora.config import AdapterConfigError, LoraConfig
from compute_service.lora.targets import hf_module_of_target, target_shapes
from compute_service.model.config import ModelConfig
from compute_service.model.lora_batch import LORA_TARGETS
from compute_service.model.presets import preset_config


def random_adapter(
    model: ModelConfig | str,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    targets: Iterable[str] | None = None,
    use_rslora: bool = False,
    strength: float = 0.1,
    seed: int = 0,
) -> LoraAdapter:
    """A random adapter for `model` (a ModelConfig or a preset name) on the projections named by
    `targets` (PEFT module names; None = every LoRA-capable projection the model has) in every
    layer that has them. Identical for identical arguments."""
    config = preset_config(model) if isinstance(model, str) else model
    shapes = target_shapes(config)
    wanted = set(LORA_TARGETS) if targets is None else set(targets)
    unknown = wanted - set(LORA_TARGETS)
    if unknown:
        raise AdapterConfigError("target_modules", f"{sorted(unknown)} are not LoRA targets")
    lora_config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        use_rslora=use_rslora,
        target_modules=tuple(sorted(wanted & {name for _, name in shapes})),
    )
    gen = torch.Generator().manual_seed(seed)
    modules: dict[tuple[int, str], LoraModule] = {}
    for target, (d_in, d_out) in shapes.items():
        if target[1] not in wanted:
            continue
        scaling = lora_config.scaling(hf_module_of_target(target, config))
        A = torch.randn(rank, d_in, generator=gen) / d_in**0.5
        B = torch.randn(d_out, rank, generator=gen) * (strength / (scaling * rank**0.5))
        modules[target] = LoraModule(A=A, B=B, scaling=scaling)
    if not modules:
        raise AdapterConfigError("target_modules", f"none of {sorted(wanted)} is in this model")
    return LoraAdapter(config=lora_config, modules=modules)


def write_random_adapter(path: str | Path, model: ModelConfig | str, **kwargs: Any) -> LoraAdapter:
    """`random_adapter(model, **kwargs)` written to `path` in PEFT format; returns it."""
    config = preset_config(model) if isinstance(model, str) else model
    adapter = random_adapter(config, **kwargs)
    save_adapter(adapter, path, config)
    return adapter
