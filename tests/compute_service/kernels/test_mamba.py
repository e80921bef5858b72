"""Mamba2 SSM: reference vs the quadratic (dual) form, Triton vs reference, resumption from a
checkpoint, chunk-end states at page boundaries, and decode steps == prefill."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from compute_service.kernels import mamba_ref, mamba_triton
from compute_service.kernels.mamba_ref import mamba_chunk_layout

from .helpers import DEVICE, assert_close, cu_seqlens, int32, requires_cuda

IMPLS = {"ref": mamba_ref, "triton": mamba_triton}


@dataclass(slots=True)
class SsmInputs:
    x: torch.Tensor  # [T, H, P]
    dt: torch.Tensor  # [T, H]
    dt_bias: torch.Tensor  # [H]
    A: torch.Tensor  # [H], negative
    B: torch.Tensor  # [T, G, N]
    C: torch.Tensor  # [T, G, N]
    D: torch.Tensor  # [H]

    def rows(self, start: int, end: int) -> SsmInputs:
        return SsmInputs(
            self.x[start:end], self.dt[start:end], self.dt_bias, self.A,
            self.B[start:end], self.C[start:end], self.D,
        )

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.x, self.dt, self.dt_bias, self.A, self.B, self.C, self.D)


def make_inputs(
    T: int, H: int, G: int, P: int, N: int, dtype: torch.dtype, device: str, seed: int = 0
) -> SsmInputs:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dt).to(device)

    return SsmInputs(
        x=rand(T, H, P),
        dt=rand(T, H),
        dt_bias=rand(H, dt=torch.float32),
        A=-torch.exp(torch.rand(H, generator=gen)).to(device),
        B=rand(T, G, N),
        C=rand(T, G, N),
        D=rand(H, dt=torch.float32),
    )


def dual_form_states(inp: SsmInputs, h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence in float64 without a recurrence: the state after token t is
    sum_{s<=t} exp(cum_t - cum_s) dt_s x_s B_s^T + exp(cum_t) h0, cum = inclusive cumsum of
    dt * A. Returns (states [L, H, P, N], y [L, H, P])."""
    L, H, P = inp.x.shape
    group = H // inp.B.shape[1]
    dt = F.softplus(inp.dt.double().cpu() + inp.dt_bias.double().cpu())
    cum = torch.cumsum(dt * inp.A.double().cpu(), dim=0)  # [L, H]
    x, B, C = inp.x.double().cpu(), inp.B.double().cpu(), inp.C.double().cpu()
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    states = torch.empty(L, H, P, B.shape[-1], dtype=torch.float64)
    y = torch.empty(L, H, P, dtype=torch.float64)
    for h in range(H):
        g = h // group
        seg = cum[:, h, None] - cum[None, :, h]
        decay = torch.exp(seg.masked_fill(~causal, float("-inf"))) * dt[None, :, h]
        states[:, h] = torch.einsum("ts,sp,sn->tpn", decay, x[:, h], B[:, g])
        states[:, h] += torch.exp(cum[:, h])[:, None, None] * h0[h].double().cpu()
        y[:, h] = torch.einsum("tpn,tn->tp", states[:, h], C[:, g])
        y[:, h] += inp.D[h].double().cpu() * x[:, h]
    return states, y


def test_chunk_layout_aligns_chunks_to_absolute_multiples() -> None:
    layout = mamba_chunk_layout(int32([0, 3, 25, 40]), int32([2, 5, 16]), 16)
    # seq 0: positions 2..4; seq 1: 5..26 crosses 16; seq 2: 16..30 starts on a boundary.
    assert layout.cu_chunks.tolist() == [0, 1, 3, 4]
    assert layout.chunk_end_pos.tolist() == [5, 16, 27, 31]
    assert layout.chunk_token_start.tolist() == [0, 3, 14, 25]
    assert layout.chunk_len.tolist() == [3, 11, 11, 15]
    assert layout.chunk_seq.tolist() == [0, 1, 1, 2]


# (H, G, P, N, chunk_size, lengths, seq_start_pos, with initial states, dtype); P, N below 16
# and non-powers of two exercise the padded tiles, a 1-token sequence the shortest chunk, and
# chunk_size 128 several row and key blocks per chunk in the Triton scan.
SCAN_CASES = [
    (4, 2, 16, 16, 16, [3, 22, 15], [2, 5, 16], False, torch.float32),
    (4, 1, 16, 16, 16, [40], [0], True, torch.float16),
    (4, 4, 8, 8, 64, [70, 9], [0, 60], True, torch.float32),
    (2, 2, 24, 16, 32, [1, 33, 50], [31, 0, 7], True, torch.float16),
    (2, 1, 16, 16, 128, [130], [20], False, torch.float32),
]


def _scan_case_id(case: tuple) -> str:
    H, G, P, N, cs, lengths, starts, init, dtype = case
    return f"H{H}G{G}P{P}N{N}-cs{cs}-len{lengths}-at{starts}-init{int(init)}-{str(dtype)[6:]}"


