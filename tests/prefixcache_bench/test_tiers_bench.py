"""The tier benchmark runs end to end at tiny size and writes the JSON it promises."""
from __future__ import annotations

import json
import subprocess

from prefixcache_bench import tiers as bench_tiers
from tests.compute_service.tiers.conftest import _single_intra_op_thread  # noqa: F401  (autouse)


def test_bench_tiers_tiny_run_writes_every_key(tmp_path, capsys):
    out = tmp_path / "tiers.json"
    assert bench_tiers.main([
        "--models", "tiny-hybrid,tiny-transformer", "--prompt-tokens", "96", "--lengths", "32,64",
        "--payload-preset", "tiny-hybrid", "--throughput-pages", "32", "--threads", "1",
        "--checkpoint-every-pages", "2",
        "--no-simulate", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    for kind in ("kv", "kv+checkpoint"):
        k = r["redis"]["kinds"][kind]
        for label in ("write_pipelined", "write_one_by_one", "read_pipelined", "read_one_by_one",
                      "encode", "decode"):
            assert k[label]["pages_s"] > 0 and k[label]["mb_s"] > 0, (kind, label)
        assert k["read_pipelined"]["found"] == k["pages"] and k["write_pipelined"]["ok"]
    for model in ("tiny-hybrid", "tiny-transformer"):
        t = r["ttft"][model]
        for key in ("ttft_cold_s", "ttft_l1_s", "ttft_l2_s", "ttft_l3_s", "ttft_l3_over_cold",
                    "ttft_l2_over_cold", "ttft_l1_over_cold", "ttft_cold_write_through_s"):
            assert t[key] > 0, (model, key)
        assert t["l1_hit_tokens"] > 0 and t["l2_hit_tokens"] > 0 and t["l3_hit_tokens"] > 0
        e = r["break_even"][model]
        assert [q["prompt_tokens"] for q in e["points"]] == [32, 64, 96]
        assert {"compute_s_per_token", "load_s_per_page", "load_fixed_s",
                "break_even_tokens"} <= e.keys()
    assert r["shared_l3_sim"] == {"measured": False, "reason": "--no-simulate"}
    assert "ttft_l3_over_cold<=0.3[tiny-hybrid]" in r["goals"]
    assert "TTFT" in capsys.readouterr().out


def test_a_simulator_without_a_shared_l3_option_is_reported_as_not_measured(monkeypatch):
    class Help:
        stdout = "usage: python -m prefixcache_bench.sim.simulate [--trace TRACE] [--host-capacity-tokens N]"

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: Help())
    sim = bench_tiers.bench_shared_l3_sim(quick=True)
    assert sim["measured"] is False and "no shared L3 tier option" in sim["reason"]


def test_bench_tiers_on_its_own_redis_cluster(tmp_path):
    """--cluster: the same run on a 3-master Redis Cluster it starts (the L3 TTFT goal holds
    for a cluster as for one node); the MAC's cost on decode is reported."""
    out = tmp_path / "tiers_cluster.json"
    assert bench_tiers.main([
        "--cluster", "--models", "tiny-transformer", "--prompt-tokens", "64", "--lengths", "32",
        "--payload-preset", "tiny-transformer", "--throughput-pages", "32", "--threads", "1",
        "--no-simulate", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["l3_store"] == "redis-cluster" and r["redis_url"] == "own 3-master Redis Cluster"
    k = r["redis"]["kinds"]["kv"]
    assert k["read_pipelined"]["found"] == k["pages"] and k["write_pipelined"]["ok"]
    assert k["decode_checksum"]["mb_s"] > 0 and k["mac_over_checksum_decode"] > 0
    t = r["ttft"]["tiny-transformer"]
    assert t["l3_hit_tokens"] > 0 and t["ttft_l3_over_cold"] > 0
