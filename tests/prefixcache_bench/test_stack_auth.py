"""`python -m prefixcache_bench.stack.auth` runs and writes what its docstring promises (a tiny run: the
figures themselves come from a quiet machine)."""
from __future__ import annotations

import json

from prefixcache_bench.stack import auth as bench_auth


def test_the_auth_overhead_benchmark_writes_its_json(tmp_path, capsys):
    out = tmp_path / "auth.json"
    assert bench_auth.main(["--steps", "20", "--rounds", "2", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["steps_per_mode"] == 40
    assert results["step_auth_on_us_p50"] > 0 and results["step_auth_off_us_p50"] > 0
    assert "auth_overhead_p50_us" in results["goals"] and results["machine"]["grpc"]
    assert "service auth off vs on" in capsys.readouterr().out
