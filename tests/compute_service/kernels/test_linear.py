"""`kernels.linear` / `linear_group` on CPU (each packed-weight backend) against F.linear, and the
`cpu_gemm` kernel itself."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compute_service import kernels
from compute_service.kernels import cpu_gemm, cpu_native, linear_cpu

from .helpers import requires_c_kernels

ROWS = [1, 8, 33, 300]


@pytest.fixture(params=[pytest.param("native", marks=requires_c_kernels), "onednn"])
def gemm_backend(request, monkeypatch) -> str:
    """The test runs once per packed backend (the process default is `native`)."""
    monkeypatch.setattr(linear_cpu, "_chosen", [request.param])
    return request.param


def _weights(outs: list[int], d_in: int, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ws = [torch.randn(o, d_in, generator=gen) for o in outs]
    bs = [torch.randn(o, generator=gen) if bias else None for o in outs]
    return ws, bs


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_linear_matches_f_linear(rows: int, bias: bool, gemm_backend: str) -> None:
    (w,), (b,) = _weights([96], 64, bias)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(kernels.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("biases", ["none", "all", "some"])
def test_linear_group_is_each_projection(rows: int, biases: str, gemm_backend: str) -> None:
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


def test_a_weight_changed_in_place_or_replaced_is_packed_again(gemm_backend: str) -> None:
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


def test_inference_tensors_and_other_dtypes(gemm_backend: str) -> None:
    """Weights made under inference_mode (no version counter) are served; fp16/bf16 fall back to
    F.linear and give exactly its values."""
    with torch.inference_mode():
        w, x = torch.randn(16, 32), torch.randn(3, 32)
        torch.testing.assert_close(kernels.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    for dtype in (torch.float16, torch.bfloat16):
        w, x = torch.randn(16, 32).to(dtype), torch.randn(3, 32).to(dtype)
        assert torch.equal(kernels.linear(x, w), F.linear(x, w))


def test_the_packed_path_is_taken(gemm_backend: str) -> None:
    """Each fast path is really taken (a build without oneDNN would silently be slower; without a
    compiler the native case is skipped, saying so)."""
    assert linear_cpu._ONEDNN
    w = torch.randn(8, 8)
    kernels.linear(torch.randn(2, 8), w)
    assert w._cpu_packed[0][0] == gemm_backend


@requires_c_kernels
def test_switching_backend_repacks(monkeypatch) -> None:
    w, x = torch.randn(40, 24), torch.randn(5, 24)
    for name in ("native", "onednn", "native"):
        monkeypatch.setattr(linear_cpu, "_chosen", [name])
        torch.testing.assert_close(kernels.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
        assert w._cpu_packed[0][0] == name


@requires_c_kernels
def test_backend_follows_the_c_kernels(monkeypatch) -> None:
    """native where the C kernels build (here), oneDNN where they are off."""
    monkeypatch.setattr(linear_cpu, "_chosen", [])
    assert linear_cpu.backend() == "native"
    monkeypatch.setattr(linear_cpu, "_chosen", [])
    monkeypatch.setattr(cpu_native.KERNELS, "_state", {"lib": None})
    assert linear_cpu.backend() == "onednn"


# ---- the cpu_gemm kernel on its own: every row-tile size, ragged column blocks, threads -------

@requires_c_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8, 9, 16, 17, 70])
@pytest.mark.parametrize("n, k", [(32, 16), (33, 7), (100, 64), (5, 130)])
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_gemm_matches_f_linear(rows: int, n: int, k: int, threads: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n * 10 + k)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for bias in (None, b):
            packed, pbias = cpu_gemm.pack(w, bias)
            assert packed.shape == (-(-n // cpu_gemm.BLOCK), k, cpu_gemm.BLOCK)
            y = cpu_gemm.gemm(x, packed, pbias, n)
            torch.testing.assert_close(y, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)


@requires_c_kernels
def test_cpu_gemm_reads_strided_rows_and_rejects_a_wrong_shape() -> None:
    w = torch.randn(48, 16)
    packed, _ = cpu_gemm.pack(w, None)
    x = torch.randn(16, 6).t()  # [6, 16], not contiguous
    torch.testing.assert_close(cpu_gemm.gemm(x, packed, None, 48), F.linear(x, w),
                               rtol=1e-5, atol=1e-5)
    assert cpu_gemm.gemm(torch.empty(0, 16), packed, None, 48).shape == (0, 48)
    with pytest.raises(ValueError, match="packed weight"):
        cpu_gemm.gemm(torch.randn(2, 15), packed, None, 48)


@requires_c_kernels
def test_kernels_build_into_a_fresh_cache_and_report_a_missing_compiler(tmp_path, monkeypatch,
                                                                      caplog) -> None:
    """A cold cache builds (and a second build reuses the file); without a compiler the built
    copy serves, and with none built `auto` falls back and says why, `on` fails, `off` never
    builds."""
    kernels = cpu_native.KERNELS  # its settings and loaded library restored after the test
    monkeypatch.setattr(kernels, "_state", dict(kernels._state))
    for name in ("mode", "cache_dir"):
        monkeypatch.setattr(kernels, name, getattr(kernels, name))
    cpu_native.configure("auto", tmp_path / "k")
    built = cpu_native.build()
    assert built.exists() and built.parent == tmp_path / "k"
    assert cpu_native.build() == built
    assert [p.name for p in (tmp_path / "k").iterdir()] == [built.name]  # no temporaries left
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert cpu_native.build() == built
    cpu_native.configure("auto", tmp_path / "empty")
    with pytest.raises(RuntimeError, match="no C compiler"):
        cpu_native.build()
    assert cpu_native.library() is None and "no C compiler" in caplog.text
    cpu_native.configure("on", tmp_path / "empty")
    with pytest.raises(RuntimeError, match=r"--cpu-native on \(PREFIXCACHE_CPU_NATIVE\)"):
        cpu_native.library()
    cpu_native.configure("off", tmp_path / "empty")
    monkeypatch.delenv("CC")
    assert cpu_native.library() is None


def test_joined_weights_take_one_gemm_with_the_same_outputs() -> None:
    """`linear_torch`: weights laid end to end in one buffer (CausalLM.join_projections) give
    what one F.linear per weight gives; anything else is not taken for joined."""
    from compute_service.kernels import linear_torch

    gen = torch.Generator().manual_seed(2)
    buf = torch.randn(96 + 32 + 32, 64, generator=gen).to(torch.bfloat16)
    q, k, v = buf[:96], buf[96:128], buf[128:]
    x = torch.randn(7, 64, generator=gen).to(torch.bfloat16)
    assert linear_torch.joined_rows([q, k, v]).data_ptr() == buf.data_ptr()
    got = linear_torch.linear_group(x, [q, k, v], [None] * 3)
    for y, w in zip(got, (q, k, v), strict=True):
        torch.testing.assert_close(y, F.linear(x, w), rtol=1e-2, atol=1e-2)
    assert kernels.choose("linear_group", x) == "torch"
    assert linear_torch.joined_rows([q, v]) is None  # a gap
    assert linear_torch.joined_rows([k, q]) is None  # out of order
    assert linear_torch.joined_rows([q, buf[96:128].clone()]) is None  # another buffer
    assert linear_torch.joined_rows([q]) is None
    # With biases the weights are projected one by one (exact F.linear).
    b = [torch.ones(96, dtype=torch.bfloat16), None, None]
    assert torch.equal(linear_torch.linear_group(x, [q, k, v], b)[0], F.linear(x, q, b[0]))


def test_join_projections_keeps_the_models_outputs() -> None:
    """q/k/v and gate/up become views of one buffer each (the GPU layout), with the same weights
    and the same logits (bf16 on CPU: the `linear_torch` path)."""
    from compute_service.model import build_preset
    from tests.compute_service.paged_driver import PagedDriver

    model = build_preset("tiny-transformer", seed=3).cast(torch.bfloat16)
    prompt = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(4)).tolist()

    def logits() -> torch.Tensor:
        driver = PagedDriver(model, page_size=16)
        return driver.forward([driver.new_sequence()], [prompt], all_logits=True).logits

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    want = logits()
    model.join_projections()
    attn = model.layers[0].attn
    q, k = attn.q_proj.weight, attn.k_proj.weight
    assert k.data_ptr() == q.data_ptr() + q.numel() * q.element_size()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    torch.testing.assert_close(logits(), want, rtol=2e-2, atol=2e-2)
