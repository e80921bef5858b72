from __future__ import annotations

import random

import pytest

from gateway.core.index import IndexConfig, KvIndex
from gateway.core.policies import (POLICY_NAMES, AffinityConfig, AffinityPolicy, ApproxPolicy,
                                   LeastLoadedPolicy, LoadTracker, RoundRobinPolicy, RouteRequest,
                                   SglangConfig, SglangPolicy, make_policy)
from prefixcache.v1 import common_pb2
from prefixcache_client.hash import prompt_hashes
from tests.gateway.helpers import HOST, FakeClock, batch, heartbeat, pages, stored

WORKERS = [f"w{i}" for i in range(8)]
PAGE = 16


def _request(hashes: list[bytes], rid: str = "r", extra_tokens: int = 0) -> RouteRequest:
    return RouteRequest(rid, hashes, len(hashes) * PAGE + extra_tokens, PAGE)


def _index_with(holdings: dict[str, list[bytes]], clock: FakeClock | None = None) -> KvIndex:
    index = KvIndex(clock=clock) if clock else KvIndex()
    for worker in WORKERS:
        index.add_worker(worker)
    for worker, hashes in holdings.items():
        index.apply(batch(worker, 0, stored(hashes)))
    return index


def test_affinity_picks_the_worker_holding_the_prefix():
    index = _index_with({"w5": pages(0, 40), "w2": pages(0, 10)})
    decision = AffinityPolicy().choose(_request(pages(0, 50)), WORKERS, index, LoadTracker())
    assert decision.worker == "w5"
    by_worker = {s.worker: s for s in decision.scores}
    assert by_worker["w5"].device_tokens == 40 * PAGE and by_worker["w2"].device_tokens == 10 * PAGE
    assert decision.prefill_tokens == 10 * PAGE
    assert "lowest score" in decision.reason


def test_affinity_prices_host_hits_between_device_hits_and_misses():
    index = _index_with({"w1": pages(0, 40)})
    index.apply(batch("w2", 0, stored(pages(0, 40), HOST)))
    policy = AffinityPolicy(AffinityConfig(host_cost=0.2, recent_pages_per_worker=0))
    decision = policy.choose(_request(pages(0, 40)), WORKERS, index, LoadTracker())
    assert decision.worker == "w1"
    by_worker = {s.worker: s for s in decision.scores}
    assert by_worker["w2"].host_tokens == 40 * PAGE
    assert by_worker["w2"].prefill_tokens == pytest.approx(0.2 * 40 * PAGE)
    assert by_worker["w3"].prefill_tokens == 40 * PAGE


def test_affinity_weighs_queued_prefill_against_cached_tokens():
    index = _index_with({"w0": pages(0, 10)})
    load = LoadTracker()
    load.report("w0", common_pb2.LoadReport(queued_prefill_tokens=100_000))
    decision = AffinityPolicy().choose(_request(pages(0, 12)), WORKERS, index, load)
    assert decision.worker != "w0"
    load.report("w0", common_pb2.LoadReport(queued_prefill_tokens=50))
    assert AffinityPolicy().choose(_request(pages(0, 12)), WORKERS, index, load).worker == "w0"


def test_equal_scores_are_spread_over_every_worker():
    index = _index_with({})
    policy, load = AffinityPolicy(AffinityConfig(recent_pages_per_worker=0)), LoadTracker()
    chosen = []
    for i in range(8):
        decision = policy.choose(_request(pages(1000 * i, 1000 * i + 8), str(i)), WORKERS, index, load)
        assert "near-tie of 8" in decision.reason
        chosen.append(decision.worker)
    assert sorted(chosen) == WORKERS
    # With load known, the least loaded of the tied workers wins.
    load.on_route("w0", "x", 5000)
    for w in WORKERS[1:]:
        load.on_route(w, f"x{w}", 9000)
    assert policy.choose(_request(pages(9000, 9008)), WORKERS, index, load).worker == "w0"


def test_a_burst_of_one_prompt_stays_on_the_worker_computing_it():
    """Before its pages' events arrive, the recent-routing memory keeps the burst together."""
    index, load, policy = _index_with({}), LoadTracker(), AffinityPolicy()
    hashes = pages(0, 64)
    first = policy.choose(_request(hashes, "0"), WORKERS, index, load)
    load.on_route(first.worker, "0", first.prefill_tokens)
    for i in range(1, 6):
        decision = policy.choose(_request(hashes, str(i)), WORKERS, index, load)
        load.on_route(decision.worker, str(i), decision.prefill_tokens)
        assert decision.worker == first.worker


