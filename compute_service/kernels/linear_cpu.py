"""`linear_group` for CPU tensors: projections through oneDNN with pre-packed weights.

Why: the plain `torch.nn.functional.linear` on CPU hands a few-row GEMM (a decode step: one row
per running sequence) to a BLAS that runs it on one thread in the weight's plain layout. oneDNN's
inner product reads a weight re-laid-out once for its micro-kernels (the packing that inductor's
CPU backend uses) and threads small problems too. Measured on the 2-core benchmark machine
(fp32, 1536 x 512 weight): 2.0x faster at 8 rows, 1.2-1.4x at 32-2,048 rows; never slower.

Projections of one input (q/k/v, gate/up) go through `linear_group`: their weights are packed
as one stacked matrix, so a decode step makes one larger GEMM instead of several small ones
(at 8 rows: q/k/v 1.5x, gate/up 1.15x faster than three and two packed calls).

The packed copy is made on first use and kept on the (first) weight tensor as the attribute
`_onednn_packed`, with the data pointers and version counters it was made from, so that a weight
replaced or changed in place is re-packed. It costs one more copy of every projection weight in
host memory: the price of the speed on a CPU worker. Values equal F.linear's up to fp32 rounding
(the reduction order differs).

Only fp32 takes this path; other dtypes, and builds without oneDNN, use F.linear.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from compute_service.kernels.tensor_version import tensor_version

__all__ = ["linear_group"]

# Rows the packing is tuned for (a decode step of a few sequences); any row count works.
PACK_ROWS_HINT = 8

_AVAILABLE = torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_linear_pointwise"
)


def _packed(
    weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The oneDNN-packed stack of `weights` and the concatenated bias (None without biases),
    made now unless the cached pair is still current."""
    tensors = [*weights, *(b for b in biases if b is not None)]
    key = tuple((t.data_ptr(), tensor_version(t)) for t in tensors)
    cached = getattr(weights[0], "_onednn_packed", None)
    if cached is None or cached[0] != key:
        stacked = weights[0] if len(weights) == 1 else torch.cat(list(weights))
        packed = torch.ops.mkldnn._reorder_linear_weight(stacked.detach(), PACK_ROWS_HINT)
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([
                b.detach() if b is not None else w.new_zeros(w.shape[0])
                for w, b in zip(weights, biases, strict=True)
            ])
        cached = (key, (packed, bias))
        weights[0]._onednn_packed = cached
    return cached[1]


def _takes_packed(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> bool:
    return _AVAILABLE and x.dim() == 2 and all(
        t.dtype == torch.float32 for t in (x, *weights)
    )


def linear_group(
    x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]
) -> list[torch.Tensor]:
    """[linear(x, w, b) for each weight and bias], computed as one GEMM: the outputs are column
    slices of one [T, sum(out)] tensor. Pass the same weights in the same order on every call
    (the packed stack is cached for them)."""
    if not _takes_packed(x, weights):
        return [F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
    packed, bias = _packed(weights, biases)
    y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    if len(weights) == 1:
        return [y]
    return list(y.split([w.shape[0] for w in weights], dim=1))
