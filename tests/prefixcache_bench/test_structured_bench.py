"""`python -m prefixcache_bench.compute.structured` on a tiny model: both modes decode the same
number of tokens (the bench asserts it), and the JSON has the figures and goal the page shows."""
from __future__ import annotations

import json

from prefixcache_bench.compute import structured


def test_the_structured_bench_runs_and_writes_its_json(tmp_path):
    out = tmp_path / "structured.json"
    structured.main(["--preset", "tiny-transformer", "--vocab", "1000", "--batch", "2",
                     "--tokens", "6", "--reps", "1", "--threads", "1", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["plain_decode_tok_s"] > 0 and data["json_schema_decode_tok_s"] > 0
    assert data["json_schema_ratio"] > 0 and data["mask_ms_per_step"] > 0
    assert set(data["goals"]) == {"json_schema_ratio"}
