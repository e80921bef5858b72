"""Which projections of a model can carry LoRA, their shapes, and their PEFT / HF names.

A target is `(layer_id, name)` with `name` a key of `LORA_TARGETS` (the PEFT module name, unique
within a decoder layer). PEFT stores its factors under the HF module path of the base model,
e.g. `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` (llama/qwen2/mistral),
`...model.layers.0.feed_forward.up_proj...` (bamba), `...backbone.layers.2.mixer.in_proj...`
(mamba2); `checkpoint.py`'s name maps translate those paths to ours.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from compute_service.lora.config import AdapterConfigError
from compute_service.model.checkpoint import hf_to_ours, ours_to_hf
from compute_service.model.config import ModelConfig
from compute_service.model.lora_batch import LORA_TARGETS
from compute_service.model.model import CausalLM

Target = tuple[int, str]
_OURS = re.compile(r"^layers\.(\d+)\.(.+)\.weight$")
_BY_PATH = {path: name for name, path in LORA_TARGETS.items()}


def target_linears(model: CausalLM) -> dict[Target, nn.Linear]:
    """Every LoRA-capable nn.Linear of `model`, by target, in layer order."""
    out: dict[Target, nn.Linear] = {}
    for i, layer in enumerate(model.layers):
        for name, path in LORA_TARGETS.items():
            owner, _, attr = path.partition(".")
            # getattr with a default: not every MLP kind has every projection (relu2 has no
            # gate_proj, Granite's fused MLP none of these names); an MoE layer's `mlp` has no
            # gate/up/down nn.Linear: its experts take no LoRA.
            linear = getattr(getattr(layer, owner), attr, None)
            if isinstance(linear, nn.Linear):
                out[(i, name)] = linear
    return out


def target_shapes(config: ModelConfig) -> dict[Target, tuple[int, int]]:
    """(in_features, out_features) of every LoRA-capable projection of a model of `config`, read
    off a parameter-less model on the meta device (so they match the model by construction)."""
    with torch.device("meta"):
        model = CausalLM(config)
    return {t: (lin.in_features, lin.out_features) for t, lin in target_linears(model).items()}


def target_of_hf_module(module: str, config: ModelConfig) -> Target:
    """The target of HF module path `module` (e.g. model.layers.3.self_attn.q_proj), or
    AdapterConfigError("target_modules") when it is no LoRA-capable projection of this model."""
    try:
        ours = hf_to_ours(f"{module}.weight", config.model_type, config.layer_types)
    except ValueError:
        ours = None
    match = _OURS.match(ours or "")
    if match is None or match.group(2) not in _BY_PATH:
        raise AdapterConfigError(
            "target_modules",
            f"{module!r} is not a supported LoRA target of this {config.model_type} model "
            f"(supported: {', '.join(LORA_TARGETS)} of its decoder layers)",
        )
    return int(match.group(1)), _BY_PATH[match.group(2)]


def hf_module_of_target(target: Target, config: ModelConfig) -> str:
    """Inverse of `target_of_hf_module`: the HF module path of `target`."""
    layer_id, name = target
    weight = ours_to_hf(f"layers.{layer_id}.{LORA_TARGETS[name]}.weight", config.model_type)
    return weight.removesuffix(".weight")
