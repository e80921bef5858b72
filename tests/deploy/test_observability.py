"""The Grafana dashboard and the PrometheusRule alerts of components/monitoring against the real
services: every query parses as PromQL, and every metric (and label matcher) it reads is one the
services export, scraped live from a cache service, a worker and a gateway that served requests
with an L3 on Redis. The rules are also checked for what Prometheus requires of them (promtool
is not used: it installs from GitHub releases only, which CI machines may not reach; the
PrometheusRule's schema is checked by test_k8s_schemas.py)."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.core.discovery import WorkerAddress
from tests.compute_service.server_harness import greedy, prompt
from tests.conftest import RedisServer
from tests.deploy.promql_names import DURATION, grafana_to_promql, problems, selectors
from tests.observed_stack import cache_service, exported, gateway, worker

MONITORING = Path(__file__).resolve().parents[2] / "deploy/k8s/components/monitoring"
DASHBOARD = json.loads((MONITORING / "dashboards/prefixcache.json").read_text())
RULES = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
ALERTS = {r["alert"]: r for g in RULES["spec"]["groups"] for r in g["rules"] if "alert" in r}


@pytest.fixture(scope="module")
def names(tmp_path_factory, one_torch_thread_module) -> dict[str, set[str]]:
    """What the three services export after serving a few requests (labelled counters exist
    only once counted): sample name -> its label names."""
    redis = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        with cache_service(redis.url) as cache:
            address = f"127.0.0.1:{cache.port}"
            with worker("obs-one", address, redis.url, metrics_port=0) as (one, client):
                client.generate(prompt(5, 21), greedy(3)).result()
                assert one.engine.flush_l3()
            with worker("obs-two", address, redis.url, metrics_port=0) as (two, _):
                with gateway([WorkerAddress(f"127.0.0.1:{two.port}", address)],
                             metrics_port=0) as gw:
                    base = f"http://127.0.0.1:{gw.http_port}"
                    for words in (prompt(5, 21), prompt(5, 21)):  # an L3 load, then a hit
                        r = httpx.post(base + "/v1/completions", timeout=60,
                                       json={"prompt": words, "max_tokens": 3})
                        assert r.status_code == 200, r.text
                    return exported([cache.metrics_port, two.metrics_port, gw.metrics_port])
    finally:
        redis.stop()


@pytest.fixture(scope="module")
def one_torch_thread_module():
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def dashboard_queries() -> list[tuple[str, str]]:
    out = [(p["title"], t["expr"]) for p in DASHBOARD["panels"] for t in p["targets"]]
    out += [(f"variable {v['name']}", v["definition"].replace("label_values(", "")
             .split(",")[0]) for v in DASHBOARD["templating"]["list"] if v["type"] == "query"]
    return out


def test_every_dashboard_query_reads_exported_metrics(names):
    queries = dashboard_queries()
    assert len(queries) >= 25
    bad = {f"{title}: {expr}": p for title, expr in queries
           if (p := problems(grafana_to_promql(expr), names))}
    assert not bad, json.dumps(bad, indent=1)


def test_the_dashboard_shows_what_operators_need():
    titles = " | ".join(p["title"] for p in DASHBOARD["panels"]).lower()
    for topic in ("by tier", "prefill saved", "time to first token", "time per output token",
                  "routing reasons", "l3 (redis) health", "queue"):
        assert topic in titles, topic
    ttft = next(p for p in DASHBOARD["panels"] if p["title"] == "Time to first token")
    assert {t["legendFormat"] for t in ttft["targets"]} == {"p50", "p90", "p99"}
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids)) and DASHBOARD["uid"]
    for p in DASHBOARD["panels"]:
        assert [t["refId"] for t in p["targets"]] == [chr(65 + i) for i in range(len(p["targets"]))]
        assert p["datasource"]["uid"] == "${datasource}"


def test_every_alert_rule_is_valid_and_reads_exported_metrics(names):
    assert RULES["kind"] == "PrometheusRule"
    assert {"PrefixcacheL3Down", "PrefixcacheL3BreakerOpen", "PrefixcacheHitRatioCollapse",
            "PrefixcacheQueueGrowth", "PrefixcacheWorkerDown"} <= ALERTS.keys()
    groups = [g["name"] for g in RULES["spec"]["groups"]]
    assert len(groups) == len(set(groups)), "group names must be unique"
    bad = {}
    for name, rule in ALERTS.items():
        assert set(rule) <= {"alert", "expr", "for", "keep_firing_for", "labels",
                             "annotations"}, name
        assert DURATION.match(rule["for"]), f"{name}: for {rule['for']!r}"
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
        if p := problems(rule["expr"], names):  # parses, or raises naming the rule's text
            bad[name] = p
    assert not bad, json.dumps(bad, indent=1)


def test_the_checks_catch_a_wrong_name_a_wrong_label_and_bad_syntax(names):
    """Negative controls: the checks are not vacuous."""
    assert problems("sum(rate(vllm:time_to_first_token_seconds_bucket[5m]))", names) == []
    assert problems("rate(vllm:time_to_first_token_second_bucket[5m])", names)
    assert problems('vllm:num_requests_waiting{modelname="m"}', names)
    assert problems("prefixcache_compute_prompt_tokens", names)  # a counter is read as _total
    with pytest.raises(ValueError):
        selectors("sum(rate(vllm:num_requests_waiting[5m])")
    assert [n for n, _ in selectors('a + on(x) group_left b{c="d"} offset 5m')] == ["a", "b"]


def test_the_worker_exports_the_inference_extension_and_vllm_names(names):
    """The scrape the dashboard is checked against really covers the worker's vLLM names."""
    for name in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:lora_requests_info", "vllm:time_to_first_token_seconds_bucket",
                 "prefixcache_compute_tpot_seconds_bucket", "prefixcache_compute_l3_up",
                 "prefixcache_cache_l3_up", "prefixcache_gateway_routing_decisions_total"):
        assert name in names, name
    assert "model_name" in names["vllm:num_requests_waiting"]
