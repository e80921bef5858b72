"""Triton depthwise causal conv1d: varlen prefill with initial state, and one-step decode.

Same signatures and semantics as `conv_ref`. The prefill runs as two launches so that no program
overwrites a conv state another program still has to read:
1. `_conv_prefill_kernel` per (sequence, token block, channel block) computes outputs, reading
   the inputs before a sequence's first token from its (old) conv state;
2. `_conv_state_kernel` per (sequence, channel block) then stores the last W-1 inputs, taking
   them from the old state where the sequence is shorter than W-1 (design.md lesson 10).

Backend `triton` of `dispatch.TABLE` (prefill and update). Tested against `conv_ref`: fp32
(relative 1e-4) and fp16 (4e-3) interpreted on CPU, bf16 (2e-2) compiled on a GPU; tolerances in
tests/compute_service/kernels/helpers.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["causal_conv1d", "causal_conv1d_update"]


def _activation_flag(activation: str | None) -> bool:
    """True for SiLU; the reference's accepted spellings, rejecting anything else."""
    if activation is None:
        return False
    if activation in ("silu", "swish"):
        return True
    raise ValueError(f"unsupported activation {activation!r}; expected None, 'silu' or 'swish'")


@triton.jit
def _input_at(
    x_ptr, state_ptr, rel, seq_start, seq_len, offs_c, c_mask, use_state,
    stride_x_t, stride_s_c, WIDTH: tl.constexpr,
):
    """Input at relative time `rel` ([BLOCK_T] int, -(W-1) <= rel) for channels `offs_c`:
    x[seq_start + rel] when 0 <= rel < seq_len, conv state column W-1+rel when rel < 0 (0
    without state), 0 past the sequence (padding rows). Returns [BLOCK_T, BLOCK_C] fp32."""
    from_x = ((rel >= 0) & (rel < seq_len))[:, None] & c_mask[None, :]
    vals = tl.load(
        x_ptr + (seq_start + tl.maximum(rel, 0)).to(tl.int64)[:, None] * stride_x_t
        + offs_c[None, :],
        mask=from_x,
        other=0.0,
    ).to(tl.float32)
    from_state = tl.where(use_state, (rel < 0)[:, None] & c_mask[None, :], False)
    vals += tl.load(
        state_ptr + offs_c[None, :] * stride_s_c + (WIDTH - 1 + tl.minimum(rel, -1))[:, None],
        mask=from_state,
        other=0.0,
    ).to(tl.float32)
    return vals


