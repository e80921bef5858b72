"""`python -m prefixcache_bench.gateway_fleet.table`, small: both implementations run on the same
slices and end with the same pages; the JSON and its text table are written."""
from __future__ import annotations

import json

from gateway.core import index_native
from prefixcache_bench.gateway_fleet import table


def test_the_table_bench_compares_c_and_numpy_on_the_same_work(tmp_path) -> None:
    before = index_native.TABLE.mode, index_native.TABLE.cache_dir
    try:
        out = tmp_path / "t.json"
        assert table.main(["--pages", "20000", "--workers", "20", "--slices", "2", "--repeats",
                           "1", "--json", str(out)]) == 0
    finally:
        index_native.configure(*before)
    result = json.loads(out.read_text())
    assert [r["size"] for r in result["rows"]] == [256, 1024, 4096, 1024, 4096, 64, 2048]
    for row in result["rows"]:
        assert row["c"] > 0 and row["numpy"] > 0
        for run in row["runs"]:
            if "pages_after" in run["c"]:
                assert run["c"]["pages_after"] == run["numpy"]["pages_after"]
    assert "c/numpy" in out.with_suffix(".txt").read_text()
