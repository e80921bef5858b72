"""kernels (once per run, CUDA only): the Triton paged decode attention in GB/s (fraction of HBM
peak) and extend attention in TFLOP/s (fraction of the bf16 dense peak), each beside torch SDPA
on contiguous tensors of the same shapes. Without CUDA those are null with a reason."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from prefixcache_bench.compute.engine_runs import rounded
from prefixcache_bench.compute.params import DEVICE_PEAKS, Params
from prefixcache_bench.harness import log


@dataclass(slots=True)
class KernelShapes:
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    decode_batch: int
    decode_seq_len: int
    extend_batch: int
    extend_tokens: int
    iters: int

    @classmethod
    def of(cls, p: Params) -> KernelShapes:
        hq, hkv, d = p.kernel_heads
        return cls(hq, hkv, d, p.page_size, p.decode_kernel_batch, p.decode_kernel_seq_len,
                   p.extend_kernel_batch, p.extend_kernel_tokens, p.kernel_iters)


def time_fn(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Median seconds per call after two warm-up calls (which also compile Triton kernels);
    CUDA events on a GPU, the wall clock elsewhere (the CPU path is for tests only)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def paged_cache(batch: int, seq_len: int, s: KernelShapes, dtype: torch.dtype,
                device: torch.device, gen: torch.Generator):
    """K/V pages for `batch` sequences of `seq_len` tokens, in a shuffled page order (a serving
    cache is fragmented), plus the same K/V as contiguous [B, Hkv, L, D] tensors for SDPA.
    Everything is made on `device` (`gen` lives there too): GPU-sized tensors, no host trip."""
    per_seq = -(-seq_len // s.page_size)
    pages = batch * per_seq
    shape = (pages, s.page_size, s.kv_heads, s.head_dim)
    k = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    order = torch.randperm(pages, generator=gen, device=device)
    k_cache, v_cache = torch.empty_like(k), torch.empty_like(v)
    k_cache[order], v_cache[order] = k, v
    block_tables = order.view(batch, per_seq).to(torch.int32)

    def dense(pages_kv: torch.Tensor) -> torch.Tensor:
        per_token = pages_kv.view(batch, -1, s.kv_heads, s.head_dim)[:, :seq_len]
        return per_token.transpose(1, 2).contiguous()

    return k_cache, v_cache, block_tables, dense(k), dense(v)


def measure_decode_attention(s: KernelShapes, dtype: torch.dtype, device: torch.device,
                             gen: torch.Generator) -> dict:
    """GB/s of K/V read by one decode step: the paged Triton kernel vs SDPA (contiguous, GQA)."""
    from compute_service import kernels

    b, L = s.decode_batch, s.decode_seq_len
    k_cache, v_cache, tables, k, v = paged_cache(b, L, s, dtype, device, gen)
    q = torch.randn(b, s.q_heads, s.head_dim, generator=gen, device=device, dtype=dtype)
    seq_lens = torch.full((b,), L, dtype=torch.int32, device=device)
    scale = s.head_dim ** -0.5
    q4 = q[:, :, None, :]
    run_ours = lambda: kernels.paged_decode_attention(  # noqa: E731
        q, k_cache, v_cache, tables, seq_lens, scale, use_triton=True)
    run_sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q4, k, v, scale=scale, enable_gqa=True)
    # A fast wrong kernel is no result: both must compute the same attention.
    err = (run_ours().float() - run_sdpa()[:, :, 0].float()).abs().max().item()
    ours, sdpa = time_fn(run_ours, s.iters, device), time_fn(run_sdpa, s.iters, device)
    nbytes = 2 * b * L * s.kv_heads * s.head_dim * k.element_size()
    return {"decode_attn_s": ours, "sdpa_decode_s": sdpa, "decode_attn_max_abs_err": err,
            "decode_attn_gb_s": nbytes / ours / 1e9, "sdpa_decode_gb_s": nbytes / sdpa / 1e9}


def measure_extend_attention(s: KernelShapes, dtype: torch.dtype, device: torch.device,
                             gen: torch.Generator) -> dict:
    """TFLOP/s of causal prefill attention (no cached prefix, so that SDPA's causal mask is the
    same one): the varlen paged Triton kernel vs SDPA. FLOPs count only unmasked work."""
    from compute_service import kernels

    b, L = s.extend_batch, s.extend_tokens
    k_cache, v_cache, tables, k, v = paged_cache(b, L, s, dtype, device, gen)
    q = torch.randn(b * L, s.q_heads, s.head_dim, generator=gen, device=device, dtype=dtype)
    cu = torch.arange(0, b * L + 1, L, dtype=torch.int32, device=device)
    prefix = torch.zeros(b, dtype=torch.int32, device=device)
    scale = s.head_dim ** -0.5
    q4 = q.view(b, L, s.q_heads, s.head_dim).transpose(1, 2).contiguous()
    run_ours = lambda: kernels.extend_attention(  # noqa: E731
        q, k_cache, v_cache, tables, cu, prefix, scale, use_triton=True)
    run_sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q4, k, v, is_causal=True, scale=scale, enable_gqa=True)
    want = run_sdpa().transpose(1, 2).reshape(b * L, s.q_heads, s.head_dim)
    err = (run_ours().float() - want.float()).abs().max().item()
    ours, sdpa = time_fn(run_ours, s.iters, device), time_fn(run_sdpa, s.iters, device)
    flops = 4 * b * s.q_heads * s.head_dim * (L * (L + 1) // 2)  # QK^T and PV, causal pairs
    return {"extend_attn_s": ours, "sdpa_extend_s": sdpa, "extend_attn_max_abs_err": err,
            "extend_attn_tflop_s": flops / ours / 1e12, "sdpa_extend_tflop_s": flops / sdpa / 1e12}


def device_peaks(name: str, p: Params) -> tuple[float | None, float | None]:
    hbm, bf16 = next(((h, f) for key, h, f in DEVICE_PEAKS if key in name), (None, None))
    return p.hbm_peak_gb_s or hbm, p.bf16_peak_tflop_s or bf16


def bench_kernels(p: Params) -> dict:
    keys = ("decode_attn_gb_s", "sdpa_decode_gb_s", "decode_attn_hbm_frac", "sdpa_decode_hbm_frac",
            "extend_attn_tflop_s", "sdpa_extend_tflop_s", "extend_attn_bf16_frac",
            "sdpa_extend_bf16_frac")
    out: dict = dict.fromkeys(keys)
    if not torch.cuda.is_available():
        out["kernels_skipped_reason"] = "no CUDA device: the Triton kernels only run on a GPU"
        return out
    try:
        import triton  # noqa: F401
    except ImportError:
        out["kernels_skipped_reason"] = "triton is not installed"
        return out
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    s, dtype = KernelShapes.of(p), getattr(torch, p.kernel_dtype)
    gen = torch.Generator(device=device).manual_seed(p.seed)
    log(f"  kernels on {name}: decode {s.decode_batch}x{s.decode_seq_len}, "
        f"extend {s.extend_batch}x{s.extend_tokens}, heads {p.kernel_heads}, {p.kernel_dtype}")
    raw = measure_decode_attention(s, dtype, device, gen)
    torch.cuda.empty_cache()
    raw |= measure_extend_attention(s, dtype, device, gen)
    torch.cuda.empty_cache()
    hbm, bf16 = device_peaks(name, p)
    out |= {k: v if k.endswith("_err") else rounded(v, 6) for k, v in raw.items()}
    out["device_name"], out["hbm_peak_gb_s"], out["bf16_peak_tflop_s"] = name, hbm, bf16
    if hbm:
        out["decode_attn_hbm_frac"] = rounded(raw["decode_attn_gb_s"] / hbm)
        out["sdpa_decode_hbm_frac"] = rounded(raw["sdpa_decode_gb_s"] / hbm)
    if bf16:
        out["extend_attn_bf16_frac"] = rounded(raw["extend_attn_tflop_s"] / bf16)
        out["sdpa_extend_bf16_frac"] = rounded(raw["sdpa_extend_tflop_s"] / bf16)
    if not (hbm and bf16):
        out["kernels_note"] = (f"no peak figures known for {name!r}: pass --hbm-peak-gb-s and "
                               "--bf16-peak-tflop-s")
    return out

