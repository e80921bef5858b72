"""vLLM's own metric names on every worker, beside the `prefixcache_compute_*` ones, so what
already reads a vLLM fleet reads ours: the Gateway API Inference Extension's endpoint picker
(`vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:kv_cache_usage_perc`,
`vllm:lora_requests_info`, `vllm:cache_config_info`), KEDA triggers, vLLM's Grafana dashboards.

Names, types, labels (`model_name`, `engine`) and histogram buckets follow vLLM 0.33.0's
`vllm/v1/metrics/loggers.py` and `buckets.py` (the list the tests hold us to is
tests/data/vllm_metric_names_v0_33_0.json). `model_name` is the worker's model id (what the
gateway and the OpenAI API call the model); `engine` is "0": one engine per worker process.

What differs, and why: vLLM counts prefix-cache queries and hits when a request is scheduled;
we count them when it finishes (RequestStats carries them then), so a scrape during a long
request lags by that request. `vllm:prefix_cache_hits` are the tokens found on this worker's
device (vLLM's local cache); those found in host memory or in L3 (Redis) are
`vllm:external_prefix_cache_hits` (vLLM's KV-connector hits), and
`vllm:prompt_tokens_cached_by_source` splits them by vLLM's source names (device, host,
external_unspecified for L3). Our per-tier counters (`prefixcache_compute_cached_prompt_tokens`)
stay the finer record.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import prometheus_client
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from compute_service.engine import Engine, RequestStats

# vllm/v1/metrics/buckets.py (0.33.0): REQUEST_LATENCY_BUCKETS, TIME_TO_FIRST_TOKEN_BUCKETS,
# INTER_TOKEN_LATENCY_BUCKETS, REQUEST_NUM_PREEMPTIONS_BUCKETS.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)

LABELS = ["model_name", "engine"]
ENGINE_INDEX = "0"


class _SchedulerCollector(Collector):
    """The scheduler gauges, read at scrape time (vLLM sets them every logging interval)."""

    def __init__(self, engine: Callable[[], Engine | None]):
        self._engine = engine

    def collect(self) -> Iterator[prometheus_client.Metric]:
        engine = self._engine()
        if engine is None:  # still loading: no model name yet, so no series
            return
        labels = [engine.cfg.model_id, ENGINE_INDEX]
        running, waiting = list(engine.running), list(engine.waiting)
        yield _gauge("vllm:num_requests_running",
                     "Number of requests in model execution batches.", labels, len(running))
        yield _gauge("vllm:num_requests_waiting",
                     "Number of requests waiting to be processed.", labels, len(waiting))
        pages = engine.cfg.device_pages
        yield _gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                     labels, held_device_pages(engine) / pages if pages else 0.0)
        # vLLM: an info gauge of CacheConfig.metrics_info(); the endpoint picker reads its
        # block_size and num_gpu_blocks labels for its prefix scorer.
        info = GaugeMetricFamily("vllm:cache_config_info",
                                 "Information of the LLMEngine CacheConfig",
                                 labels=["block_size", "num_gpu_blocks"] + LABELS)
        info.add_metric([str(engine.cfg.page_size), str(pages)] + labels, 1.0)
        yield info
        # The value is the time of the update, so the endpoint picker keeps the newest series.
        # Emitted with or without adapters: the picker reads max_lora to know this worker serves
        # them. vLLM's labels plus model_name and engine (a reader that selects by label names
        # ignores the extra ones; one that sums by model_name finds it, as on every other one).
        lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                 labels=["max_lora", "waiting_lora_adapters",
                                         "running_lora_adapters"] + LABELS)
        lora.add_metric([str(engine.cfg.max_loras), _adapters(waiting), _adapters(running)]
                        + labels, time.time())
        yield lora


def held_device_pages(engine: Engine) -> int:
    """Distinct device pages the running and retiring requests hold. Read from the scrape thread
    while the engine thread steps: copies of the queues (taken whole under the GIL) and of each
    page list, so a page freed meanwhile is at worst counted once more for one scrape."""
    held: set[int] = set()
    for queue in (engine.running, engine.retiring):
        for r in list(queue):
            held.update(list(r.pages))
    return len(held)



def _gauge(name: str, doc: str, labels: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=LABELS)
    family.add_metric(labels, value)
    return family


def _adapters(requests: list) -> str:
    """vLLM's form: the distinct adapter names, comma-separated, in first-seen order."""
    return ",".join(dict.fromkeys(r.adapter for r in requests if r.adapter))