def _load_with_recent(recent: dict[str, int]) -> LoadTracker:
    """A tracker whose workers have this much recent routed prefill and nothing queued or in flight."""
    load = LoadTracker(clock=FakeClock())
    for worker, tokens in recent.items():
        load.on_route(worker, f"past-{worker}", tokens)
        load.on_finish(f"past-{worker}")
    return load


def test_a_hot_shared_header_does_not_pull_every_new_prompt_to_its_overloaded_holder():
    """A new prompt that shares only a few-shot header goes by balance; its burst then follows it."""
    header, task = pages(0, 32), pages(1000, 1200)  # 512 shared tokens, 3200 new ones
    index = _index_with({"w3": header})
    recent = {w: 8000 for w in WORKERS} | {"w3": 20_000, "w5": 1000}
    # Without the overload term, the header's 512 tokens outweigh w3's recent excess.
    flat = AffinityPolicy(AffinityConfig(overload_weight=0.0))
    assert flat.choose(_request(header + task, "0"), WORKERS, index, _load_with_recent(recent)).worker == "w3"
    policy, load = AffinityPolicy(), _load_with_recent(recent)
    first = policy.choose(_request(header + task, "0"), WORKERS, index, load)
    by_worker = {s.worker: s for s in first.scores}
    assert by_worker["w3"].overload > 1.0 and by_worker["w5"].overload == 0.0
    # The least recent prefill among the workers at or below the mean: not the header's holder.
    assert first.worker == "w5" and first.prefill_tokens == len(header + task) * PAGE
    load.on_route(first.worker, "0", first.prefill_tokens)
    # The other samples of the burst go where the prompt is being computed, overloaded or not.
    for i in range(1, 8):
        decision = policy.choose(_request(header + task, str(i)), WORKERS, index, load)
        load.on_route(decision.worker, str(i), decision.prefill_tokens)
        assert decision.worker == "w5" and decision.prefill_tokens == 0


def test_an_overloaded_worker_keeps_the_requests_whose_prefix_it_holds():
    """The overload term weighs only the work a worker would compute: a conversation's next turn
    stays on the worker holding its history however loaded that worker is."""
    index = _index_with({"w3": pages(0, 200)})
    load = _load_with_recent({w: 8000 for w in WORKERS} | {"w3": 40_000})
    decision = AffinityPolicy().choose(_request(pages(0, 202)), WORKERS, index, load)
    assert decision.worker == "w3" and decision.prefill_tokens == 2 * PAGE
    # Cached 200 pages, new 160: mostly cached, so a cache decision, whatever w3's overload.
    decision = AffinityPolicy().choose(_request(pages(0, 200) + pages(5000, 5160)), WORKERS, index, load)
    assert decision.worker == "w3" and "overload" not in decision.reason
    # Cached 200, new 240: mostly new, so w3 (2.3 above the mean) pays for its 240 pages and loses.
    decision = AffinityPolicy().choose(_request(pages(0, 200) + pages(5000, 5240)), WORKERS, index, load)
    w3 = next(s for s in decision.scores if s.worker == "w3")
    assert decision.worker != "w3" and w3.overload == pytest.approx(40_000 / 12_000 - 1)
    assert w3.score > 240 * PAGE * (1 + 4 * w3.overload)
    # The same relative overload weighs the same at any throughput: scaled loads, same choice.
    header, task = pages(0, 32), pages(1000, 1200)
    index = _index_with({"w3": header})
    for scale in (1, 100):
        recent = {w: 8000 * scale for w in WORKERS} | {"w3": 12_000 * scale, "w5": 7000 * scale}
        chosen = AffinityPolicy(AffinityConfig(balance_weight=0.0)).choose(
            _request(header + task), WORKERS, index, _load_with_recent(recent))
        assert chosen.worker == "w5"


