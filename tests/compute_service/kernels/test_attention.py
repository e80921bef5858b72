"""Paged attention: reference vs dense attention with explicit masks, Triton vs reference.

Every KV page that a request's block table does not reference, the unused tail of each block
table, and (with a sliding window) every page wholly outside the window are poisoned with NaN:
a kernel that reads any of them produces a non-finite output.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from compute_service.kernels import attention_ref, attention_torch, attention_triton

from .helpers import DEVICE, assert_close, cu_seqlens, int32, requires_cuda

NUM_KV_HEADS = 2


@dataclass(slots=True)
class PagedBatch:
    """Caches holding `keys`/`values` (per sequence, [L, Hkv, D]) behind `block_tables`."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def make_paged_batch(
    lengths: list[int],
    page_size: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    device: str,
    first_live_pos: list[int] | None = None,
) -> PagedBatch:
    """Scatter random K/V of sequences of `lengths` tokens over shuffled pages of a NaN cache.

    Pages of sequence b wholly before first_live_pos[b] are poisoned again after the write, as
    if a sliding-window engine had recycled them.
    """
    pages_needed = [math.ceil(n / page_size) for n in lengths]
    num_pages = sum(pages_needed) + 3  # spare pages stay poisoned
    shape = (num_pages, page_size, NUM_KV_HEADS, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    order = torch.randperm(num_pages, generator=gen).tolist()
    poisoned_page = order[-1]
    width = max(pages_needed) + 1  # the unused tail of every row points at a poisoned page
    tables = torch.full((len(lengths), width), poisoned_page, dtype=torch.int32)
    keys, values = [], []
    next_page = 0
    for b, n in enumerate(lengths):
        tables[b, : pages_needed[b]] = torch.tensor(order[next_page : next_page + pages_needed[b]])
        next_page += pages_needed[b]
        k = torch.randn(n, NUM_KV_HEADS, head_dim, generator=gen).to(dtype).to(device)
        v = torch.randn(n, NUM_KV_HEADS, head_dim, generator=gen).to(dtype).to(device)
        positions = torch.arange(n)
        slots = tables[b, positions // page_size].long() * page_size + positions % page_size
        attention_ref.write_kv(k, v, k_cache, v_cache, slots.to(device))
        keys.append(k)
        values.append(v)
        if first_live_pos is not None:
            for j in range(first_live_pos[b] // page_size):
                k_cache[tables[b, j]] = float("nan")
                v_cache[tables[b, j]] = float("nan")
    return PagedBatch(k_cache, v_cache, tables.to(device), keys, values)


def dense_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_pos: list[int],
    sm_scale: float,
    window: int,
) -> torch.Tensor:
    """Float64 attention of q [Lq, Hq, D] over all positions of keys/values [L, Hkv, D], one
    head at a time, with the causal and window masks written out per (query, key)."""
    num_q_heads = q.shape[1]
    group = num_q_heads // keys.shape[1]
    mask = torch.zeros(len(query_pos), keys.shape[0], dtype=torch.bool)
    for i, qp in enumerate(query_pos):
        for p in range(keys.shape[0]):
            mask[i, p] = p <= qp and (window == 0 or p > qp - window)
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(num_q_heads):
        kh = keys[:, h // group].double().cpu()
        vh = values[:, h // group].double().cpu()
        scores = (q[:, h].double().cpu() @ kh.T) * sm_scale
        scores = scores.masked_fill(~mask, float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ vh
    return out


@pytest.mark.parametrize("impl", ["reference", "torch", "torch-strided-cache"])
def test_write_kv_stores_each_token_at_its_slot_only(impl: str) -> None:
    """Each token lands in its slot and nothing else is written, for the reference, the
    serving path, and the serving path on a cache whose page and slot dims do not merge (it
    falls back to the reference, never writing into a temporary copy)."""
    gen = torch.Generator().manual_seed(0)
    cache_shape = (6, 16, NUM_KV_HEADS, 64)
    k_cache = torch.full(cache_shape, float("nan"))
    v_cache = torch.full(cache_shape, float("nan"))
    slots = torch.tensor([17, 3, 95, 40])
    k = torch.randn(4, NUM_KV_HEADS, 64, generator=gen)
    v = torch.randn(4, NUM_KV_HEADS, 64, generator=gen)
    if impl == "reference":
        attention_ref.write_kv(k, v, k_cache, v_cache, slots)
    elif impl == "torch":
        attention_torch.write_kv(k, v, k_cache, v_cache, slots)
    else:  # the same caches seen through page-major storage of another layout
        k_base = k_cache.transpose(0, 1).contiguous()
        v_base = v_cache.transpose(0, 1).contiguous()
        k_view, v_view = k_base.transpose(0, 1), v_base.transpose(0, 1)
        attention_torch.write_kv(k, v, k_view, v_view, slots)
        k_cache, v_cache = k_view.contiguous(), v_view.contiguous()
    flat_k, flat_v = k_cache.view(-1, NUM_KV_HEADS, 64), v_cache.view(-1, NUM_KV_HEADS, 64)
    assert torch.equal(flat_k[slots], k) and torch.equal(flat_v[slots], v)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


# (gqa group, head_dim, page_size, prefix_lens, q_lens, window, dtype): every listed value of
# each axis appears at least once; prefixes cover 0, mid-page and several pages.
EXTEND_CASES = [
    (1, 64, 16, [0, 0], [5, 17], 0, torch.float32),
    (4, 64, 16, [7, 40], [9, 3], 0, torch.float16),
    (8, 128, 16, [35, 0, 16], [20, 1, 6], 0, torch.float32),
    (4, 128, 64, [70, 3], [10, 30], 0, torch.float16),
    (1, 64, 64, [130], [40], 0, torch.float32),
    (4, 64, 16, [37, 5, 0], [12, 20, 9], 8, torch.float32),
    (8, 64, 64, [150, 20], [5, 50], 24, torch.float16),
    (1, 128, 16, [48, 2], [33, 7], 5, torch.float16),
]


def _extend_case_id(case: tuple) -> str:
    group, d, ps, prefixes, q_lens, window, dtype = case
    return f"g{group}-d{d}-ps{ps}-pre{prefixes}-q{q_lens}-w{window}-{str(dtype)[6:]}"


def _run_extend(
    case: tuple, device: str, dtype: torch.dtype, config: tuple | None = None
) -> None:
    group, head_dim, page_size, prefixes, q_lens, window, _ = case
    gen = torch.Generator().manual_seed(1)
    lengths = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
    first_live = [max(0, p - window + 1) for p in prefixes] if window else None
    batch = make_paged_batch(lengths, page_size, head_dim, dtype, gen, device, first_live)
    q = torch.randn(sum(q_lens), NUM_KV_HEADS * group, head_dim, generator=gen)
    q = q.to(dtype).to(device)
    sm_scale = head_dim**-0.5
    args = (
        q, batch.k_cache, batch.v_cache, batch.block_tables,
        cu_seqlens(q_lens, device), int32(prefixes, device), sm_scale, window,
    )

    ref = attention_ref.extend_attention(*args)
    starts = cu_seqlens(q_lens).tolist()
    for b, prefix in enumerate(prefixes):
        rows = slice(starts[b], starts[b + 1])
        expected = dense_attention(
            q[rows], batch.keys[b], batch.values[b],
            list(range(prefix, lengths[b])), sm_scale, window,
        )
        assert_close(ref[rows].cpu(), expected, dtype)
    # With a config, the grid is sized by the host's max_q_len (the engine's way); without,
    # by the kernel's own read of cu_seqlens.
    max_q_len = max(q_lens) if config else None
    out = attention_triton.extend_attention(*args, max_q_len, config=config)
    assert_close(out.cpu(), ref.cpu(), dtype)


@pytest.mark.parametrize("case", EXTEND_CASES, ids=_extend_case_id)
def test_extend_attention(case: tuple) -> None:
    _run_extend(case, DEVICE, case[-1])


# The device's launch configurations (128- and 64-row query tiles, 64-key tiles, the unmasked
# off-diagonal loop) on the same cases: (BLOCK_M, BLOCK_N, num_warps, num_stages).
@pytest.mark.parametrize("config", [(128, 64, 8, 3), (64, 64, 4, 4), (16, 64, 4, 2), (64, 16, 4, 2)])
@pytest.mark.parametrize("case", EXTEND_CASES[2::3], ids=_extend_case_id)
def test_extend_attention_launch_configs(case: tuple, config: tuple) -> None:
    _run_extend(case, DEVICE, case[-1], config)


# (gqa group, head_dim, page_size, seq_lens, window, dtype, num_splits); num_splits None is the
# default heuristic, 5 splits over a 7-token window leaves some splits empty.
DECODE_CASES = [
    (1, 64, 16, [1, 17, 40], 0, torch.float32, 1),
    (4, 128, 16, [33, 5], 0, torch.float16, 3),
    (8, 64, 64, [200, 64, 65], 0, torch.float32, 4),
    (4, 64, 64, [130, 7], 16, torch.float16, 2),
    (8, 128, 16, [50, 3], 7, torch.float32, 5),
    (1, 128, 64, [129], 100, torch.float16, None),
]


def _decode_case_id(case: tuple) -> str:
    group, d, ps, seq_lens, window, dtype, splits = case
    return f"g{group}-d{d}-ps{ps}-len{seq_lens}-w{window}-{str(dtype)[6:]}-s{splits}"


def _run_decode(case: tuple, device: str, dtype: torch.dtype) -> None:
    group, head_dim, page_size, seq_lens, window, _, num_splits = case
    gen = torch.Generator().manual_seed(2)
    first_live = [max(0, n - window) for n in seq_lens] if window else None
    batch = make_paged_batch(seq_lens, page_size, head_dim, dtype, gen, device, first_live)
    q = torch.randn(len(seq_lens), NUM_KV_HEADS * group, head_dim, generator=gen)
    q = q.to(dtype).to(device)
    sm_scale = head_dim**-0.5
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, int32(seq_lens, device), sm_scale)

    ref = attention_ref.paged_decode_attention(*args, window)
    for b, n in enumerate(seq_lens):
        expected = dense_attention(
            q[b : b + 1], batch.keys[b], batch.values[b], [n - 1], sm_scale, window
        )
        assert_close(ref[b : b + 1].cpu(), expected, dtype)
    # Decode is extend with one new token after a prefix of seq_len - 1.
    as_extend = attention_ref.extend_attention(
        q, batch.k_cache, batch.v_cache, batch.block_tables,
        cu_seqlens([1] * len(seq_lens), device), int32([n - 1 for n in seq_lens], device),
        sm_scale, window,
    )
    assert torch.equal(as_extend, ref)
    out = attention_triton.paged_decode_attention(*args, window, num_splits=num_splits)
    assert_close(out.cpu(), ref.cpu(), dtype)


@pytest.mark.parametrize("case", DECODE_CASES, ids=_decode_case_id)
def test_paged_decode_attention(case: tuple) -> None:
    _run_decode(case, DEVICE, case[-2])


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("case", EXTEND_CASES[1::2], ids=_extend_case_id)
def test_extend_attention_bf16_gpu(case: tuple) -> None:
    _run_extend(case, "cuda", torch.bfloat16)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("case", DECODE_CASES[::2], ids=_decode_case_id)
def test_paged_decode_attention_bf16_gpu(case: tuple) -> None:
    _run_decode(case, "cuda", torch.bfloat16)
