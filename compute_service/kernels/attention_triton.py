"""Triton paged attention: split-KV decode and causal varlen extend over a paged prefix.

Same signatures and semantics as `attention_ref` (the decode kernel also takes `num_splits`).
Both kernels look a token's page up in the block table per token, so any page size works with
any tile size, and every K/V load is masked to the positions the program is entitled to: the
sequence's length and, with a sliding window, the window. Pages outside that range, which may
already be recycled (design.md lesson 2), are never read.

Softmax runs in base 2 (scores pre-multiplied by sm_scale * log2(e)) with fp32 accumulators.

Backend `triton` of `dispatch.TABLE` (decode and extend; `write_kv` has none). Tested against
`attention_ref`: fp32 (relative 1e-4) and fp16 (4e-3) interpreted on CPU, bf16 (2e-2) compiled on
a GPU; tolerances in tests/compute_service/kernels/helpers.py.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

__all__ = ["EXTEND_CONFIGS", "extend_attention", "extend_config", "paged_decode_attention"]

_LOG2E = 1.4426950408889634


@triton.jit
def _load_kv_tile(cache_ptr, page, slot, kvh, stride_p, stride_s, stride_h, offs_d, kv_mask):
    """The [BLOCK_N, BLOCK_D] K or V tile of the positions at (page, slot) for kv head kvh,
    zero where kv_mask is off (such slots are never read)."""
    return tl.load(
        cache_ptr + page.to(tl.int64)[:, None] * stride_p + slot[:, None] * stride_s
        + kvh * stride_h + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    part_out_ptr, part_lse_ptr,
    scale_log2, window,
    stride_qb, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_bt,
    GROUP: tl.constexpr, HQ: tl.constexpr, PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One (sequence, kv head, split): the GROUP query heads sharing that kv head over one
    contiguous range of the attended positions. Writes the normalised partial output and its
    base-2 log-sum-exp (-inf for an empty split) to part_out [B, HQ, S, D] / part_lse [B, HQ, S].
    """
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + b)
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    split_len = tl.cdiv(seq_len - lo, NUM_SPLITS)
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_h
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        p_mask = pos < end
        page = tl.load(block_tables_ptr + b * stride_bt + pos // PAGE_SIZE, mask=p_mask, other=0)
        slot = pos % PAGE_SIZE
        kv_mask = p_mask[:, None] & d_mask[None, :]
        k = _load_kv_tile(k_cache_ptr, page, slot, kvh, stride_kp, stride_ks, stride_kh, offs_d,
                          kv_mask)
        v = _load_kv_tile(v_cache_ptr, page, slot, kvh, stride_vp, stride_vs, stride_vh, offs_d,
                          kv_mask)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        s = tl.where(p_mask[None, :], s, float("-inf"))
        # Every tile holds at least one valid position, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    nonempty = l_i > 0
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    row = (b * HQ + heads) * NUM_SPLITS + split
    tl.store(part_lse_ptr + row, lse, mask=h_mask)
    tl.store(
        part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
        out,
        mask=h_mask[:, None] & d_mask[None, :],
    )


@triton.jit
def _decode_merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_ob, stride_oh,
    HQ: tl.constexpr, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Combine the splits of one (sequence, query head) by their log-sum-exp weights.
    Split 0 is never empty (seq_len >= 1), so the maximum lse is finite."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    row = (b * HQ + h) * NUM_SPLITS + offs_s
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, 0))
    weights = weights / tl.sum(weights, 0)
    parts = tl.load(
        part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )
    out = tl.sum(weights[:, None] * parts, 0)
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def _default_num_splits(q: torch.Tensor, num_kv_heads: int) -> int:
    """Enough (sequence, kv head, split) programs to fill the GPU about twice over."""
    if not q.is_cuda:
        return 2
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    return max(1, min(16, triton.cdiv(2 * sms, q.shape[0] * num_kv_heads)))


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k_cache.shape[2]})"
        )
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache must be contiguous in the head dimension")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    window: int = 0,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """See `attention_ref.paged_decode_attention`; `num_splits` KV ranges per (seq, kv head)
    are computed in parallel and merged. No host synchronisation (graph-capturable)."""
    _check_cache(q, k_cache, v_cache)
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    splits = num_splits or _default_num_splits(q, num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)

    part_out = torch.empty(
        num_seqs, num_q_heads, splits, head_dim, dtype=torch.float32, device=q.device
    )
    part_lse = torch.empty(num_seqs, num_q_heads, splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(num_seqs, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, seq_lens,
        part_out, part_lse,
        sm_scale * _LOG2E, window,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, HQ=num_q_heads, PAGE_SIZE=k_cache.shape[1],
        NUM_SPLITS=splits, HEAD_DIM=head_dim,
        # tl.dot needs at least 16 rows: the GQA group is padded up with masked heads.
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=64 if block_d <= 64 else 32,
        BLOCK_D=block_d,
    )
    out = torch.empty_like(q)
    _decode_merge_kernel[(num_seqs, num_q_heads)](
        part_out, part_lse, out,
        out.stride(0), out.stride(1),
        HQ=num_q_heads, NUM_SPLITS=splits, HEAD_DIM=head_dim,
        BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d,
    )
    return out


@triton.jit
def _extend_tile(
    q, m_i, l_i, acc, n0, hi, q_pos,
    k_cache_ptr, v_cache_ptr, bt_row_ptr, kvh, scale_log2, window,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    offs_d, d_mask,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
):
    """One K/V tile of the online softmax. MASKED=False is the off-diagonal case: every key of
    the tile is visible to every query row of the block (causal, no window, below `hi`), so
    the loads and the scores take no masks."""
    pos = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        p_mask = pos < hi
        page = tl.load(bt_row_ptr + pos // PAGE_SIZE, mask=p_mask, other=0)
    else:
        page = tl.load(bt_row_ptr + pos // PAGE_SIZE)
    slot = pos % PAGE_SIZE
    k_ptrs = (k_cache_ptr + page.to(tl.int64)[:, None] * stride_kp + slot[:, None] * stride_ks
              + kvh * stride_kh + offs_d[None, :])
    v_ptrs = (v_cache_ptr + page.to(tl.int64)[:, None] * stride_vp + slot[:, None] * stride_vs
              + kvh * stride_vh + offs_d[None, :])
    if MASKED:
        kv_mask = p_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    elif EVEN_D:  # no mask at all: 16-byte vector loads along the head dimension
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=d_mask[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
    s = tl.dot(q, tl.trans(k)) * scale_log2
    if MASKED:
        allowed = p_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        allowed = tl.where(window > 0, allowed & (pos[None, :] > q_pos[:, None] - window), allowed)
        s = tl.where(allowed, s, float("-inf"))
        # A row may have no allowed key in this tile (window start, padding rows): keep its
        # running max finite so exp2 never sees -inf - -inf.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = m_new
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, cu_seqlens_ptr, prefix_lens_ptr,
    scale_log2, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_bt,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One (query block, sequence, query head): flash attention over the key positions any of
    the block's queries may see, [lo, hi), loaded straight from the paged cache. The key range
    is walked in two parts: the tiles every query of the block sees whole (no masks), then
    the tiles on the diagonal (or the whole range under a sliding window), masked.

    Query blocks are taken last first: under causal attention the last blocks have the most
    keys, and starting them first evens out the tail of the grid."""
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)

    q_start = tl.load(cu_seqlens_ptr + b)
    q_len = tl.load(cu_seqlens_ptr + b + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    prefix = tl.load(prefix_lens_ptr + b)
    kvh = h // GROUP

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    r_mask = rows < q_len
    q_pos = prefix + rows
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + rows).to(tl.int64)[:, None] * stride_qt + h * stride_qh
        + offs_d[None, :],
        mask=r_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    # Causal: nothing past the block's last query. Window: nothing before the first query's
    # window, so out-of-window (possibly recycled) pages are excluded from the loads.
    hi = prefix + tl.minimum((m_block + 1) * BLOCK_M, q_len)
    first_q = prefix + m_block * BLOCK_M
    # Unmasked tiles: every key <= the block's first query position (and no window).
    mid = tl.where(window > 0, 0, (first_q + 1) // BLOCK_N * BLOCK_N)
    lo = tl.where(window > 0, tl.maximum(first_q - window + 1, 0), mid)
    bt_row_ptr = block_tables_ptr + b * stride_bt

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, mid, BLOCK_N):
        m_i, l_i, acc = _extend_tile(
            q, m_i, l_i, acc, n0, hi, q_pos,
            k_cache_ptr, v_cache_ptr, bt_row_ptr, kvh, scale_log2, window,
            stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            offs_d, d_mask,
            PAGE_SIZE, BLOCK_N, False, HEAD_DIM == BLOCK_D,
        )
    for n0 in range(lo, hi, BLOCK_N):
        m_i, l_i, acc = _extend_tile(
            q, m_i, l_i, acc, n0, hi, q_pos,
            k_cache_ptr, v_cache_ptr, bt_row_ptr, kvh, scale_log2, window,
            stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            offs_d, d_mask,
            PAGE_SIZE, BLOCK_N, True, HEAD_DIM == BLOCK_D,
        )

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + (q_start + rows).to(tl.int64)[:, None] * stride_ot + h * stride_oh
        + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=r_mask[:, None] & d_mask[None, :],
    )