def test_load_alone_does_not_move_a_prompt_off_the_worker_holding_its_prefix():
    """Requests in flight slow a holder down by a few percent; recomputing its prefix elsewhere
    is paid in full. A long queue on the holder, or balance (the test above), still moves it."""
    header, task = pages(0, 32), pages(1000, 1040)  # 512 tokens held by w3, 640 new
    index, request = _index_with({"w3": header}), _request(header + task)
    load = LoadTracker()
    load.report("w3", common_pb2.LoadReport(running_requests=20))  # 20 x 50 tokens > the 512 held
    kept = AffinityPolicy().choose(request, WORKERS, index, load)
    w3 = next(s for s in kept.scores if s.worker == "w3")
    assert kept.worker == "w3" and kept.prefill_tokens == len(task) * PAGE
    assert "kept on a holder" in kept.reason and w3.score > min(s.score for s in kept.scores)
    # Its queue over two steps of prefill (move_queue_tokens): load may move it, at a recompute.
    load.report("w3", common_pb2.LoadReport(running_requests=20, queued_prefill_tokens=20_000))
    moved = AffinityPolicy().choose(request, WORKERS, index, load)
    assert moved.worker != "w3" and moved.prefill_tokens == len(header + task) * PAGE
    assert AffinityPolicy(AffinityConfig(move_queue_tokens=30_000)).choose(
        request, WORKERS, index, load).worker == "w3"


@pytest.mark.parametrize("other", [{"adapter": "lora-1"}, {"salt": "tenant-b"}, {"model_id": "other-model"}])
def test_namespaces_never_match_each_other(other):
    tokens = [random.Random(1).randrange(50_000) for _ in range(40 * PAGE)]
    ns = {"model_id": "m", "adapter": "", "salt": "tenant-a"}
    held = prompt_hashes(tokens, PAGE, **ns)
    index = _index_with({"w6": held})
    policy = AffinityPolicy(AffinityConfig(recent_pages_per_worker=0))
    same = policy.choose(_request(prompt_hashes(tokens, PAGE, **ns)), WORKERS, index, LoadTracker())
    assert same.worker == "w6" and max(s.device_tokens for s in same.scores) == 40 * PAGE
    foreign = policy.choose(_request(prompt_hashes(tokens, PAGE, **{**ns, **other})), WORKERS, index,
                            LoadTracker())
    assert all(s.device_tokens == s.host_tokens == s.remote_tokens == 0 for s in foreign.scores)


def test_a_stale_worker_is_trusted_less():
    clock = FakeClock()
    index = KvIndex(IndexConfig(stale_after_s=5, dead_after_s=30), clock=clock)
    index.apply(batch("w0", 0, stored(pages(0, 30))))  # longer match, but goes quiet
    index.apply(batch("w1", 0, stored(pages(0, 24))))
    clock.now += 20
    index.heartbeat(heartbeat("w1", 0))
    decision = AffinityPolicy().choose(_request(pages(0, 30)), ["w0", "w1"], index, LoadTracker())
    assert decision.worker == "w1"
    by_worker = {s.worker: s for s in decision.scores}
    assert by_worker["w0"].confidence < 1.0 and by_worker["w1"].confidence == 1.0
    index.heartbeat(heartbeat("w0", 0))  # heard from again: full confidence, longest match wins
    assert AffinityPolicy().choose(_request(pages(0, 30)), ["w0", "w1"], index, LoadTracker()).worker == "w0"


def test_approx_remembers_what_it_routed_without_events():
    index, load, policy = _index_with({}), LoadTracker(), ApproxPolicy(max_pages_per_worker=1000)
    first = policy.choose(_request(pages(0, 30), "a"), WORKERS, index, load)
    load.on_route(first.worker, "a", first.prefill_tokens)
    load.on_finish("a")
    follow_up = policy.choose(_request(pages(0, 40), "b"), WORKERS, index, load)
    assert follow_up.worker == first.worker
    assert {s.worker: s.device_tokens for s in follow_up.scores}[first.worker] == 30 * PAGE
    policy.remove_worker(first.worker)
    assert policy.routed.size(first.worker) == 0


def test_load_tracker_combines_own_view_and_reports():
    clock = FakeClock()
    load = LoadTracker(clock=clock, report_ttl_s=5)
    load.on_route("w0", "a", 1000)
    load.on_route("w0", "b", 500)
    assert (load.get("w0").queued_prefill_tokens, load.get("w0").inflight_requests) == (1500, 2)
    load.report("w0", common_pb2.LoadReport(queued_prefill_tokens=4000, waiting_requests=3, running_requests=1))
    assert (load.get("w0").queued_prefill_tokens, load.get("w0").inflight_requests) == (4000, 4)
    clock.now += 10  # the report is stale: only the gateway's own view counts
    load.on_first_token("a")
    assert load.get("w0").queued_prefill_tokens == 500
    load.on_finish("a")
    load.on_finish("b")
    assert (load.get("w0").queued_prefill_tokens, load.get("w0").inflight_requests) == (0, 0)
    assert 0 < load.get("w0").recent_prefill_tokens < 1500  # decays
    load.remove_worker("w0")
    assert load.get("w0").recent_prefill_tokens == 0