def _run_scan(case: tuple, device: str, dtype: torch.dtype) -> None:
    H, G, P, N, chunk_size, lengths, starts, with_init, _ = case
    inp = make_inputs(sum(lengths), H, G, P, N, dtype, device)
    gen = torch.Generator().manual_seed(3)
    init = torch.randn(len(lengths), H, P, N, generator=gen).to(device) if with_init else None
    cu = cu_seqlens(lengths, device)
    args = (*inp.args(), cu, init, int32(starts, device), chunk_size)

    y, final, chunk_states, cu_chunks, chunk_end_pos = mamba_ref.mamba_chunk_scan(*args)
    rows = cu_seqlens(lengths).tolist()
    for b, (length, s0) in enumerate(zip(lengths, starts, strict=True)):
        h0 = init[b] if init is not None else torch.zeros(H, P, N)
        states, y_expected = dual_form_states(inp.rows(rows[b], rows[b + 1]), h0)
        assert_close(y[rows[b] : rows[b + 1]].cpu(), y_expected, dtype)
        assert_close(final[b].cpu(), states[-1], torch.float32)
        boundaries = {e for e in range(s0 + 1, s0 + length) if e % chunk_size == 0}
        ends = sorted(boundaries | {s0 + length})
        chunks = range(cu_chunks[b].item(), cu_chunks[b + 1].item())
        assert chunk_end_pos[chunks.start : chunks.stop].tolist() == ends
        for k, end in zip(chunks, ends, strict=True):
            assert_close(chunk_states[k].cpu(), states[end - s0 - 1], torch.float32)

    out = mamba_triton.mamba_chunk_scan(*args)
    assert_close(out[0].cpu(), y.cpu(), dtype)
    for got, want in zip(out[1:3], (final, chunk_states), strict=True):
        assert_close(got.cpu(), want.cpu(), torch.float32 if device == "cpu" else dtype)
    assert torch.equal(out[3], cu_chunks) and torch.equal(out[4], chunk_end_pos)


@pytest.mark.parametrize("case", SCAN_CASES, ids=_scan_case_id)
def test_mamba_chunk_scan(case: tuple) -> None:
    _run_scan(case, DEVICE, case[-1])


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("split", [21, 32], ids=["mid-page", "page-aligned"])
def test_scan_resumes_from_checkpoint(impl: str, split: int) -> None:
    """Whole prompt == first part, then the rest from the first part's final state; chunk-end
    states sit on the same absolute page boundaries either way and equal prefix scans."""
    page, length, H, G, P, N = 16, 45, 4, 2, 16, 16
    scan = IMPLS[impl].mamba_chunk_scan
    inp = make_inputs(length, H, G, P, N, torch.float32, DEVICE, seed=5)
    h0 = torch.randn(1, H, P, N, generator=torch.Generator().manual_seed(6)).to(DEVICE)

    def run(start: int, end: int, init: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        return scan(
            *inp.rows(start, end).args(), cu_seqlens([end - start], DEVICE), init,
            int32([start], DEVICE), page,
        )

    y, final, states, _, ends = run(0, length, h0)
    y1, final1, states1, _, ends1 = run(0, split, h0)
    y2, final2, states2, _, ends2 = run(split, length, final1)
    assert_close(torch.cat([y1, y2]).cpu(), y.cpu(), torch.float32)
    assert_close(final2.cpu(), final.cpu(), torch.float32)
    assert ends.tolist() == [16, 32, 45]
    resumed = dict(zip(torch.cat([ends1, ends2]).tolist(), torch.cat([states1, states2])))
    for k, end in enumerate(ends.tolist()):
        assert_close(resumed[end].cpu(), states[k].cpu(), torch.float32)
        prefix_final = mamba_ref.mamba_chunk_scan(
            *inp.rows(0, end).args(), cu_seqlens([end], DEVICE), h0, int32([0], DEVICE), page
        )[1]
        assert_close(states[k].cpu(), prefix_final[0].cpu(), torch.float32)


def _run_decode_steps(impl: str, dtype: torch.dtype, state_dtype: torch.dtype, device: str) -> None:
    H, G, P, N, steps, slots = 4, 2, 16, 16, 6, [3, 0]
    inp = make_inputs(2 * steps, H, G, P, N, dtype, device, seed=7)
    init = torch.randn(2, H, P, N, generator=torch.Generator().manual_seed(8))
    init = init.to(state_dtype).to(device)
    y_scan, final = mamba_ref.mamba_chunk_scan(
        *inp.args(), cu_seqlens([steps, steps], device), init, int32([0, 0], device), 16
    )[:2]

    ssm_state = torch.full((5, H, P, N), float("nan"), dtype=state_dtype, device=device)
    ssm_state[slots] = init
    idx = int32(slots, device)
    for t in range(steps):
        rows = [t, steps + t]  # token t of each sequence
        y = IMPLS[impl].selective_state_update(
            ssm_state, inp.x[rows], inp.dt[rows], inp.dt_bias, inp.A, inp.B[rows], inp.C[rows],
            inp.D, idx,
        )
        assert_close(y.cpu(), y_scan[rows].cpu(), dtype)
    assert_close(ssm_state[slots].cpu(), final.cpu(), state_dtype)
    untouched = [s for s in range(5) if s not in slots]
    assert ssm_state[untouched].isnan().all()


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize(
    "dtype,state_dtype",
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float32),
        (torch.float16, torch.float16),
    ],
    ids=["fp32", "fp16-fp32state", "fp16"],
)
def test_decode_steps_match_prefill(
    impl: str, dtype: torch.dtype, state_dtype: torch.dtype
) -> None:
    _run_decode_steps(impl, dtype, state_dtype, DEVICE)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("case", SCAN_CASES, ids=_scan_case_id)
def test_mamba_chunk_scan_bf16_gpu(case: tuple) -> None:
    _run_scan(case, "cuda", torch.bfloat16)


@pytest.mark.gpu
@requires_cuda
def test_decode_steps_match_prefill_bf16_gpu() -> None:
    _run_decode_steps("triton", torch.bfloat16, torch.float32, "cuda")