@triton.jit
def _conv_prefill_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, cu_seqlens_ptr, states_ptr, idx_ptr, has_init_ptr,
    stride_x_t, stride_y_t, stride_w_c, stride_s_s, stride_s_c,
    C: tl.constexpr, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    b = tl.program_id(0)
    t0 = tl.program_id(1) * BLOCK_T
    seq_start = tl.load(cu_seqlens_ptr + b)
    seq_len = tl.load(cu_seqlens_ptr + b + 1) - seq_start
    if t0 >= seq_len:
        return
    offs_t = t0 + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = offs_c < C
    t_mask = offs_t < seq_len
    state_ptr = states_ptr + tl.load(idx_ptr + b).to(tl.int64) * stride_s_s
    use_state = tl.load(has_init_ptr + b) != 0

    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(WIDTH):
        w = tl.load(w_ptr + offs_c * stride_w_c + k, mask=c_mask, other=0.0).to(tl.float32)
        rel = offs_t - (WIDTH - 1) + k
        vals = _input_at(
            x_ptr, state_ptr, rel, seq_start, seq_len, offs_c, c_mask, use_state,
            stride_x_t, stride_s_c, WIDTH,
        )
        acc += vals * w[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(
        y_ptr + (seq_start + offs_t).to(tl.int64)[:, None] * stride_y_t + offs_c[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=t_mask[:, None] & c_mask[None, :],
    )


@triton.jit
def _conv_state_kernel(
    x_ptr, cu_seqlens_ptr, states_ptr, idx_ptr, has_init_ptr,
    stride_x_t, stride_s_s, stride_s_c,
    C: tl.constexpr, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """state[:, j] <- input at relative time seq_len - (W-1) + j, j < W-1. All of the tile is
    loaded before anything is stored, so reading the old state in place is safe."""
    b = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = offs_c < C
    seq_start = tl.load(cu_seqlens_ptr + b)
    seq_len = tl.load(cu_seqlens_ptr + b + 1) - seq_start
    state_ptr = states_ptr + tl.load(idx_ptr + b).to(tl.int64) * stride_s_s
    use_state = tl.load(has_init_ptr + b) != 0
    offs_j = tl.arange(0, BLOCK_W)
    vals = _input_at(
        x_ptr, state_ptr, seq_len - (WIDTH - 1) + offs_j, seq_start, seq_len, offs_c, c_mask,
        use_state,
        stride_x_t, stride_s_c, WIDTH,
    )  # [BLOCK_W, BLOCK_C]
    tl.store(
        state_ptr + offs_c[None, :] * stride_s_c + offs_j[:, None],
        vals.to(states_ptr.dtype.element_ty),
        mask=(offs_j < WIDTH - 1)[:, None] & c_mask[None, :],
    )


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """See `conv_ref.causal_conv1d`. Reads the longest sequence length on the host once to
    size the grid."""
    silu = _activation_flag(activation)
    if x.stride(-1) != 1 or conv_states.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("x, weight and conv_states must be contiguous in their last dimension")
    T, C = x.shape
    width = weight.shape[1]
    num_seqs = cu_seqlens.numel() - 1
    y = torch.empty_like(x)
    if num_seqs == 0:
        return y
    max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())
    block_c = min(128, triton.next_power_of_2(C))
    c_blocks = triton.cdiv(C, block_c)
    if max_len > 0:
        block_t = min(64, triton.next_power_of_2(max_len))
        _conv_prefill_kernel[(num_seqs, triton.cdiv(max_len, block_t), c_blocks)](
            x, weight, bias if bias is not None else weight, y, cu_seqlens, conv_states,
            state_indices, has_initial_state,
            x.stride(0), y.stride(0), weight.stride(0), conv_states.stride(0),
            conv_states.stride(1),
            C=C, WIDTH=width, HAS_BIAS=bias is not None, SILU=silu,
            BLOCK_T=block_t, BLOCK_C=block_c,
        )
    if width > 1:
        _conv_state_kernel[(num_seqs, c_blocks)](
            x, cu_seqlens, conv_states, state_indices, has_initial_state,
            x.stride(0), conv_states.stride(0), conv_states.stride(1),
            C=C, WIDTH=width, BLOCK_W=triton.next_power_of_2(width - 1), BLOCK_C=block_c,
        )
    return y


@triton.jit
def _conv_update_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, states_ptr, idx_ptr,
    stride_x_b, stride_y_b, stride_w_c, stride_s_s, stride_s_c,
    C: tl.constexpr, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """window = [state (W-1 columns), x]; y = act(bias + window . w); state <- window[1:]."""
    b = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = offs_c < C
    offs_w = tl.arange(0, BLOCK_W)
    state_ptr = states_ptr + tl.load(idx_ptr + b).to(tl.int64) * stride_s_s
    window = tl.load(
        state_ptr + offs_c[:, None] * stride_s_c + offs_w[None, :],
        mask=c_mask[:, None] & (offs_w < WIDTH - 1)[None, :],
        other=0.0,
    ).to(tl.float32)
    x = tl.load(x_ptr + b * stride_x_b + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    window = tl.where((offs_w == WIDTH - 1)[None, :], x[:, None], window)
    w = tl.load(
        w_ptr + offs_c[:, None] * stride_w_c + offs_w[None, :],
        mask=c_mask[:, None] & (offs_w < WIDTH)[None, :],
        other=0.0,
    ).to(tl.float32)
    acc = tl.sum(window * w, 1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y_ptr + b * stride_y_b + offs_c, acc.to(y_ptr.dtype.element_ty), mask=c_mask)
    # Column j of the new state is column j+1 of the window.
    tl.store(
        state_ptr + offs_c[:, None] * stride_s_c + (offs_w - 1)[None, :],
        window.to(states_ptr.dtype.element_ty),
        mask=c_mask[:, None] & ((offs_w >= 1) & (offs_w < WIDTH))[None, :],
    )


def causal_conv1d_update(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """See `conv_ref.causal_conv1d_update`. No host synchronisation."""
    silu = _activation_flag(activation)
    if x.stride(-1) != 1 or conv_states.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("x, weight and conv_states must be contiguous in their last dimension")
    batch, C = x.shape
    width = weight.shape[1]
    y = torch.empty_like(x)
    block_c = min(128, triton.next_power_of_2(C))
    _conv_update_kernel[(batch, triton.cdiv(C, block_c))](
        x, weight, bias if bias is not None else weight, y, conv_states, state_indices,
        x.stride(0), y.stride(0), weight.stride(0), conv_states.stride(0), conv_states.stride(1),
        C=C, WIDTH=width, HAS_BIAS=bias is not None, SILU=silu,
        BLOCK_W=triton.next_power_of_2(width), BLOCK_C=block_c,
    )
    return y
