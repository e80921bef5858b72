"""The prefix_cache_overhead part of the compute benchmark runs end to end on a tiny preset: a
cache service child on loopback, both engines, identical greedy tokens, and every figure it
reports (speed goals are not asserted: they depend on the machine)."""
from __future__ import annotations

import contextlib
import io
import json

import pytest

from prefixcache_bench import compute as bench


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> tuple[dict, str]:
    path = tmp_path_factory.mktemp("bench") / "overhead.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert bench.main(["--presets", "tiny-hybrid", "--threads", "1",
                           "--parts", "prefix_cache_overhead", "--overhead-rounds", "2",
                           "--overhead-requests", "4", "--overhead-prompt-tokens", "24",
                           "--overhead-new-tokens", "20", "--json", str(path)]) == 0
    return json.loads(path.read_text()), out.getvalue()


def test_both_engines_ran_and_agree(result):
    data, table = result
    r = data["presets"]["tiny-hybrid"]
    assert r["prefix_cache_outputs_identical"] is True
    assert r["prefix_cache_hit_tokens"] == 0  # distinct random prompts: 0% hits
    assert r["decode_prefix_cache_tok_s"] > 0 and r["decode_no_prefix_cache_tok_s"] > 0
    samples = r["prefix_cache_samples"]
    assert len(samples["ratio"]) == 2 and len(samples["prefix_cache_tok_s"]) == 2
    assert r["decode_prefix_cache_ratio"] == pytest.approx(
        sorted(samples["ratio"])[0] / 2 + sorted(samples["ratio"])[1] / 2, rel=1e-3)
    assert 0 <= r["prefix_cache_wait_frac"] < 1 and 0 <= r["no_prefix_cache_wait_frac"] < 1
    assert 0 < r["prefix_cache_calls_per_step"] < 1  # most decode steps send nothing
    assert r["goals"]["decode_prefix_cache_ratio"]["goal"] == ">= 0.98"
    assert "decode_prefix_cache_ratio" in table


def test_only_the_part_asked_for_ran(result):
    data, _ = result
    r = data["presets"]["tiny-hybrid"]
    assert "decode_tok_s" not in r and "ttft_cold_s" not in r
    assert data["params"]["parts"] == ["prefix_cache_overhead"]
    assert data["params"]["overhead_requests"] == 4
    assert "--parts prefix_cache_overhead" in data["command"]
    assert "prefix_cache_overhead" not in bench.DEFAULT_PARTS
