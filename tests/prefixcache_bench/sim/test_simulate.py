from __future__ import annotations

import json

import pytest

from gateway.core.index import KvIndex
from gateway.core.index_table import page_keys
from gateway.core.policies import RoundRobinPolicy, make_policy
from prefixcache_bench.sim import fleet_summary
from prefixcache_bench.sim.bench import run_bench
from prefixcache_bench.sim.cache import PageCache, SharedL3
from prefixcache_bench.sim.bounds import unbounded_hit_ratio
from prefixcache_bench.sim.engine import SimConfig, run_policy, split_hashes
from prefixcache_bench.sim.simulate import main
from prefixcache_bench.sim.trace import BlockTokens, CopyHashes, TraceRequest, load_trace, scale_copies
from prefixcache_bench import CONVERSATION_TRACE
from tests.gateway.helpers import DEVICE, HOST, REMOTE, batch, pages

KEYS = {"hit_ratio", "bound_hit_ratio", "imbalance", "mean_ttft_s", "p99_ttft_s", "decision_p50_us",
        "decision_p99_us"}


def test_page_cache_events_reproduce_its_page_sets():
    cache = PageCache(device_pages=20, host_pages=15, page_size=16)
    index = KvIndex()
    prompts = [pages(0, 8), pages(0, 12), pages(100, 110), pages(0, 4) + pages(200, 206), pages(0, 12),
               pages(300, 325), pages(0, 8)]
    for seq, prompt in enumerate(prompts):
        d, h = cache.match(prompt)
        assert index.apply(batch("w", seq, *cache.commit(prompt, d, h))).page_events > 0
    assert index.pages("w", DEVICE) == page_keys(cache.device)
    assert index.pages("w", HOST) == page_keys(cache.host)
    assert len(cache.device) == 20 and len(cache.host) == 15


def test_simulator_on_a_trace_slice(tmp_path):
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    assert main(["--trace", str(CONVERSATION_TRACE), "--workers", "8", "--capacity-tokens", "200000", "--policy", "all",
                 "--max-requests", "300", "--json", str(out), "--png", str(png), "--quiet"]) == 0
    result = json.loads(out.read_text())
    policies = result["policies"]
    assert set(policies) == {"affinity", "approx", "round_robin", "least_loaded", "sglang"}
    for stats in policies.values():
        assert KEYS <= set(stats)
        assert stats["requests"] == 300 and 0 <= stats["hit_ratio"] <= 1
    assert policies["affinity"]["hit_ratio"] > policies["round_robin"]["hit_ratio"]
    assert 0 < result["bound_hit_ratio"] <= 1 and "hit_vs_bound_ok" in result["goals"]
    assert png.stat().st_size > 10_000


def test_simulator_on_a_scaled_trace_routes_through_the_router_and_sizes_the_index(tmp_path):
    out = tmp_path / "sim.json"
    args = ["--trace", str(CONVERSATION_TRACE), "--workers", "24", "--capacity-tokens", "200000",
            "--policy", "affinity", "--max-requests", "87", "--json", str(out), "--quiet"]
    assert main(args + ["--scale-copies", "3", "--copy-spacing-s", "0"]) == 0
    result = json.loads(out.read_text())
    aff = result["policies"]["affinity"]
    assert aff["requests"] == 87 and len(aff["computed_prefill_tokens_per_worker"]) == 24
    assert result["command"].endswith("--scale-copies 3 --copy-spacing-s 0")
    assert "load_avg_start" in result and aff["decision_p99_us"] >= aff["decision_p50_us"] > 0
    # Every page a request computed is indexed once (no host tier, no L3, nothing evicted yet at
    # this size): keys = distinct pages, ~34-53 bytes each in the flat table (plus masks).
    assert 0 < aff["index_keys"] and 20 < aff["index_bytes_per_key"] < 200
    # Three disjoint copies in step (no spacing): the first 87 are each copy's first 29 (its 30th
    # ties with its 31st), and no request of a copy hits another copy's pages, so the ceiling is
    # that of one copy's 29.
    assert main(args[:-5] + ["--max-requests", "29", "--json", str(out), "--quiet"]) == 0
    one = json.loads(out.read_text())
    assert result["unbounded_hit_ratio"] == pytest.approx(one["unbounded_hit_ratio"])
    scaled = tmp_path / "scaled.json"
    scaled.write_text(json.dumps(result))
    summary = tmp_path / "summary.txt"
    assert fleet_summary.main([str(scaled), str(out), "--out", str(summary)]) == 0
    table = summary.read_text().splitlines()
    assert table[0].split()[:6] == ["file", "policy", "workers", "copies", "requests", "hit_ratio"]
    assert table[2].split()[:5] == ["scaled.json", "affinity", "24", "3", "87"]
    assert table[3].split()[:5] == ["sim.json", "affinity", "24", "1", "29"]
    assert table[-1] == one["command"]


