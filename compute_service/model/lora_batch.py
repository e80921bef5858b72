"""The model side of LoRA serving: which projections take a per-token low-rank update, and the
`LoraBatch` that carries the update's weights and token-to-adapter map into one forward call.

Adapters live in slots of stacked buffers (see `compute_service.lora.AdapterRegistry`, which
builds `LoraBatch`es); a token names a slot, or -1 for the base model. Every targeted projection
computes `y = linear(x)` and then `kernels.lora_apply` adds, for the tokens with a slot,
`scaling[s] * (x @ A[s].T) @ B[s].T`. With no `LoraBatch` the forward is exactly the base model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from compute_service import kernels
from compute_service.kernels import LoraSegments

# Projections that may carry LoRA, by the PEFT / HF module name (unique within one decoder
# layer), with the path of the matching nn.Linear inside our DecoderLayer.
LORA_TARGETS: dict[str, str] = {
    "q_proj": "attn.q_proj",
    "k_proj": "attn.k_proj",
    "v_proj": "attn.v_proj",
    "o_proj": "attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
    "in_proj": "mamba.in_proj",
    "out_proj": "mamba.out_proj",
}


@dataclass(slots=True)
class LoraWeights:
    """One projection's adapters, one per slot: A [S, r_max, in], B [S, out, r_max] in the model
    dtype, scaling [S] fp32. An adapter of rank r < r_max (or one that does not target this
    projection) has the unused rows of A / columns of B zero. B_t: B transposed to
    [S, r_max, out], kept beside B on CPU for the C kernel (`kernels.lora_cpu`), else None."""

    A: torch.Tensor
    B: torch.Tensor
    scaling: torch.Tensor
    B_t: torch.Tensor | None = None


@dataclass(slots=True)
class LayerLora:
    """The LoRA update of one decoder layer in one forward call.

    token_slot [T] int32: the adapter slot of each packed token (-1 = base model);
    segments: `kernels.lora_segments(token_slot, S)`, shared by all projections of the call;
    weights: PEFT module name (a key of `LORA_TARGETS`) -> that projection's stacks. Projections
    absent from `weights` get no update.
    """

    token_slot: torch.Tensor
    segments: LoraSegments
    weights: dict[str, LoraWeights]


@dataclass(slots=True)
class LoraBatch:
    """`ForwardBatch.lora`: per model layer (index = layer id), its `LayerLora` or None when no
    adapter in the batch targets that layer. All tensors on the model's device."""

    layers: list[LayerLora | None]


def project(linear: nn.Linear, x: torch.Tensor, lora: LayerLora | None, name: str) -> torch.Tensor:
    """linear(x) [T, out], plus the LoRA update of projection `name` when `lora` targets it.
    (`kernels.linear` rather than the module's forward: on CPU it runs on pre-packed weights.)"""
    return project_group((linear,), x, lora, (name,))[0]


def project_group(
    linears: Sequence[nn.Linear], x: torch.Tensor, lora: LayerLora | None, names: Sequence[str]
) -> list[torch.Tensor]:
    """[project(l, x, lora, name) for each pair], with the base projections computed as one GEMM
    where the kernels can (`kernels.linear_group`); each LoRA update lands in its own output."""
    ys = kernels.linear_group(x, [l.weight for l in linears], [l.bias for l in linears])
    for y, name in zip(ys, names, strict=True):
        if lora is not None and (w := lora.weights.get(name)) is not None:
            kernels.lora_apply(y, x, w.A, w.B, w.scaling, lora.token_slot, lora.segments,
                               B_t=w.B_t)
    return ys
