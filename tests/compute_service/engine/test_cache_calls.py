"""The engine does not wait on the cache (compute_service.engine.step_planner): prefix caching off
gives the same greedy tokens as on; a steady decode calls the cache once per page, during the
forward; overlapped and waited-for calls give the same output; a failed overlapped call is undone
and retried (or the pool is re-registered); leases are renewed before they expire; and the time
spent waiting on the cache is counted and exported."""
from __future__ import annotations

import random
import threading
import time

import grpc
import pytest
import torch

from cache_service.core import DEFAULT_LEASE_TTL_S, CacheCore
from compute_service.engine import Engine, EngineConfig, SamplingParams
from compute_service.engine.local_pages import LocalPages
from compute_service.engine.step_planner import SERVICE_LEASE_TTL_S
from compute_service.model import ByteTokenizer
from compute_service.server_metrics import ComputeMetrics
from prefixcache.v1 import cache_service_pb2 as pb
from prefixcache_client.cache import CacheUnavailableError
from tests.compute_service.engine.references import FAMILIES, NEW, PAGE, model, reference
from tests.compute_service.hf_families import is_hf


def engine(name: str, cache=None, **cfg) -> Engine:
    settings = dict(page_size=PAGE, device_pages=256, token_budget=24, max_running=16,
                    checkpoint_slots=64, model_id=name)
    settings.update(cfg)
    if settings.get("prefix_cache", True) and cache is None:
        cache = CacheCore()
    return Engine(model(name), ByteTokenizer(), cache, EngineConfig(**settings))


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 255) for _ in range(n)]


def run(eng: Engine, prompts: dict[str, list[int]], new: int = NEW, step=None) -> dict:
    """Submits all prompts at once; steps (with `step`, else Engine.step) until idle; returns
    tokens and final stats per id."""
    got: dict[str, list] = {k: [] for k in prompts}
    for key, prompt in prompts.items():
        eng.submit(prompt, SamplingParams(max_tokens=new, ignore_eos=True), got[key].append,
                   request_id=key)
    for _ in range(10_000):
        if not eng.has_work():
            break
        (step or eng.step)()
    return {k: ([t for o in outs for t in o.token_ids], outs[-1].stats) for k, outs in got.items()}


BASE = prompt_of(1, 45)
# Cold prompts, some sharing pages with each other (siblings), two the same (twins).
MIXED = {"a": BASE, "b": BASE[:30] + prompt_of(2, 9), "c": prompt_of(3, 21), "d": BASE,
         "e": prompt_of(4, 7)}


# ---- prefix caching off ----------------------------------------------------------------------

@pytest.mark.parametrize("name", FAMILIES)
def test_no_prefix_cache_gives_the_cached_engines_greedy_output(name):
    cached = run(engine(name), MIXED)
    off_engine = engine(name, prefix_cache=False)
    off = run(off_engine, MIXED)
    for key, prompt in MIXED.items():
        assert off[key][0] == cached[key][0] == reference(name, tuple(prompt)), key
        assert off[key][1].cached_tokens_device == 0
        assert off[key][1].computed_prompt_tokens == len(prompt)  # no sibling waits for publishes
    assert sum(s.cached_tokens_device for _, s in cached.values()) > 0  # the cached one did hit
    local: LocalPages = off_engine.cache
    assert isinstance(local, LocalPages) and not local.leases
    assert sorted(local.free) == list(range(256))  # every page came back
    assert off_engine.stats.cached_prompt_tokens == 0 and off_engine.stats.cache_calls > 0
    assert off_engine.stats.cache_calls_overlapped == 0  # in process: nothing to hide


def test_no_prefix_cache_with_preemption_and_adapters_unload():
    name = "tiny-hybrid"
    prompts = {f"p{i}": prompt_of(200 + i, 45) for i in range(6)}
    eng = engine(name, prefix_cache=False, device_pages=30, token_budget=64)
    got = run(eng, prompts)
    assert eng.stats.preemptions > 0
    for key, prompt in prompts.items():
        assert got[key][0] == reference(name, tuple(prompt)), key
    assert eng.cache.evict_namespace(pb.EvictNamespaceRequest()).removed_pages == 0


def test_no_prefix_cache_refuses_a_cache_and_tiers():
    with pytest.raises(ValueError, match="^cache"):
        engine("tiny-transformer", cache=CacheCore(), prefix_cache=False)
    with pytest.raises(ValueError, match="^prefix_cache"):
        engine("tiny-transformer", prefix_cache=False, host_pages=8)


