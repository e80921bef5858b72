"""`linear_group` for CPU tensors: fp32 projections on weights packed once for a faster GEMM.

Why: the plain `torch.nn.functional.linear` on CPU hands a few-row GEMM (a decode step: one row
per running sequence) to a BLAS that runs it on one thread in the weight's plain layout, far
below the memory bandwidth. Two faster GEMMs read a copy of the weight laid out for them:

- `native`: our own loop, `cpu_gemm`, built for this CPU on first use (`cpu_native`): it streams
  the weights at the memory bandwidth at a decode's few rows (see `cpu_gemm`).
- `onednn`: oneDNN's inner product on its own packed layout (the packing inductor's CPU backend
  uses), faster than F.linear at every row count. Where the C kernels are off
  (`PREFIXCACHE_CPU_NATIVE=off`) or cannot be built.
- `torch`: F.linear, for a torch build without oneDNN.

What `native` over `onednn` is worth to a decode: docs/results/README.md.

Values equal F.linear's up to fp32 rounding (the reduction order differs).

Projections of one input (q/k/v, gate/up) go through `linear_group`: their weights are packed
as one stacked matrix, so a decode step makes one larger GEMM instead of several small ones.

The packed copy is made on first use and kept on the (first) weight tensor as the attribute
`_cpu_packed`, with the backend, data pointers and version counters it was made from, so that a
weight replaced or changed in place is re-packed. A weight marked `release_after_packing` (a
serving worker marks every projection but a tied embedding: `model/warmup.py`) then gives up its
own storage: it keeps its shape over a single zero (stride 0), so the packed copy replaces it
rather than doubling it; such a weight can no longer be read, and a path that would read it
(F.linear's fallback, or packing it again in another group) raises instead of computing with
zeros.

Only fp32 takes this path; other dtypes use F.linear.

Backend `cpu` of `dispatch.TABLE` for `linear_group` (`linear_ref` serves CUDA). Both packed
backends are tested against F.linear at rtol = atol = 1e-5.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from compute_service.kernels import cpu_gemm, cpu_native
from compute_service.kernels.tensor_version import tensor_version

__all__ = ["backend", "is_released", "linear_group", "packed_rows", "release_after_packing"]

# oneDNN's packing is tuned for this many rows (a decode step of a few sequences); any works.
ONEDNN_PACK_ROWS_HINT = 8

_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")

_chosen: list[str] = []


def backend() -> str:
    """The GEMM behind fp32 CPU projections in this process (chosen once, see the module doc)."""
    if not _chosen:
        _chosen.append("native" if cpu_native.enabled() else "onednn" if _ONEDNN else "torch")
    return _chosen[0]


def _pack(name: str, stacked: torch.Tensor, bias: torch.Tensor | None):
    if name == "native":
        return cpu_gemm.pack(stacked, bias)
    return torch.ops.mkldnn._reorder_linear_weight(stacked, ONEDNN_PACK_ROWS_HINT), bias


def release_after_packing(weight: torch.Tensor) -> None:
    """Mark `weight` to give up its storage once packed (see the module docstring)."""
    weight._release_after_packing = True


def is_released(weight: torch.Tensor) -> bool:
    return getattr(weight, "_released", False)


def packed_rows(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """weight[ids] read from `weight`'s native packed copy ([N/32, K, 32]: row n is
    packed[n // 32, :, n % 32]), for a tied embedding released after packing for the logits."""
    packed = weight._cpu_packed[1][0]
    return packed[ids // cpu_gemm.BLOCK, :, ids % cpu_gemm.BLOCK]


def _release(weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None], key):
    """Each marked weight's storage replaced by one zero (same shape, stride 0); returns the
    cache key of the tensors as they now are (so the packed stack stays current)."""
    if not all(getattr(w, "_release_after_packing", False) for w in weights):
        return key
    for w in weights:
        w.data = torch.zeros((), dtype=w.dtype, device=w.device).expand(w.shape)
        w._released = True
    tensors = [*weights, *(b for b in biases if b is not None)]
    return (key[0], *((t.data_ptr(), tensor_version(t)) for t in tensors))


def _packed(
    name: str, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Backend `name`'s packed stack of `weights` and their concatenated bias (None without
    biases), made now unless the cached pair is still current."""
    tensors = [*weights, *(b for b in biases if b is not None)]
    key = (name, *((t.data_ptr(), tensor_version(t)) for t in tensors))
    cached = getattr(weights[0], "_cpu_packed", None)
    if cached is None or cached[0] != key:
        if any(is_released(w) for w in weights):  # packing zeros would compute garbage
            raise RuntimeError("linear_group: weights released after packing were called in "
                               "another group or changed; call them as the warm-up did")
        stacked = weights[0] if len(weights) == 1 else torch.cat(list(weights))
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([
                b.detach() if b is not None else w.new_zeros(w.shape[0])
                for w, b in zip(weights, biases, strict=True)
            ])
        packed = _pack(name, stacked.detach(), bias)
        del stacked
        cached = (_release(weights, biases, key), packed)
        weights[0]._cpu_packed = cached
    return cached[1]


def linear_group(
    x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]
) -> list[torch.Tensor]:
    """[linear(x, w, b) for each weight and bias], computed as one GEMM: the outputs are column
    slices of one [T, sum(out)] tensor. Pass the same weights in the same order on every call
    (the packed stack is cached for them)."""
    name = backend()
    if name == "torch" or x.dim() != 2 or any(t.dtype != torch.float32 for t in (x, *weights)):
        if any(is_released(w) for w in weights):
            raise RuntimeError("linear_group: a weight released after packing cannot take the "
                               f"F.linear path (x {tuple(x.shape)} {x.dtype})")
        return [F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
    packed, bias = _packed(name, weights, biases)
    if name == "native":
        y = cpu_gemm.gemm(x, packed, bias, sum(w.shape[0] for w in weights))
    else:
        y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    if len(weights) == 1:
        return [y]
    return list(y.split([w.shape[0] for w in weights], dim=1))
