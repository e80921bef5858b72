"""Causal conv1d: reference vs a per-token loop, Triton vs reference, prefills shorter than the
window (design.md lesson 10), and decode steps / split prefills == one prefill. Conv-state slots that no
request names are poisoned with NaN and must come out untouched."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compute_service.kernels import conv_ref, conv_triton

from .helpers import DEVICE, assert_close, cu_seqlens, distinct_slots, int32, requires_cuda

IMPLS = {"ref": conv_ref, "triton": conv_triton}
SPARE_SLOTS = 3


def per_token_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    history: torch.Tensor | None,
    activation: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, one token at a time in float64, keeping an explicit list of past inputs.
    x: [L, C]; history: [C, W-1] oldest first, or None for zeros. Returns (y [L, C], last W-1
    inputs [C, W-1])."""
    C, W = weight.shape
    past = [torch.zeros(C, dtype=torch.float64) for _ in range(W - 1)]
    if history is not None:
        past = [history[:, j].double().cpu() for j in range(W - 1)]
    w = weight.double().cpu()
    ys = []
    for t in range(x.shape[0]):
        past.append(x[t].double().cpu())
        window = past[len(past) - W :]
        out = sum(w[:, k] * window[k] for k in range(W))
        if bias is not None:
            out = out + bias.double().cpu()
        ys.append(F.silu(out) if activation == "silu" else out)
    state = torch.stack(past[len(past) - (W - 1) :], dim=1) if W > 1 else torch.zeros(C, 0)
    return torch.stack(ys), state


# (channels, width, lengths, has_initial_state, with bias, activation, dtype): lengths 1 and 2
# are shorter than W-1 = 3, with and without initial state; 136 channels and 70 tokens span
# more than one Triton tile.
PREFILL_CASES = [
    (24, 4, [1, 2, 3, 9], [True, False, True, False], True, "silu", torch.float32),
    (40, 4, [2, 20], [True, True], False, None, torch.float16),
    (16, 2, [1, 5, 3], [False, True, True], True, "silu", torch.float16),
    (136, 4, [3, 70], [True, False], True, "silu", torch.float32),
]


def _prefill_case_id(case: tuple) -> str:
    C, W, lengths, has_init, with_bias, act, dtype = case
    init = [int(h) for h in has_init]
    return f"C{C}W{W}-len{lengths}-init{init}-b{int(with_bias)}-{act}-{str(dtype)[6:]}"


def _run_prefill(case: tuple, device: str, dtype: torch.dtype) -> None:
    C, W, lengths, has_init, with_bias, activation, _ = case
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(lengths), C, generator=gen).to(dtype).to(device)
    weight = torch.randn(C, W, generator=gen).to(dtype).to(device)
    bias = torch.randn(C, generator=gen).to(dtype).to(device) if with_bias else None
    num_slots = len(lengths) + SPARE_SLOTS
    slots = distinct_slots(len(lengths), num_slots, gen)
    states = torch.full((num_slots, C, W - 1), float("nan"), dtype=dtype, device=device)
    states[slots] = torch.randn(len(lengths), C, W - 1, generator=gen).to(dtype).to(device)
    cu = cu_seqlens(lengths, device)
    has_init_t = torch.tensor(has_init, device=device)

    ref_states = states.clone()
    y = conv_ref.causal_conv1d(
        x, weight, bias, cu, ref_states, int32(slots, device), has_init_t, activation
    )
    rows = cu.tolist()
    for b, slot in enumerate(slots):
        y_expected, state_expected = per_token_conv(
            x[rows[b] : rows[b + 1]], weight, bias, states[slot] if has_init[b] else None,
            activation,
        )
        assert_close(y[rows[b] : rows[b + 1]].cpu(), y_expected, dtype)
        assert_close(ref_states[slot].cpu(), state_expected, dtype)

    tri_states = states.clone()
    out = conv_triton.causal_conv1d(
        x, weight, bias, cu, tri_states, int32(slots, device), has_init_t, activation
    )
    assert_close(out.cpu(), y.cpu(), dtype)
    assert_close(tri_states[slots].cpu(), ref_states[slots].cpu(), dtype)
    untouched = [s for s in range(num_slots) if s not in slots]
    assert tri_states[untouched].isnan().all() and ref_states[untouched].isnan().all()


