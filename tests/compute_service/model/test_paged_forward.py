"""The paged forward is invariant to how a sequence is split into calls, batched, or resumed
from cached pages / Mamba checkpoints (design.md §5: greedy output must not depend on it)."""

from __future__ import annotations

import pytest
import torch

from compute_service.model import ForwardBatch, ForwardMode, build_preset
from tests.compute_service.paged_driver import PagedDriver

TINY = ["tiny-transformer", "tiny-sliding", "tiny-mamba2", "tiny-hybrid"]
MAMBA = ["tiny-mamba2", "tiny-hybrid"]
TOL = {"atol": 2e-4, "rtol": 1e-4}
PAGE = 16


@pytest.fixture(scope="module", params=TINY)
def model(request: pytest.FixtureRequest):
    return build_preset(request.param, seed=7)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _continue_greedy(
    driver: PagedDriver, seq, first_logits: torch.Tensor, steps: int
) -> list[torch.Tensor]:
    """Decode `steps` greedy tokens; returns the logits of each step (first_logits first)."""
    out = [first_logits]
    for _ in range(steps):
        out.append(
            driver.forward([seq], [[int(out[-1].argmax())]], mode=ForwardMode.DECODE).logits[0]
        )
    return out


def test_chunked_prefill_with_cached_prefix_equals_one_prefill(model) -> None:
    """50 tokens (longer than the sliding window 32) in one call vs in 4 calls whose prefixes
    end mid-page (13, 29) and on a page boundary (32); then 5 greedy decode steps."""
    driver = PagedDriver(model, page_size=PAGE)
    prompt = _prompt(50)
    one = driver.new_sequence()
    full = driver.forward([one], [prompt], all_logits=True).logits
    chunked = driver.new_sequence()
    parts = [
        driver.forward([chunked], [prompt[a:b]], all_logits=True).logits
        for a, b in [(0, 13), (13, 29), (29, 32), (32, 50)]
    ]
    torch.testing.assert_close(torch.cat(parts), full, **TOL)
    for x, y in zip(
        _continue_greedy(driver, one, full[-1], 5),
        _continue_greedy(driver, chunked, parts[-1][-1], 5),
    ):
        torch.testing.assert_close(x, y, **TOL)


def test_mixed_extend_batch_equals_separate_calls(model) -> None:
    """One EXTEND call with a fresh prompt, a continuing chunk and a single decoding token."""
    driver = PagedDriver(model, page_size=PAGE)
    p1, p2, p3 = _prompt(20, 1), _prompt(30, 2), _prompt(9, 3)
    ref = []
    for prompt, split in [(p1, 0), (p2, 17), (p3, 8)]:
        seq = driver.new_sequence()
        if split:
            driver.forward([seq], [prompt[:split]])
        ref.append(driver.forward([seq], [prompt[split:]], all_logits=True).logits)
    s1, s2, s3 = driver.new_sequence(), driver.new_sequence(), driver.new_sequence()
    driver.forward([s2, s3], [p2[:17], p3[:8]])
    got = driver.forward([s1, s2, s3], [p1, p2[17:], p3[8:]], all_logits=True).logits
    torch.testing.assert_close(got, torch.cat(ref), **TOL)


def test_decode_batch_equals_single_decodes(model) -> None:
    """Three sequences of different lengths (mid-page, page end, past two pages) decoded in one
    DECODE call equal each decoded alone."""
    driver = PagedDriver(model, page_size=PAGE)
    batched, alone = [], []
    for n, seed in [(5, 4), (16, 5), (33, 6)]:
        for group in (batched, alone):
            seq = driver.new_sequence()
            driver.forward([seq], [_prompt(n, seed)])
            group.append(seq)
    tokens = [[11], [12], [13]]
    got = driver.forward(batched, tokens, mode=ForwardMode.DECODE).logits
    for i, seq in enumerate(alone):
        want = driver.forward([seq], [tokens[i]], mode=ForwardMode.DECODE).logits
        torch.testing.assert_close(got[i], want[0], **TOL)


def test_prefix_cache_hit_on_shared_pages() -> None:
    """Attention-only: a second request reuses the first one's first two pages read-only and
    computes only its own suffix."""
    model = build_preset("tiny-sliding", seed=3)
    driver = PagedDriver(model, page_size=PAGE)
    prompt = _prompt(45, 8)
    first = driver.new_sequence()
    full = driver.forward([first], [prompt], all_logits=True).logits
    hit = driver.fork(first, 2 * PAGE)
    suffix = driver.forward([hit], [prompt[2 * PAGE :]], all_logits=True).logits
    torch.testing.assert_close(suffix, full[2 * PAGE :], **TOL)


