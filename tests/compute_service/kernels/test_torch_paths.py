"""The vectorised PyTorch paths that serve CPU tensors vs the references: paged attention
(`attention_torch`) and the Mamba2 single-step update (`mamba_torch`).

Attention: same grids as test_attention (GQA groups 1/4/8, head dims 64/128, page sizes 16/64,
prefixes 0, mid-page and several pages, varlen batches, sliding windows) in fp32, fp16 and bf16,
plus what only the vectorised path has: prompts longer than a query block, mixed batches, decode
rows of very different lengths (several padded groups) and batches split into row chunks.
Unreferenced pages, the unused tail of each block table, pages wholly outside a window and the
unwritten tail of each sequence's last page are NaN (see `make_paged_batch`), so a padding lane
that read one of them instead of a real key would poison the output even though it is masked.

Mamba2: several decode steps over a pool whose slots not named by state_indices are NaN.
"""
from __future__ import annotations

import pytest
import torch

from compute_service import kernels
from compute_service.kernels import (
    attention_cpu,
    attention_ref,
    attention_torch,
    cpu_native,
    mamba_ref,
    mamba_torch,
)

from .helpers import assert_close, cu_seqlens, distinct_slots, int32, requires_c_kernels
from .test_attention import DECODE_CASES, EXTEND_CASES, NUM_KV_HEADS, PagedBatch, make_paged_batch
from .test_mamba import make_inputs

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype)[6:]


def _extend_batch(
    group: int,
    head_dim: int,
    page_size: int,
    prefixes: list[int],
    q_lens: list[int],
    window: int,
    dtype: torch.dtype,
    seed: int = 1,
) -> tuple[tuple, PagedBatch]:
    """extend_attention arguments over a poisoned paged batch, and the batch."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
    first_live = [max(0, p - window + 1) for p in prefixes] if window else None
    batch = make_paged_batch(lengths, page_size, head_dim, dtype, gen, "cpu", first_live)
    q = torch.randn(sum(q_lens), NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype)
    args = (
        q, batch.k_cache, batch.v_cache, batch.block_tables, cu_seqlens(q_lens),
        int32(prefixes), head_dim**-0.5, window,
    )
    return args, batch


def _decode_batch(
    group: int,
    head_dim: int,
    page_size: int,
    seq_lens: list[int],
    window: int,
    dtype: torch.dtype,
    seed: int = 2,
) -> tuple[tuple, PagedBatch]:
    """paged_decode_attention arguments over a poisoned paged batch, and the batch."""
    gen = torch.Generator().manual_seed(seed)
    first_live = [max(0, n - window) for n in seq_lens] if window else None
    batch = make_paged_batch(seq_lens, page_size, head_dim, dtype, gen, "cpu", first_live)
    q = torch.randn(len(seq_lens), NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype)
    args = (
        q, batch.k_cache, batch.v_cache, batch.block_tables, int32(seq_lens), head_dim**-0.5,
        window,
    )
    return args, batch


def _check_extend(args: tuple, dtype: torch.dtype) -> None:
    out = attention_torch.extend_attention(*args)
    assert_close(out, attention_ref.extend_attention(*args), dtype)


def _check_decode(args: tuple, dtype: torch.dtype) -> None:
    """The PyTorch path and, for fp32, the C kernel (`attention_cpu`) against the reference."""
    expected = attention_ref.paged_decode_attention(*args)
    assert_close(attention_torch.paged_decode_attention(*args), expected, dtype)
    native = dtype == torch.float32 and cpu_native.enabled()
    assert attention_cpu.native_takes(*args[:3]) == native
    assert_close(attention_cpu.paged_decode_attention(*args), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("case", EXTEND_CASES, ids=lambda c: f"g{c[0]}-d{c[1]}-ps{c[2]}-w{c[5]}")
def test_extend_matches_reference(case: tuple, dtype: torch.dtype) -> None:
    args, _ = _extend_batch(*case[:-1], dtype)
    _check_extend(args, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"g{c[0]}-d{c[1]}-ps{c[2]}-w{c[4]}")
def test_decode_matches_reference(case: tuple, dtype: torch.dtype) -> None:
    args, _ = _decode_batch(*case[:5], dtype)
    _check_decode(args, dtype)


# (gqa group, head_dim, page_size, prefix_lens, q_lens, window): prompts over QUERY_BLOCK (256)
# from 0, mid-page and several pages, beside empty, one-token (decode path) and short sequences;
# cold prompts (prefix 0) with and without a window shorter than themselves.
LONG_EXTEND_CASES = [
    (4, 64, 16, [0], [600], 0),
    (1, 64, 16, [0, 0], [300, 40], 32),
    (8, 128, 64, [37, 0, 130], [300, 1, 257], 0),
    (1, 64, 16, [20, 300, 0, 5], [1, 0, 520, 12], 0),
    (4, 64, 16, [45, 7, 0], [400, 1, 30], 100),
    (8, 64, 64, [500, 3], [270, 1], 64),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=_dtype_id)
@pytest.mark.parametrize(
    "case", LONG_EXTEND_CASES, ids=lambda c: f"g{c[0]}-pre{c[3]}-q{c[4]}-w{c[5]}"
)
def test_long_and_mixed_extend_matches_reference(case: tuple, dtype: torch.dtype) -> None:
    args, _ = _extend_batch(*case, dtype)
    _check_extend(args, dtype)


# (gqa group, head_dim, page_size, seq_lens, window): lengths far apart, so rows fall into
# several padded groups; rows of one page beside rows of many pad with a partly written page.
SPREAD_DECODE_CASES = [
    (4, 64, 16, [1, 1500, 17, 700, 40, 300, 2], 0),
    (8, 128, 64, [65, 1200, 3, 640], 0),
    (1, 64, 16, [1500, 9, 700, 250], 600),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=_dtype_id)
@pytest.mark.parametrize("case", SPREAD_DECODE_CASES, ids=lambda c: f"g{c[0]}-len{c[3]}-w{c[4]}")
def test_spread_decode_matches_reference(case: tuple, dtype: torch.dtype) -> None:
    assert len(attention_torch._length_groups(case[3])) > 1
    args, _ = _decode_batch(*case, dtype)
    _check_decode(args, dtype)


def test_length_groups_bound_padding() -> None:
    spans = [64, 2048, 300, 1000, 17, 512, 1500, 800]
    groups = attention_torch._length_groups(spans)
    assert sorted(r for g in groups for r in g) == list(range(len(spans)))
    for g in groups:
        longest = spans[g[0]]
        assert all(spans[r] <= longest for r in g)
        shared = longest <= attention_torch.SHARED_CALL_KEYS
        assert shared or all(2 * spans[r] >= longest for r in g)
    assert attention_torch._length_groups([]) == []


def test_row_chunks_match_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk size too small for two rows splits every call into single rows (each padded to its
    own length, so the results agree to rounding, not bit for bit)."""
    decode_args, _ = _decode_batch(4, 64, 16, [40, 33, 50, 47], 0, torch.float32)
    extend_args, _ = _extend_batch(4, 64, 16, [5, 0, 30], [20, 1, 9], 0, torch.float32)
    whole = (
        attention_torch.paged_decode_attention(*decode_args),
        attention_torch.extend_attention(*extend_args),
    )
    monkeypatch.setattr(attention_torch, "CHUNK_BYTES", 1)
    split_decode = attention_torch.paged_decode_attention(*decode_args)
    assert_close(split_decode, whole[0], torch.float32)
    assert_close(attention_torch.extend_attention(*extend_args), whole[1], torch.float32)


