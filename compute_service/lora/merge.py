"""The merged-weights reference: a model whose projections are W + scaling * B @ A."""

from __future__ import annotations

import copy

import torch

from compute_service.lora.adapter import LoraAdapter
from compute_service.lora.targets import target_linears
from compute_service.model.model import CausalLM


def merged_model(base: CausalLM, adapter: LoraAdapter) -> CausalLM:
    """A deep copy of `base` with `adapter` merged into its weights (computed in fp32, rounded
    once to the weight dtype). `base` is not modified. Raises KeyError if the adapter targets a
    projection `base` lacks (it was read for another config)."""
    merged = copy.deepcopy(base)
    linears = target_linears(merged)
    with torch.no_grad():
        for target, module in adapter.modules.items():
            weight = linears[target].weight
            delta = module.scaling * (module.B.float() @ module.A.float()).to(weight.device)
            weight.copy_((weight.float() + delta).to(weight.dtype))
    return merged
