"""`python -m prefixcache_bench.stack.tracing_overhead` runs, exports its spans over OTLP/gRPC and
writes what its docstring promises (a tiny run: the figures come from the committed run)."""
from __future__ import annotations

import json

from prefixcache_bench.stack import tracing_overhead as bench


def test_the_tracing_overhead_benchmark_exports_spans_and_writes_its_json(tmp_path, capsys):
    out = tmp_path / "tracing.json"
    assert bench.main(["--rounds", "1", "--streams", "2", "--max-tokens", "4",
                       "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["decode_tokens_per_s_off"] > 0 and results["decode_tokens_per_s_on"] > 0
    # Two traced calls: each a gateway.Generate and a worker.Generate span, and cache.Step ones.
    assert results["spans_exported"] >= 5
    assert "decode_tokens_per_s_ratio_on_off" in results["goals"]
    assert "tracing off vs on" in capsys.readouterr().out
