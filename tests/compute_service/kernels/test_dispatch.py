"""The dispatch table (`kernels.dispatch`): every public function picks the cpu path for fp32 CPU
tensors where the operation has one (`attention_cpu`, `lora_cpu`, `linear_cpu`), else the
vectorised `*_torch` module where there is one, else the reference; Triton when forced or on CUDA;
the reference when asked for it. Every backend takes the reference's parameters by name."""
from __future__ import annotations

import inspect

import pytest
import torch

from compute_service import kernels
from compute_service.kernels import dispatch

from .helpers import int32

_Q = torch.randn(1, 2, 16)
_CACHE = torch.randn(2, 4, 1, 16)
# public name -> arguments (CPU, fp32)
_ARGS = {
    "write_kv": (torch.randn(1, 1, 16), torch.randn(1, 1, 16), _CACHE, _CACHE, int32([3])),
    "paged_decode_attention": (_Q, _CACHE, _CACHE, int32([[1, 0]]), int32([6]), 0.25),
    "extend_attention": (_Q, _CACHE, _CACHE, int32([[1, 0]]), int32([0, 1]), int32([5]), 0.25),
    "selective_state_update": (
        torch.randn(2, 1, 4, 8), torch.randn(1, 1, 4), torch.randn(1, 1), torch.zeros(1),
        -torch.ones(1), torch.randn(1, 1, 8), torch.randn(1, 1, 8), torch.ones(1), int32([1]),
    ),
    "mamba_chunk_scan": (
        torch.randn(3, 1, 4), torch.randn(3, 1), torch.zeros(1), -torch.ones(1),
        torch.randn(3, 1, 8), torch.randn(3, 1, 8), torch.ones(1), int32([0, 3]), None,
        int32([0]), 16,
    ),
    "causal_conv1d": (
        torch.randn(3, 4), torch.randn(4, 4), None, int32([0, 3]), torch.randn(1, 4, 3),
        int32([0]), torch.tensor([True]),
    ),
    "causal_conv1d_update": (
        torch.randn(1, 4), torch.randn(1, 4, 3), torch.randn(4, 4), None, int32([0]),
    ),
    "lora_apply": (
        torch.zeros(2, 6), torch.randn(2, 5), torch.randn(1, 2, 5), torch.randn(1, 6, 2),
        torch.ones(1), int32([0, -1]),
    ),
    "linear_group": (torch.randn(2, 5), [torch.randn(3, 5)], [None]),
    "fused_moe": (
        torch.randn(2, 8), torch.randn(3, 8, 8), torch.randn(3, 8, 4),
        torch.tensor([[0, 2], [1, 0]]), torch.rand(2, 2),
    ),
    "rms_norm": (torch.randn(2, 8), torch.ones(8), 1e-6),
    "rope": (torch.randn(2, 1, 8), torch.ones(2, 1, 8), torch.zeros(2, 1, 8)),
}


def test_every_operation_has_a_public_function_and_arguments() -> None:
    assert set(_ARGS) == set(dispatch.TABLE)
    for op in dispatch.TABLE:
        assert op in kernels.__all__ and callable(getattr(kernels, op))


@pytest.mark.parametrize("op", list(dispatch.TABLE))
def test_backends_take_the_reference_parameters(op: str) -> None:
    row = dispatch.TABLE[op]
    want = list(inspect.signature(getattr(dispatch.module(row.ref), op)).parameters)
    for name in (row.torch, row.triton, row.cpu):
        if name:
            got = list(inspect.signature(getattr(dispatch.module(name), op)).parameters)
            assert got[: len(want)] == want, name
            # Beyond the reference: launch tuning knobs only (decode splits, extend tile configs).
            assert set(got[len(want):]) <= {*row.cpu_only, "num_splits", "config"}, name
    public = list(inspect.signature(getattr(kernels, op)).parameters)
    assert public == [*want, *row.cpu_only, "use_triton", "reference"]


@pytest.mark.parametrize("op", list(dispatch.TABLE))
def test_dispatch(monkeypatch: pytest.MonkeyPatch, op: str) -> None:
    row = dispatch.TABLE[op]
    for backend in dispatch.BACKENDS:
        if name := getattr(row, backend):
            monkeypatch.setattr(dispatch.module(name), op, lambda *a, _tag=backend, **k: _tag)
    fast = "cpu" if row.cpu else "torch" if row.torch else "ref"
    public, args = getattr(kernels, op), _ARGS[op]
    assert public(*args) == fast  # CPU tensors, no override
    assert public(*args, use_triton=False) == fast
    assert public(*args, reference=True) == "ref"
    assert public(*args, use_triton=False, reference=True) == "ref"
    if row.triton:
        assert public(*args, use_triton=True) == "triton"
    else:
        with pytest.raises(ValueError, match="no Triton kernel"):
            public(*args, use_triton=True)
    with pytest.raises(ValueError, match="exclusive"):
        public(*args, use_triton=True, reference=True)


@pytest.mark.parametrize("op", [op for op, row in dispatch.TABLE.items() if row.cpu])
def test_the_cpu_path_takes_fp32_only(op: str) -> None:
    probe = torch.zeros(2, 2)
    assert dispatch.choose(op, probe) == "cpu"
    expected = "torch" if dispatch.TABLE[op].torch else "ref"
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        assert dispatch.choose(op, probe.to(dtype)) == expected


def test_keywords_reach_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """`window=` by keyword (as the model passes it), and `B_t` only to the cpu path."""
    seen: list[tuple] = []
    monkeypatch.setattr(dispatch.module("attention_cpu"), "paged_decode_attention",
                        lambda *a, **k: seen.append((len(a), k)))
    kernels.paged_decode_attention(*_ARGS["paged_decode_attention"], window=4)
    assert seen == [(6, {"window": 4})]
    for name in ("lora_cpu", "lora_ref"):
        monkeypatch.setattr(dispatch.module(name), "lora_apply",
                            lambda *a, _n=name, **k: seen.append((_n, sorted(k))))
    kernels.lora_apply(*_ARGS["lora_apply"], B_t=torch.zeros(1, 2, 6))
    kernels.lora_apply(*_ARGS["lora_apply"], B_t=torch.zeros(1, 2, 6), reference=True)
    assert seen[1:] == [("lora_cpu", ["B_t"]), ("lora_ref", [])]


def test_cpu_status_names_what_serves() -> None:
    status = kernels.cpu_status()
    assert set(status) == {"gemm", "decode_attention", "library"}
    assert status["gemm"] in ("native", "onednn", "torch")
    assert status["decode_attention"] == ("native" if status["library"] else "torch")