@pytest.mark.parametrize("case", PREFILL_CASES, ids=_prefill_case_id)
def test_causal_conv1d_prefill(case: tuple) -> None:
    _run_prefill(case, DEVICE, case[-1])


def _run_resume(impl: str, dtype: torch.dtype, device: str) -> None:
    """Two sequences of 7 tokens: one prefill == a 2-token prefill (shorter than W-1) followed
    by 5 decode steps == that prefill followed by a 5-token prefill from its state."""
    C, W, length, first = 24, 4, 7, 2
    ops = IMPLS[impl]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, length, C, generator=gen).to(dtype).to(device)
    weight = torch.randn(C, W, generator=gen).to(dtype).to(device)
    bias = torch.randn(C, generator=gen).to(dtype).to(device)
    slots = int32([4, 1], device)
    states = torch.full((6, C, W - 1), float("nan"), dtype=dtype, device=device)
    states[slots.long()] = torch.randn(2, C, W - 1, generator=gen).to(dtype).to(device)
    has_init = torch.tensor([True, False], device=device)

    def prefill(state: torch.Tensor, start: int, end: int, init: torch.Tensor) -> torch.Tensor:
        y = ops.causal_conv1d(
            x[:, start:end].reshape(-1, C), weight, bias, cu_seqlens([end - start] * 2, device),
            state, slots, init,
        )
        return y.view(2, end - start, C)

    whole_state = states.clone()
    y_whole = prefill(whole_state, 0, length, has_init)

    decode_state = states.clone()
    y_decode = [prefill(decode_state, 0, first, has_init)]
    for t in range(first, length):
        y = ops.causal_conv1d_update(x[:, t], decode_state, weight, bias, slots)
        y_decode.append(y[:, None])
    assert_close(torch.cat(y_decode, dim=1).cpu(), y_whole.cpu(), dtype)
    used = slots.long()
    assert_close(decode_state[used].cpu(), whole_state[used].cpu(), dtype)

    split_state = states.clone()
    y_first = prefill(split_state, 0, first, has_init)
    y_rest = prefill(split_state, first, length, torch.tensor([True, True], device=device))
    assert_close(torch.cat([y_first, y_rest], dim=1).cpu(), y_whole.cpu(), dtype)
    assert_close(split_state[used].cpu(), whole_state[used].cpu(), dtype)
    for state in (whole_state, decode_state, split_state):
        assert state[[0, 2, 3, 5]].isnan().all()


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_decode_and_split_prefill_match_one_prefill(impl: str, dtype: torch.dtype) -> None:
    _run_resume(impl, dtype, DEVICE)


@pytest.mark.parametrize("activation", [None, "silu"])
def test_causal_conv1d_update_matches_reference(activation: str | None) -> None:
    C, W = 40, 4
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, C, generator=gen).to(DEVICE)
    weight = torch.randn(C, W, generator=gen).to(DEVICE)
    slots = int32([2, 0, 5], DEVICE)
    states = torch.full((6, C, W - 1), float("nan"), device=DEVICE)
    states[slots.long()] = torch.randn(3, C, W - 1, generator=gen).to(DEVICE)
    ref_states, tri_states = states.clone(), states.clone()
    y = conv_ref.causal_conv1d_update(x, ref_states, weight, None, slots, activation)
    out = conv_triton.causal_conv1d_update(x, tri_states, weight, None, slots, activation)
    assert_close(out.cpu(), y.cpu(), torch.float32)
    torch.testing.assert_close(tri_states, ref_states, equal_nan=True)


def test_unknown_activation_is_rejected() -> None:
    x = torch.zeros(1, 4)
    with pytest.raises(ValueError, match="activation"):
        conv_ref.causal_conv1d_update(x, torch.zeros(1, 4, 3), torch.zeros(4, 4), None,
                                      int32([0]), "gelu")
    with pytest.raises(ValueError, match="activation"):
        conv_triton.causal_conv1d_update(x, torch.zeros(1, 4, 3), torch.zeros(4, 4), None,
                                         int32([0]), "gelu")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("case", PREFILL_CASES, ids=_prefill_case_id)
def test_causal_conv1d_prefill_bf16_gpu(case: tuple) -> None:
    _run_prefill(case, "cuda", torch.bfloat16)


@pytest.mark.gpu
@requires_cuda
def test_decode_and_split_prefill_bf16_gpu() -> None:
    _run_resume("triton", torch.bfloat16, "cuda")
