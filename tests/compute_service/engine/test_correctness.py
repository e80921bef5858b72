"""Greedy output never depends on where a prefix came from (design.md §5).

For every family (transformer, sliding window, Mamba2, hybrid), the engine's output equals an
independent reference (PagedDriver: one prefill call, then one decode call per token) whether the
prompt was cold, fully cached, cached up to mid-page, published mid-flight by a concurrent
sibling, sampled first from a twin's logits, or resumed after preemption; with multi-chunk
prompts, 16 concurrent same-prefix requests, a prompt shorter than the conv window, and a
second turn reusing the first.
"""
from __future__ import annotations

import random

import pytest

from cache_service.core import CacheCore
from compute_service.engine import Engine, EngineConfig, SamplingParams
from compute_service.model import ByteTokenizer
from tests.compute_service.engine.references import FAMILIES, NEW, PAGE, model, reference
from tests.compute_service.hf_families import HF_FAMILIES


def engine(name: str, **cfg) -> Engine:
    settings = dict(page_size=PAGE, device_pages=256, token_budget=24, max_running=16,
                    checkpoint_slots=64, model_id=name)
    settings.update(cfg)
    return Engine(model(name), ByteTokenizer(), CacheCore(), EngineConfig(**settings))


def run(eng: Engine, prompts: dict[str, list[int]]) -> dict[str, tuple[list[int], object]]:
    """Submits all prompts at once, steps until done; returns tokens and final stats per id."""
    got: dict[str, list] = {k: [] for k in prompts}
    for key, prompt in prompts.items():
        eng.submit(prompt, SamplingParams(max_tokens=NEW, ignore_eos=True), got[key].append, request_id=key)
    eng.run_until_idle()
    return {k: ([t for o in outs for t in o.token_ids], outs[-1].stats) for k, outs in got.items()}


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 255) for _ in range(n)]


BASE = prompt_of(1, 45)  # 11.25 pages: several chunks at a 24-token budget


@pytest.mark.parametrize("name", FAMILIES)
def test_cold_fully_cached_and_mid_page(name):
    eng = engine(name)
    cold = run(eng, {"cold": BASE})["cold"]
    assert cold[0] == reference(name, tuple(BASE))
    assert cold[1].cached_tokens_device == 0 and cold[1].computed_prompt_tokens == len(BASE)
    again = run(eng, {"again": BASE})["again"]
    assert again[0] == cold[0]
    assert again[1].cached_tokens_device > 0  # hybrid/Mamba: up to the deepest checkpoint
    mid = BASE[:22] + prompt_of(2, 13)  # shares 5.5 pages: only 5 can hit
    out = run(eng, {"mid": mid})["mid"]
    assert out[0] == reference(name, tuple(mid))
    assert out[1].cached_tokens_device <= 20


@pytest.mark.parametrize("name", FAMILIES)
def test_sixteen_concurrent_same_prefix_requests(name):
    eng = engine(name)
    prompts = {f"s{i}": BASE[:40] + prompt_of(100 + i, 5) for i in range(16)}
    got = run(eng, prompts)
    for key, prompt in prompts.items():
        assert got[key][0] == reference(name, tuple(prompt)), key
    # Siblings waited for the first one's publishes instead of computing the prefix 16 times.
    computed = sum(s.computed_prompt_tokens for _, s in got.values())
    assert computed <= 40 + 16 * 12, computed
    assert sum(s.shared_tokens_in_flight for _, s in got.values()) > 0


@pytest.mark.parametrize("name", FAMILIES)
def test_twins_take_their_first_token_from_the_first_ones_logits(name):
    """Four samples of one prompt (an RL rollout's group): all first tokens come in the step
    that completes the prompt, the prefix is computed once, and the output equals the reference."""
    eng = engine(name)
    prompt = BASE[:42]  # 10.5 pages: the twins recompute the partial page and their token
    steps: dict[str, list[int]] = {}
    got: dict[str, list] = {}
    for i in range(4):
        key = f"t{i}"
        steps[key], got[key] = [], []
        eng.submit(prompt, SamplingParams(max_tokens=NEW, ignore_eos=True),
                   lambda o, k=key: (steps[k].append(eng.stats.steps), got[k].append(o)), request_id=key)
    eng.run_until_idle()
    want = reference(name, tuple(prompt))
    for key, outs in got.items():
        assert [t for o in outs for t in o.token_ids] == want, key
    assert len({s[0] for s in steps.values()}) == 1  # every first token in one step
    stats = [outs[-1].stats for outs in got.values()]
    assert [s.first_token_from_twin for s in stats] == [False, True, True, True]
    assert eng.stats.twin_first_tokens == 3
    assert sum(s.computed_prompt_tokens for s in stats) <= len(prompt) + 3 * 3


@pytest.mark.parametrize("name", FAMILIES)
def test_published_mid_flight_by_a_sibling(name):
    """The sibling arrives while the first request is still in prefill and reuses its chunks."""
    eng = engine(name, token_budget=8)
    first, second = BASE, BASE[:36] + prompt_of(5, 6)
    out = {}
    for key, prompt in (("first", first), ("second", second)):
        out[key] = []
        eng.submit(prompt, SamplingParams(max_tokens=NEW, ignore_eos=True), out[key].append, request_id=key)
        for _ in range(3):
            eng.step()  # the first request has published a few chunks before the second arrives
    eng.run_until_idle()
    toks = {k: [t for o in v for t in o.token_ids] for k, v in out.items()}
    assert toks["first"] == reference(name, tuple(first))
    assert toks["second"] == reference(name, tuple(second))
    assert out["second"][-1].stats.cached_tokens_device > 0


@pytest.mark.parametrize("name", FAMILIES)
def test_preemption_and_resumption(name):
    # 30 pages cannot hold six 45-token requests with their outputs at once.
    eng = engine(name, device_pages=30, token_budget=64)
    prompts = {f"p{i}": prompt_of(200 + i, 45) for i in range(6)}
    got = run(eng, prompts)
    assert eng.stats.preemptions > 0
    for key, prompt in prompts.items():
        assert got[key][0] == reference(name, tuple(prompt)), key


@pytest.mark.parametrize("name", FAMILIES)
def test_second_turn_reuses_the_first_turns_prompt_and_answer(name):
    eng = engine(name)
    turn1 = run(eng, {"t1": BASE})["t1"][0]
    prompt2 = BASE + turn1 + prompt_of(9, 7)
    out = run(eng, {"t2": prompt2})["t2"]
    assert out[0] == reference(name, tuple(prompt2))
    assert out[1].cached_tokens_device >= 40  # beyond the first prompt's last checkpointed page


@pytest.mark.parametrize("name", FAMILIES)
def test_prompt_shorter_than_the_conv_window(name):
    eng = engine(name)
    for prompt in ([7], [7, 9], [7, 9, 11]):
        assert run(eng, {"short": prompt})["short"][0] == reference(name, tuple(prompt))


@pytest.mark.parametrize("name", ["tiny-hybrid", *HF_FAMILIES])
def test_remote_mode_gives_the_same_output_over_grpc(name):
    from tests.cache_service.grpc_harness import running_server
    from prefixcache_client.cache import CacheClient
    with running_server() as server, CacheClient(f"127.0.0.1:{server.port}") as client:
        eng = Engine(model(name), ByteTokenizer(), client, EngineConfig(
            page_size=PAGE, device_pages=128, token_budget=24, model_id=name))
        got = run(eng, {"a": BASE, "b": BASE})
        assert got["a"][0] == got["b"][0] == reference(name, tuple(BASE))
        assert got["b"][1].cached_tokens_device > 0
