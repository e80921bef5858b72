"""Progress under page pressure: every admitted request finishes, with the output it gets alone.

A small pool and chunked prefill used to let requests that each fit the pool alone take each
other's pages forever (a preempted request came back, matched its pages and starved the other
one in turn). The scheduler now preempts the youngest running request, never an older one for a
younger, and admits nothing while a request waits for pages (Scheduler.make_room); a request
that cannot fit in the pool alone is rejected at submit.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from cache_service.core import CacheCore
from compute_service.engine import Engine, EngineConfig, FinishReason, SamplingParams
from compute_service.model import ByteTokenizer
from tests.compute_service.engine.references import model, reference

# A case found by search: the old scheduler preempted these in turn for 1,500+ steps.
STARVING = dict(page_size=8, device_pages=8, token_budget=12)
STARVING_REQUESTS = [(0, 50, 9), (100, 19, 23), (200, 44, 17)]  # (first token, prompt, max_tokens)


def run_with_arrivals(eng: Engine, requests: list[tuple[list[int], int, int]], max_steps: int):
    """Submits each (prompt, max_tokens, arrival step) at its step; steps until idle or
    `max_steps`. Returns each request's tokens and final stats."""
    outs: list[list] = [[] for _ in requests]
    pending = sorted(range(len(requests)), key=lambda i: requests[i][2])
    for step in range(max_steps):
        while pending and requests[pending[0]][2] <= step:
            i = pending.pop(0)
            prompt, max_tokens, _ = requests[i]
            eng.submit(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       outs[i].append, request_id=f"r{i}")
        if not pending and not eng.has_work():
            break
        eng.step()
    else:
        pytest.fail(f"no progress: {len(eng.running)} running, {len(eng.waiting)} waiting after "
                    f"{max_steps} steps, {eng.stats.preemptions} preemptions")
    return [([t for o in got for t in o.token_ids], got[-1].stats) for got in outs]


def engine(name: str, **cfg) -> Engine:
    settings_ = dict(model_id=name, checkpoint_slots=8, max_running=4)
    settings_.update(cfg)
    return Engine(model(name), ByteTokenizer(), CacheCore(), EngineConfig(**settings_))


def test_requests_that_each_fit_alone_all_finish_in_a_pool_too_small_for_both():
    eng = engine("tiny-transformer", **STARVING)
    requests = [(list(range(s, s + n)), m, 0) for s, n, m in STARVING_REQUESTS]
    results = run_with_arrivals(eng, requests, max_steps=400)
    assert eng.stats.preemptions > 0  # the pool really was too small for all of them
    for (prompt, max_tokens, _), (tokens, stats) in zip(requests, results):
        assert stats.finish_reason is FinishReason.LENGTH
        assert tokens == reference("tiny-transformer", tuple(prompt), max_tokens)


def test_a_request_that_cannot_fit_alone_is_rejected_at_submit():
    eng = engine("tiny-transformer", page_size=8, device_pages=4)
    with pytest.raises(ValueError, match="exceed this worker's context of 32 tokens"):
        eng.submit(list(range(30)), SamplingParams(max_tokens=3), lambda o: None)
    eng.submit(list(range(29)), SamplingParams(max_tokens=3), lambda o: None)  # exactly fits


@st.composite
def workloads(draw):
    page = draw(st.sampled_from([4, 8]))
    pages = draw(st.integers(3, 10))
    capacity = page * pages
    n = draw(st.integers(2, 5))
    requests = []
    for i in range(n):
        total = draw(st.integers(2, capacity))
        max_tokens = draw(st.integers(1, max(1, total // 3)))
        start = draw(st.integers(1, 250 - total))
        # Some requests share a prefix with the one before (siblings, twins, cache hits).
        if requests and draw(st.booleans()):
            prev = requests[-1][0]
            start_tokens = prev[:draw(st.integers(1, len(prev)))]
        else:
            start_tokens = []
        prompt = (start_tokens + list(range(start, start + total)))[:max(1, total - max_tokens)]
        requests.append((prompt, max_tokens, draw(st.integers(0, 12))))
    cfg = dict(page_size=page, device_pages=pages, token_budget=draw(st.integers(1, 3 * page)),
               max_running=draw(st.integers(1, 4)))
    return cfg, requests


@pytest.mark.parametrize("name", ["tiny-transformer", "tiny-hybrid"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads())
def test_every_admitted_request_finishes_with_its_greedy_output(name, workload):
    cfg, requests = workload
    eng = engine(name, **cfg)
    # Generous but finite: a livelock never ends, a slow schedule does.
    bound = 50 * sum(len(p) + m for p, m, _ in requests) + 100
    results = run_with_arrivals(eng, requests, max_steps=bound)
    for (prompt, max_tokens, _), (tokens, stats) in zip(requests, results):
        assert stats.finish_reason is FinishReason.LENGTH
        assert tokens == reference(name, tuple(prompt), max_tokens)
