"""The public kernel API picks the PyTorch path for CPU tensors (`attention_cpu` for decode
attention, the vectorised `*_torch` module where there is one, else the reference), Triton when
forced or on CUDA, and the reference when asked for it."""
from __future__ import annotations

import pytest
import torch

from compute_service import kernels
from compute_service.kernels import (
    attention_cpu,
    attention_ref,
    attention_torch,
    attention_triton,
    conv_ref,
    conv_triton,
    mamba_ref,
    mamba_torch,
    mamba_triton,
)

from .helpers import int32

# (public name, reference module, PyTorch-path module, Triton module, arguments)
_Q = torch.randn(1, 2, 16)
_CACHE = torch.randn(2, 4, 1, 16)
_CASES = [
    (
        "paged_decode_attention", attention_ref, attention_cpu, attention_triton,
        (_Q, _CACHE, _CACHE, int32([[1, 0]]), int32([6]), 0.25),
    ),
    (
        "extend_attention", attention_ref, attention_torch, attention_triton,
        (_Q, _CACHE, _CACHE, int32([[1, 0]]), int32([0, 1]), int32([5]), 0.25),
    ),
    (
        "selective_state_update", mamba_ref, mamba_torch, mamba_triton,
        (torch.randn(2, 1, 4, 8), torch.randn(1, 1, 4), torch.randn(1, 1), torch.zeros(1),
         -torch.ones(1), torch.randn(1, 1, 8), torch.randn(1, 1, 8), torch.ones(1), int32([1])),
    ),
    (
        "mamba_chunk_scan", mamba_ref, mamba_ref, mamba_triton,
        (torch.randn(3, 1, 4), torch.randn(3, 1), torch.zeros(1), -torch.ones(1),
         torch.randn(3, 1, 8), torch.randn(3, 1, 8), torch.ones(1), int32([0, 3]), None,
         int32([0]), 16),
    ),
    (
        "causal_conv1d", conv_ref, conv_ref, conv_triton,
        (torch.randn(3, 4), torch.randn(4, 4), None, int32([0, 3]), torch.randn(1, 4, 3),
         int32([0]), torch.tensor([True])),
    ),
    (
        "causal_conv1d_update", conv_ref, conv_ref, conv_triton,
        (torch.randn(1, 4), torch.randn(1, 4, 3), torch.randn(4, 4), None, int32([0])),
    ),
]


@pytest.mark.parametrize("name,ref,fast,tri,args", _CASES, ids=[c[0] for c in _CASES])
def test_dispatch(
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    ref: object,
    fast: object,
    tri: object,
    args: tuple,
) -> None:
    def recorder(tag: str):
        def fn(*a: object, **k: object) -> str:
            return tag
        return fn

    monkeypatch.setattr(ref, name, recorder("ref"))
    if fast is not ref:
        monkeypatch.setattr(fast, name, recorder("torch"))
    monkeypatch.setattr(tri, name, recorder("triton"))
    fast_tag = "ref" if fast is ref else "torch"
    public = getattr(kernels, name)
    assert public(*args) == fast_tag  # CPU tensors, no override
    assert public(*args, use_triton=True) == "triton"
    assert public(*args, use_triton=False) == fast_tag
    assert public(*args, reference=True) == "ref"
    assert public(*args, use_triton=False, reference=True) == "ref"
    with pytest.raises(ValueError, match="exclusive"):
        public(*args, use_triton=True, reference=True)
