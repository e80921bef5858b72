"""Triton Mamba2 SSD: varlen chunked scan with absolute-aligned chunks, and one-step update.

Same signatures and semantics as `mamba_ref`. The scan uses the chunked (SSD) formulation over
the chunk list of `mamba_chunk_layout`, in four launches:

1. `_dt_cumsum_kernel`   per (chunk, head block): dt = softplus(dt + dt_bias) and the in-chunk
                         inclusive cumulative sum of dt * A, stored per token (fp32).
2. `_chunk_state_kernel` per (chunk, head, P block): the state at the chunk's end assuming a zero
                         state at its start,  sum_s exp(cum_last - cum_s) dt_s x_s B_s^T.
3. `_state_pass_kernel`  per (sequence, head, P block), sequential over the sequence's chunks:
                         S_k = exp(cum_last_k) S_{k-1} + local_k, starting from the initial state;
                         S_k overwrites local_k in chunk_states and the last one is final_states.
4. `_chunk_scan_kernel`  per (chunk row block, head, P block):
                         y_t = exp(cum_t) C_t S_{k-1}
                               + sum_{s<=t} exp(cum_t - cum_s) dt_s (C_t.B_s) x_s + D x_t.
Because chunks never straddle a sequence or an absolute multiple of chunk_size, the states in
chunk_states are exactly the page-boundary checkpoints the engine stores (design.md lesson 8).

Backend `triton` of `dispatch.TABLE` (chunk scan, single-step update). Tested against `mamba_ref`:
fp32 (relative 1e-4) and fp16 (4e-3) interpreted on CPU, bf16 (2e-2) compiled on a GPU; tolerances
in tests/compute_service/kernels/helpers.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from compute_service.kernels.mamba_ref import mamba_chunk_layout

__all__ = ["mamba_chunk_scan", "selective_state_update"]


@triton.jit
def _softplus(v):
    # torch.nn.functional.softplus with its default threshold of 20.
    return tl.where(v > 20.0, v, tl.log(1.0 + tl.exp(tl.minimum(v, 20.0))))


@triton.jit
def _dt_cumsum_kernel(
    dt_ptr, dt_bias_ptr, A_ptr, chunk_start_ptr, chunk_len_ptr,
    dt_out_ptr, cum_out_ptr,
    stride_dt_t, stride_dt_h,
    T, H: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """dt_out[h, t] = softplus(dt[t, h] + dt_bias[h]); cum_out[h, t] = in-chunk inclusive
    cumsum of dt_out * A[h]. Both [H, T] fp32."""
    k = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    tok0 = tl.load(chunk_start_ptr + k)
    length = tl.load(chunk_len_ptr + k)
    offs_t = tl.arange(0, BLOCK_L)
    t_mask = offs_t < length
    h_mask = offs_h < H
    mask = t_mask[:, None] & h_mask[None, :]
    rows = (tok0 + offs_t).to(tl.int64)
    dt = tl.load(
        dt_ptr + rows[:, None] * stride_dt_t + offs_h[None, :] * stride_dt_h, mask=mask, other=0.0
    ).to(tl.float32)
    bias = tl.load(dt_bias_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32)
    A = tl.load(A_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32)
    dt = tl.where(mask, _softplus(dt + bias[None, :]), 0.0)
    cum = tl.cumsum(dt * A[None, :], 0)
    out = offs_h[None, :].to(tl.int64) * T + rows[:, None]
    tl.store(dt_out_ptr + out, dt, mask=mask)
    tl.store(cum_out_ptr + out, cum, mask=mask)


@triton.jit
def _chunk_state_kernel(
    x_ptr, B_ptr, dt_ptr, cum_ptr, chunk_start_ptr, chunk_len_ptr, states_ptr,
    stride_x_t, stride_x_h, stride_B_t, stride_B_g,
    T, H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, HEADS_PER_GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """states[k, h, p, n] = sum over the chunk's tokens s of
    exp(cum_last - cum_s) * dt_s * x[s, h, p] * B[s, g, n]  (the chunk's own contribution)."""
    k = tl.program_id(0)
    h = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    p_mask = offs_p < P
    n_mask = offs_n < N
    g = h // HEADS_PER_GROUP
    tok0 = tl.load(chunk_start_ptr + k)
    length = tl.load(chunk_len_ptr + k)
    head_row = h.to(tl.int64) * T
    cum_last = tl.load(cum_ptr + head_row + tok0 + length - 1)

    acc = tl.zeros([BLOCK_P, BLOCK_N], tl.float32)
    for s0 in range(0, length, BLOCK_K):
        offs_s = s0 + tl.arange(0, BLOCK_K)
        s_mask = offs_s < length
        rows = (tok0 + offs_s).to(tl.int64)
        dt = tl.load(dt_ptr + head_row + rows, mask=s_mask, other=0.0)
        cum = tl.load(cum_ptr + head_row + rows, mask=s_mask, other=0.0)
        weight = tl.where(s_mask, tl.exp(cum_last - cum) * dt, 0.0)
        x = tl.load(
            x_ptr + rows[:, None] * stride_x_t + h * stride_x_h + offs_p[None, :],
            mask=s_mask[:, None] & p_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        Bm = tl.load(
            B_ptr + rows[:, None] * stride_B_t + g * stride_B_g + offs_n[None, :],
            mask=s_mask[:, None] & n_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.dot(tl.trans(x * weight[:, None]), Bm)

    out = ((k.to(tl.int64) * H + h) * P + offs_p[:, None]) * N + offs_n[None, :]
    tl.store(states_ptr + out, acc, mask=p_mask[:, None] & n_mask[None, :])


@triton.jit
def _state_pass_kernel(
    states_ptr, cum_ptr, chunk_start_ptr, chunk_len_ptr, cu_chunks_ptr,
    init_ptr, final_ptr,
    T, H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, HAS_INIT: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Chain one sequence's chunks: S_k = exp(cum_last_k) * S_{k-1} + local_k, in place."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask = (offs_p < P)[:, None] & (offs_n < N)[None, :]
    tile = (h * P + offs_p[:, None]) * N + offs_n[None, :]
    seq_tile = b.to(tl.int64) * H * P * N + tile
    if HAS_INIT:
        state = tl.load(init_ptr + seq_tile, mask=mask, other=0.0).to(tl.float32)
    else:
        state = tl.zeros([BLOCK_P, BLOCK_N], tl.float32)
    c0 = tl.load(cu_chunks_ptr + b)
    c1 = tl.load(cu_chunks_ptr + b + 1)
    # Advance a pointer rather than multiply the loop index, which stays 32-bit.
    chunk_tile = states_ptr + c0.to(tl.int64) * H * P * N + tile
    for k in range(c0, c1):
        last = tl.load(chunk_start_ptr + k) + tl.load(chunk_len_ptr + k) - 1
        decay = tl.exp(tl.load(cum_ptr + h.to(tl.int64) * T + last))
        state = decay * state + tl.load(chunk_tile, mask=mask, other=0.0)
        tl.store(chunk_tile, state, mask=mask)
        chunk_tile += H * P * N
    tl.store(final_ptr + seq_tile, state, mask=mask)


@triton.jit
def _load_rows_f32(ptr, rows, stride_row, col0, offs_col, row_mask, col_mask):
    """The [rows, offs_col] tile at ptr + rows * stride_row + col0 + offs_col, as fp32, zero
    outside the masks."""
    return tl.load(
        ptr + rows[:, None] * stride_row + col0 + offs_col[None, :],
        mask=row_mask[:, None] & col_mask[None, :],
        other=0.0,
    ).to(tl.float32)


@triton.jit
def _chunk_scan_kernel(
    x_ptr, B_ptr, C_ptr, D_ptr, dt_ptr, cum_ptr, y_ptr,
    states_ptr, init_ptr, chunk_seq_ptr, chunk_start_ptr, chunk_len_ptr, cu_chunks_ptr,
    stride_x_t, stride_x_h, stride_B_t, stride_B_g, stride_C_t, stride_C_g,
    stride_y_t, stride_y_h,
    T, H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, HEADS_PER_GROUP: tl.constexpr,
    HAS_INIT: tl.constexpr, ROW_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Outputs of BLOCK_M tokens of one chunk: the carried-in state's contribution plus the
    causal in-chunk (C B^T * decay) x term plus the D skip."""
    k = tl.program_id(0) // ROW_BLOCKS
    m0 = (tl.program_id(0) % ROW_BLOCKS) * BLOCK_M
    h = tl.program_id(1)
    length = tl.load(chunk_len_ptr + k)
    if m0 >= length:
        return
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    p_mask = offs_p < P
    n_mask = offs_n < N
    g = h // HEADS_PER_GROUP
    tok0 = tl.load(chunk_start_ptr + k)
    head_row = h.to(tl.int64) * T

    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < length
    rows_m = (tok0 + offs_m).to(tl.int64)
    cum_m = tl.load(cum_ptr + head_row + rows_m, mask=m_mask, other=0.0)
    Cm = _load_rows_f32(C_ptr, rows_m, stride_C_t, g * stride_C_g, offs_n, m_mask, n_mask)

    # State entering the chunk: the previous chunk's end state, or the sequence's initial state.
    b = tl.load(chunk_seq_ptr + k)
    first_chunk = tl.load(cu_chunks_ptr + b)
    pn_mask = p_mask[:, None] & n_mask[None, :]
    tile = (h * P + offs_p[:, None]) * N + offs_n[None, :]
    prev_chunk = tl.maximum(k - 1, 0).to(tl.int64)
    prev = tl.load(
        states_ptr + prev_chunk * H * P * N + tile,
        mask=tl.where(k != first_chunk, pn_mask, False),
        other=0.0,
    )
    if HAS_INIT:
        prev += tl.load(
            init_ptr + b.to(tl.int64) * H * P * N + tile,
            mask=tl.where(k == first_chunk, pn_mask, False),
            other=0.0,
        ).to(tl.float32)
    acc = tl.dot(Cm, tl.trans(prev)) * tl.exp(cum_m)[:, None]  # [BLOCK_M, BLOCK_P]

    # Keys of the chunk up to the block's last row (causal within the chunk).
    for s0 in range(0, tl.minimum(m0 + BLOCK_M, length), BLOCK_K):
        offs_s = s0 + tl.arange(0, BLOCK_K)
        s_mask = offs_s < length
        rows_s = (tok0 + offs_s).to(tl.int64)
        cum_s = tl.load(cum_ptr + head_row + rows_s, mask=s_mask, other=0.0)
        dt_s = tl.load(dt_ptr + head_row + rows_s, mask=s_mask, other=0.0)
        Bs = _load_rows_f32(B_ptr, rows_s, stride_B_t, g * stride_B_g, offs_n, s_mask, n_mask)
        xs = _load_rows_f32(x_ptr, rows_s, stride_x_t, h * stride_x_h, offs_p, s_mask, p_mask)
        # s <= t < length implies s is a valid token. Mask before exp: for s > t (or a padding
        # row t, whose cum reads as 0) cum_t - cum_s > 0 and could overflow.
        causal = (offs_s[None, :] <= offs_m[:, None]) & m_mask[:, None]
        decay = tl.exp(tl.where(causal, cum_m[:, None] - cum_s[None, :], float("-inf")))
        scores = tl.dot(Cm, tl.trans(Bs)) * decay * dt_s[None, :]
        acc += tl.dot(scores, xs)

    x_m = _load_rows_f32(x_ptr, rows_m, stride_x_t, h * stride_x_h, offs_p, m_mask, p_mask)
    acc += tl.load(D_ptr + h).to(tl.float32) * x_m
    tl.store(
        y_ptr + rows_m[:, None] * stride_y_t + h * stride_y_h + offs_p[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=m_mask[:, None] & p_mask[None, :],
    )


def _require_unit_last_stride(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")


def _dot_block(n: int) -> int:
    """A power-of-two tile >= 16 (tl.dot's minimum) covering n."""
    return max(16, triton.next_power_of_2(n))


def mamba_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_states: torch.Tensor | None,
    seq_start_pos: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See `mamba_ref.mamba_chunk_scan`. The chunk layout is computed on the host."""
    _require_unit_last_stride(x=x, B=B, C=C)
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    num_seqs = cu_seqlens.numel() - 1
    layout = mamba_chunk_layout(cu_seqlens, seq_start_pos, chunk_size)
    K = layout.chunk_len.numel()
    dev = x.device

    y = torch.empty_like(x)
    final_states = torch.empty(num_seqs, H, P, N, dtype=torch.float32, device=dev)
    chunk_states = torch.empty(K, H, P, N, dtype=torch.float32, device=dev)
    has_init = initial_states is not None
    if has_init:
        initial_states = initial_states.contiguous()
        final_states.copy_(initial_states)
    else:
        final_states.zero_()  # sequences with no tokens keep their (zero) initial state
    if K == 0:
        return y, final_states, chunk_states, layout.cu_chunks, layout.chunk_end_pos

    dt_soft = torch.empty(H, T, dtype=torch.float32, device=dev)
    cum = torch.empty(H, T, dtype=torch.float32, device=dev)
    block_l = triton.next_power_of_2(chunk_size)
    block_h = max(1, min(triton.next_power_of_2(H), 4096 // block_l))
    _dt_cumsum_kernel[(K, triton.cdiv(H, block_h))](
        dt, dt_bias, A, layout.chunk_token_start, layout.chunk_len,
        dt_soft, cum,
        dt.stride(0), dt.stride(1),
        T, H=H, BLOCK_L=block_l, BLOCK_H=block_h,
    )

    block_p = min(64, _dot_block(P))
    block_n = _dot_block(N)
    block_k = min(64, _dot_block(chunk_size))
    p_blocks = triton.cdiv(P, block_p)
    common = dict(H=H, P=P, N=N, BLOCK_P=block_p, BLOCK_N=block_n)
    _chunk_state_kernel[(K, H, p_blocks)](
        x, B, dt_soft, cum, layout.chunk_token_start, layout.chunk_len, chunk_states,
        x.stride(0), x.stride(1), B.stride(0), B.stride(1),
        T, HEADS_PER_GROUP=H // G, BLOCK_K=block_k, **common,
    )
    _state_pass_kernel[(num_seqs, H, p_blocks)](
        chunk_states, cum, layout.chunk_token_start, layout.chunk_len, layout.cu_chunks,
        initial_states if has_init else final_states, final_states,
        T, HAS_INIT=has_init, **common,
    )
    block_m = block_k
    row_blocks = triton.cdiv(chunk_size, block_m)
    _chunk_scan_kernel[(K * row_blocks, H, p_blocks)](
        x, B, C, D, dt_soft, cum, y,
        chunk_states, initial_states if has_init else final_states,
        layout.chunk_seq, layout.chunk_token_start, layout.chunk_len, layout.cu_chunks,
        x.stride(0), x.stride(1), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        y.stride(0), y.stride(1),
        T, HEADS_PER_GROUP=H // G, HAS_INIT=has_init, ROW_BLOCKS=row_blocks,
        BLOCK_M=block_m, BLOCK_K=block_k, **common,
    )
    return y, final_states, chunk_states, layout.cu_chunks, layout.chunk_end_pos


@triton.jit
def _state_update_kernel(
    state_ptr, x_ptr, dt_ptr, dt_bias_ptr, A_ptr, B_ptr, C_ptr, D_ptr, idx_ptr, y_ptr,
    stride_s_s, stride_s_h, stride_s_p,
    stride_x_b, stride_x_h, stride_dt_b, stride_dt_h,
    stride_B_b, stride_B_g, stride_C_b, stride_C_g, stride_y_b, stride_y_h,
    P: tl.constexpr, N: tl.constexpr, HEADS_PER_GROUP: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One step for (sequence b, head h, P block): read-modify-write of its state tile."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    p_mask = offs_p < P
    n_mask = offs_n < N
    mask = p_mask[:, None] & n_mask[None, :]
    g = h // HEADS_PER_GROUP
    slot = tl.load(idx_ptr + b).to(tl.int64)
    state_tile = (
        state_ptr + slot * stride_s_s + h * stride_s_h
        + offs_p[:, None] * stride_s_p + offs_n[None, :]
    )
    state = tl.load(state_tile, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + b * stride_x_b + h * stride_x_h + offs_p, mask=p_mask, other=0.0)
    x = x.to(tl.float32)
    dt = tl.load(dt_ptr + b * stride_dt_b + h * stride_dt_h).to(tl.float32)
    dt = _softplus(dt + tl.load(dt_bias_ptr + h).to(tl.float32))
    dA = tl.exp(dt * tl.load(A_ptr + h).to(tl.float32))
    Bv = tl.load(B_ptr + b * stride_B_b + g * stride_B_g + offs_n, mask=n_mask, other=0.0)
    Cv = tl.load(C_ptr + b * stride_C_b + g * stride_C_g + offs_n, mask=n_mask, other=0.0)
    state = state * dA + (dt * x)[:, None] * Bv.to(tl.float32)[None, :]
    tl.store(state_tile, state.to(state_ptr.dtype.element_ty), mask=mask)
    y = tl.sum(state * Cv.to(tl.float32)[None, :], 1) + tl.load(D_ptr + h).to(tl.float32) * x
    tl.store(y_ptr + b * stride_y_b + h * stride_y_h + offs_p, y.to(y_ptr.dtype.element_ty),
             mask=p_mask)


def selective_state_update(
    ssm_state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """See `mamba_ref.selective_state_update`. No host synchronisation."""
    _require_unit_last_stride(ssm_state=ssm_state, x=x, B=B, C=C)
    batch, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    y = torch.empty_like(x)
    block_p = min(32, triton.next_power_of_2(P))
    _state_update_kernel[(batch, H, triton.cdiv(P, block_p))](
        ssm_state, x, dt, dt_bias, A, B, C, D, state_indices, y,
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        x.stride(0), x.stride(1), dt.stride(0), dt.stride(1),
        B.stride(0), B.stride(1), C.stride(0), C.stride(1), y.stride(0), y.stride(1),
        P=P, N=N, HEADS_PER_GROUP=H // G,
        BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(N),
    )
    return y
