"""`python -m prefixcache_bench.gateway_fleet.record_queue`, small: decisions alternate between
a slice that settled the last record and one that left it to them; the slices really apply live
batches, the JSON and its table are written."""
from __future__ import annotations

import json

from prefixcache_bench.gateway_fleet import record_queue


def test_the_record_queue_bench_times_both_groups_after_real_slices(tmp_path, monkeypatch) -> None:
    queued_before, queued_after, statuses = [], [], []  # each slice's, snapshot batches first
    run = record_queue.Router.apply_stream_items

    def counted(router, items):
        queued_before.append(router.policy.recent.queued())
        out = run(router, items)
        queued_after.append(router.policy.recent.queued())
        statuses.append({r.status.name for r in out})
        return out
    monkeypatch.setattr(record_queue.Router, "apply_stream_items", counted)
    out = tmp_path / "q.json"
    assert record_queue.main(["--pools", "8", "--total-pages", "4000", "--decisions", "40",
                              "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["decisions"] == 40 and result["recent_pages"] == 8 * 4096
    for group in ("queued", "settled"):
        assert 0 < result[f"{group}_route_cpu_p50_us"] <= result[f"{group}_route_cpu_p99_us"]
    # the timed slices: live batches applied, each after a decision that queued its record
    assert statuses[-40:] == [{"APPLIED"}] * 40
    assert queued_before[-39:] == [1] * 39
    assert queued_after[-38:] == [1, 0] * 19  # slices that leave it to the decision, that settle
    assert "settled" in out.with_suffix(".txt").read_text()