# Launch configurations of the extend kernel: (BLOCK_M, BLOCK_N, num_warps, num_stages), keyed
# by (padded head_dim, compute capability). H100/H200 (9.0) and A100 (8.0), with 160-228 KB of
# shared memory per block, take large tiles so each program's dots fill the tensor cores; any
# other GPU (e.g. 8.6/8.9/12.0 with ~100 KB) the small fallback; the interpreter (CPU, tests)
# keeps the small tiles it was tested with. `prefixcache_bench.gpu_check` sweeps candidates
# around these on the device and names the best: for d 128, 64-row tiles beat the 128-row tiles
# (128, 64, 8, 3) by 1.14x and 1.24x in the first two H100 runs, and a fourth pipeline stage,
# (64, 64, 4, 4), was first in each of the three sweeps that had it: 1.05x (64, 64, 4, 3) on an
# H100, 1.13x and 1.12x on an H200 (docs/results/gpu/NOTES.md, runs 4-6).
EXTEND_CONFIGS: dict[tuple[int, tuple[int, int]], tuple[int, int, int, int]] = {
    (64, (9, 0)): (128, 64, 4, 3),
    (128, (9, 0)): (64, 64, 4, 4),
    (256, (9, 0)): (64, 32, 4, 2),
    (64, (8, 0)): (128, 64, 4, 3),
    (128, (8, 0)): (128, 64, 8, 2),
    (256, (8, 0)): (64, 32, 4, 2),
}
_EXTEND_FALLBACK_CUDA = (64, 32, 4, 2)


