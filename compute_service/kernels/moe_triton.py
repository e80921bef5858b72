"""Triton fused mixture-of-experts MLP: a grouped GEMM over the tokens sorted by expert.

Same signature and semantics as `moe_ref.fused_moe`. Each (token, choice) pair of `topk_ids` is
a row; rows are sorted by expert and every expert's run is padded to whole tiles of BLOCK_M rows
(`_align`, on the device, without a host sync: the tile count is bounded by
T*k + E*(BLOCK_M-1) rows), so that every program multiplies one tile of rows by a *single*
expert's weights with `tl.dot`, whatever the mix of experts:

1. `_gate_up_kernel`, grid (row tiles, I blocks): h[r, n] = silu(x[t] @ Wg[e, n].T) *
   (x[t] @ Wu[e, n].T) for the tile's rows r = (t, j), gate and up accumulated side by side
   in fp32 and the SiLU gate applied before the one store (the [rows, 2I] product never exists).
2. `_down_kernel`, grid (row tiles, H blocks): y[r, n] = topk_weights[r] * (h[r] @ Wd[e, n].T),
   stored in fp32.

The k rows of a token are then summed in torch (a fixed order: deterministic, no atomics) and
cast to x's dtype. Tiles past the last expert's run exit at once; padding rows are masked;
an expert no token picks is never read.

Backend `triton` of `dispatch.TABLE` for `fused_moe`. Tested against `moe_ref` in fp32 and fp16
interpreted on CPU, and compiled on a GPU when one is present
(tests/compute_service/kernels/test_moe.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from compute_service.kernels.moe_ref import check_moe_args

__all__ = ["fused_moe"]

_BLOCK_M = 16
_BLOCK_N = 64
_BLOCK_K = 32


def _align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """(row ids sorted by expert, each expert's run padded to `block_m` with the sentinel T*k;
    the expert of each tile, `num_experts` for tiles past the end). Sizes are upper bounds
    known on the host, so nothing here waits for the device."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    rows = flat.numel()
    order = torch.argsort(flat, stable=True)
    # scatter_add, not bincount: bincount sizes its output from max(flat), a device sync.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_start = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    expert_sorted = flat[order]
    rank = torch.arange(rows, device=flat.device) - start[expert_sorted]
    max_rows = rows + num_experts * (block_m - 1)
    sorted_ids = torch.full((max_rows,), rows, dtype=torch.int64, device=flat.device)
    sorted_ids[padded_start[expert_sorted] + rank] = order
    tiles = triton.cdiv(max_rows, block_m)
    tile_start = torch.arange(tiles, device=flat.device) * block_m
    tile_expert = torch.searchsorted(torch.cumsum(padded, 0), tile_start, right=True)
    return sorted_ids, tile_expert.to(torch.int64), tiles


@triton.jit
def _tile_rows(sorted_ptr, tile, num_rows, BLOCK_M: tl.constexpr):
    offs = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ptr + offs)
    return rows, rows < num_rows


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, h_ptr, sorted_ptr, tile_expert_ptr,
    num_rows, num_experts, top_k, H, I,
    stride_x_t, stride_w_e, stride_w_n, stride_h_r,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tile, nb = tl.program_id(0), tl.program_id(1)
    e = tl.load(tile_expert_ptr + tile)
    if e < num_experts:
        rows, r_mask = _tile_rows(sorted_ptr, tile, num_rows, BLOCK_M)
        tokens = rows // top_k
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < I
        w_base = w_ptr + e * stride_w_e
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < H
            a = tl.load(x_ptr + tokens[:, None] * stride_x_t + offs_k[None, :],
                        mask=r_mask[:, None] & k_mask[None, :], other=0.0)
            wk_mask = k_mask[:, None] & n_mask[None, :]
            wg = tl.load(w_base + offs_n[None, :] * stride_w_n + offs_k[:, None],
                         mask=wk_mask, other=0.0)
            wu = tl.load(w_base + (I + offs_n[None, :]) * stride_w_n + offs_k[:, None],
                         mask=wk_mask, other=0.0)
            acc_g += tl.dot(a, wg)
            acc_u += tl.dot(a, wu)
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(h_ptr + rows[:, None] * stride_h_r + offs_n[None, :],
                 h.to(h_ptr.dtype.element_ty), mask=r_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, weights_ptr, y_ptr, sorted_ptr, tile_expert_ptr,
    num_rows, num_experts, H, I,
    stride_h_r, stride_w_e, stride_w_n, stride_y_r,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tile, nb = tl.program_id(0), tl.program_id(1)
    e = tl.load(tile_expert_ptr + tile)
    if e < num_experts:
        rows, r_mask = _tile_rows(sorted_ptr, tile, num_rows, BLOCK_M)
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < H
        w_base = w_ptr + e * stride_w_e
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < I
            a = tl.load(h_ptr + rows[:, None] * stride_h_r + offs_k[None, :],
                        mask=r_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_base + offs_n[None, :] * stride_w_n + offs_k[:, None],
                        mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc += tl.dot(a, w)
        scale = tl.load(weights_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows[:, None] * stride_y_r + offs_n[None, :],
                 acc * scale[:, None], mask=r_mask[:, None] & n_mask[None, :])


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """See `moe_ref.fused_moe`. Needs unit stride in the last dim of x and the weights."""
    check_moe_args(x, w_gate_up, w_down, topk_ids, topk_weights)
    for name, t in (("x", x), ("w_gate_up", w_gate_up), ("w_down", w_down)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    T, H = x.shape
    E, I2, _ = w_gate_up.shape
    I, k = I2 // 2, topk_ids.shape[1]
    rows = T * k
    if rows == 0:
        return torch.zeros_like(x)
    sorted_ids, tile_expert, tiles = _align(topk_ids, E, _BLOCK_M)
    # The SiLU-gated hidden in x's dtype, as the reference rounds it before the down projection.
    h = torch.empty(rows, I, dtype=x.dtype, device=x.device)
    y = torch.empty(rows, H, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    _gate_up_kernel[(tiles, triton.cdiv(I, _BLOCK_N))](
        x, w_gate_up, h, sorted_ids, tile_expert,
        rows, E, k, H, I,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), h.stride(0),
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
    )
    _down_kernel[(tiles, triton.cdiv(H, _BLOCK_N))](
        h, w_down, weights, y, sorted_ids, tile_expert,
        rows, E, H, I,
        h.stride(0), w_down.stride(0), w_down.stride(1), y.stride(0),
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
    )
    return y.view(T, k, H).sum(1).to(x.dtype)
