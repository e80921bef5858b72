"""Vectorised PyTorch paged attention: the serving path for CPU tensors.

Same signatures and semantics as `attention_ref` (the test oracle), without its Python loop over
sequences, its repeat_interleave of K/V per query head, or its [Hq, Lq, Lk] score tensors:

- A padded batch of rows gathers the K (and V) of all its keys with ONE `index_select` over
  the cache's slots, straight from the block tables: [B, L, Hkv, D].
- Attention is `torch.nn.functional.scaled_dot_product_attention` in fp32 (the reference's
  precision); on CPU that is a flash kernel, which tiles the scores and reads K/V through their
  strides. Query head h reads kv head h // (Hq // Hkv) without K/V being repeated per head.
- Decode pads a batch to its longest context, after grouping rows by context length so that a
  short row never pays for much more than twice its own keys (`_length_groups`). The groups and
  the slots of their keys are worked out once per decode step and shared by its layers
  (`_DecodeLayouts`): per layer only the gathers and the attention itself remain.
- Extend attends a prompt in query blocks of QUERY_BLOCK tokens, each over the keys up to its
  own last query: the causal triangle is skipped at block granularity, and the largest
  score-shaped tensor is a block's [QUERY_BLOCK, keys] mask (none for a cold block, which uses
  SDPA's causal mode). Sequences with one new token (decoding sequences in a mixed batch) take
  the decode path, together.

Never-read guarantee, as in the reference: only slots holding one of the row's keys inside its
window are read (a page wholly outside the window may already be recycled, a block-table entry
past the row's pages may be stale). A padding lane, past the end of a shorter row, re-reads the
row's newest key and is masked: it must not read an unwritten slot instead, because a NaN there
would poison the output even in a masked lane (NaN + -inf and 0 * NaN are NaN).

The caches' page and slot dimensions must merge into one (true of any contiguous cache, such as
`allocate_kv_caches` makes): the gathers index the [num_pages * page_size, Hkv, D] view.

Backend `torch` of `dispatch.TABLE` (write_kv, decode, extend). Tested against `attention_ref`
in fp32, fp16 and bf16 (relative 1e-4 / 4e-3 / 2e-2, tests/compute_service/kernels/helpers.py).
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from compute_service.kernels import attention_ref
from compute_service.kernels.tensor_version import tensor_version

__all__ = ["extend_attention", "paged_decode_attention", "write_kv"]

# Query tokens per attention call of a long prompt: an n-token cold prefill does about
# (1 + QUERY_BLOCK / n) / 2 of the full square's work in ceil(n / QUERY_BLOCK) calls, and a
# call never holds more than [Hq, QUERY_BLOCK, keys] of anything (SDPA's kernel tiles below).
QUERY_BLOCK = 256

# Decode rows whose padded context is at most this many keys always share one call: below it,
# the fixed cost of a call outweighs the padding.
SHARED_CALL_KEYS = 512

# Rows of a padded batch are attended in chunks whose gathered fp32 K and V (plus the fp32 mask
# SDPA derives from the boolean one) take about this much, so that SDPA reads K/V back from the
# CPU cache right after the gather. Measured at B = 8, 1 thread: 4 MB chunks made decode over
# 2048 keys 2x faster than one 32 MB gather, and changed nothing up to 256 keys, where one
# chunk holds the whole batch. A single row is never split, so this bounds the gather
# workspace only up to the longest row's keys.
CHUNK_BYTES = 4 << 20


class _Workspace(threading.local):
    """Per-thread buffers that the K/V gathers write into, reused from call to call.

    A fresh tensor of a few megabytes per call came back from glibc's malloc as fresh pages
    (its memory had been returned to the system), and faulting them in cost more than the
    gather itself: ~1000 minor faults and 3-4x the time of the whole decode call at 8 x 256
    keys. The gathered tensors are consumed by the same call, never returned.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype, torch.device, bool], torch.Tensor] = {}

    def take(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """An uninitialised [shape] tensor in buffer `name`, valid until the next take(name)."""
        numel = math.prod(shape)
        # A buffer made under inference_mode cannot be written outside it: one set per mode.
        key = (name, dtype, device, torch.is_inference_mode_enabled())
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self.buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel].view(shape)


