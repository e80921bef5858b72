"""Shared pieces of the kernel tests: tolerances, the GPU and C-compiler skip markers, small
constructors."""
from __future__ import annotations

import pytest
import torch

from compute_service.kernels import cpu_native

# Where the Triton kernels run: compiled on a GPU when there is one, else interpreted on CPU
# (tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Triton vs the fp32 reference: interpreted fp32 differs only by summation order, compiled fp32
# dots use TF32 on a GPU; fp16 and bf16 inputs/outputs are rounded. Tolerances are relative to
# the output's scale.
_REL_TOL = {
    torch.float32: 1e-4 if DEVICE == "cpu" else 5e-3,
    torch.float16: 4e-3,
    torch.bfloat16: 2e-2,
}

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: compiled Triton kernels in bf16 are only checked on a GPU",
)


# The CPU C kernels are built with the system C compiler (scripts/setup.sh installs gcc where it
# can); without one the service falls back to oneDNN and PyTorch, which are tested everywhere.
requires_c_kernels = pytest.mark.skipif(
    not cpu_native.enabled(),
    reason="no C compiler here: the CPU C kernels (compute_service/kernels/csrc) cannot be built",
)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Finite and within the dtype's tolerance, scaled by the magnitude of `expected`."""
    actual, expected = actual.float(), expected.float()
    assert torch.isfinite(actual).all(), "output has non-finite values"
    scale = max(1.0, expected.abs().max().item())
    tol = _REL_TOL[dtype] * scale
    torch.testing.assert_close(actual, expected, rtol=_REL_TOL[dtype], atol=tol)


def int32(values: list[int], device: str | torch.device = "cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def cu_seqlens(lengths: list[int], device: str | torch.device = "cpu") -> torch.Tensor:
    """[0, l0, l0 + l1, ...] as int32."""
    out = [0]
    for length in lengths:
        out.append(out[-1] + length)
    return int32(out, device)


def distinct_slots(count: int, total: int, generator: torch.Generator) -> list[int]:
    """`count` distinct slot indices out of `total`, in random order."""
    return torch.randperm(total, generator=generator)[:count].tolist()
