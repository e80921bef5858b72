"""The sparse mixture-of-experts MLP, shared by every family that has one.

    logits = gate(x)                                   [T, E], the router (no bias)
    routing "softmax_topk" (Qwen3-MoE, transformers' `Qwen3MoeTopKRouter`):
      p      = softmax(logits, fp32)                   over all E experts
      w, ids = topk(p, k)                              [T, k]
      w      = w / sum(w)      when `renormalize`      (Qwen3-MoE `norm_topk_prob`)
    routing "topk_softmax" (Granite, transformers' `GraniteMoeHybridTopKRouter`):
      l, ids = topk(logits in fp32, k)
      w      = softmax(l)                              over those k only
    y[t]   = sum_j w[t, j] * expert_{ids[t, j]}(x[t])  expert_e = down_e(silu(gate_e(x)) * up_e(x))

Weights are cast to the router logits' dtype before the experts, as both routers do. The two
routings give the same weights in exact arithmetic when "softmax_topk" renormalises (softmax is
monotonic, and the renormalised top k of a softmax is the softmax of the top k logits); they
round differently, so each family takes its own, step for step. A shared expert (Granite's
`shared_mlp`) is not part of this module: the decoder layer adds it beside (`model.py`).

The experts are one stacked pair of tensors, as transformers v5 holds them and as the fused
kernel reads them (`kernels.fused_moe`: the per-expert reference on CPU, the Triton grouped
GEMM on CUDA):

    gate.weight              [E, H]        router
    experts.gate_up_proj     [E, 2I, H]    gate rows 0..I-1, then up rows
    experts.down_proj        [E, H, I]

Qwen3-MoE hub checkpoints store one tensor per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`);
`checkpoint.py` stacks them at load and splits them at save. Granite's are stacked already:
`block_sparse_moe.input_linear` is `gate_up_proj`, `output_linear` is `down_proj`,
`router.layer` is `gate`.

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
    router_logits: torch.Tensor, top_k: int, renormalize: bool, routing: str = "softmax_topk"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k] int64),
    by `routing` (see the module doc; `renormalize` applies to "softmax_topk" only)."""
    if routing == "topk_softmax":
        top_logits, ids = router_logits.float().topk(top_k, dim=-1)
        return torch.softmax(top_logits, dim=-1).to(router_logits.dtype), ids
    if routing != "softmax_topk":
        raise ValueError(f"routing: {routing!r} (supported: softmax_topk, topk_softmax)")
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
    `intermediate`, weighted by `routing` (see the module doc)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        routing: str = "softmax_topk",
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k: {top_k} must be in [1, num_experts={num_experts}]")
        self.top_k, self.renormalize, self.routing = top_k, renormalize, routing
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(hidden, intermediate, num_experts)

    def forward(self, x: torch.Tensor, lora: LayerLora | None = None) -> torch.Tensor:
        """`lora` is accepted for the decoder layer's uniform call and has no expert targets."""
        logits = kernels.linear(x, self.gate.weight)
        weights, ids = route(logits, self.top_k, self.renormalize, self.routing)
        return kernels.fused_moe(
            x, self.experts.gate_up_proj, self.experts.down_proj, ids, weights
        )