def test_a_bounded_index_evicts_and_says_how_much(tmp_path):
    """--index-entries bounds the Router's index: it ends within the bound, counts what the bound
    dropped, and routing with less prefix knowledge hits no more than with all of it."""
    out = tmp_path / "sim.json"
    args = ["--trace", str(CONVERSATION_TRACE), "--workers", "4", "--capacity-tokens", "200000",
            "--policy", "affinity", "--max-requests", "200", "--json", str(out), "--quiet"]
    assert main(args) == 0
    full = json.loads(out.read_text())["policies"]["affinity"]
    assert full["index_evictions"] == 0
    assert main(args + ["--index-entries", "2000"]) == 0
    bounded = json.loads(out.read_text())["policies"]["affinity"]
    assert bounded["index_keys"] <= 2000 < full["index_keys"]
    assert bounded["index_evictions"] > 0
    assert bounded["hit_ratio"] <= full["hit_ratio"]


def test_a_copy_alone_replays_as_the_original_and_copies_together_share_no_page():
    # Copy 2 of the trace's first 60 requests, alone on 4 workers: its masked hashes give the
    # same hits, the same prefill per worker and the same index size as the original's own.
    original = load_trace(CONVERSATION_TRACE, 60)
    blocks = BlockTokens()
    blobs = [b"".join(blocks.page_hashes(r, 16, "sim-model")) for r in original]
    cfg = SimConfig(workers=4, capacity_tokens=100_000)
    base = run_policy(original, blobs, make_policy("affinity"), cfg)
    scaled = scale_copies(original, 3, 0.0)
    alone = [r for r in scaled if r.copy == 2]
    copy = run_policy(alone, CopyHashes(alone, blobs), make_policy("affinity"), cfg)
    assert base.cached_tokens > 0 and copy.prompt_tokens == base.prompt_tokens
    assert (copy.cached_tokens, copy.computed_per_worker, copy.index_keys) == (
        base.cached_tokens, base.computed_per_worker, base.index_keys)
    # All three copies on 12 workers: no copy's page is another's, so the index holds three
    # times the pages one copy left, and the unbounded ceiling is the original's.
    hashes = CopyHashes(scaled, blobs)
    per_copy = [set().union(*(split_hashes(hashes[i]) for i, r in enumerate(scaled) if r.copy == k))
                for k in range(3)]
    assert len(set().union(*per_copy)) == 3 * len(per_copy[0]) > 0
    assert unbounded_hit_ratio(scaled, blobs, 16) == pytest.approx(unbounded_hit_ratio(original, blobs, 16))
    big = run_policy(scaled, hashes, make_policy("affinity"), SimConfig(workers=12, capacity_tokens=10**7))
    small = run_policy(original, blobs, make_policy("affinity"), SimConfig(workers=4, capacity_tokens=10**7))
    assert big.index_keys == 3 * small.index_keys


def test_simulator_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["--trace", "x.jsonl", "--policy", "nope"])
    with pytest.raises(SystemExit):
        main([])
    assert "--trace is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--trace", "x.jsonl", "--index-entries", "-1"])
    assert "--index-entries must be >= 1" in capsys.readouterr().err


def test_micro_benchmark_reports_decision_latency_and_ingest_rate():
    result = run_bench(workers=8, prompt_tokens=1024, samples=40, prefixes_per_worker=2, ingest_batches=200)
    assert 0 < result.decision_p50_us <= result.decision_p99_us
    assert result.hash_p99_us > 0 and result.lookup_p99_us > 0
    assert result.ingest_page_events_per_s > 10_000 and result.index_entries > 0


def test_shared_l3_events_reproduce_its_page_set():
    l3, index = SharedL3(capacity_pages=30, page_size=16), KvIndex()
    # Each write lists a prompt's pages deepest first; the last one rewrites held pages only.
    writes = [pages(0, 12), pages(100, 120), pages(0, 12), pages(200, 215), pages(5, 9), pages(300, 312)]
    for seq, hashes in enumerate(writes):
        pairs = [(h, hashes[i - 1] if i else b"") for i, h in reversed(list(enumerate(hashes)))]
        index.apply(batch("l3", seq, *l3.write(pairs)))
    assert index.pages("l3", REMOTE) == page_keys(l3.pages) and len(l3) == 30
    assert (l3.new_pages, l3.evictions, l3.writes) == (12 + 20 + 2 + 15 + 0 + 12, 2 + 2 + 15 + 0 + 12, 75)
    assert l3.extend(pages(0, 12), 0) == 0 and l3.extend(pages(0, 12), 5) == 4  # 5..8 were rewritten
    assert l3.extend(pages(200, 215), 0) == 14  # its deepest page went first
    # REMOTE is shared: a worker that holds nothing still matches the L3's pages.
    index.add_worker("w")
    assert index.lookup(pages(200, 215))["w"].remote_pages == 14