@pytest.mark.parametrize("name", MAMBA)
def test_mamba_resume_from_page_boundary_checkpoint(name: str) -> None:
    """Boundaries come out of every chunk at absolute page multiples (offsets chunk-relative:
    the second chunk starts at 30, so its boundary at 32 is only 2 tokens in, fewer than the
    conv window). Resuming from each boundary reproduces the logits and the greedy decode."""
    model = build_preset(name, seed=4)
    driver = PagedDriver(model, page_size=PAGE)
    prompt = _prompt(52, 9)
    ref = driver.new_sequence()
    first = driver.forward([ref], [prompt[:30]], all_logits=True, checkpoint_interval=PAGE)
    second = driver.forward([ref], [prompt[30:]], all_logits=True, checkpoint_interval=PAGE)
    full = torch.cat([first.logits, second.logits])
    assert first.mamba_boundaries.positions.tolist() == [16]
    assert second.mamba_boundaries.positions.tolist() == [32, 48]
    n_mamba = len(model.config.mamba_layer_ids)
    assert len(second.mamba_boundaries.ssm) == len(second.mamba_boundaries.conv) == n_mamba
    ref_tail = _continue_greedy(driver, ref, full[-1], 4)
    for out, k in [(first, 0), (second, 0), (second, 1)]:
        pos = int(out.mamba_boundaries.positions[k])
        seq = driver.fork(ref, pos, boundary=(out.mamba_boundaries, k))
        logits = driver.forward([seq], [prompt[pos:]], all_logits=True).logits
        torch.testing.assert_close(logits, full[pos:], **TOL)
        for x, y in zip(_continue_greedy(driver, seq, logits[-1], 4), ref_tail):
            torch.testing.assert_close(x, y, **TOL)


def test_boundary_at_call_end_equals_final_state() -> None:
    """A call ending exactly on a page boundary reports that boundary, equal to the slot's state."""
    model = build_preset("tiny-hybrid", seed=5)
    driver = PagedDriver(model, page_size=PAGE)
    seq = driver.new_sequence()
    out = driver.forward([seq], [_prompt(2 * PAGE, 10)], checkpoint_interval=PAGE)
    b = out.mamba_boundaries
    assert b.positions.tolist() == [16, 32] and b.seq_index.tolist() == [0, 0]
    for (ssm, conv), b_ssm, b_conv in zip(driver.mamba_states, b.ssm, b.conv, strict=True):
        torch.testing.assert_close(b_ssm[1], ssm[seq.slot])
        torch.testing.assert_close(b_conv[1], conv[seq.slot])


def test_no_boundaries_without_interval_or_mamba() -> None:
    driver = PagedDriver(build_preset("tiny-transformer"), page_size=PAGE)
    assert (
        driver.forward(
            [driver.new_sequence()], [_prompt(40)], checkpoint_interval=PAGE
        ).mamba_boundaries
        is None
    )
    driver = PagedDriver(build_preset("tiny-mamba2"), page_size=PAGE)
    assert driver.forward([driver.new_sequence()], [_prompt(40)]).mamba_boundaries is None


def test_hand_built_batch_with_empty_logit_selection() -> None:
    """The raw interface without the driver: a middle prefill chunk (prefix 10, mid-page) that
    asks for no logits still advances the caches, so the next chunk matches one prefill."""
    model = build_preset("tiny-hybrid", seed=2)
    driver = PagedDriver(model, page_size=PAGE)
    prompt = _prompt(30, 11)
    ref = driver.forward([driver.new_sequence()], [prompt]).logits
    seq = driver.new_sequence()
    driver.forward([seq], [prompt[:10]])
    seq.pages.append(driver.free_pages.pop(0))  # tokens 16.. of the chunk go to a second page
    batch = ForwardBatch(
        mode=ForwardMode.EXTEND,
        cu_seqlens_q=torch.tensor([0, 12], dtype=torch.int32),
        prefix_lens=torch.tensor([10], dtype=torch.int32),
        block_tables=torch.tensor([seq.pages], dtype=torch.int32),
        slot_mapping=torch.tensor([seq.pages[p // PAGE] * PAGE + p % PAGE for p in range(10, 22)]),
        kv_caches=driver.kv_caches,
        mamba_states=driver.mamba_states,
        state_indices=torch.tensor([seq.slot], dtype=torch.int32),
        has_initial_state=torch.tensor([True]),
        logits_indices=torch.empty(0, dtype=torch.int64),
    )
    out = model(torch.tensor(prompt[10:22]), torch.arange(10, 22), batch)
    assert out.logits.shape == (0, model.config.vocab_size) and out.mamba_boundaries is None
    seq.length = 22
    torch.testing.assert_close(driver.forward([seq], [prompt[22:]]).logits, ref, **TOL)
