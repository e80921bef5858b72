"""vLLM's metric names on a live worker, scraped over HTTP: every name the Gateway API Inference
Extension's model-server protocol reads, and vLLM 0.33.0's request metrics with their types,
labels and buckets (tests/data/vllm_metric_names_v0_33_0.json, vendored with provenance), whose
values agree with our own prefixcache_compute_* counters."""
from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.compute_service.server_harness import greedy, make_engine, prompt, running, wait_until
from tests.compute_service.test_server_adapters import load, lora_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VENDORED = json.loads((Path(__file__).parents[1] / "data" / "vllm_metric_names_v0_33_0.json")
                      .read_text())
MODEL = "tiny-transformer"


def scrape(port: int) -> dict:
    """name -> family, as Prometheus parses the text (counters lose their _total suffix)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict, name: str, sample: str | None = None, **labels: str) -> float:
    family = families[name]
    sample = sample or (f"{name}_total" if family.type == "counter" else name)
    matches = [s.value for s in family.samples if s.name == sample
               and all(s.labels.get(k) == v for k, v in labels.items())]
    assert matches, f"{sample} with {labels} not exported"
    return sum(matches)


def test_every_metric_the_inference_extension_reads_with_model_name(adapter_dirs):
    with running(lora_engine(), metrics_port=0) as (server, client):
        load(server, "a", adapter_dirs["a"])
        families = scrape(server.metrics_port)
        for name, spec in VENDORED["gateway_api_inference_extension_model_server_protocol"].items():
            assert name in families, f"{name} missing from the worker's /metrics"
            family = families[name]
            assert family.type == spec["type"], f"{name}: {family.type}, not {spec['type']}"
            [s] = family.samples  # one engine, one series
            assert s.labels["model_name"] == MODEL, f"{name}: model_name {s.labels}"
            assert set(spec["labels"]) <= s.labels.keys(), f"{name}: labels {s.labels}"
        info = families["vllm:lora_requests_info"].samples[0].labels
        assert info["max_lora"] == "2" and info["running_lora_adapters"] == ""
        cache = families["vllm:cache_config_info"].samples[0].labels
        assert (cache["block_size"], cache["num_gpu_blocks"]) == ("4", "64")

        # While an adapter request runs, the picker sees the adapter among the running ones.
        stream = client.generate(prompt(3, 30), greedy(200), adapter="a")
        reader = threading.Thread(target=lambda: list(stream), daemon=True)
        reader.start()
        seen = set()
        while reader.is_alive():
            seen.add(scrape(server.metrics_port)["vllm:lora_requests_info"]
                     .samples[0].labels["running_lora_adapters"])
        reader.join()
        assert "a" in seen, seen


def test_request_metrics_match_vllm_types_labels_buckets_and_our_counters():
    with running(make_engine(), metrics_port=0) as (server, client):
        for start in (1, 1, 50):  # the second request finds the first one's pages on device
            list(client.generate(prompt(start, 21), greedy(6)))
        wait_until(lambda: value(scrape(server.metrics_port), "vllm:request_success") == 3)
        families = scrape(server.metrics_port)
    for name, spec in VENDORED["vllm_v1_metrics_loggers"].items():
        assert name in families, f"{name} missing"
        family = families[name]
        assert family.type == spec["type"], f"{name}: {family.type}, not {spec['type']}"
        for s in family.samples:
            assert set(spec["labels"]) <= s.labels.keys() - {"le"}, f"{name}: {s.labels}"
            assert s.labels["model_name"] == MODEL and s.labels["engine"] == "0"
        if spec["type"] == "histogram":
            bounds = sorted({float(s.labels["le"]) for s in family.samples
                             if s.name.endswith("_bucket")} - {float("inf")})
            assert bounds == spec["buckets"], f"{name}: buckets {bounds}"
    ours = lambda n, **kw: value(families, n, **kw)  # noqa: E731
    assert ours("vllm:prompt_tokens") == ours("prefixcache_compute_prompt_tokens") == 63
    assert ours("vllm:generation_tokens") == ours("prefixcache_compute_output_tokens") == 18
    assert ours("vllm:prefix_cache_queries") == 63
    device = ours("prefixcache_compute_cached_prompt_tokens", medium="device")
    assert device >= 16 and ours("vllm:prefix_cache_hits") == device
    assert ours("vllm:prompt_tokens_cached_by_source", source="device") == device
    assert ours("vllm:request_success", finished_reason="length") == 3
    # Per token: 5 gaps per request of 6 tokens; per request: one TPOT, queue and phase each.
    assert value(families, "vllm:inter_token_latency_seconds",
                 "vllm:inter_token_latency_seconds_count") == 15
    for name in ("vllm:request_time_per_output_token_seconds", "vllm:request_queue_time_seconds",
                 "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                 "prefixcache_compute_tpot_seconds", "prefixcache_compute_queue_seconds"):
        assert value(families, name, f"{name}_count") == 3, name
    e2e = value(families, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_sum")
    phases = sum(value(families, f"vllm:request_{p}_time_seconds",
                       f"vllm:request_{p}_time_seconds_sum") for p in ("queue", "prefill", "decode"))
    # The phases tile the request up to its last token; e2e also runs to its finish after it.
    assert 0 < phases <= e2e + 1e-9


def test_a_resumed_requests_cache_hits_past_its_prompt_count_as_its_prompt():
    """A resumed request's cached pages may cover the output it was given (resume_output),
    past its prompt: the counters count prompt tokens (hits never above queries) and never go
    down (a negative increment once failed the engine's step, in a loop)."""
    import prometheus_client

    from compute_service.engine.request import RequestStats
    from compute_service.vllm_metrics import VllmMetrics

    registry = prometheus_client.CollectorRegistry()
    metrics = VllmMetrics(registry, lambda: None)
    metrics.request_finished(RequestStats("r", "w", prompt_tokens=10, cached_tokens_device=12,
                                          cached_tokens_host=4, output_tokens=3), "m")
    get = lambda name, **kw: registry.get_sample_value(  # noqa: E731
        name, {"model_name": "m", "engine": "0", **kw})
    assert get("vllm:prefix_cache_queries_total") == 10
    assert get("vllm:prefix_cache_hits_total") == 10
    assert get("vllm:external_prefix_cache_queries_total") == 0
    assert get("vllm:external_prefix_cache_hits_total") == 0
    assert get("vllm:prompt_tokens_cached_by_source_total", source="host") == 0
