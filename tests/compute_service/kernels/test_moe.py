"""Fused mixture-of-experts MLP: the reference vs a per-token float64 loop, the Triton grouped
GEMM vs the reference over expert mixes (an expert picked by no token is NaN and must never be
read; one expert taking every token spans several row tiles), widths that are not multiples of
the tiles, fp32 and fp16 (interpreted on CPU, compiled on a GPU when there is one), bf16 and a
prefill-sized batch on a GPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compute_service import kernels
from compute_service.kernels import moe_ref, moe_triton

from .helpers import DEVICE, assert_close, requires_cuda

# (tokens, hidden, expert width I, experts, top-k, unused experts (NaN), dtype)
CASES = [
    (5, 64, 32, 4, 2, (), torch.float32),
    (37, 48, 40, 8, 2, (3, 6), torch.float32),  # widths not multiples of the tiles
    (20, 64, 24, 6, 1, (0,), torch.float32),
    (1, 32, 16, 4, 4, (), torch.float32),  # a decode step, every expert
    (19, 64, 48, 5, 3, (2,), torch.float16),
    (3, 96, 32, 4, 2, (), torch.float16),
]


def _case_id(case: tuple) -> str:
    t, h, i, e, k, unused, dtype = case
    return f"T{t}-H{h}-I{i}-E{e}-k{k}-unused{len(unused)}-{str(dtype)[6:]}"


def _inputs(case: tuple, device: str, dtype: torch.dtype, seed: int = 0):
    t, h, i, e, k, unused, _ = case
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen)
    w_gate_up = torch.randn(e, 2 * i, h, generator=gen) / h**0.5
    w_down = torch.randn(e, h, i, generator=gen) / i**0.5
    used = torch.tensor([x for x in range(e) if x not in unused])
    # k distinct used experts per token (a router's top-k), random weights.
    picks = torch.stack([used[torch.randperm(len(used), generator=gen)[:k]] for _ in range(t)])
    weights = torch.rand(t, k, generator=gen)
    for u in unused:
        w_gate_up[u], w_down[u] = float("nan"), float("nan")
    tensors = [x.to(dtype), w_gate_up.to(dtype), w_down.to(dtype), picks, weights]
    return [v.to(device) for v in tensors]


def _per_token(x, w_gate_up, w_down, ids, weights) -> torch.Tensor:
    """The definition, one token and one choice at a time in float64."""
    i = w_down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            gu = w_gate_up[e].double() @ x[t].double()
            h = F.silu(gu[:i]) * gu[i:]
            out[t] += weights[t, j].double() * (w_down[e].double() @ h)
    return out


@pytest.mark.parametrize("case", [c for c in CASES if c[6] == torch.float32], ids=_case_id)
def test_reference_matches_per_token_definition(case: tuple) -> None:
    args = _inputs(case, "cpu", torch.float32)
    got = moe_ref.fused_moe(*args)
    torch.testing.assert_close(got.double(), _per_token(*args), rtol=1e-5, atol=1e-5)


def _check_triton(case: tuple, device: str, dtype: torch.dtype) -> None:
    args = _inputs(case, device, dtype)
    expected = moe_ref.fused_moe(*[a.cpu() if a.dtype != torch.float16 else a.cpu().float()
                                   for a in args]).to(dtype)
    got = moe_triton.fused_moe(*args)
    assert got.dtype == dtype and got.shape == args[0].shape
    assert_close(got.cpu(), expected, dtype)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_triton_matches_reference(case: tuple) -> None:
    _check_triton(case, DEVICE, case[6])


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_triton_bf16_on_gpu(case: tuple) -> None:
    _check_triton(case, "cuda", torch.bfloat16)


@pytest.mark.gpu
@requires_cuda
def test_triton_prefill_sized_batch_on_gpu() -> None:
    """2,000 tokens, 64 experts top-8, hidden 1024, expert width 768 (Qwen3-30B-A3B's shape)."""
    case = (2000, 1024, 768, 64, 8, (), torch.bfloat16)
    _check_triton(case, "cuda", torch.bfloat16)


def test_an_empty_batch_and_the_dispatch() -> None:
    x, w_gate_up, w_down, ids, weights = _inputs(CASES[0], "cpu", torch.float32)
    assert kernels.choose("fused_moe", x) == "ref"
    # Forcing Triton takes tensors it can read: compiled Triton on a GPU cannot read CPU ones.
    x, w_gate_up, w_down, ids, weights = _inputs(CASES[0], DEVICE, torch.float32)
    for impl in (moe_ref, moe_triton):
        assert impl.fused_moe(x[:0], w_gate_up, w_down, ids[:0], weights[:0]).shape == (0, 64)
    want = moe_ref.fused_moe(x, w_gate_up, w_down, ids, weights)
    assert_close(kernels.fused_moe(x, w_gate_up, w_down, ids, weights, use_triton=True), want,
                 torch.float32)


def test_shape_errors_name_the_argument() -> None:
    x, w_gate_up, w_down, ids, weights = _inputs(CASES[0], "cpu", torch.float32)
    with pytest.raises(ValueError, match="w_down"):
        moe_ref.fused_moe(x, w_gate_up, w_down[:, :, :-1], ids, weights)
    with pytest.raises(ValueError, match="w_gate_up"):
        moe_ref.fused_moe(x, w_gate_up[:, :-1], w_down, ids, weights)
    with pytest.raises(ValueError, match="topk_weights"):
        moe_ref.fused_moe(x, w_gate_up, w_down, ids, weights[:, :1])
