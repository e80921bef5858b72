"""Prometheus metrics of the compute service: per-request counters and latency histograms
recorded when a request finishes, and engine gauges and counters read at scrape time."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from compute_service.engine import Engine, RequestStats
from compute_service.vllm_metrics import VllmMetrics, held_device_pages

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# Time per output token after the first (decode time / (output tokens - 1)): CPU decode steps of
# the tiny models are milliseconds, a GPU's tens of milliseconds at most, a loaded CPU's seconds.
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


class _EngineCollector(Collector):
    """Engine gauges and counters read at scrape time, so they are never stale."""

    def __init__(self, engine: Callable[[], Engine | None], open_requests: Callable[[], int]):
        self._engine = engine
        self._open_requests = open_requests

    def collect(self) -> Iterator[prometheus_client.Metric]:
        yield GaugeMetricFamily("prefixcache_compute_open_requests",
                                "Requests submitted and not finished.",
                                value=self._open_requests())
        engine = self._engine()
        if engine is None:
            return
        yield GaugeMetricFamily("prefixcache_compute_running_requests",
                                "Requests holding pages in the engine.", value=len(engine.running))
        yield GaugeMetricFamily("prefixcache_compute_waiting_requests",
                                "Requests queued for admission (new or preempted).",
                                value=len(engine.waiting))
        # The autoscaling signals (deploy/k8s/components/autoscaling-workers): waiting requests
        # above, and how full the device KV pool is with pages requests hold.
        pages = engine.cfg.device_pages
        held = held_device_pages(engine)
        yield GaugeMetricFamily("prefixcache_compute_kv_device_pages",
                                "KV pages of the device pool (its capacity, as sized at start).",
                                value=pages)
        yield GaugeMetricFamily("prefixcache_compute_kv_device_pages_used",
                                "Device KV pages held by running requests (each shared page "
                                "once); cached pages no request holds are free to evict and "
                                "do not count.", value=held)
        yield GaugeMetricFamily("prefixcache_compute_kv_device_usage_ratio",
                                "prefixcache_compute_kv_device_pages_used / "
                                "prefixcache_compute_kv_device_pages, 0..1: 1 means new "
                                "requests wait for pages (or preempt).",
                                value=held / pages if pages else 0.0)
        yield GaugeMetricFamily("prefixcache_compute_max_running_requests",
                                "Requests that may run at once (--max-running).",
                                value=engine.cfg.max_running)
        stats = engine.stats
        yield CounterMetricFamily("prefixcache_compute_engine_steps", "Engine steps.",
                                  value=stats.steps)
        yield CounterMetricFamily("prefixcache_compute_engine_forward_tokens",
                                  "Tokens through the model's forward.",
                                  value=stats.forward_tokens)
        yield CounterMetricFamily("prefixcache_compute_engine_preemptions",
                                  "Requests preempted for lack of pages.", value=stats.preemptions)
        yield CounterMetricFamily("prefixcache_compute_engine_remote_loaded_tokens",
                                  "Prompt tokens loaded from L3 (Redis) instead of computed.",
                                  value=stats.remote_loaded_tokens)
        yield CounterMetricFamily("prefixcache_compute_engine_step_seconds",
                                  "Time the engine spent in steps (cache calls, forward, "
                                  "sampling).", value=stats.step_s)
        yield CounterMetricFamily("prefixcache_compute_cache_wait_seconds",
                                  "Of the step time, the time the engine thread was blocked "
                                  "waiting for the cache service's answer.",
                                  value=stats.cache_wait_s)
        calls = CounterMetricFamily("prefixcache_compute_cache_calls",
                                    "Step calls to the cache service: overlapped with the "
                                    "forward, or waited for before it (steps with nothing to "
                                    "say send none).", labels=["mode"])
        calls.add_metric(["overlapped"], stats.cache_calls_overlapped)
        calls.add_metric(["waited"], stats.cache_calls - stats.cache_calls_overlapped)
        yield calls
        yield CounterMetricFamily("prefixcache_compute_engine_recoveries",
                                  "Times the pool was re-registered under a new epoch after the "
                                  "cache service lost it.", value=stats.recoveries)
        yield GaugeMetricFamily("prefixcache_compute_adapters_loaded",
                                "LoRA adapters loaded (requests may name them).",
                                value=len(engine.adapter_names()))
        yield from tier_metric_families(engine.tier_metrics())


# Engine.tier_metrics() keys that are levels, not monotonic counts.
_TIER_GAUGES = {
    "l3_breaker_open": "L3 circuit breaker: 0 closed, 1 half-open, 2 open.",
    "l3_write_queue_bytes": "Page bytes queued for L3 writes.",
    "l3_up": "1 while Redis (every master of a cluster) answers, 0 from a failed start check "
             "or an opened breaker until a call or a re-check succeeds.",
}
_REJECTED = "l3_rejected_"


def tier_metric_families(values: dict[str, float]) -> Iterator[prometheus_client.Metric]:
    """Engine.tier_metrics() as `prefixcache_compute_<key>`: gauges for levels, counters (with
    `_total`) for everything else. Empty without an L3 tier, so no series exists then."""
    rejected = {k: v for k, v in values.items() if k.startswith(_REJECTED)}
    if rejected:  # one family, the reason a label: forged pages are one alert, not nine
        family = CounterMetricFamily("prefixcache_compute_l3_rejected",
                                     "L3 pages rejected on load (a miss), by reason "
                                     "(pagestore.page_format.REASONS).", labels=["reason"])
        for key in sorted(rejected):
            family.add_metric([key.removeprefix(_REJECTED)], rejected[key])
        yield family
    for key in sorted(values.keys() - rejected.keys()):
        name = f"prefixcache_compute_{key}"
        if key in _TIER_GAUGES:
            yield GaugeMetricFamily(name, _TIER_GAUGES[key], value=values[key])
        else:
            what = key.removeprefix("l3_").replace("_", " ")
            yield CounterMetricFamily(name, f"L3 tier: {what}.", value=values[key])


class ComputeMetrics:
    """Prometheus metrics of one server, in their own registry (several servers per process)."""

    def __init__(self, engine: Callable[[], Engine | None], open_requests: Callable[[], int]):
        self.registry = prometheus_client.CollectorRegistry()
        r = self.registry
        self.rpcs = prometheus_client.Counter(
            "prefixcache_compute_rpcs", "Finished RPCs by method and status code.",
            ["method", "code"], registry=r)
        self.requests = prometheus_client.Counter(
            "prefixcache_compute_requests", "Finished requests by finish reason.",
            ["finish_reason"], registry=r)
        self.prompt_tokens = prometheus_client.Counter(
            "prefixcache_compute_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.cached_tokens = prometheus_client.Counter(
            "prefixcache_compute_cached_prompt_tokens",
            "Prompt tokens served from cache, by the medium they were found on.", ["medium"],
            registry=r)
        self.shared_tokens = prometheus_client.Counter(
            "prefixcache_compute_shared_in_flight_tokens",
            "Prompt tokens a sibling request in flight computed (part of the cached tokens).",
            registry=r)
        self.twin_first_tokens = prometheus_client.Counter(
            "prefixcache_compute_twin_first_tokens",
            "Requests whose first token was sampled from a twin's logits (same prompt, in flight).",
            registry=r)
        self.computed_tokens = prometheus_client.Counter(
            "prefixcache_compute_computed_prompt_tokens",
            "Prompt tokens the requests computed themselves.", registry=r)
        self.output_tokens = prometheus_client.Counter(
            "prefixcache_compute_output_tokens", "Generated tokens.", registry=r)
        self.ttft = prometheus_client.Histogram(
            "prefixcache_compute_ttft_seconds", "Arrival to first output token.",
            buckets=_TTFT_BUCKETS, registry=r)
        self.duration = prometheus_client.Histogram(
            "prefixcache_compute_request_duration_seconds", "Arrival to the last message.",
            buckets=_DURATION_BUCKETS, registry=r)
        self.tpot = prometheus_client.Histogram(
            "prefixcache_compute_tpot_seconds",
            "Time per output token after the first, per request (its decode time / (output "
            "tokens - 1)); requests of one output token have none.",
            buckets=_TPOT_BUCKETS, registry=r)
        self.queue = prometheus_client.Histogram(
            "prefixcache_compute_queue_seconds",
            "Arrival to first scheduled (matched and given pages), per request.",
            buckets=_TTFT_BUCKETS, registry=r)
        r.register(_EngineCollector(engine, open_requests))
        prometheus_client.ProcessCollector(registry=r)
        self._engine = engine
        self.vllm = VllmMetrics(r, engine)

    def request_finished(self, s: RequestStats) -> None:
        self.requests.labels(s.finish_reason.value).inc()
        self.prompt_tokens.inc(s.prompt_tokens)
        self.cached_tokens.labels("device").inc(s.cached_tokens_device)
        self.cached_tokens.labels("host").inc(s.cached_tokens_host)
        self.cached_tokens.labels("remote").inc(s.cached_tokens_remote)
        self.shared_tokens.inc(s.shared_tokens_in_flight)
        self.twin_first_tokens.inc(s.first_token_from_twin)
        self.computed_tokens.inc(s.computed_prompt_tokens)
        self.output_tokens.inc(s.output_tokens)
        if s.output_tokens:  # an aborted request that never produced a token has no TTFT
            self.ttft.observe(s.ttft_s)
        self.duration.observe(s.total_s)
        self.queue.observe(s.queue_s)
        if s.token_gaps_s:
            self.tpot.observe(s.decode_s / len(s.token_gaps_s))
        engine = self._engine()
        self.vllm.request_finished(s, engine.cfg.model_id if engine is not None else "")
