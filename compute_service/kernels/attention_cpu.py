"""Paged decode attention on CPU: the C kernel of `csrc/decode_attention.c` (built by
`cpu_native`) for fp32, the vectorised PyTorch path (`attention_torch`) otherwise.

Why (see the C file): the PyTorch path gathers every row's K and V into a padded copy and runs
SDPA on it, so K/V cross memory three times; the kernel reads each key once, in place. At long
contexts the kernel's per-key dot products, not memory traffic, are what to speed up next. What
the C kernels are worth to a decode: docs/results/README.md (`PREFIXCACHE_CPU_NATIVE` on vs off).

Backend `cpu` of `dispatch.TABLE` for `paged_decode_attention`. Tested against `attention_ref`
in fp32 at relative 1e-4 (tests/compute_service/kernels/helpers.py).
"""
from __future__ import annotations

import torch

from compute_service.kernels import attention_torch, cpu_native

__all__ = ["native_takes", "paged_decode_attention"]

MAX_GROUP, MAX_HEAD_DIM = 16, 512  # the C kernel's fixed buffers


def native_takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the C kernel serves these tensors (fp32, on CPU, contiguous caches, shapes within
    its buffers) on this machine."""
    return (
        q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
        and not (q.is_cuda or k_cache.is_cuda)
        and k_cache.is_contiguous() and v_cache.is_contiguous()
        and q.shape[1] % k_cache.shape[2] == 0
        and q.shape[1] // k_cache.shape[2] <= MAX_GROUP and q.shape[2] <= MAX_HEAD_DIM
        and cpu_native.enabled()
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    window: int = 0,
) -> torch.Tensor:
    """See `attention_ref.paged_decode_attention`."""
    if not native_takes(q, k_cache, v_cache):
        return attention_torch.paged_decode_attention(
            q, k_cache, v_cache, block_tables, seq_lens, sm_scale, window
        )
    batch, heads, head_dim = q.shape
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    if batch:
        status = cpu_native.library().paged_decode_attention(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
            tables.shape[1], lens.data_ptr(), batch, heads, k_cache.shape[2], head_dim,
            k_cache.shape[1], sm_scale, window, out.data_ptr(), torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"paged_decode_attention: shapes outside the C kernel ({status})")
    return out
