"""Plain PyTorch reference for the Mamba2 SSM: varlen chunk scan and single-step update.

Recurrence per head h (group g = h // (H // G)), token t:
    dt_t    = softplus(dt[t, h] + dt_bias[h])
    state_t = exp(dt_t * A[h]) * state_{t-1} + dt_t * outer(x[t, h], B[t, g])   # [P, N]
    y[t, h] = state_t @ C[t, g] + D[h] * x[t, h]                                 # [P]

The scan is a sequential loop over tokens: slow but obviously correct, and the definition the
Triton chunked kernels are tested against. All state arithmetic is in fp32.

Chunks are aligned to ABSOLUTE positions: sequence b's token i sits at absolute position
seq_start_pos[b] + i, and a chunk ends at every absolute multiple of chunk_size and at the end of
the sequence. So when a prompt is prefilled in several steps, or resumed from a checkpoint, its
chunk-end states fall on the same absolute positions (page boundaries when chunk_size divides the
page size) whatever the step split was.

Backends (`dispatch.TABLE`), each tested against this reference at the dtype's tolerance
(tests/compute_service/kernels/helpers.py: relative 1e-4 for fp32 interpreted on CPU, 5e-3
compiled on a GPU (TF32 dots), 4e-3 for fp16, 2e-2 for bf16, scaled by the output's
magnitude); fp32 states at the fp32 tolerance:
- `mamba_triton`: chunk scan and single-step update (CUDA by default): fp32 and fp16 interpreted
  on CPU, bf16 compiled on a GPU.
- `mamba_torch`: the vectorised single-step update (the torch path of `selective_state_update`):
  fp32, fp16 and bf16 inputs with fp32 or fp16 states. The chunk scan has no torch path: this
  reference serves CPU tensors.
The reference scan itself is checked against the dual (quadratic) form per sequence, and decode
steps against one prefill, at the same tolerances.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class ChunkLayout:
    """Where the absolute-aligned chunks of a varlen batch lie.

    cu_chunks: [B + 1] int32, sequence b owns chunks cu_chunks[b] : cu_chunks[b + 1].
    chunk_seq: [K] int32, the sequence of each chunk.
    chunk_token_start: [K] int32, first token (row of the packed batch) of each chunk.
    chunk_len: [K] int32, tokens in each chunk (1 .. chunk_size).
    chunk_end_pos: [K] int32, absolute position (exclusive end) of each chunk.
    """

    cu_chunks: torch.Tensor
    chunk_seq: torch.Tensor
    chunk_token_start: torch.Tensor
    chunk_len: torch.Tensor
    chunk_end_pos: torch.Tensor


def mamba_chunk_layout(
    cu_seqlens: torch.Tensor, seq_start_pos: torch.Tensor, chunk_size: int
) -> ChunkLayout:
    """Chunk boundaries of a varlen batch at absolute multiples of `chunk_size`.

    A sequence of L tokens starting at absolute position s has one chunk per chunk-size window
    it touches: floor((s + L - 1) / chunk_size) - floor(s / chunk_size) + 1 of them (0 if L == 0).
    Computed on the host; the tensors are returned on cu_seqlens' device.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    cu = cu_seqlens.tolist()
    starts = seq_start_pos.tolist()
    cu_chunks, seqs, token_starts, lens, ends = [0], [], [], [], []
    for b, s0 in enumerate(starts):
        row, length = cu[b], cu[b + 1] - cu[b]
        pos, end = s0, s0 + length
        while pos < end:
            chunk_end = min((pos // chunk_size + 1) * chunk_size, end)
            seqs.append(b)
            token_starts.append(row + pos - s0)
            lens.append(chunk_end - pos)
            ends.append(chunk_end)
            pos = chunk_end
        cu_chunks.append(len(seqs))

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=cu_seqlens.device)

    return ChunkLayout(
        cu_chunks=as_tensor(cu_chunks),
        chunk_seq=as_tensor(seqs),
        chunk_token_start=as_tensor(token_starts),
        chunk_len=as_tensor(lens),
        chunk_end_pos=as_tensor(ends),
    )


def _heads_to_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N]: head h reads group h // (H // G)."""
    return t.repeat_interleave(num_heads // t.shape[-2], dim=-2)


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
    """Mamba2 SSD scan of a varlen batch, with per-sequence initial state and chunk-end states.

    x: [T, H, P]; dt: [T, H]; dt_bias, A, D: [H]; B, C: [T, G, N], H % G == 0;
    cu_seqlens: [B + 1] int32; initial_states: [B, H, P, N] (the state before each sequence's
    first token) or None for zeros; seq_start_pos: [B] int32, absolute position of each
    sequence's first token; chunk_size: chunk boundaries fall at its absolute multiples.

    Returns (y [T, H, P] in x's dtype, final_states [B, H, P, N] fp32,
    chunk_states [K, H, P, N] fp32, cu_chunks [B + 1] int32, chunk_end_pos [K] int32):
    chunk_states[k] is the state after the last token of chunk k, whose absolute exclusive end
    is chunk_end_pos[k]; the last chunk of sequence b holds final_states[b]. A sequence with no
    tokens has no chunks and final_states equal to its initial state.
    """
    T, H, P = x.shape
    N = B.shape[-1]
    num_seqs = cu_seqlens.numel() - 1
    layout = mamba_chunk_layout(cu_seqlens, seq_start_pos, chunk_size)
    K = layout.chunk_len.numel()

    dt_full = F.softplus(dt.float() + dt_bias.float())  # [T, H]
    dA = torch.exp(dt_full * A.float())  # [T, H]
    Bh = _heads_to_groups(B.float(), H)  # [T, H, N]
    Ch = _heads_to_groups(C.float(), H)
    xf = x.float()

    y = torch.empty(T, H, P, dtype=torch.float32, device=x.device)
    final_states = torch.zeros(num_seqs, H, P, N, dtype=torch.float32, device=x.device)
    chunk_states = torch.empty(K, H, P, N, dtype=torch.float32, device=x.device)
    # The packed-batch row after which each chunk-end state is recorded.
    last_rows = (layout.chunk_token_start + layout.chunk_len - 1).tolist()
    chunk_of_row = {row: k for k, row in enumerate(last_rows)}

    cu = cu_seqlens.tolist()
    for b in range(num_seqs):
        state = (
            initial_states[b].float().clone()
            if initial_states is not None
            else torch.zeros(H, P, N, dtype=torch.float32, device=x.device)
        )
        for t in range(cu[b], cu[b + 1]):
            state = dA[t, :, None, None] * state + (
                dt_full[t, :, None, None] * xf[t, :, :, None] * Bh[t, :, None, :]
            )
            y[t] = torch.einsum("hpn,hn->hp", state, Ch[t])
            if t in chunk_of_row:
                chunk_states[chunk_of_row[t]] = state
        final_states[b] = state

    y = y + D.float()[None, :, None] * xf
    return y.to(x.dtype), final_states, chunk_states, layout.cu_chunks, layout.chunk_end_pos


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
    """One decode step of the recurrence for a batch of sequences, updating their states in place.

    ssm_state: [S, H, P, N] (any float dtype; arithmetic in fp32); x: [B, H, P]; dt: [B, H];
    dt_bias, A, D: [H]; B, C: [B, G, N]; state_indices: [B] int32, distinct slots of ssm_state.
    Only the rows ssm_state[state_indices] are read or written. Returns y: [B, H, P] in x's dtype.
    """
    H = x.shape[1]
    idx = state_indices.long()
    dt_full = F.softplus(dt.float() + dt_bias.float())  # [B, H]
    dA = torch.exp(dt_full * A.float())
    Bh = _heads_to_groups(B.float(), H)  # [B, H, N]
    Ch = _heads_to_groups(C.float(), H)
    xf = x.float()
    state = ssm_state[idx].float()
    state = dA[:, :, None, None] * state + (
        dt_full[:, :, None, None] * xf[:, :, :, None] * Bh[:, :, None, :]
    )
    ssm_state[idx] = state.to(ssm_state.dtype)
    y = torch.einsum("bhpn,bhn->bhp", state, Ch) + D.float()[None, :, None] * xf
    return y.to(x.dtype)