_WORKSPACE = _Workspace()


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """`attention_ref.write_kv` as one `index_copy_` per cache into its [slots, Hkv, D] view
    (a third of the reference's time at decode sizes, which splits each slot into page and
    offset for advanced indexing). A cache whose page and slot dims do not merge takes the
    reference."""
    try:
        k_rows = k_cache.view(-1, *k_cache.shape[2:])
        v_rows = v_cache.view(-1, *v_cache.shape[2:])
    except RuntimeError:
        attention_ref.write_kv(k, v, k_cache, v_cache, slot_mapping)
        return
    slots = slot_mapping.long()
    k_rows.index_copy_(0, slots, k.to(k_cache.dtype))
    v_rows.index_copy_(0, slots, v.to(v_cache.dtype))


def _gather(cache: torch.Tensor, slots: torch.Tensor, name: str) -> torch.Tensor:
    """Rows of `cache` [num_pages, page_size, Hkv, D] at flat `slots` [R] int64 (page * page_size
    + offset), as fp32 [R, Hkv, D] in workspace buffer `name`: ONE index_select."""
    _, _, num_kv_heads, head_dim = cache.shape
    # view, not reshape: a cache whose page and slot dims do not merge raises instead of being
    # copied whole on every call.
    rows = cache.view(-1, num_kv_heads, head_dim)
    shape = (slots.numel(), num_kv_heads, head_dim)
    out = _WORKSPACE.take(name, shape, cache.dtype, cache.device)
    torch.index_select(rows, 0, slots, out=out)
    if out.dtype == torch.float32:
        return out
    return _WORKSPACE.take(f"{name}.fp32", shape, torch.float32, cache.device).copy_(out)


@dataclass(slots=True)
class _KeyLayout:
    """Where the keys of rows of n queries each sit in the cache, padded to the longest row.

    Row b's keys are positions first[b] .. total[b] - 1 (total = prefix + n; first > 0 only
    where a window cuts); key_pos [B, L] holds those positions, padded past the row's end;
    slots [B * L] int64 the cache slots to read for them (a padding lane re-reads the row's
    newest key: see the module docstring); padded: whether any row has padding lanes.
    """

    total: torch.Tensor
    key_pos: torch.Tensor
    slots: torch.Tensor
    padded: bool

    @property
    def length(self) -> int:
        return self.key_pos.shape[1]


