"""The sparse mixture-of-experts MLP, shared by every family that has one.

    logits = gate(x)                                   [T, E], the router (no bias)
    p      = softmax(logits, fp32)                     over all E experts
    w, ids = topk(p, k)                                [T, k]
    w      = w / sum(w)        when `renormalize`      (Qwen3-MoE `norm_topk_prob`)
    y[t]   = sum_j w[t, j] * expert_{ids[t, j]}(x[t])  expert_e = down_e(silu(gate_e(x)) * up_e(x))

This is transformers' `Qwen3MoeSparseMoeBlock` step for step (`Qwen3MoeTopKRouter` then
`Qwen3MoeExperts`), weights cast to the router logits' dtype before the experts. Families whose
router takes the top-k of the logits and a softmax over those k (Mixtral, Granite MoE) compute
the same weights as `renormalize=True` (softmax is monotonic and renormalising the top-k of a
softmax is the softmax of the top-k logits).

The experts are one stacked pair of tensors, as transformers v5 holds them and as the fused
kernel reads them (`kernels.fused_moe`: the per-expert reference on CPU, the Triton grouped
GEMM on CUDA):

    mlp.gate.weight              [E, H]        router
    mlp.experts.gate_up_proj     [E, 2I, H]    gate rows 0..I-1, then up rows
    mlp.experts.down_proj        [E, H, I]

Hub checkpoints store one tensor per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`);
`checkpoint.py` stacks them at load and splits them at save.

Reuse by another family (e.g. granitemoehybrid): build `SparseMoE(hidden, expert_width,
num_experts, top_k, renormalize)`, map its checkpoint names onto the three tensors above in
`checkpoint.py` (Granite's `input_linear` is `gate_up_proj`, `output_linear` is `down_proj`,
`router.layer` is `gate`), and add any shared expert beside it in the decoder layer.

LoRA: the experts take none (an adapter naming an MoE layer's gate/up/down projection is refused
at load, `lora.targets`); attention projections of the same layers do.
"""
from __future__ import annotations

import torch
from torch import nn

from compute_service import kernels
from compute_service.model.lora_batch import LayerLora

__all__ = ["Experts", "SparseMoE", "route"]


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k] int64):
    softmax in fp32 over all experts, the top k, divided by their sum when `renormalize`."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


class Experts(nn.Module):
    """The stacked SwiGLU experts: `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))


class SparseMoE(nn.Module):
    """x [T, H] -> [T, H]: router `gate`, top-`top_k` of `num_experts` SwiGLU experts of width
    `intermediate` (see the module doc)."""

    def __init__(
        self, hidden: int, intermediate: int, num_experts: int, top_k: int, renormalize: bool
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k: {top_k} must be in [1, num_experts={num_experts}]")
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(hidden, intermediate, num_experts)

    def forward(self, x: torch.Tensor, lora: LayerLora | None = None) -> torch.Tensor:
        """`lora` is accepted for the decoder layer's uniform call and has no expert targets."""
        weights, ids = route(kernels.linear(x, self.gate.weight), self.top_k, self.renormalize)
        return kernels.fused_moe(
            x, self.experts.gate_up_proj, self.experts.down_proj, ids, weights
        )
