"""`python -m prefixcache_bench.gateway_fleet.table`, small: the kernel and its baseline (the numpy
table, or the kernel built without prefetch) run on the same slices and end with the same pages;
the JSON and its text table are written."""
from __future__ import annotations

import json

import pytest

from gateway.core import index_native
from prefixcache_bench.gateway_fleet import table


@pytest.mark.parametrize("baseline", table.BASELINES)
def test_the_table_bench_compares_c_and_its_baseline_on_the_same_work(tmp_path, baseline) -> None:
    kernel, before = index_native.TABLE, (index_native.TABLE.mode, index_native.TABLE.cache_dir)
    try:
        out = tmp_path / "t.json"
        assert table.main(["--pages", "20000", "--workers", "20", "--slices", "2", "--repeats",
                           "1", "--baseline", baseline, "--json", str(out)]) == 0
    finally:
        index_native.configure(*before)
    assert index_native.TABLE is kernel  # the variant built for the baseline is swapped back
    result = json.loads(out.read_text())
    assert result["baseline"] == baseline
    assert [r["size"] for r in result["rows"]] == [256, 1024, 4096, 1024, 4096, 64, 2048]
    for row in result["rows"]:
        assert row["c"] > 0 and row[baseline] > 0
        for run in row["runs"]:
            if "pages_after" in run["c"]:
                assert run["c"]["pages_after"] == run[baseline]["pages_after"]
    assert f"c/{baseline}" in out.with_suffix(".txt").read_text()


def test_the_baseline_without_prefetch_is_another_build_of_the_same_kernel() -> None:
    variant = index_native.table_library(table.IMPLS["c_no_prefetch"][1])
    assert variant.path() != index_native.TABLE.path()