def _key_layout(
    block_tables: torch.Tensor, prefix: torch.Tensor, n: int, window: int, page_size: int
) -> _KeyLayout:
    """The `_KeyLayout` of rows with `prefix` [B] int64 cached tokens and n new queries each."""
    total = prefix + n
    # First key any query of the row may see: earlier positions are never read.
    first = (prefix - window + 1).clamp(min=0) if window > 0 else torch.zeros_like(prefix)
    span_min, span_max = (total - first).aminmax()
    L = int(span_max)
    key_pos = first[:, None] + torch.arange(L, device=prefix.device)  # [B, L]
    read_pos = torch.minimum(key_pos, (total - 1)[:, None])
    slots = block_tables.gather(1, read_pos // page_size).long() * page_size + read_pos % page_size
    return _KeyLayout(total, key_pos, slots.flatten(), int(span_min) != L)


class _DecodeLayouts(threading.local):
    """The key layouts of the current decode step, shared by its layers.

    Every attention layer of one forward call passes the same `block_tables` and `seq_lens`
    tensors (the model computes them once per call), so the positions and slots of their keys
    are the same in every layer (per window size). Cached layouts are reused while both tensors
    are those very objects, unchanged: they are held here (so that their ids cannot pass to new
    tensors) and their version counters are compared. (Tensors made under inference_mode have
    no version counter; nothing changes these in place during a call.)
    """

    def __init__(self) -> None:
        self.tensors: tuple[torch.Tensor, torch.Tensor] | None = None
        self.versions: tuple[int, int] = (0, 0)
        self.plans: dict[tuple[int, int], list[tuple[list[int] | None, _KeyLayout]]] = {}

    def plan(
        self, block_tables: torch.Tensor, seq_lens: torch.Tensor, window: int, page_size: int
    ) -> list[tuple[list[int] | None, _KeyLayout]]:
        """[(the group's rows, or None for all rows; its key layout)] of one decode call."""
        versions = (tensor_version(block_tables), tensor_version(seq_lens))
        if (self.tensors is None or self.tensors[0] is not block_tables
                or self.tensors[1] is not seq_lens or self.versions != versions):
            self.tensors, self.versions, self.plans = (block_tables, seq_lens), versions, {}
        plan = self.plans.get((window, page_size))
        if plan is None:
            plan = self.plans[(window, page_size)] = _decode_plan(
                block_tables, seq_lens, window, page_size
            )
        return plan


_DECODE_LAYOUTS = _DecodeLayouts()


def _decode_plan(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, window: int, page_size: int
) -> list[tuple[list[int] | None, _KeyLayout]]:
    """Rows grouped by context length (`_length_groups`), each group with its key layout."""
    groups = _length_groups([min(n, window) if window > 0 else n for n in seq_lens.tolist()])
    prefix = seq_lens.long() - 1
    if len(groups) == 1:
        return [(None, _key_layout(block_tables, prefix, 1, window, page_size))]
    return [
        (rows, _key_layout(block_tables[rows], prefix[rows], 1, window, page_size))
        for rows in groups
    ]


def _padded_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    prefix: torch.Tensor,
    sm_scale: float,
    window: int,
    layout: _KeyLayout | None = None,
) -> torch.Tensor:
    """Causal attention of rows of n queries each over their paged keys, padded to the longest.

    q: [B, n, Hq, D], row b's query i at position prefix[b] + i; block_tables: [B, M] int32;
    prefix: [B] int64. Row b's keys are its positions < prefix[b] + n, all in the cache; query
    P attends to p <= P and, with window W > 0, p > P - W. `layout` is these rows'
    `_key_layout` when the caller has it. Returns [B, n, Hq, D] fp32.
    """
    B, n, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if layout is None:
        layout = _key_layout(block_tables, prefix, n, window, page_size)
    L = layout.length

    row_bytes = L * (2 * num_kv_heads * head_dim * 4 + n * 5)
    chunk_rows = max(1, CHUNK_BYTES // row_bytes)
    if chunk_rows < B:
        return torch.cat([
            _padded_attention(
                q[i : i + chunk_rows], k_cache, v_cache, block_tables[i : i + chunk_rows],
                prefix[i : i + chunk_rows], sm_scale, window,
            )
            for i in range(0, B, chunk_rows)
        ])

    key_pos, total = layout.key_pos, layout.total
    # [B, Hkv, L, D] views of [B, L, Hkv, D]: SDPA reads through the strides.
    k = _gather(k_cache, layout.slots, "k").view(B, L, num_kv_heads, head_dim).transpose(1, 2)
    v = _gather(v_cache, layout.slots, "v").view(B, L, num_kv_heads, head_dim).transpose(1, 2)

    if n == 1:
        # One query per row and head ([B, Hq, 1, D]), the kv head shared through enable_gqa:
        # SDPA's CPU kernel runs this 1.3-1.5x faster than the same product with the query
        # heads of a kv head folded into the query axis ([B, Hkv, group, D]).
        mask = (key_pos < total[:, None])[:, None, None, :] if layout.padded else None
        out = F.scaled_dot_product_attention(
            q.float().transpose(1, 2), k, v, attn_mask=mask, scale=sm_scale, enable_gqa=True
        )  # query head h reads kv head h // (Hq // Hkv), as in the reference
        return out.transpose(1, 2)

    q_heads_major = q.float().transpose(1, 2)  # [B, Hq, n, D]
    if int(prefix.max()) == 0 and (window == 0 or window >= n):
        # Whole cold prompts (queries and keys both at positions 0 .. n-1) that no window cuts:
        # SDPA's own causal mode, which also skips the tiles above the diagonal.
        out = F.scaled_dot_product_attention(
            q_heads_major, k, v, is_causal=True, scale=sm_scale, enable_gqa=True
        )
        return out.transpose(1, 2)
    query_pos = prefix[:, None] + torch.arange(n, device=q.device)  # [B, n]
    mask = key_pos[:, None, :] <= query_pos[:, :, None]  # [B, n, L]; excludes re-read lanes
    if window > 0:
        mask &= key_pos[:, None, :] > query_pos[:, :, None] - window
    out = F.scaled_dot_product_attention(
        q_heads_major, k, v, attn_mask=mask[:, None], scale=sm_scale, enable_gqa=True
    )  # query head h reads kv head h // (Hq // Hkv), as in the reference
    return out.transpose(1, 2)


def _length_groups(spans: list[int]) -> list[list[int]]:
    """Row indices grouped for padded decode calls, longest context first: a group takes rows
    down to half its longest span (so padding at most doubles a row's keys), and any row once
    the group's longest span is at most SHARED_CALL_KEYS."""
    order = sorted(range(len(spans)), key=spans.__getitem__, reverse=True)
    groups: list[list[int]] = []
    for row in order:
        longest = spans[groups[-1][0]] if groups else 0
        if groups and (2 * spans[row] >= longest or longest <= SHARED_CALL_KEYS):
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


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
    tokens including the current one. Hq % Hkv == 0. window = 0: full attention; W > 0: only
    the last W positions. Returns [B, Hq, D] in q's dtype (see `attention_ref`).
    """
    prefix = seq_lens.long() - 1
    plan = _DECODE_LAYOUTS.plan(block_tables, seq_lens, window, k_cache.shape[1])
    if len(plan) == 1:
        out = _padded_attention(
            q[:, None], k_cache, v_cache, block_tables, prefix, sm_scale, window, plan[0][1]
        )
        return out[:, 0].to(q.dtype)
    out = torch.empty_like(q)  # with B == 0 there is no group and nothing to fill
    for rows, layout in plan:
        idx = torch.tensor(rows, device=q.device)
        attn = _padded_attention(
            q[idx, None], k_cache, v_cache, block_tables[idx], prefix[idx], sm_scale, window,
            layout,
        )
        out[idx] = attn[:, 0].to(q.dtype)
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
    block_tables: [B, M] int32; cu_seqlens_q: [B + 1] int32; prefix_lens: [B] int32. Query j
    of sequence b sits at position prefix_lens[b] + j (see `attention_ref`). Returns [T, Hq, D]
    in q's dtype.
    """
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    prefixes = prefix_lens.tolist()
    single = [b for b in range(len(prefixes)) if starts[b + 1] - starts[b] == 1]
    if single:
        seqs = torch.tensor(single, device=q.device)
        rows = torch.tensor([starts[b] for b in single], device=q.device)
        out[rows] = paged_decode_attention(
            q[rows], k_cache, v_cache, block_tables[seqs], prefix_lens[seqs] + 1, sm_scale, window
        )
    for b, prefix in enumerate(prefixes):
        q_len = starts[b + 1] - starts[b]
        if q_len <= 1:
            continue
        for j in range(0, q_len, QUERY_BLOCK):
            m = min(QUERY_BLOCK, q_len - j)
            rows = slice(starts[b] + j, starts[b] + j + m)
            attn = _padded_attention(
                q[None, rows], k_cache, v_cache, block_tables[b : b + 1],
                torch.tensor([prefix + j], device=q.device), sm_scale, window,
            )
            out[rows] = attn[0].to(q.dtype)
    return out
