"""Triton batched multi-adapter LoRA update (SGMV style): shrink, then expand-and-add.

Same signature and semantics as `lora_ref.lora_apply`. Tokens are grouped by slot
(`LoraSegments`), and every program works on one tile of BLOCK_T tokens *of one slot*, so a
tile multiplies by a single adapter's A or B with `tl.dot` whatever the mix of adapters:

1. `_shrink_kernel`, grid (token tiles, slots, K splits): partial[k, t] = x[t, K range k] @
   A[s, :, K range k].T for the slot's tokens. Splitting the input dim keeps a decode batch
   (a handful of tokens) from running on only S programs; partials are summed in a fixed order
   in step 2 (not with atomics), so results are deterministic.
2. `_expand_kernel`, grid (token tiles, out blocks, slots): y[t, n] += (scaling[s] *
   sum_k partial[k, t]) @ B[s, n, :].T, read-modify-write of y; each y row belongs to one slot,
   so no two programs write the same element.

The token-tile axis is sized for the worst case (all tokens in one slot); tiles past a slot's
token count exit at once, and a slot with no tokens is never read (unused slots may hold
garbage). Accumulation is fp32 (TF32 dots for fp32 inputs on a GPU).

Backend `triton` of `dispatch.TABLE` for `lora_apply`. Tested against `lora_ref`: fp32 (relative
1e-4) and fp16 (4e-3) interpreted on CPU, bf16 (2e-2) compiled on a GPU; tolerances in
tests/compute_service/kernels/helpers.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from compute_service.kernels.lora_ref import LoraSegments, check_lora_args, lora_segments

__all__ = ["lora_apply"]

_BLOCK_T = 16
_BLOCK_K = 64
_BLOCK_N = 64
# Input width per K split, and the most splits (the partial buffer is [splits, T, r]).
_SPLIT_WIDTH = 128
_MAX_SPLITS = 16


@triton.jit
def _slot_tile(order_ptr, starts_ptr, counts_ptr, tile, s, BLOCK_T: tl.constexpr):
    """Token rows [BLOCK_T] (int64) of tile `tile` of slot s, their mask, and whether any."""
    n = tl.load(counts_ptr + s)
    offs = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    mask = offs < n
    rows = tl.load(order_ptr + tl.load(starts_ptr + s) + offs, mask=mask, other=0)
    return rows.to(tl.int64), mask, tile * BLOCK_T < n


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, order_ptr, starts_ptr, counts_ptr, part_ptr,
    K, R, split_width,
    stride_x_t, stride_a_s, stride_a_r, stride_p_k, stride_p_t,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tile, s, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows, t_mask, active = _slot_tile(order_ptr, starts_ptr, counts_ptr, tile, s, BLOCK_T)
    if active:
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        k_lo = split * split_width
        k_hi = tl.minimum(k_lo + split_width, K)
        acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k_hi
            xt = tl.load(
                x_ptr + rows[:, None] * stride_x_t + offs_k[None, :],
                mask=t_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            at = tl.load(  # A[s].T tile: [BLOCK_K, BLOCK_R]
                a_ptr + s * stride_a_s + offs_r[None, :] * stride_a_r + offs_k[:, None],
                mask=k_mask[:, None] & r_mask[None, :],
                other=0.0,
            )
            acc += tl.dot(xt, at)
        tl.store(
            part_ptr + split * stride_p_k + rows[:, None] * stride_p_t + offs_r[None, :],
            acc,
            mask=t_mask[:, None] & r_mask[None, :],
        )


@triton.jit
def _expand_kernel(
    part_ptr, b_ptr, scaling_ptr, y_ptr, order_ptr, starts_ptr, counts_ptr,
    N, R, num_splits,
    stride_p_k, stride_p_t, stride_b_s, stride_b_n, stride_y_t,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    tile, nb, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows, t_mask, active = _slot_tile(order_ptr, starts_ptr, counts_ptr, tile, s, BLOCK_T)
    if active:
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        tr_mask = t_mask[:, None] & r_mask[None, :]
        v = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
        for k in range(num_splits):
            v += tl.load(
                part_ptr + k * stride_p_k + rows[:, None] * stride_p_t + offs_r[None, :],
                mask=tr_mask,
                other=0.0,
            )
        v *= tl.load(scaling_ptr + s).to(tl.float32)
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        bt = tl.load(  # B[s].T tile: [BLOCK_R, BLOCK_N]
            b_ptr + s * stride_b_s + offs_n[None, :] * stride_b_n + offs_r[:, None],
            mask=r_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        delta = tl.dot(v, bt.to(tl.float32))
        y_ptrs = y_ptr + rows[:, None] * stride_y_t + offs_n[None, :]
        tn_mask = t_mask[:, None] & n_mask[None, :]
        yt = tl.load(y_ptrs, mask=tn_mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (yt + delta).to(y_ptr.dtype.element_ty), mask=tn_mask)


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    A_stack: torch.Tensor,
    B_stack: torch.Tensor,
    scaling: torch.Tensor,
    token_slot: torch.Tensor,
    segments: LoraSegments | None = None,
) -> None:
    """See `lora_ref.lora_apply`. Needs unit stride in the last dim of y, x and the stacks."""
    check_lora_args(y, x, A_stack, B_stack, scaling, token_slot)
    for name, t in (("y", y), ("x", x), ("A_stack", A_stack), ("B_stack", B_stack)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    T, K = x.shape
    S, R, _ = A_stack.shape
    N = y.shape[1]
    if T == 0 or S == 0:
        return
    if segments is None:
        segments = lora_segments(token_slot, S)
    num_splits = min(_MAX_SPLITS, triton.cdiv(K, _SPLIT_WIDTH))
    # Round the split width up to whole K tiles so only the last split has a ragged end.
    split_width = triton.cdiv(triton.cdiv(K, num_splits), _BLOCK_K) * _BLOCK_K
    num_splits = triton.cdiv(K, split_width)
    block_r = max(16, triton.next_power_of_2(R))  # tl.dot needs every dim >= 16
    partial = torch.empty(num_splits, T, R, dtype=torch.float32, device=x.device)
    tiles = triton.cdiv(T, _BLOCK_T)
    seg = (segments.order, segments.starts, segments.counts)
    _shrink_kernel[(tiles, S, num_splits)](
        x, A_stack, *seg, partial,
        K, R, split_width,
        x.stride(0), A_stack.stride(0), A_stack.stride(1), partial.stride(0), partial.stride(1),
        BLOCK_T=_BLOCK_T, BLOCK_R=block_r, BLOCK_K=_BLOCK_K,
    )
    _expand_kernel[(tiles, triton.cdiv(N, _BLOCK_N), S)](
        partial, B_stack, scaling, y, *seg,
        N, R, num_splits,
        partial.stride(0), partial.stride(1), B_stack.stride(0), B_stack.stride(1), y.stride(0),
        BLOCK_T=_BLOCK_T, BLOCK_R=block_r, BLOCK_N=_BLOCK_N,
    )
