"""`moe.route` against the routers of transformers' modeling code, bit for bit: each family's
routing weights and expert ids, in fp32 and bf16, including logits with near ties."""

from __future__ import annotations

import pytest
import torch

from compute_service.model.moe import route

transformers = pytest.importorskip("transformers")
from transformers.models.granitemoehybrid import modeling_granitemoehybrid as granite  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3_moe  # noqa: E402

HIDDEN, EXPERTS = 32, 8


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(40, HIDDEN, generator=gen)
    w = torch.randn(EXPERTS, HIDDEN, generator=gen) * 0.3
    w[1] = w[0] + 1e-6  # experts 0 and 1 nearly tied for every token
    return x.to(dtype), w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 3])
def test_topk_softmax_is_granites_router(dtype: torch.dtype, top_k: int) -> None:
    x, w = _inputs(dtype)
    config = transformers.GraniteMoeHybridConfig(
        hidden_size=HIDDEN, num_local_experts=EXPERTS, num_experts_per_tok=top_k, mamba_n_heads=8
    )
    router = granite.GraniteMoeHybridTopKRouter(config)
    router.weight.data = w
    _, want_w, want_ids = router(x)
    got_w, got_ids = route(torch.nn.functional.linear(x, w), top_k, True, "topk_softmax")
    assert torch.equal(got_ids, want_ids) and got_w.dtype == want_w.dtype == dtype
    assert torch.equal(got_w, want_w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [False, True])
def test_softmax_topk_is_qwen3_moes_router(dtype: torch.dtype, renormalize: bool) -> None:
    x, w = _inputs(dtype)
    config = transformers.Qwen3MoeConfig(
        hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=3, norm_topk_prob=renormalize
    )
    router = qwen3_moe.Qwen3MoeTopKRouter(config)
    router.weight.data = w
    _, want_w, want_ids = router(x)
    got_w, got_ids = route(torch.nn.functional.linear(x, w), 3, renormalize)
    assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w)


def test_an_unknown_routing_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="routing"):
        route(torch.zeros(2, EXPERTS), 2, True, "sigmoid")
