"""RMSNorm and RoPE: the references against their definitions, the Triton kernels against the
references (fp32 and fp16 interpreted on CPU, compiled on a GPU when there is one; bf16 on a
GPU), rows and heads that are not powers of two, partial rotary, strided inputs."""
from __future__ import annotations

import pytest
import torch

from compute_service import kernels
from compute_service.kernels import norm_rope_ref, norm_rope_triton

from .helpers import DEVICE, assert_close, requires_cuda

DTYPES = [torch.float32, torch.float16]


def _rope_tables(t: int, rotary_dim: int, dtype: torch.dtype, gen: torch.Generator):
    positions = torch.randint(0, 4096, (t,), generator=gen).float()
    inv_freq = 10000.0 ** (-torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def test_references_match_their_definitions() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 10, generator=gen), torch.randn(10, generator=gen)
    want = w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(norm_rope_ref.rms_norm(x, w, 1e-5), want)
    # RoPE: each channel pair (i, i + half) turned by its angle, the rest unchanged.
    x = torch.randn(2, 3, 12, generator=gen, dtype=torch.float64)
    cos, sin = _rope_tables(2, 8, torch.float64, gen)
    out = norm_rope_ref.rope(x, cos, sin)
    for i in range(4):
        c, s = cos[:, :, i], sin[:, :, i]
        torch.testing.assert_close(out[..., i], x[..., i] * c - x[..., i + 4] * s)
        torch.testing.assert_close(out[..., i + 4], x[..., i + 4] * c + x[..., i] * s)
    torch.testing.assert_close(out[..., 8:], x[..., 8:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 96), (33, 200)])
def test_rms_norm_triton_matches_reference(rows: int, hidden: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)
    want = norm_rope_ref.rms_norm(x, w, 1e-6)
    got = norm_rope_triton.rms_norm(x, w, 1e-6)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert_close(got.cpu(), want.cpu(), dtype)


def test_rms_norm_triton_on_heads_of_a_strided_view() -> None:
    """Qwen3's q/k norms: [T, heads, head_dim] views of a wider projection output."""
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, 3 * 4 * 16, generator=gen).to(DEVICE)
    q = qkv[:, : 4 * 16].view(5, 4, 16)
    w = torch.randn(16, generator=gen).to(DEVICE)
    assert_close(norm_rope_triton.rms_norm(q, w, 1e-6).cpu(),
                 norm_rope_ref.rms_norm(q, w, 1e-6).cpu(), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,heads,head_dim,rotary_dim", [
    (1, 1, 16, 16), (9, 5, 64, 64), (4, 20, 32, 16), (3, 2, 48, 24),
])
def test_rope_triton_matches_reference(t, heads, head_dim, rotary_dim, dtype) -> None:
    gen = torch.Generator().manual_seed(t * heads)
    x = torch.randn(t, heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    cos, sin = (v.to(DEVICE) for v in _rope_tables(t, rotary_dim, dtype, gen))
    got = norm_rope_triton.rope(x, cos, sin)
    assert_close(got.cpu(), norm_rope_ref.rope(x, cos, sin).cpu(), dtype)


def test_rope_triton_on_a_strided_view_and_empty() -> None:
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(6, 3 * 2 * 32, generator=gen).to(DEVICE)
    k = qkv[:, 2 * 32: 4 * 32].view(6, 2, 32)
    cos, sin = (v.to(DEVICE) for v in _rope_tables(6, 32, torch.float32, gen))
    assert_close(norm_rope_triton.rope(k, cos, sin).cpu(),
                 norm_rope_ref.rope(k, cos, sin).cpu(), torch.float32)
    empty = norm_rope_triton.rope(k[:0], cos[:0], sin[:0])
    assert empty.shape == (0, 2, 32)


def test_errors_name_what_does_not_fit() -> None:
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="rope"):
        norm_rope_triton.rope(x, torch.ones(2, 1, 6)[..., :5], torch.ones(2, 1, 5))
    with pytest.raises(ValueError, match="weight"):
        norm_rope_triton.rms_norm(x, torch.ones(7), 1e-6)


def test_dispatch_picks_the_reference_on_cpu_and_triton_when_asked() -> None:
    x = torch.randn(3, 16)
    assert kernels.choose("rms_norm", x) == "ref"
    assert kernels.choose("rope", x) == "ref"
    w = torch.ones(16)
    assert_close(kernels.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-6, use_triton=True).cpu(),
                 kernels.rms_norm(x, w, 1e-6), torch.float32)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [576, 4096])
def test_bf16_on_a_gpu(hidden: int) -> None:
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(257, hidden, generator=gen).to(torch.bfloat16).cuda()
    w = torch.randn(hidden, generator=gen).to(torch.bfloat16).cuda()
    assert_close(norm_rope_triton.rms_norm(x, w, 1e-5).cpu(),
                 norm_rope_ref.rms_norm(x, w, 1e-5).cpu(), torch.bfloat16)
    heads = x[:, : hidden // 64 * 64].reshape(257, hidden // 64, 64)
    cos, sin = (v.cuda() for v in _rope_tables(257, 64, torch.bfloat16, gen))
    assert_close(norm_rope_triton.rope(heads, cos, sin).cpu(),
                 norm_rope_ref.rope(heads, cos, sin).cpu(), torch.bfloat16)
