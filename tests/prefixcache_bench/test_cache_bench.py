"""The benchmark harness runs end to end on tiny parameters and reports sane numbers.

Speed goals are not asserted here (they depend on the machine); only that every metric exists,
has a plausible value, and that the event stream lost nothing.
"""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

from prefixcache_bench import cache as bench

TINY = ["--server", "thread", "--match-iters", "20", "--step-iters", "10", "--step-prompts", "32",
        "--event-pages", "20000", "--mem-pages", "2000", "--mem-hits", "200",
        "--trace-requests", "30", "--warmup", "2"]


def write_trace(path, conversations: int = 12, seed: int = 7) -> list[dict]:
    """A small Mooncake-style trace: every request shares block 0 (a system prompt), and each
    conversation's turns extend the previous turn's hash ids."""
    rng = random.Random(seed)
    next_id, rows, live = 1, [], []
    for _ in range(conversations * 3):
        if live and rng.random() < 0.6:
            ids = live.pop(rng.randrange(len(live)))
        else:
            ids = [0]
        ids = ids + list(range(next_id, next_id + rng.randint(1, 2)))
        next_id = ids[-1] + 1
        n = (len(ids) - 1) * bench.TRACE_BLOCK_TOKENS + rng.randint(1, bench.TRACE_BLOCK_TOKENS)
        rows.append({"timestamp": len(rows), "input_length": n, "output_length": 10,
                     "hash_ids": ids})
        live.append(ids)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    write_trace(path)
    return path


