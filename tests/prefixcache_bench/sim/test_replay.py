"""`python -m prefixcache_bench.sim.replay`: trace requests become prompts inside the target's vocabulary and
context with the trace's sharing intact; a 20-request slice of the Mooncake conversation trace
replayed against a live two-worker stack prints a table and writes the JSON summary."""
from __future__ import annotations

import json
import subprocess
import sys

from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache_bench import CONVERSATION_TRACE
from prefixcache_bench.sim.replay import Outcome, prompts, summarize
from prefixcache_bench.sim.trace import TraceRequest
from tests.cache_service.grpc_harness import REPO


def test_the_replay_tool_never_imports_torch():
    """It runs where the gateway runs (its image holds no torch)."""
    code = "import sys, prefixcache_bench.sim.replay; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


def test_prompts_fit_the_target_and_keep_shared_prefixes():
    info = pb.GetModelInfoResponse(vocab_size=300, max_context_tokens=200)
    reqs = [TraceRequest(0, 0.0, 1000, 8, (1, 2)), TraceRequest(1, 0.0, 900, 8, (1, 3)),
            TraceRequest(2, 0.0, 20, 8, (4,))]
    a, b, c = prompts(reqs, info, block_tokens=32, max_input=None, seed=0)
    # 1000 tokens of 512-token blocks -> 63 of 32-token blocks; 900 -> 57; 20 -> 2.
    assert (len(a), len(b), len(c)) == (63, 57, 2)
    assert a[:32] == b[:32] and a[32:57] != b[32:57]
    assert all(0 <= t < 300 for t in a + b + c)
    capped = prompts(reqs, info, block_tokens=512, max_input=None, seed=0)
    assert [len(p) for p in capped] == [192, 192, 20]  # context 200 - 8 output tokens
    assert [len(p) for p in prompts(reqs, info, 512, max_input=50, seed=0)] == [50, 50, 20]


def test_summary_counts_hits_from_the_final_stats():
    def done(i: int, worker: str, prompt: int, device: int, ttft: float) -> Outcome:
        stats = pb.GenerateStats(worker=worker, prompt_tokens=prompt, cached_tokens_device=device,
                                 computed_prompt_tokens=prompt - device)
        return Outcome(i, "OK", ttft, ttft * 2, stats)

    summary = summarize([done(0, "w1", 100, 0, 0.1), done(1, "w1", 100, 80, 0.05),
                         done(2, "w2", 200, 20, 0.2), Outcome(3, "UNAVAILABLE")], 1.0)
    assert summary["hit_ratio"] == 100 / 400 and summary["errors"] == {"UNAVAILABLE": 1}
    assert summary["workers"]["w1"] == {"requests": 2, "prompt_tokens": 200,
                                        "computed_prompt_tokens": 120, "cached_tokens": 80,
                                        "hit_ratio": 0.4, "load_share": 0.5}
    assert summary["ttft_p50_s"] == 0.1


def test_replays_a_trace_slice_against_a_live_stack(live_stacks, tmp_path):
    stack = live_stacks.get()
    out = tmp_path / "replay.json"
    run = subprocess.run(
        [sys.executable, "-m", "prefixcache_bench.sim.replay", "--trace", str(CONVERSATION_TRACE), "--target",
         stack.address, "--max-requests", "20", "--block-tokens", "16", "--max-input-tokens",
         "96", "--max-output-tokens", "4", "--time-scale", "100", "--token", "tok-a",
         "--concurrency", "4", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "replay: 20/20" in run.stderr  # the progress line at the end
    assert "hit ratio" in run.stdout and "TTFT p50" in run.stdout
    summary = json.loads(out.read_text())
    for key in ("requests", "completed", "errors", "hit_ratio", "prompt_tokens", "cached_tokens",
                "ttft_p50_s", "ttft_p99_s", "workers", "duration_s"):
        assert key in summary, key
    assert summary["requests"] == summary["completed"] == 20 and not summary["errors"]
    assert 0 < summary["hit_ratio"] < 1  # the requests share their first block
    assert set(summary["workers"]) <= {"w1", "w2"}
    assert sum(w["requests"] for w in summary["workers"].values()) == 20
    for w in summary["workers"].values():
        assert {"requests", "prompt_tokens", "cached_tokens", "hit_ratio", "load_share"} <= w.keys()