def extend_config(q: torch.Tensor, head_dim: int, max_q_len: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for this device, head size and longest query."""
    block_d = triton.next_power_of_2(head_dim)
    if not q.is_cuda:
        # Interpreter: the tile sizes the kernel tests were written against.
        return (64 if block_d <= 64 else 32, 32, 4, 1)
    cap = tuple(torch.cuda.get_device_capability(q.device))
    block_m, block_n, warps, stages = EXTEND_CONFIGS.get((block_d, cap), _EXTEND_FALLBACK_CUDA)
    # Short queries (chunked prefill tails, small extends): no 128-row tile of padding.
    while block_m > 16 and block_m // 2 >= max_q_len:
        block_m //= 2
    if block_m <= 64:
        warps = min(warps, 4)
    return block_m, block_n, warps, stages


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    prefix_lens: torch.Tensor,
    sm_scale: float,
    window: int = 0,
    max_q_len: int | None = None,
    *,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """See `attention_ref.extend_attention`. The grid is sized by the longest query length:
    `max_q_len` when the caller passes it, else read from `cu_seqlens_q` (a device
    synchronisation: once per layer, the host then waits for the GPU before it can queue the
    next layer's kernels). `config` (BLOCK_M, BLOCK_N, num_warps, num_stages) overrides the
    table (`extend_config`), for sweeps."""
    _check_cache(q, k_cache, v_cache)
    total, num_q_heads, head_dim = q.shape
    num_seqs = prefix_lens.shape[0]
    out = torch.empty_like(q)
    if total == 0:
        return out
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())
    block_d = triton.next_power_of_2(head_dim)
    block_m, block_n, num_warps, num_stages = config or extend_config(q, head_dim, max_q_len)
    grid = (math.ceil(max_q_len / block_m), num_seqs, num_q_heads)
    _extend_kernel[grid](
        q, k_cache, v_cache, out,
        block_tables, cu_seqlens_q, prefix_lens,
        sm_scale * _LOG2E, window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=num_q_heads // k_cache.shape[2], PAGE_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