def test_pages_outside_the_attended_range_are_never_indexed() -> None:
    """Block-table entries past each sequence's pages and before its window hold page ids out
    of the cache's range: indexing any of them raises."""
    window, page_size, prefixes, q_lens = 20, 16, [70, 0, 33], [1, 40, 300]
    args, batch = _extend_batch(4, 64, page_size, prefixes, q_lens, window, torch.float32)
    tables = batch.block_tables.clone()
    bad = batch.k_cache.shape[0] + 1000
    for b, (p, n) in enumerate(zip(prefixes, q_lens, strict=True)):
        tables[b, : max(0, p - window + 1) // page_size] = bad  # wholly before the window
        tables[b, -(-(p + n) // page_size) :] = bad  # past the last page
    args = (*args[:3], tables, *args[4:])
    _check_extend(args, torch.float32)
    seq_lens = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
    decode_tables = batch.block_tables.clone()
    for b, n in enumerate(seq_lens):
        decode_tables[b, : max(0, n - window) // page_size] = bad
        decode_tables[b, -(-n // page_size) :] = bad
    q = torch.randn(len(seq_lens), 4 * NUM_KV_HEADS, 64)
    decode_args = (q, batch.k_cache, batch.v_cache, decode_tables, int32(seq_lens), 0.125, window)
    _check_decode(decode_args, torch.float32)


def test_public_api_serves_cpu_tensors_with_the_cpu_path() -> None:
    args, _ = _decode_batch(4, 64, 16, [40, 7], 0, torch.float32)
    expected = attention_cpu.paged_decode_attention(*args)
    assert torch.equal(kernels.paged_decode_attention(*args), expected)
    assert torch.equal(
        kernels.paged_decode_attention(*args, reference=True),
        attention_ref.paged_decode_attention(*args),
    )


def test_gather_workspace_serves_inside_and_outside_inference_mode() -> None:
    """The engine calls under inference_mode, tests and tools outside it, in one process."""
    args, _ = _decode_batch(4, 64, 16, [40, 7], 0, torch.float32)
    expected = attention_ref.paged_decode_attention(*args)
    with torch.inference_mode():
        assert_close(attention_torch.paged_decode_attention(*args), expected, torch.float32)
    assert_close(attention_torch.paged_decode_attention(*args), expected, torch.float32)
    with torch.inference_mode():
        assert_close(attention_torch.paged_decode_attention(*args), expected, torch.float32)



def test_decode_key_layouts_are_shared_by_layers_and_never_stale() -> None:
    """The layers of one decode step (same block_tables and seq_lens tensors) reuse one key
    layout per window; a new tensor, or the same tensor changed in place, gets a fresh one."""
    args, _ = _decode_batch(2, 64, 16, [40, 7, 33], 0, torch.float32)
    q, k_cache, v_cache, tables, lens, scale, _ = args
    layouts = attention_torch._DECODE_LAYOUTS

    def decode(tables, lens, window=0):
        out = attention_torch.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale,
                                                     window)
        expected = attention_ref.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale,
                                                        window)
        assert_close(out, expected, torch.float32)
        return layouts.plans

    plans = decode(tables, lens)
    assert decode(tables, lens) is plans  # the next layer: reused
    assert (16, 16) not in plans
    decode(tables, lens, window=16)
    assert set(plans) == {(0, 16), (16, 16)}  # one layout per window
    assert decode(tables, lens.clone()) is not plans  # a new tensor: computed again
    plans = layouts.plans
    lens[1] = 5  # in place (a shorter row: its last key moves)
    assert decode(tables, lens) is not plans

# (H, G, P, N): groups of 1, 2 and all heads, P/N off powers of two, and small-hybrid's shape.
SSM_SHAPES = [(4, 2, 16, 16), (4, 1, 16, 16), (4, 4, 8, 8), (2, 2, 24, 16), (16, 1, 64, 64)]


@pytest.mark.parametrize(
    "dtype,state_dtype",
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float32),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.float32),
    ],
    ids=["fp32", "fp16-fp32state", "fp16", "bf16-fp32state"],
)
@pytest.mark.parametrize("shape", SSM_SHAPES, ids=lambda s: "H{}G{}P{}N{}".format(*s))
@pytest.mark.parametrize("layout", ["scattered", "run", "shuffled-run"])
def test_selective_state_update_matches_reference(
    shape: tuple[int, int, int, int], dtype: torch.dtype, state_dtype: torch.dtype, layout: str
) -> None:
    """Several steps of 3 sequences in a pool of 7 slots: outputs and states as the reference's,
    slots not named never read (NaN) nor written. The slots are scattered, or a run of
    consecutive slots in order or shuffled (the in-place path for fp32 states)."""
    H, G, P, N = shape
    steps, batch, pool = 4, 3, 7
    inp = make_inputs(steps * batch, H, G, P, N, dtype, "cpu", seed=11)
    gen = torch.Generator().manual_seed(12)
    slots = {"scattered": distinct_slots(batch, pool, gen), "run": [2, 3, 4],
             "shuffled-run": [4, 2, 3]}[layout]
    if layout == "scattered":
        assert mamba_torch.slot_run(int32(slots)) is None, "the scattered case must not be a run"
    ours = torch.full((pool, H, P, N), float("nan"), dtype=state_dtype)
    ours[slots] = torch.randn(batch, H, P, N, generator=gen).to(state_dtype)
    theirs = ours.clone()
    idx = int32(slots)
    for t in range(steps):
        rows = slice(t * batch, (t + 1) * batch)
        step = (
            inp.x[rows], inp.dt[rows], inp.dt_bias, inp.A, inp.B[rows], inp.C[rows], inp.D, idx
        )
        y = mamba_torch.selective_state_update(ours, *step)
        assert y.dtype == dtype
        assert_close(y, mamba_ref.selective_state_update(theirs, *step), dtype)
        assert_close(ours[slots], theirs[slots], state_dtype)
    untouched = [s for s in range(pool) if s not in slots]
    assert ours[untouched].isnan().all()


# The C decode kernel's own edges: a page longer than its 64-key run, a head dim that is not a
# multiple of its 16-float vectors, odd GQA groups, both thread counts, and scores spread over
# hundreds (online-softmax rescaling, exp underflow to the clamp).
@requires_c_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "group,head_dim,page_size,seq_lens,window,q_scale",
    [
        (3, 40, 128, [300, 1, 129], 0, 1.0),
        (16, 24, 16, [65, 64, 63], 0, 1.0),
        (2, 64, 128, [250, 70], 100, 1.0),
        (4, 64, 16, [200, 31], 0, 40.0),
    ],
)
def test_c_decode_kernel_edges(group, head_dim, page_size, seq_lens, window, q_scale,
                               threads) -> None:
    args, _ = _decode_batch(group, head_dim, page_size, seq_lens, window, torch.float32)
    args = (args[0] * q_scale, *args[1:])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert attention_cpu.native_takes(*args[:3])
        out = attention_cpu.paged_decode_attention(*args)
    finally:
        torch.set_num_threads(before)
    assert_close(out, attention_ref.paged_decode_attention(*args), torch.float32)
