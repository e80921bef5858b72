"""Batched multi-adapter LoRA: reference vs a per-token float64 loop, Triton vs reference over a
grid of ranks, slot mixes and dims. Slots no token names are poisoned with NaN and must never be
read; tokens without an adapter (-1) must come out bit-identical."""
from __future__ import annotations

import pytest
import torch

from compute_service import kernels
from compute_service.kernels import lora_cpu, lora_ref, lora_triton

from .helpers import DEVICE, assert_close, int32, requires_c_kernels, requires_cuda

IMPLS = {"ref": lora_ref, "triton": lora_triton}


def _stacks(
    ranks: list[int | None], d_in: int, d_out: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A/B stacks with one slot per entry of `ranks`: rank r zero-padded to r_max, or None for an
    unused slot, filled with NaN (also its scaling)."""
    r_max = max(r for r in ranks if r is not None)
    S = len(ranks)
    A = torch.zeros(S, r_max, d_in)
    B = torch.zeros(S, d_out, r_max)
    scaling = torch.empty(S)
    for s, r in enumerate(ranks):
        if r is None:
            A[s], B[s], scaling[s] = float("nan"), float("nan"), float("nan")
            continue
        A[s, :r] = torch.randn(r, d_in, generator=gen) / d_in**0.5
        B[s, :, :r] = torch.randn(d_out, r, generator=gen) / r**0.5
        scaling[s] = 2.0 / r
    return A.to(dtype), B.to(dtype), scaling


def _per_token(
    y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scaling: torch.Tensor,
    token_slot: list[int],
) -> torch.Tensor:
    """The definition, one token at a time in float64."""
    out = y.double().clone()
    for t, s in enumerate(token_slot):
        if s >= 0:
            out[t] += scaling[s].double() * (B[s].double() @ (A[s].double() @ x[t].double()))
    return out


# (ranks per slot (None = unused, NaN), token slots, in, out, dtype). Slots appear in runs (as
# packed sequences do) and interleaved; 40 tokens of one slot span several token tiles; in 256
# gives two K splits; out 200 is not a multiple of the out tile.
CASES = [
    ([4, 8, 16], [0, 0, 0, 1, 1, -1, -1, 2, 2, 2, 2], 64, 128, torch.float32),
    ([8, None, 4, 16], [2, -1, 0, 3, 0, 2, 3, -1, 0], 256, 64, torch.float32),
    ([16, None, 8], [0] * 40 + [-1] * 3 + [2] * 5, 128, 200, torch.float32),
    ([4, 16, None, None, 8], [4, 1, 4, 0, -1, 1, 1, 4], 256, 256, torch.float16),
    ([8, 8], [-1, -1, -1], 64, 64, torch.float16),
    ([16], [0], 96, 72, torch.float16),
]


def _case_id(case: tuple) -> str:
    ranks, slots, d_in, d_out, dtype = case
    return f"r{ranks}-T{len(slots)}-in{d_in}-out{d_out}-{str(dtype)[6:]}".replace(" ", "")


def _inputs(case: tuple, device: str, dtype: torch.dtype, seed: int = 0):
    ranks, slots, d_in, d_out, _ = case
    gen = torch.Generator().manual_seed(seed)
    A, B, scaling = _stacks(ranks, d_in, d_out, dtype, gen)
    x = torch.randn(len(slots), d_in, generator=gen).to(dtype)
    y = torch.randn(len(slots), d_out, generator=gen).to(dtype)
    return [t.to(device) for t in (y, x, A, B, scaling)] + [int32(slots, device)]


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_reference_matches_per_token_definition(case: tuple) -> None:
    y, x, A, B, scaling, token_slot = _inputs(case, "cpu", torch.float32)
    expected = _per_token(y, x, A, B, scaling, token_slot.tolist())
    lora_ref.lora_apply(y, x, A, B, scaling, token_slot)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)


def _check_impl(impl, case: tuple, device: str, dtype: torch.dtype) -> None:
    y, x, A, B, scaling, token_slot = _inputs(case, device, dtype)
    expected = y.clone()
    lora_ref.lora_apply(expected, x, A, B, scaling, token_slot)
    before = y.clone()
    impl.lora_apply(y, x, A, B, scaling, token_slot)
    assert_close(y, expected, dtype)
    base = token_slot == -1
    assert torch.equal(y[base], before[base]), "tokens without an adapter were modified"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_triton_matches_reference(case: tuple) -> None:
    _check_impl(lora_triton, case, DEVICE, case[4])


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_triton_bf16_on_gpu(case: tuple) -> None:
    _check_impl(lora_triton, case, "cuda", torch.bfloat16)


@pytest.mark.gpu
@requires_cuda
def test_triton_large_mixed_batch_on_gpu() -> None:
    """Prefill-sized batch: 1000 tokens over 4 adapters of a 4096 -> 1024 projection."""
    gen = torch.Generator().manual_seed(1)
    slots = torch.randint(-1, 4, (1000,), generator=gen).tolist()
    case = ([16, 8, 4, 16], slots, 4096, 1024, torch.bfloat16)
    _check_impl(lora_triton, case, "cuda", torch.bfloat16)


@pytest.mark.parametrize("name", list(IMPLS))
def test_precomputed_segments_and_empty_batch(name: str) -> None:
    """Passing `lora_segments` once gives the same result; T == 0 is a no-op."""
    impl = IMPLS[name]
    case = CASES[1]
    y, x, A, B, scaling, token_slot = _inputs(case, DEVICE, torch.float32)
    y2 = y.clone()
    impl.lora_apply(y, x, A, B, scaling, token_slot)
    segments = kernels.lora_segments(token_slot, A.shape[0])
    impl.lora_apply(y2, x, A, B, scaling, token_slot, segments)
    torch.testing.assert_close(y2, y, rtol=0, atol=0)
    empty = torch.empty(0, y.shape[1], device=DEVICE)
    impl.lora_apply(empty, x[:0], A, B, scaling, token_slot[:0])


def test_segments_layout() -> None:
    seg = kernels.lora_segments(int32([2, -1, 0, 2, 0, -1, 2]), 4)
    assert seg.order.tolist() == [1, 5, 2, 4, 0, 3, 6]
    assert seg.starts.tolist() == [2, 4, 4, 7]
    assert seg.counts.tolist() == [2, 0, 3, 0]


def test_shape_and_dtype_errors() -> None:
    y, x, A, B, scaling, token_slot = _inputs(CASES[0], "cpu", torch.float32)
    with pytest.raises(ValueError, match="B_stack"):
        lora_ref.lora_apply(y, x, A, B[:, :-1], scaling, token_slot)
    with pytest.raises(ValueError, match="dtype"):
        lora_ref.lora_apply(y, x.double(), A, B, scaling, token_slot)


def test_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors use the reference unless Triton is forced, or the C kernel given B_t."""
    calls: list[str] = []
    for tag, module in IMPLS.items():
        monkeypatch.setattr(module, "lora_apply", lambda *a, _tag=tag: calls.append(_tag))
    args = _inputs(CASES[0], "cpu", torch.float32)
    kernels.lora_apply(*args)
    kernels.lora_apply(*args, use_triton=True)
    assert calls == ["ref", "triton"]


@requires_c_kernels
def test_dispatch_takes_the_c_kernel_given_b_t(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(lora_ref, "lora_apply", lambda *a: calls.append("ref"))
    args = _inputs(CASES[0], "cpu", torch.float32)
    y, x, A, B = args[:4]
    before = y.clone()
    kernels.lora_apply(*args, B_t=B.transpose(1, 2).contiguous())
    assert calls == [] and not torch.equal(y, before)  # the C kernel ran


# ---- the C kernel (CPU, fp32, B kept transposed by the registry) -------------------------------

@requires_c_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_cpu_kernel_matches_reference(case: tuple, threads: int) -> None:
    """fp32 takes the C kernel (fp16 falls back to the reference), into a y that is a column
    view of a wider output as project_group's are; unused slots are NaN and never read."""
    y, x, A, B, scaling, token_slot = _inputs(case, "cpu", case[4])
    wide = torch.randn(y.shape[0], y.shape[1] + 24, dtype=y.dtype)
    wide[:, 8 : 8 + y.shape[1]] = y
    view = wide[:, 8 : 8 + y.shape[1]]
    B_t = B.transpose(1, 2).contiguous()
    assert lora_cpu.native_takes(view, x, A, B_t) == (case[4] == torch.float32)
    expected = y.clone()
    lora_ref.lora_apply(expected, x, A, B, scaling, token_slot)
    outside = wide.clone()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        lora_cpu.lora_apply(view, x, A, B, scaling, token_slot, None, B_t)
    finally:
        torch.set_num_threads(before)
    assert_close(view, expected, case[4])
    assert torch.equal(wide[:, :8], outside[:, :8]) and torch.equal(wide[:, -16:], outside[:, -16:])
    base = token_slot == -1
    assert torch.equal(view[base], outside[:, 8 : 8 + y.shape[1]][base])


@requires_c_kernels
def test_cpu_kernel_rejects_a_b_t_of_the_wrong_shape() -> None:
    y, x, A, B, scaling, token_slot = _inputs(CASES[0], "cpu", torch.float32)
    with pytest.raises(ValueError, match="B_t"):
        lora_cpu.lora_apply(y, x, A, B, scaling, token_slot, None, B.contiguous().view(
            B.shape[0], B.shape[2], B.shape[1])[:, :, :-1].contiguous())