def test_local_pages_allocates_all_or_nothing_and_frees_on_release():
    local = LocalPages()
    local.register_pool(pb.RegisterPoolRequest(pool_id="w", epoch=1, page_size=4, device_pages=3))
    resp = local.step(pb.StepRequest(matches=[pb.MatchOp(request_id="r", packed_token_ids=b"")]))
    m = resp.matches[0]
    assert (m.cached_tokens, list(m.device_pages), m.mamba_slot) == (0, [], -1)
    lease = m.lease_id
    ok = local.step(pb.StepRequest(allocations=[pb.AllocateOp(lease_id=lease, num_pages=2)]))
    assert ok.allocations[0].ok and list(ok.allocations[0].device_pages) == [0, 1]
    no = local.step(pb.StepRequest(allocations=[pb.AllocateOp(lease_id=lease, num_pages=2)]))
    assert not no.allocations[0].ok and "1 free" in no.allocations[0].reason
    local.step(pb.StepRequest(releases=[pb.ReleaseOp(lease_id=lease)]))
    assert sorted(local.free) == [0, 1, 2] and not local.leases
    with pytest.raises(ValueError, match="publishes"):
        local.step(pb.StepRequest(publishes=[pb.PublishOp(lease_id=lease, computed_pages=1)]))


# ---- what a decode sends -----------------------------------------------------------------------

class Recording:
    """Wraps a cache's `step`: every request it was sent, and from which thread."""

    def __init__(self, cache, fail=None):
        self.cache, self.calls, self.threads, self.fail = cache, [], [], fail
        self.real = cache.step
        cache.step = self

    def __call__(self, req: pb.StepRequest) -> pb.StepResponse:
        self.calls.append(req)
        self.threads.append(threading.current_thread().name)
        if self.fail is not None:
            self.fail(len(self.calls), req, self.real)
        return self.real(req)


