"""RMSNorm and rotary position embedding (RoPE): the references of `rms_norm` and `rope`.

Both are a handful of elementwise PyTorch ops, which on a GPU means a handful of kernel
launches each (an RMSNorm in bf16 is ~8, a RoPE ~7), twice per layer: the eager forward of a
32-layer model spends more launches on them than on its GEMMs. `norm_rope_triton` does each in
one launch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["rms_norm", "rope"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)) over the last dim. Low-precision inputs are
    normalised in fp32 and rounded back to their dtype before the weight multiplies them (the
    Llama/HF order)."""
    if x.dtype == weight.dtype == torch.float32:
        # The same arithmetic as below (nothing to cast), as one fused op.
        return F.rms_norm(x, weight.shape, weight, eps)
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, head_dim] -> same shape, RoPE in the NeoX ("rotate half") layout applied to the
    first rotary_dim = cos.shape[-1] channels; the rest (partial rotary, e.g. Bamba's 0.5) pass
    through unchanged. cos, sin [T, 1, rotary_dim], each half a copy of the other (the tables
    of `RotaryEmbedding`)."""
    rotary_dim = cos.shape[-1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos + rotated * sin
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
