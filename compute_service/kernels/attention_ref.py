"""Plain PyTorch reference for paged attention: KV write, decode and extend (prefill).

These functions define the semantics that the Triton kernels in `attention_triton` must match,
and they are the path that serves on a machine without a GPU. They loop over sequences and
gather exactly the cache slots a sequence owns, so pages that a block table does not reference
(or that lie wholly outside a sliding window) are never read.

Cache layout of one attention layer:
    k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim]
    slot of position p of a sequence = block_tables[b, p // page_size] * page_size + p % page_size

Backends (`dispatch.TABLE`), each tested against this reference at the dtype's tolerance
(tests/compute_service/kernels/helpers.py: relative 1e-4 for fp32 interpreted on CPU, 5e-3
compiled on a GPU (TF32 dots), 4e-3 for fp16, 2e-2 for bf16, scaled by the output's magnitude):
- `attention_torch`: vectorised, the torch path (CPU tensors; `write_kv` on every device, whose
  slots are checked exactly): fp32, fp16 and bf16.
- `attention_triton`: decode and extend (CUDA by default): fp32 and fp16 interpreted on CPU, bf16
  compiled on a GPU.
- `attention_cpu`: the C decode kernel for fp32 CPU tensors: fp32.
The reference itself is checked against dense per-sequence softmax attention at the same
tolerances, and its decode equals its one-token extend exactly.
"""
from __future__ import annotations

import torch


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store the K/V of T new tokens into their cache slots, in place.

    k, v: [T, Hkv, D]; k_cache, v_cache: [num_pages, page_size, Hkv, D];
    slot_mapping: [T] int64, a flat slot (page * page_size + offset) per token, all valid.
    """
    page_size = k_cache.shape[1]
    slots = slot_mapping.long()
    # Index by (page, offset) rather than a flattened view so any cache strides work and a
    # non-contiguous cache can never silently receive the write in a temporary copy.
    pages, offsets = slots // page_size, slots % page_size
    k_cache[pages, offsets] = k.to(k_cache.dtype)
    v_cache[pages, offsets] = v.to(v_cache.dtype)


def _gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Rows of `cache` [num_pages, page_size, Hkv, D] at one sequence's `positions`: [L, Hkv, D]."""
    page_size = cache.shape[1]
    pages = block_table.long()[positions // page_size]
    return cache[pages, positions % page_size]


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """Masked softmax attention in fp32 with GQA.

    q: [Lq, Hq, D]; k, v: [Lk, Hkv, D]; allowed: [Lq, Lk] bool, every row has a True.
    Returns [Lq, Hq, D] in q's dtype.
    """
    group = q.shape[1] // k.shape[1]
    # Query head h reads kv head h // group: repeat each kv head `group` times, in order.
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * sm_scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vf).to(q.dtype)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    window: int = 0,
) -> torch.Tensor:
    """One query token per sequence attending to its paged KV cache.

    q: [B, Hq, D]; block_tables: [B, M] int32; seq_lens: [B] int32 >= 1, the number of cached
    tokens including the current one (its K/V are already written). Hq % Hkv == 0.
    window = 0: full attention; window = W > 0: only the last W positions
    (p > seq_len - 1 - W). Returns [B, Hq, D] in q's dtype.
    """
    out = torch.empty_like(q)
    for b, seq_len in enumerate(seq_lens.tolist()):
        lo = max(0, seq_len - window) if window > 0 else 0
        positions = torch.arange(lo, seq_len, device=q.device)
        k = _gather_kv(k_cache, block_tables[b], positions)
        v = _gather_kv(v_cache, block_tables[b], positions)
        allowed = torch.ones(1, positions.numel(), dtype=torch.bool, device=q.device)
        out[b] = _attend(q[b : b + 1], k, v, allowed, sm_scale)[0]
    return out


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
) -> torch.Tensor:
    """Causal attention of a varlen batch of new tokens over cached prefix + themselves.

    q: [T, Hq, D], sequence b's queries are rows cu_seqlens_q[b] : cu_seqlens_q[b + 1];
    block_tables: [B, M] int32; cu_seqlens_q: [B + 1] int32; prefix_lens: [B] int32.
    The new tokens' K/V are already in the cache at positions prefix_lens[b] + j. Query j of
    sequence b sits at position P = prefix_lens[b] + j and attends to key positions p <= P,
    and with window W > 0 only to p > P - W. Returns [T, Hq, D] in q's dtype.
    `max_q_len`, the longest sequence's new tokens when the caller knows it on the host, spares
    a kernel that sizes its grid by it a device synchronisation (the references ignore it).
    """
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    for b, prefix in enumerate(prefix_lens.tolist()):
        q_start, q_end = starts[b], starts[b + 1]
        if q_end == q_start:
            continue
        total = prefix + q_end - q_start
        # Only keys inside some query's window are gathered: earlier pages may already have
        # been recycled, so they must not be read at all, not merely masked.
        lo = max(0, prefix - window + 1) if window > 0 else 0
        key_pos = torch.arange(lo, total, device=q.device)
        query_pos = torch.arange(prefix, total, device=q.device)
        allowed = key_pos[None, :] <= query_pos[:, None]
        if window > 0:
            allowed &= key_pos[None, :] > query_pos[:, None] - window
        k = _gather_kv(k_cache, block_tables[b], key_pos)
        v = _gather_kv(v_cache, block_tables[b], key_pos)
        out[q_start:q_end] = _attend(q[q_start:q_end], k, v, allowed, sm_scale)
    return out
