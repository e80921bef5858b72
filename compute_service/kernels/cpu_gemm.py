"""The fp32 CPU GEMM of `csrc/gemm.c` (built by `cpu_native`): pack a weight once, multiply often.

Why (see the C file): at the few rows of a decode step a projection streams its weight through
the FMA units once, and this loop aims to stream it at the memory bandwidth, with threads that do
not wait on each other when another process shares the cores. It is meant to keep up with oneDNN
at prefill's many rows too, so that one packed copy serves prefill and decode. What it is worth
to a decode: docs/results/README.md (`PREFIXCACHE_CPU_NATIVE` on vs off).

Each output is a plain fp32 sum over k in order, whatever the number of rows: a token's
projection does not depend on what else is in the batch.

Used by `linear_cpu` (its `native` backend). Tested against F.linear at rtol = atol = 1e-5.
"""
from __future__ import annotations

import torch

from compute_service.kernels import cpu_native

__all__ = ["BLOCK", "gemm", "pack"]

BLOCK = 32  # output columns per packed block, as in the C source


def pack(
    weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """weight [N, K] fp32 -> (packed [ceil(N/32), K, 32], bias zero-padded to ceil(N/32)*32 or
    None): the layout `gemm` reads (see the C source)."""
    n, k = weight.shape
    padded = -(-n // BLOCK) * BLOCK
    w = torch.zeros(padded, k, dtype=torch.float32)
    w[:n] = weight.detach()
    packed = w.view(padded // BLOCK, BLOCK, k).transpose(1, 2).contiguous()
    if bias is None:
        return packed, None
    b = torch.zeros(padded, dtype=torch.float32)
    b[:n] = bias.detach()
    return packed, b


def gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """x [M, K] fp32 @ W.T + bias -> [M, n], for (packed, bias) = pack(W, bias) with W [n, K]."""
    lib = cpu_native.library()
    if lib is None:
        raise RuntimeError("cpu_gemm: the CPU C kernels are off or cannot be built here")
    x = x.contiguous()
    m, k = x.shape
    if packed.shape[1] != k or packed.shape[0] * BLOCK < n:
        raise ValueError(f"x [{m}, {k}] does not match the packed weight {tuple(packed.shape)}")
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        lib.cpu_gemm(
            x.data_ptr(), k, m, k, packed.data_ptr(),
            bias.data_ptr() if bias is not None else None, n, y.data_ptr(), n,
            torch.get_num_threads(),
        )
    return y
