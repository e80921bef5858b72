"""Compute kernels of the model layers: paged attention, Mamba2 SSM scan/update, causal conv1d,
batched multi-adapter LoRA, the projections' `linear`, the fused mixture-of-experts MLP, RMSNorm
and RoPE.

Each public function has the signature of its PyTorch reference (the `*_ref` modules) plus the
keywords `use_triton` and `reference`; `dispatch.TABLE` lists the backends of every operation
(reference, vectorised PyTorch, Triton, CPU C kernels) and `dispatch.choose` says which serves a
call. The implementation modules keep their own public functions, callable directly.
"""
from __future__ import annotations

import torch

from compute_service.kernels.dispatch import TABLE, choose, cpu_status, public
from compute_service.kernels.lora_ref import LoraSegments, lora_segments
from compute_service.kernels.mamba_ref import ChunkLayout, mamba_chunk_layout

__all__ = [
    "TABLE",
    "ChunkLayout",
    "LoraSegments",
    "causal_conv1d",
    "causal_conv1d_update",
    "choose",
    "cpu_status",
    "extend_attention",
    "fused_moe",
    "linear",
    "linear_group",
    "lora_apply",
    "lora_segments",
    "mamba_chunk_layout",
    "mamba_chunk_scan",
    "paged_decode_attention",
    "rms_norm",
    "rope",
    "selective_state_update",
    "write_kv",
]

write_kv = public("write_kv")
paged_decode_attention = public("paged_decode_attention")
extend_attention = public("extend_attention")
mamba_chunk_scan = public("mamba_chunk_scan")
selective_state_update = public("selective_state_update")
causal_conv1d = public("causal_conv1d")
causal_conv1d_update = public("causal_conv1d_update")
lora_apply = public("lora_apply")
linear_group = public("linear_group")
fused_moe = public("fused_moe")
rms_norm = public("rms_norm")
rope = public("rope")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T + bias, as `torch.nn.functional.linear` (see `linear_group`)."""
    return linear_group(x, [weight], [bias])[0]
