"""`python -m prefixcache_bench.compute.sampling` on a tiny model: every mode runs, its outputs
carry logprobs exactly when asked, and the JSON has the figures and goals the page shows."""
from __future__ import annotations

import json

from prefixcache_bench.compute import sampling


def test_the_sampling_bench_runs_and_writes_its_json(tmp_path):
    out = tmp_path / "sampling.json"
    sampling.main(["--preset", "tiny-transformer", "--vocab", "512", "--batch", "2",
                   "--tokens", "4", "--reps", "1", "--threads", "1", "--json", str(out)])
    data = json.loads(out.read_text())
    for mode in sampling.MODES:
        assert data[f"{mode}_decode_tok_s"] > 0 and data[f"{mode}_sampler_ms_per_step"] > 0
    assert set(data["goals"]) == {"logprobs_ratio", "penalties_ratio"}
    assert data["command"].startswith("python -m prefixcache_bench.compute.sampling")
