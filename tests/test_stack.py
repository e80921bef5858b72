"""The README's main job: the whole stack, the demo workload, the summary, a clean shutdown;
and the benchmark of the HTTP front against gRPC, which starts the same services."""
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE_SIZE = 16  # the stack's workers


def rows(out: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in out.splitlines()
            if line.startswith(("chat", "burst", "alice", "bob", "base", "lora", "http"))}


@pytest.mark.timeout(660)  # the subprocess's own limit is 600 s; pytest's default 300 cut it
def test_the_stack_runs_the_demo_and_stops_cleanly(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # The default model: SmolLM2-135M-Instruct, trained (3 min on a busy 2-core machine).
    res = subprocess.run([sys.executable, "-m", "stack"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "all services stopped cleanly" in res.stdout
    r = rows(res.stdout)
    # columns: request tenant prompt device host L3 shared computed ttft worker why...
    device, remote, computed, worker = 3, 5, 7, 9
    assert int(r["chat0-turn1"][device]) > 0  # the next turn reuses the conversation
    # The burst's new prompt is computed once per worker that got part of it: every other sample
    # either waited for its sibling's publishes (shared) or arrived after them (device hit), so
    # it computes only its last partial page. (Which of the two happens depends on timing.)
    burst = [v for k, v in r.items() if k.startswith("burst")]
    computing = [v for v in burst if int(v[computed]) >= PAGE_SIZE]
    assert len(burst) == 6 and len(computing) == len({v[worker] for v in burst}), burst
    assert r["bob-sunday"][device] == "0"  # another tenant never shares a page
    assert r["lora-hours"][device] == "0"  # an adapter never shares the base model's pages
    assert int(r["lora-hours-2"][device]) > 0
    assert all(int(r[f"chat{i}-turn3"][remote]) > 0 for i in range(3))  # L3 after a drain
    # A chat over the OpenAI-compatible HTTP API, then its next turn: the history is reused.
    assert int(r["http-chat"][computed]) > 0 and r["http-chat"][10] == "HTTP:"
    assert int(r["http-chat-2"][device]) > 0
    assert "hit ratio" in res.stdout
    # The trained model answers the HTTP chat in words, not random tokens.
    answers = res.stdout.split("answers (shortened)", 1)[1]
    chat = next(line for line in answers.splitlines() if line.strip().startswith("http-chat "))
    assert len(re.findall(r"\b(the|a|I|you|to|and|is|of|for|in)\b", chat)) >= 2, chat


def test_the_http_benchmark_measures_both_fronts(tmp_path):
    out = tmp_path / "http.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "prefixcache_bench.stack.http", "--requests", "3", "--json",
                          str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode in (0, 1), res.stdout + res.stderr  # 1: the goal failed, still measured
    results = json.loads(out.read_text())
    for api in ("grpc", "http", "httpx"):
        assert 0 < results[f"{api}_ttft_ms_p50"] < 10_000
    assert results["requests_per_api"] == 3 and "http_overhead_p50_ms" in results["goals"]


def test_the_fault_drill_costs_no_request_and_no_wrong_output(tmp_path):
    """Forged pages in Redis, a FLUSHALL and a killed cache service, under load through the
    whole stack: no request fails, no output is wrong, the killed cache service stalls no
    client for more than 2 s (issue 25, finding 8: 6 s), and L3 reuse comes back after the
    FLUSHALL (finding 7; the L3 share per turn after it is reported). Each phase reports its
    p50, its longest gap without a token and where its prompt tokens came from (finding 11)."""
    out = tmp_path / "drill.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "prefixcache_bench.stack.fault_drill", "--faults",
                          "redis-garbage,redis-flushall,cache-sigkill", "--quiet-s", "6",
                          "--clients", "2", "--json", str(out)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout + res.stderr
    phases = json.loads(out.read_text())["phases"]
    assert set(phases) == {"baseline", "redis-garbage", "redis-flushall", "cache-sigkill"}
    for name, phase in phases.items():
        assert phase["requests"] > 0 and phase["failed"] == 0 and phase["wrong"] == 0, (name, phase)
        assert 0 < phase["p50_s"] <= phase["max_gap_s"] + 60 and phase["max_gap_s"] > 0, name
        assert set(phase["share"]) == {"device", "host", "l3", "shared", "computed"}, name
        assert abs(sum(phase["share"].values()) - 1) < 0.01, (name, phase["share"])
        assert sum(phase["prompt_tokens"].values()) > 0, name
    # Finding 8 was a 6 s stall; restarting the killed service alone takes up to ~1.4 s when
    # this machine is slow (measured: 1.06-1.37 s on a day its Python ran 2-3x slower), so the
    # bound is 2 s. The committed drill (docs/results/stack/fault_drill.json) reports the figure.
    assert phases["cache-sigkill"]["max_gap_s"] < 2.0, phases["cache-sigkill"]
    # L3 holds the pages again after the FLUSHALL: the workers wrote what their trees held.
    before = phases["baseline"]["l3_pages_at_end"]
    assert before > 0 and phases["redis-flushall"]["l3_pages_at_end"] >= 0.5 * before, phases
    # The workers' device pools hold fewer pages than the conversations: the baseline loads part
    # of its prompts from L3, and each fault phase reports the L3 share per turn after it.
    assert phases["baseline"]["share"]["l3"] > 0.05, phases["baseline"]
    assert phases["baseline"]["l3_share_by_turn_after"] is None
    assert set(phases["redis-flushall"]["l3_share_by_turn_after"]) == {"turn1", "turn2", "later"}
    # ... and where its lost reuse lies: in each prompt's history or in its new part.
    assert set(phases["baseline"]["computed_history_new"]) == {"all"}
    assert set(phases["redis-flushall"]["computed_history_new"]["turn2"]) == {"history", "new"}


def test_the_openai_dropin_check_passes_on_the_trained_model(tmp_path):
    """The official openai client against the stack's services serving SmolLM2: json_schema 20/20
    at temperature 1, required and named tool calls, logprobs, penalties and cache_salt."""
    out = tmp_path / "dropin.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "prefixcache_bench.stack.openai_dropin", "--json",
                          str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    results = json.loads(out.read_text())
    assert results["all_ok"] and results["json_schema"]["valid"] == 20
