"""Plain PyTorch reference for the fused mixture-of-experts MLP: `fused_moe`, one expert at a
time, as transformers' `Qwen3MoeExperts` computes it.

    out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = topk_ids[t, j]

with the expert weights stacked the way transformers v5 keeps them: `w_gate_up [E, 2I, H]`
(gate rows 0..I-1, then up rows), `w_down [E, H, I]`. Routing (which experts, which weights) is
the caller's (`compute_service.model.moe.route`), so this one operation serves every family's
router. It is the oracle the Triton kernel (`moe_triton`) is tested against, and the path CPU
tensors take: its per-expert `F.linear` over the tokens routed to that expert is what a CPU
does well, and it rounds exactly as transformers does (fp32 greedy parity).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["check_moe_args", "fused_moe"]


def check_moe_args(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> None:
    """ValueError naming the first argument whose shape does not fit the others."""
    if x.dim() != 2:
        raise ValueError(f"x: want [T, hidden], got shape {tuple(x.shape)}")
    t, h = x.shape
    if w_gate_up.dim() != 3 or w_gate_up.shape[2] != h or w_gate_up.shape[1] % 2:
        raise ValueError(f"w_gate_up: want [E, 2I, {h}], got shape {tuple(w_gate_up.shape)}")
    e, i2, _ = w_gate_up.shape
    if tuple(w_down.shape) != (e, h, i2 // 2):
        raise ValueError(f"w_down: want {(e, h, i2 // 2)}, got shape {tuple(w_down.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids: want [{t}, k], got shape {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights: shape {tuple(topk_weights.shape)} != topk_ids {tuple(topk_ids.shape)}"
        )


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I], topk_ids [T, k] (int, in [0, E)),
    topk_weights [T, k] -> [T, H] in x's dtype. Experts no token picks are never read."""
    check_moe_args(x, w_gate_up, w_down, topk_ids, topk_weights)
    out = torch.zeros_like(x)
    weights = topk_weights.to(x.dtype)
    for e in torch.unique(topk_ids).tolist():
        token, slot = torch.where(topk_ids == e)
        gate, up = F.linear(x[token], w_gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w_down[e]) * weights[token, slot, None]
        out.index_add_(0, token, y)
    return out