def _requests(*prompts: list[bytes]) -> tuple[list[TraceRequest], list[bytes]]:
    reqs = [TraceRequest(i, 10.0 * i, 16 * len(p), 1, ()) for i, p in enumerate(prompts)]
    return reqs, [b"".join(p) for p in prompts]


def test_siblings_wait_for_the_pages_a_step_computes_and_twins_share_its_first_token():
    # One worker busy with X when Y, its twin, Y + 2 pages and Z arrive: the next step takes Y
    # and Z and holds the other two back (Scheduler._waits_for_sibling). The twin gets its first
    # token with Y's (Scheduler.twins); both then run a step that hits Y's pages.
    x, y, z = pages(0, 64), pages(1000, 1010), pages(2000, 2010)
    y2 = y + pages(3000, 3002)
    prompts = [x, y, y, y2, z]
    reqs = [TraceRequest(i, 0.001 * i, 16 * len(p), 1, (i if p is not y else -1,))
            for i, p in enumerate(prompts)]
    result = run_policy(reqs, [b"".join(p) for p in prompts], RoundRobinPolicy(), SimConfig(workers=1))
    assert result.computed_per_worker == [16 * (64 + 10 + 2 + 10)] and result.cached_tokens == 2 * 160
    # First tokens in the order recorded: X; the twin, Y and Z at one step's end; then Y + 2.
    finish = [t + a for t, a in zip(result.ttft_s, (0.0, 0.002, 0.001, 0.004, 0.003))]
    assert finish[2] == pytest.approx(finish[1]) and finish[3] == pytest.approx(finish[1])
    assert finish[0] < finish[1] < finish[4]


def test_l3_write_back_reloads_what_a_worker_evicted():
    # One worker holding 64 pages: B evicts A, which goes to L3 and is loaded back for A again.
    a, b = pages(0, 64), pages(1000, 1064)
    reqs, blobs = _requests(a, b, a)
    cfg = SimConfig(workers=1, capacity_tokens=64 * 16, l3_capacity_tokens=1000 * 16)
    result = run_policy(reqs, blobs, RoundRobinPolicy(), cfg)
    assert (result.cached_tokens, result.l3_hit_tokens, result.host_hit_tokens) == (64 * 16, 64 * 16, 0)
    assert result.l3_new_pages == 128 and result.ttft_s[2] < result.ttft_s[0] / 2
    # Without the L3, A is computed twice.
    assert run_policy(reqs, blobs, RoundRobinPolicy(), SimConfig(workers=1, capacity_tokens=64 * 16)
                      ).cached_tokens == 0


def test_l3_write_through_shares_a_prefix_across_workers():
    a = pages(0, 64)
    reqs, blobs = _requests(a, a + pages(500, 510))
    through = SimConfig(workers=2, capacity_tokens=1000 * 16, l3_capacity_tokens=1000 * 16, l3_write_through=True)
    result = run_policy(reqs, blobs, RoundRobinPolicy(), through)  # the second request goes to worker 1
    assert result.l3_hit_tokens == result.cached_tokens == 64 * 16
    assert result.computed_per_worker == [64 * 16, 10 * 16] and result.l3_page_writes == 74
    back = SimConfig(workers=2, capacity_tokens=1000 * 16, l3_capacity_tokens=1000 * 16)
    assert run_policy(reqs, blobs, RoundRobinPolicy(), back).l3_hit_tokens == 0  # nothing evicted yet


def test_simulator_with_a_shared_l3(tmp_path):
    out = tmp_path / "l3.json"
    assert main(["--trace", str(CONVERSATION_TRACE), "--workers", "4", "--capacity-tokens", "100000", "--policy", "affinity",
                 "--max-requests", "300", "--l3-capacity-tokens", "2000000", "--json", str(out), "--quiet"]) == 0
    result = json.loads(out.read_text())
    aff, l3 = result["policies"]["affinity"], result["l3"]
    assert l3["write_policy"] == "write-back" and l3["events"] and l3["capacity_tokens"] == 2_000_000
    assert aff["l3_hit_ratio"] > 0 and aff["l3_new_pages"] > 0
    assert aff["hit_ratio"] == pytest.approx(aff["device_hit_ratio"] + aff["host_hit_ratio"] + aff["l3_hit_ratio"])
    assert result["bound_hit_ratio"] <= l3["bound_hit_ratio"] <= result["unbounded_hit_ratio"]
    assert aff["hit_vs_l3_bound"] == pytest.approx(aff["hit_ratio"] / l3["bound_hit_ratio"])
    assert "hit_vs_l3_bound_ok" in result["goals"]