def test_round_robin_and_least_loaded():
    index, load = _index_with({}), LoadTracker()
    rr = RoundRobinPolicy()
    assert [rr.choose(_request(pages(0, 1)), WORKERS, index, load).worker for _ in range(9)] == WORKERS + ["w0"]
    for w in WORKERS:
        load.report(w, common_pb2.LoadReport(queued_prefill_tokens=100 if w != "w3" else 10))
    assert LeastLoadedPolicy().choose(_request(pages(0, 1)), WORKERS, index, load).worker == "w3"


def test_sglang_cache_aware_rule():
    index, load = _index_with({}), LoadTracker()
    policy = SglangPolicy(SglangConfig(cache_threshold=0.5, balance_abs_threshold=4, balance_rel_threshold=1.5))
    first = policy.choose(_request(pages(0, 20), "a"), WORKERS, index, load)
    # Match rate 20/24 > 0.5: the worker whose tree holds the prefix.
    assert policy.choose(_request(pages(0, 24), "b"), WORKERS, index, load).worker == first.worker
    # Match rate 20/100 <= 0.5: the smallest tree (any worker but the one holding 24 pages).
    low = policy.choose(_request(pages(0, 100), "c"), WORKERS, index, load)
    assert low.worker != first.worker and "smallest tree" in low.reason
    # Imbalanced in-flight counts: shortest queue, whatever the cache says.
    for i in range(10):
        load.on_route(first.worker, f"x{i}", 1)
    shortest = policy.choose(_request(pages(0, 24), "d"), WORKERS, index, load)
    assert shortest.worker != first.worker and "imbalanced" in shortest.reason


def test_make_policy_knows_every_name():
    for name in POLICY_NAMES:
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="policy"):
        make_policy("nope")
    with pytest.raises(ValueError, match="candidates"):
        AffinityPolicy().choose(_request(pages(0, 1)), [], KvIndex(), LoadTracker())


def _preview_scenario() -> tuple[list[RouteRequest], KvIndex]:
    """Requests that exercise every branch: held prefixes, repeats, near-ties, new prompts."""
    index = _index_with({"w5": pages(0, 40), "w2": pages(0, 10), "w7": pages(500, 530)})
    requests = []
    for i in range(24):
        base = (0, 500, 1000 * (i + 1), 0)[i % 4]
        requests.append(_request(pages(base, base + 20 + i), str(i)))
    return requests, index


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_preview_is_choose_without_side_effects(name):
    """Interleaving previews changes no later choice, and each preview is the choice made next."""
    requests, index = _preview_scenario()
    watched, plain = make_policy(name), make_policy(name)
    clock = FakeClock()  # recent load decays with time: both trackers see the same instants
    load_watched, load_plain = LoadTracker(clock=clock), LoadTracker(clock=clock)
    for request in requests:
        before = watched.preview(request, WORKERS, index, load_watched)
        assert watched.preview(request, WORKERS, index, load_watched) == before
        chosen = watched.choose(request, WORKERS, index, load_watched)
        assert chosen == before
        expected = plain.choose(request, WORKERS, index, load_plain)
        assert chosen == expected
        for load in (load_watched, load_plain):
            load.on_route(chosen.worker, request.request_id, chosen.prefill_tokens)
        clock.now += 1.0


def test_preview_leaves_routed_memory_and_rotation_alone():
    index, load = _index_with({}), LoadTracker()
    affinity, approx, sglang = AffinityPolicy(), ApproxPolicy(max_pages_per_worker=1000), SglangPolicy()
    rr, least = RoundRobinPolicy(), LeastLoadedPolicy()
    for i in range(5):
        request = _request(pages(100 * i, 100 * i + 30), str(i))
        for policy in (affinity, approx, sglang, rr, least):
            policy.preview(request, WORKERS, index, load)
    assert all(affinity.recent.size(w) == approx.routed.size(w) == sglang.routed.size(w) == 0 for w in WORKERS)
    assert (affinity._rr, rr._next, least._rr) == (0, 0, 0)
    assert rr.choose(_request(pages(0, 1)), WORKERS, index, load).worker == "w0"
    with pytest.raises(ValueError, match="candidates"):
        affinity.preview(_request(pages(0, 1)), [], index, load)