@pytest.mark.parametrize("name", ["tiny-transformer", "tiny-hybrid"])
def test_a_steady_decode_calls_the_cache_once_per_page_during_the_forward(name):
    new = 26
    eng = engine(name, token_budget=256)
    rec = Recording(eng.cache)
    prompts = {f"r{i}": prompt_of(50 + i, 16) for i in range(4)}  # 4 pages each
    got: dict[str, list] = {k: [] for k in prompts}
    for key, prompt in prompts.items():
        eng.submit(prompt, SamplingParams(max_tokens=new, ignore_eos=True), got[key].append,
                   request_id=key)
    eng.step()  # matches
    eng.step()  # the prompts, and every first token
    first = len(rec.calls)
    steps = eng.stats.steps
    while eng.running:
        eng.step()
    decode_steps = eng.stats.steps - steps
    eng.run_until_idle()  # the releases
    decode = rec.calls[first:]
    for key, prompt in prompts.items():
        assert [t for o in got[key] for t in o.token_ids] == reference(name, tuple(prompt), new)
    # 25 decode steps cross 6 page boundaries (tokens 17..41 of 4-token pages): at most one call
    # per page (the first decode token's page is allocated now: one call waited for) and the
    # final releases; no renewal (the TTL is long), no load report that did not change.
    assert decode_steps == new - 1
    assert len(decode) <= 1 + 6 + 1, [len(c.publishes) for c in decode]
    assert all(not c.renew_lease_ids for c in decode)
    overlapped = [c for c, t in zip(decode, rec.threads[first:]) if t == "cache-caller"]
    assert len(overlapped) >= 5 and eng.stats.cache_calls_overlapped >= 5
    for c in overlapped:  # one call per page: publish, lookahead allocation (and checkpoint)
        assert {op.lease_id for op in c.publishes} == {op.lease_id for op in c.allocations}
        assert all(len(op.packed_append_token_ids) <= 4 * PAGE for op in c.publishes)
        if name == "tiny-hybrid":
            assert len(c.checkpoints) == len(c.publishes) == 4
    # What the cache holds equals what a waited-for engine leaves: every full page published.
    stats = eng.cache.get_stats(pb.GetStatsRequest()).pools[0]
    assert stats.active_leases == 0
    assert stats.media[0].cached_pages == 4 * ((16 + new - 1) // PAGE)


# The presets only: the overlap is family-independent, and this is the heaviest engine test
# (two engines, 11 prompts, preemption); the "hf:" families' cache paths are in test_correctness.
@pytest.mark.parametrize("name", [f for f in FAMILIES if not is_hf(f)])
def test_overlapped_and_waited_for_calls_give_the_same_output(name):
    prompts = {f"p{i}": prompt_of(300 + i, 45) for i in range(6)} | MIXED
    outs = {}
    for overlap in (True, False):
        eng = engine(name, device_pages=40, token_budget=64, overlap_cache_calls=overlap)
        outs[overlap] = run(eng, prompts, new=9)
        assert eng.stats.preemptions > 0  # 40 pages cannot hold them all
        assert (eng.stats.cache_calls_overlapped > 0) == overlap
    for key, prompt in prompts.items():
        assert outs[True][key][0] == outs[False][key][0] == reference(name, tuple(prompt), 9)


# ---- failures ----------------------------------------------------------------------------------

def unavailable():
    return CacheUnavailableError("Step", grpc.StatusCode.UNAVAILABLE, "injected")


@pytest.mark.parametrize("name", ["tiny-transformer", "tiny-hybrid"])
def test_a_failed_overlapped_call_is_undone_and_its_ops_sent_again(name):
    """The call fails before the cache applied anything: the step still emits the tokens its
    forward sampled, raises, and the next step sends the same publishes again."""
    eng = engine(name, token_budget=64)
    failed: list[pb.StepRequest] = []

    def fail(n, req, real):
        if threading.current_thread().name == "cache-caller" and req.publishes and not failed:
            failed.append(req)
            raise unavailable()

    rec = Recording(eng.cache, fail)
    errors = []

    def step():
        try:
            eng.step()
        except CacheUnavailableError as exc:
            errors.append(exc)

    prompts = {f"r{i}": prompt_of(70 + i, 14) for i in range(3)}
    got = run(eng, prompts, new=12, step=step)
    assert len(errors) == 1 and failed
    retry = rec.calls[rec.calls.index(failed[0]) + 1]
    again = {op.lease_id: op.computed_pages for op in retry.publishes}
    assert all(again.get(op.lease_id, 0) >= op.computed_pages for op in failed[0].publishes)
    for key, prompt in prompts.items():
        assert got[key][0] == reference(name, tuple(prompt), 12), key


def test_an_overlapped_call_lost_after_it_was_applied_re_registers_the_pool():
    """The answer is lost after the cache applied the step (not idempotent): the loop
    re-registers under a new epoch and every request is recomputed to the same output."""
    name = "tiny-hybrid"
    eng = engine(name, token_budget=64)
    lost = []

    def fail(n, req, real):
        if threading.current_thread().name == "cache-caller" and req.publishes and not lost:
            lost.append(real(req))
            raise unavailable()

    Recording(eng.cache, fail)
    prompts = {f"r{i}": prompt_of(90 + i, 14) for i in range(3)}
    done = threading.Event()
    got: dict[str, list] = {k: [] for k in prompts}

    def sink(key):
        return lambda o: (got[key].append(o),
                          o.stats and all(v and v[-1].stats for v in got.values()) and done.set())

    eng.start()
    try:
        for key, prompt in prompts.items():
            eng.submit(prompt, SamplingParams(max_tokens=12, ignore_eos=True), sink(key),
                       request_id=key)
        assert done.wait(60)
    finally:
        eng.close()
    assert lost and eng.stats.recoveries == 1
    for key, prompt in prompts.items():
        assert [t for o in got[key] for t in o.token_ids] == reference(name, tuple(prompt), 12)


# ---- leases, waits, metrics --------------------------------------------------------------------

def test_leases_are_renewed_before_they_expire():
    """A TTL of 0.4 s and steps 0.15 s apart: renewals go out (a quarter TTL after a lease was
    last named) and no lease expires, though most steps send nothing."""
    eng = engine("tiny-transformer", lease_ttl_s=0.4)
    rec = Recording(eng.cache)

    def slow_step():
        eng.step()
        time.sleep(0.15)

    got = run(eng, {"r": BASE[:9]}, new=10, step=slow_step)
    assert got["r"][0] == reference("tiny-transformer", tuple(BASE[:9]), 10)
    assert any(c.renew_lease_ids for c in rec.calls)
    assert eng.stats.preemptions == 0
    assert SERVICE_LEASE_TTL_S == DEFAULT_LEASE_TTL_S


def test_the_cache_wait_is_counted_and_exported():
    eng = engine("tiny-transformer")
    run(eng, {f"r{i}": prompt_of(400 + i, 12) for i in range(4)}, new=12)
    s = eng.stats
    assert 0 < s.cache_wait_s < s.step_s
    assert 0 < s.cache_calls_overlapped < s.cache_calls < s.steps
    metrics = ComputeMetrics(lambda: eng, lambda: 0)

    def sample(name, **labels):
        return metrics.registry.get_sample_value(name, labels)

    assert sample("prefixcache_compute_cache_wait_seconds_total") == s.cache_wait_s
    assert sample("prefixcache_compute_engine_step_seconds_total") == s.step_s
    assert sample("prefixcache_compute_cache_calls_total", mode="overlapped") == \
        s.cache_calls_overlapped
    assert sample("prefixcache_compute_cache_calls_total", mode="waited") == \
        s.cache_calls - s.cache_calls_overlapped


def test_checkpoints_stored_in_parallel_land_in_their_slots():
    """Many checkpoints of one step (a decode completing a page in every request) are copied by
    two threads on CPU: each slot gets its own state, from the running slot or a kept copy."""
    eng = engine("tiny-hybrid", max_running=12, checkpoint_slots=24)
    runner = eng.runner
    gen = torch.Generator().manual_seed(0)
    for ssm, conv in runner.states:
        ssm.copy_(torch.randn(ssm.shape, generator=gen))
        conv.copy_(torch.randn(conv.shape, generator=gen))
    from compute_service.engine.request import Request
    stored, want = [], {}
    for i in range(12):
        r = Request(f"r{i}", [1], SamplingParams(), lambda o: None, slot=i)
        kept = None if i % 3 else runner.snapshot_state((i + 5) % 12)
        r.checkpoints[7] = kept
        dst = 23 - 2 * i if i < 11 else 0
        stored.append((r, pb.CheckpointResult(lease_id="l", page_index=7, ok=True, slot=dst)))
        src = i if kept is None else (i + 5) % 12
        want[12 + dst] = [(ssm[src].clone(), conv[src].clone()) for ssm, conv in runner.states]
    assert len(stored) >= runner.parallel_copies
    runner.store_checkpoints(stored)
    for dst, states in want.items():
        for (ssm, conv), (s, c) in zip(runner.states, states):
            assert torch.equal(ssm[dst], s) and torch.equal(conv[dst], c), dst
    assert all(not r.checkpoints for r, _ in stored) and runner._copier is not None
    eng.close()
    assert runner._copier is None


@pytest.mark.parametrize("name", ["tiny-transformer", "tiny-hybrid"])
def test_a_twin_matched_in_an_overlapped_call_takes_its_first_token_from_that_forward(name):
    """A's last prompt token needs no new page, so the step that computes it sends its call
    during the forward, with twin B's match: B is still waiting while the forward samples, takes
    its first token from A's logits, and is started (with the tokens its match sent) before
    that token is appended. Both give the reference's tokens."""
    prompt = prompt_of(500, 8)  # two pages
    eng = engine(name, token_budget=7)
    rec = Recording(eng.cache)
    got = run(eng, {"a": prompt, "b": prompt}, new=NEW)
    want = reference(name, tuple(prompt))
    assert got["a"][0] == got["b"][0] == want
    assert got["b"][1].first_token_from_twin and eng.stats.twin_first_tokens == 1
    overlapped = [c for c, t in zip(rec.calls, rec.threads) if t == "cache-caller"]
    assert any(c.matches and c.matches[0].request_id == "b" for c in overlapped)


def test_the_server_flag_turns_prefix_caching_off(monkeypatch):
    from compute_service.__main__ import engine_config, parse_args

    monkeypatch.delenv("PREFIXCACHE_PREFIX_CACHE", raising=False)
    assert parse_args(["--model", "tiny-transformer"]).prefix_cache is True
    args = parse_args(["--model", "tiny-transformer", "--no-prefix-cache"])
    assert args.prefix_cache is False
    assert engine_config(args, model("tiny-transformer"), "m", 1, None).prefix_cache is False
    with pytest.raises(SystemExit):
        parse_args(["--model", "tiny-transformer", "--no-prefix-cache", "--host-pages", "8"])
    monkeypatch.setenv("PREFIXCACHE_PREFIX_CACHE", "0")
    assert parse_args(["--model", "tiny-transformer"]).prefix_cache is False
