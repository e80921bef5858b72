"""Plain PyTorch reference for the Mamba2 depthwise causal conv1d: varlen prefill and decode.

Conv state layout: conv_states[s, c, j], j = 0 .. W-2, holds the last W-1 inputs of channel c,
oldest first (j = W-2 is the newest). Output of token t, channel c:
    y[t, c] = act(bias[c] + sum_{k<W} weight[c, k] * in[t - (W-1) + k, c])
where in[i] for i < 0 is the sequence's initial conv state (or zero).

Backends (`dispatch.TABLE`): this reference serves CPU tensors (there is no vectorised torch
path) and `conv_triton` CUDA tensors by default, tested against it at the dtype's tolerance
(tests/compute_service/kernels/helpers.py: relative 1e-4 for fp32 interpreted on CPU, 5e-3
compiled on a GPU (TF32 dots), 4e-3 for fp16, 2e-2 for bf16, scaled by the output's
magnitude): fp32 and fp16 interpreted on CPU, bf16 compiled on a GPU.
The reference itself is checked against a per-token convolution, and decode steps and split
prefills against one prefill.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def apply_activation(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    """None (identity) or "silu"/"swish"."""
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"unsupported activation {activation!r}; expected None, 'silu' or 'swish'")


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
    """Depthwise causal conv of a varlen batch; updates each sequence's conv state in place.

    x: [T, C]; weight: [C, W]; bias: [C] or None; cu_seqlens: [B + 1] int32;
    conv_states: [S, C, W-1]; state_indices: [B] int32, distinct slots; has_initial_state: [B]
    bool. The W-1 inputs before sequence b come from conv_states[state_indices[b]] when
    has_initial_state[b], else zeros. Afterwards that slot holds the last W-1 inputs of the
    sequence, older state included when the sequence is shorter than W-1. Slots not named by
    state_indices are never read or written. Returns y: [T, C] in x's dtype.
    """
    C, W = weight.shape
    wf = weight.float()
    y = torch.empty_like(x)
    cu = cu_seqlens.tolist()
    for b, (slot, has_init) in enumerate(
        zip(state_indices.tolist(), has_initial_state.tolist(), strict=True)
    ):
        xs = x[cu[b] : cu[b + 1]].float()  # [L, C]
        if has_init:
            history = conv_states[slot].float().t()  # [W-1, C], oldest first
        else:
            history = torch.zeros(W - 1, C, dtype=torch.float32, device=x.device)
        full = torch.cat([history, xs], dim=0)  # [L + W-1, C]
        L = xs.shape[0]
        # windows[t] = full[t : t + W], the W inputs ending at token t.
        windows = full.unfold(0, W, 1)  # [L, C, W]
        out = (windows * wf).sum(-1)
        if bias is not None:
            out = out + bias.float()
        y[cu[b] : cu[b + 1]] = apply_activation(out, activation).to(x.dtype)
        conv_states[slot] = full[L:].t().to(conv_states.dtype)
    return y


def causal_conv1d_update(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode step: conv of each sequence's new token with its state, shifting it in place.

    x: [B, C]; conv_states: [S, C, W-1]; weight: [C, W]; bias: [C] or None;
    state_indices: [B] int32, distinct slots. Returns y: [B, C] in x's dtype.
    """
    idx = state_indices.long()
    full = torch.cat([conv_states[idx].float(), x.float()[:, :, None]], dim=-1)  # [B, C, W]
    out = (full * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    conv_states[idx] = full[:, :, 1:].to(conv_states.dtype)
    return apply_activation(out, activation).to(x.dtype)