def test_cli_writes_every_metric_with_sane_values(tmp_path, trace, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--quick", "--json", str(out), "--trace", str(trace), *TINY]) == 0
    r = json.loads(out.read_text())

    for key in ("match_4k_us_p50", "match_4k_us_p99", "match_4k_core_step_us_p50",
                "match_4k_core_step_us_p99", "step_rpc_32_ms_p50", "step_rpc_32_ms_p99",
                "step_rpc_32_mixed_ms_p50", "events_per_s", "bytes_per_page", "trace_ops_per_s"):
        assert isinstance(r[key], (int, float)) and r[key] > 0, key
    assert r["match_4k_us_p50"] <= r["match_4k_us_p99"]
    assert r["step_rpc_32_ms_p50"] <= r["step_rpc_32_ms_p99"]
    assert r["match_4k_pages"] == (4096 - 1) // 16
    # Fully cached prompts of 1,536-2,048 tokens: 95..127 pages hit per request.
    assert 95 <= r["step_rpc_32_hit_pages_per_request"] <= 127
    assert r["step_rpc_32_mixed_failed_allocations"] == 0

    assert r["events_lost"] == 0
    assert r["events_index_mismatch"] == 0
    assert r["events_seq_gaps"] == 0 and r["events_resnapshots"] == 0
    assert r["events_subscriber_error"] is None
    assert r["events_received"] == r["events_generated"] >= 20_000

    # The vLLM-format ZMQ stream, beside the gRPC one: nothing lost, the same page set.
    assert r["zmq_events_lost_after_replay"] == 0 and r["zmq_grpc_events_lost"] == 0
    assert r["zmq_index_mismatch"] == 0 and r["zmq_consumer_error"] is None
    assert r["zmq_events_generated"] >= 20_000 and r["zmq_events_per_s"] > 0
    assert r["zmq_on_step_rpc_32_ms_p50"] > 0 and r["zmq_off_step_rpc_32_ms_p50"] > 0
    assert r["zmq_on_step_batches_received"] > 0

    # A cached page's tokens alone are 64 bytes (its hash and page number add 20 more; runs of
    # pages share one node); 2 kB would be a leak.
    assert 64 < r["bytes_per_page"] < 2000
    assert r["mem_cached_pages"] >= 2000
    # Hits cache nothing anew: a leak shows as growth per hit. tracemalloc counts every thread,
    # and an earlier part's threads (the ZMQ publisher's queue, gRPC's) may still free buffers
    # while the hits run on a loaded machine, so the figure can read a few bytes below zero.
    assert -64 < r["mem_growth_bytes_per_hit"] < 64

    assert r["trace_requests"] == 30
    assert 0 < r["trace_cpu_ms_per_request"] <= r["trace_ms_per_request"] * 1.5
    assert 0 < r["trace_hit_ratio"] <= r["trace_ideal_hit_ratio"] < 1
    assert r["trace_failed_allocations"] == 0

    assert r["params"]["seed"] == bench.Params().seed and r["params"]["server"] == "thread"
    assert r["machine"]["cpu_count"] >= 1 and r["machine"]["python"].startswith("3.")
    assert set(r["goals"]) == set(bench.GOALS)
    assert all(isinstance(g["pass"], bool) for g in r["goals"].values())
    table = capsys.readouterr().out
    assert "events_per_s" in table and ("PASS" in table or "FAIL" in table)


def test_trace_replay_with_unbounded_cache_reaches_the_ideal_hit_ratio(tmp_path, trace):
    p = bench.Params(trace_path=str(trace), trace_requests=None, trace_device_tokens=10_000_000)
    r = bench.bench_trace(p)
    for policy in ("", "frequency_"):  # every eviction policy, when nothing is evicted
        assert r[f"trace_{policy}evictions"] == 0
        assert r[f"trace_{policy}hit_ratio"] == r["trace_ideal_hit_ratio"] > 0


def test_trace_rounds_report_the_median_ratio_and_each_round(tmp_path, trace, monkeypatch):
    """--trace-rounds 3: every policy replays the trace three times (side by side, in chunks of
    fewer requests than the trace has, so the order alternates); the ratio to LRU is the
    median of the rounds' ratios, each round's ratio and load average are recorded, and the
    hit ratios (deterministic) are the same in every round, as the run checks."""
    out = tmp_path / "rounds.json"
    argv = ["--json", str(out), "--trace", str(trace), "--only", "trace", "--trace-rounds", "3",
            "--trace-device-tokens", "8000"]
    from prefixcache_bench.cache import parts_trace
    # The 36-request trace in 8 chunks: the policies' order reversed in turn.
    monkeypatch.setattr(parts_trace, "CHUNK", 5)
    assert bench.main(argv) == 0
    r = json.loads(out.read_text())
    assert r["trace_rounds"] == 3 and len(r["trace_round_load_avg"]) == 3
    assert r["command"].startswith("python -m prefixcache_bench.cache --json ")
    for policy in ("frequency", "adaptive"):
        ratios = r[f"trace_{policy}_ops_over_lru_rounds"]
        assert len(ratios) == 3 and r[f"trace_{policy}_ops_over_lru"] == sorted(ratios)[1]
    assert r["trace_requests"] == r["trace_adaptive_requests"] == 36
    assert r["trace_evictions"] > 0  # a pool small enough that the policies differ in work


def test_ideal_hit_tokens_counts_whole_pages_of_earlier_prefixes():
    page, block = 16, bench.TRACE_BLOCK_TOKENS
    trace = [(block + 100, [1, 2]),       # nothing cached yet; publishes 32 + 6 pages
             (block + 100, [1, 2]),       # same prompt: (612 - 1) // 16 = 38 pages
             (block + 300, [1, 2]),       # only the 38 published pages of block 2's chain
             (2 * block, [1, 3]),         # block 1 only: 32 pages
             (50, [9])]                   # nothing
    assert bench.ideal_hit_tokens(trace, page) == (38 + 38 + 32) * page


def test_block_tokens_are_deterministic_and_in_vocabulary():
    a, b = bench.block_tokens(42, 1000), bench.block_tokens(42, 1000)
    assert len(a) == bench.TRACE_BLOCK_TOKENS and np.array_equal(a, b)
    assert not np.array_equal(a, bench.block_tokens(43, 1000))
    assert int(a.max()) < 1000


def test_only_rejects_unknown_parts(tmp_path):
    with pytest.raises(SystemExit):
        bench.parse_args(["--json", str(tmp_path / "x.json"), "--only", "match,nope"])


def test_server_in_a_child_process(tmp_path):
    """The default deployment shape: `python -m cache_service` in its own process."""
    out = tmp_path / "bench.json"
    argv = ["--json", str(out), "--server", "process", "--only", "step,events", "--step-iters",
            "5", "--step-prompts", "32", "--event-pages", "10000", "--warmup", "1"]
    assert bench.main(argv) == 0
    r = json.loads(out.read_text())
    assert r["step_rpc_32_ms_p50"] > 0 and r["step_rpc_32_server_cpu_ms"] is not None
    assert r["events_lost"] == 0 and r["events_index_mismatch"] == 0
    assert "match_4k_us_p50" not in r and "trace_ops_per_s" not in r
