"""The peer harness's project driver still drives this project's cache index (the peers
themselves are fetched by hand, see prefixcache_bench/README.md, so they are not run here)."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

from prefixcache_bench import CONVERSATION_TRACE

REPO = Path(__file__).resolve().parents[2]
PROJECT_KINDS = ["project-pool", "project-core"]


def load_harness():
    spec = importlib.util.spec_from_file_location("peer_radix", REPO / "prefixcache_bench" / "peer_radix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_project_driver_replays_the_trace_and_runs_match_and_insert():
    harness = load_harness()
    ctx = SimpleNamespace(proj=harness.load_project(str(REPO)))
    trace = ctx.proj.bench.load_trace(str(CONVERSATION_TRACE), 40)
    replay = harness.bench_trace(ctx, PROJECT_KINDS, trace, 200_000, 0)
    for kind in PROJECT_KINDS:
        assert replay[kind]["failed"] == 0 and replay[kind]["ops_per_s"] > 0
    # Both drivers see the same cache: the same hits.
    assert replay["project-pool"]["hit_ratio"] == replay["project-core"]["hit_ratio"] > 0
    match = harness.bench_match(ctx, PROJECT_KINDS, iters=5, warmup=1, rep=0)
    insert = harness.bench_insert(ctx, PROJECT_KINDS, iters=5, warmup=1, rep=0)
    assert set(match) >= set(PROJECT_KINDS) and set(insert) >= set(PROJECT_KINDS)
