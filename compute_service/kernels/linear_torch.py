"""`linear_group` in PyTorch with one GEMM for weights laid end to end.

`CausalLM.join_projections` (on a GPU) stores q/k/v and gate/up each in one buffer, every
weight a view of its rows: such a group is one `F.linear` over the whole buffer, its outputs
column slices of one [T, sum(out)] tensor (one cuBLAS launch instead of three, and a wider
GEMM). Any other group takes one `F.linear` per weight, as the reference does. Tested against
`linear_ref` on CPU with joined and separate weights.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = ["joined_rows", "linear_group"]


def joined_rows(weights: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The [sum(out), in] tensor the weights are consecutive row ranges of, or None when they
    are not (other buffers, gaps, other dtypes or widths, a single weight)."""
    if len(weights) < 2:
        return None
    first = weights[0]
    if not first.is_contiguous():
        return None
    offset = first.storage_offset() + first.numel()
    for w in weights[1:]:
        if (not w.is_contiguous() or w.dtype != first.dtype or w.shape[1:] != first.shape[1:]
                or w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or w.storage_offset() != offset):
            return None
        offset += w.numel()
    rows = sum(w.shape[0] for w in weights)
    return first.as_strided((rows, first.shape[1]), (first.shape[1], 1))


def linear_group(
    x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]
) -> list[torch.Tensor]:
    """See `linear_ref.linear_group`."""
    joined = joined_rows(weights) if all(b is None for b in biases) else None
    if joined is None:
        return [F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
    return list(F.linear(x, joined).split([w.shape[0] for w in weights], dim=-1))
