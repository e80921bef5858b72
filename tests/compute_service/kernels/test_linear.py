"""`kernels.linear` / `linear_group` on CPU (oneDNN with pre-packed weights) against F.linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compute_service import kernels
from compute_service.kernels import linear_cpu

ROWS = [1, 8, 33, 300]


def _weights(outs: list[int], d_in: int, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ws = [torch.randn(o, d_in, generator=gen) for o in outs]
    bs = [torch.randn(o, generator=gen) if bias else None for o in outs]
    return ws, bs


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_linear_matches_f_linear(rows: int, bias: bool) -> None:
    (w,), (b,) = _weights([96], 64, bias)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(kernels.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("biases", ["none", "all", "some"])
def test_linear_group_is_each_projection(rows: int, biases: str) -> None:
    """One GEMM over the stacked weights gives each projection's output, with the biases of
    the projections that have one (q/k/v with qkv_bias, or a mix)."""
    ws, bs = _weights([64, 32, 32], 48, biases != "none")
    if biases == "some":
        bs[1] = None
    x = torch.randn(rows, 48, generator=torch.Generator().manual_seed(2))
    outs = kernels.linear_group(x, ws, bs)
    assert [o.shape for o in outs] == [(rows, 64), (rows, 32), (rows, 32)]
    for out, w, b in zip(outs, ws, bs, strict=True):
        torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_a_weight_changed_in_place_or_replaced_is_packed_again() -> None:
    lin = torch.nn.Linear(32, 16)
    x = torch.randn(4, 32)
    with torch.no_grad():
        first = kernels.linear(x, lin.weight, lin.bias)
        lin.weight.mul_(2)  # in place: same storage, new version
        torch.testing.assert_close(kernels.linear(x, lin.weight, lin.bias), lin(x))
        lin.bias.add_(1)  # the bias is part of the packed state too
        torch.testing.assert_close(kernels.linear(x, lin.weight, lin.bias), lin(x))
        lin.weight.data = torch.randn(16, 32)  # replaced: new storage
        torch.testing.assert_close(kernels.linear(x, lin.weight, lin.bias), lin(x))
    assert not torch.equal(first, lin(x))


def test_inference_tensors_and_other_dtypes() -> None:
    """Weights made under inference_mode (no version counter) are served; fp16/bf16 fall back to
    F.linear and give exactly its values."""
    with torch.inference_mode():
        w, x = torch.randn(16, 32), torch.randn(3, 32)
        torch.testing.assert_close(kernels.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    for dtype in (torch.float16, torch.bfloat16):
        w, x = torch.randn(16, 32).to(dtype), torch.randn(3, 32).to(dtype)
        assert torch.equal(kernels.linear(x, w), F.linear(x, w))


def test_uses_onednn_on_this_build() -> None:
    """The fast path is really taken here (a build without oneDNN would silently be slower)."""
    assert linear_cpu._AVAILABLE
    w = torch.randn(8, 8)
    kernels.linear(torch.randn(2, 8), w)
    assert hasattr(w, "_onednn_packed")
