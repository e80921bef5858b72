"""RMSNorm and RoPE in one Triton launch each (references: `norm_rope_ref`).

- `rms_norm`: one program per row; the row is read once into registers (hidden sizes up to
  16k fit one block), normalised in fp32, rounded to the input dtype, then multiplied by the
  weight and rounded again, as the reference does.
- `rope`: one program per token and a block of heads; each channel pair (i, i + half) is rotated
  in fp32 and rounded once (the reference rounds each product and the sum in the input dtype,
  so bf16 results may differ in the last bit). Channels past rotary_dim are copied.

Backend `triton` of `dispatch.TABLE` for both; tested against the references in fp32/fp16
(interpreted on CPU) and bf16 (compiled on a GPU).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rms_norm", "rope"]


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n, stride_x, stride_o, eps,
                     ROUND_FIRST: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n + eps)
    y = x * rstd
    if ROUND_FIRST:  # low precision: round to the input dtype before the weight (the reference)
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """See `norm_rope_ref.rms_norm`."""
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match x's last dim {n}")
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, weight, out, n, x2.stride(0), out.stride(0), eps,
            ROUND_FIRST=x.dtype != torch.float32, BLOCK=triton.next_power_of_2(n),
            num_warps=4 if n <= 4096 else 8,
        )
    return out.view(x.shape)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, D,
                 stride_xt, stride_xh, stride_ot, stride_oh, stride_ct,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 BLOCK_REST: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < H
    i = tl.arange(0, BLOCK_HALF)
    i_mask = i < HALF
    c = tl.load(cos_ptr + t * stride_ct + i, mask=i_mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_ct + i, mask=i_mask, other=0.0).to(tl.float32)
    m = h_mask[:, None] & i_mask[None, :]
    x_row = x_ptr + t * stride_xt + heads[:, None] * stride_xh
    o_row = out_ptr + t * stride_ot + heads[:, None] * stride_oh
    x1 = tl.load(x_row + i[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF + i[None, :], mask=m, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(o_row + i[None, :], (x1 * c[None, :] - x2 * s[None, :]).to(dtype), mask=m)
    tl.store(o_row + HALF + i[None, :], (x2 * c[None, :] + x1 * s[None, :]).to(dtype), mask=m)
    if BLOCK_REST > 0:  # partial rotary: the channels past rotary_dim pass through
        r = 2 * HALF + tl.arange(0, BLOCK_REST)
        rm = h_mask[:, None] & (r < D)[None, :]
        tl.store(o_row + r[None, :], tl.load(x_row + r[None, :], mask=rm, other=0.0), mask=rm)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """See `norm_rope_ref.rope`."""
    t, h, d = x.shape
    rotary_dim = cos.shape[-1]
    if rotary_dim % 2 or rotary_dim > d or cos.shape != (t, 1, rotary_dim) or sin.shape != cos.shape:
        raise ValueError(f"rope: cos/sin {tuple(cos.shape)}, {tuple(sin.shape)} do not fit "
                         f"x {tuple(x.shape)} (want [T, 1, even rotary_dim <= head_dim])")
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, cos.dtype), device=x.device)
    if t == 0:
        return out
    half = rotary_dim // 2
    block_h = min(triton.next_power_of_2(h), 16)
    rest = d - rotary_dim
    _rope_kernel[(t, triton.cdiv(h, block_h))](
        x, cos, sin, out, h, d,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0),
        HALF=half, BLOCK_H=block_h, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_REST=triton.next_power_of_2(rest) if rest else 0,
    )
    return out
