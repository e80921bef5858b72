"""Plain PyTorch reference for the projections: `linear_group`, one `F.linear` per weight.

CUDA tensors and every dtype but fp32 on CPU take `linear_torch` (one GEMM for weights laid end to
end in one buffer); fp32 CPU projections take `linear_cpu` (packed weights through our C GEMM or
oneDNN), tested against this to rtol = atol = 1e-5 (the reduction order differs). There is no
Triton version.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = ["linear_group"]


def linear_group(
    x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]
) -> list[torch.Tensor]:
    """[F.linear(x, w, b) for each weight and bias]."""
    return [F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
