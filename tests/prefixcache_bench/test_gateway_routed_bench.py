"""`python -m prefixcache_bench.gateway_fleet.routed`, small: both stores, each in its own process,
remember the same pages and are timed on the same prompts; the JSON and its table are written."""
from __future__ import annotations

import json

from prefixcache_bench.gateway_fleet import routed


def test_the_routed_bench_fills_both_stores_to_their_bound_and_times_them(tmp_path) -> None:
    out = tmp_path / "r.json"
    assert routed.main(["--workers", "10", "--pages", "64", "--calls", "50", "--repeats", "1",
                        "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["impl"] for r in result["runs"]] == list(routed.IMPLS)
    assert {r["remembered_pages"] for r in result["runs"]} == {10 * 64}
    assert [r["key"] for r in result["rows"]] == [key for _, key in routed.ROWS]
    assert all(r["c"] > 0 for r in result["rows"] if r["key"] != "bytes_per_page")
    assert "c/dicts" in out.with_suffix(".txt").read_text()