class VllmMetrics:
    """vLLM's per-request metrics, recorded when a request finishes, and its scheduler gauges,
    in the worker's registry."""

    def __init__(self, registry: prometheus_client.CollectorRegistry,
                 engine: Callable[[], Engine | None]):
        def counter(name: str, doc: str, extra: tuple[str, ...] = ()):
            return prometheus_client.Counter(name, doc, LABELS + list(extra), registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return prometheus_client.Histogram(name, doc, LABELS, buckets=buckets,
                                               registry=registry)

        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens.")
        self.external_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, in "
            "terms of number of queried tokens.")
        self.external_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in "
            "terms of number of cached tokens.")
        self.preemptions = counter("vllm:num_preemptions",
                                   "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_cached = counter("vllm:prompt_tokens_cached",
                                     "Number of cached prompt tokens (local + external).")
        self.prompt_cached_by_source = counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them.", ("source",))
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.")
        self.success = counter("vllm:request_success",
                               "Count of successfully processed requests.", ("finished_reason",))
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.",
                             INTER_TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.",
                              INTER_TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.",
                               REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.",
                                   REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.",
                                 REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.",
                                REQUEST_LATENCY_BUCKETS)
        self.request_preemptions = histogram("vllm:request_num_preemptions",
                                             "Number of preemptions per request.",
                                             PREEMPTION_BUCKETS)
        registry.register(_SchedulerCollector(engine))

    def request_finished(self, s: RequestStats, model_name: str) -> None:
        labels = (model_name, ENGINE_INDEX)
        # A resumed request (GenerateRequest.resume_output) may find cached pages over the
        # output it was given, past its prompt: vLLM's counters count prompt tokens, hits never
        # above queries (unclamped, the counter's negative increment failed the engine's step).
        local = min(s.cached_tokens_device, s.prompt_tokens)
        host = min(s.cached_tokens_host, s.prompt_tokens - local)
        remote = min(s.cached_tokens_remote, s.prompt_tokens - local - host)
        external = host + remote
        self.prefix_queries.labels(*labels).inc(s.prompt_tokens)
        self.prefix_hits.labels(*labels).inc(local)
        # What the device missed was asked of the host and L3 tiers (vLLM: of the connector).
        self.external_queries.labels(*labels).inc(s.prompt_tokens - local)
        self.external_hits.labels(*labels).inc(external)
        self.prompt_tokens.labels(*labels).inc(s.prompt_tokens)
        self.prompt_cached.labels(*labels).inc(local + external)
        for source, n in (("device", local), ("host", host), ("external_unspecified", remote)):
            self.prompt_cached_by_source.labels(*labels, source).inc(n)
        self.generation_tokens.labels(*labels).inc(s.output_tokens)
        self.preemptions.labels(*labels).inc(s.preemptions)
        self.request_preemptions.labels(*labels).observe(s.preemptions)
        reason = s.finish_reason.value if s.finish_reason is not None else "abort"
        self.success.labels(*labels, reason).inc()
        self.e2e.labels(*labels).observe(s.total_s)
        self.queue.labels(*labels).observe(s.queue_s)
        if not s.output_tokens:  # no first token: no TTFT, prefill or decode phase
            return
        self.ttft.labels(*labels).observe(s.ttft_s)
        self.prefill.labels(*labels).observe(s.prefill_s)
        self.decode.labels(*labels).observe(s.decode_s)
        self.inference.labels(*labels).observe(s.prefill_s + s.decode_s)
        itl = self.itl.labels(*labels)
        for gap in s.token_gaps_s:
            itl.observe(gap)
        if s.token_gaps_s:
            self.tpot.labels(*labels).observe(s.decode_s / len(s.token_gaps_s))
