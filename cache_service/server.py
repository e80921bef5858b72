"""The gRPC shell over `CacheCore`: servicer, health, reflection, metrics, lease expiry, drain.

Everything that decides anything lives in the core; this module only translates between gRPC and
the core, and adds what every production server needs (design.md §8).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cache_service.access import CacheAccess, CacheLimits
from cache_service.core import CacheCore
from cache_service.zmq_publisher import ZmqEventPublisher
from prefixcache.v1 import cache_service_pb2 as pb
from prefixcache.v1 import cache_service_pb2_grpc as pb_grpc
from prefixcache.v1 import common_pb2
from prefixcache_client.errors import CacheError
from service_shell import (ServiceShell, ShellPorts, TlsConfig, kv, server_options,
                           tls_mode)
from service_shell import tracing
from service_shell.auth import CACHE_POLICY, ServiceIdentities, interceptors

log = logging.getLogger("cache_service.server")
_TRACER = tracing.tracer("prefixcache.cache")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["CacheService"].full_name


@dataclass(slots=True)
class ServerConfig:
    # Loopback unless told otherwise (the manifests set [::], with identities on): a server
    # without an identities file serves anyone who reaches it (service_shell/auth_flags.py).
    host: str = "127.0.0.1"
    # 0 = any free port (the bound one is `CacheServer.port`).
    port: int = 50051
    # None = no metrics endpoint; 0 = any free port (the bound one is `CacheServer.metrics_port`).
    metrics_port: int | None = None
    # None = health on `port` only; else also on this plaintext port, for kubelet probes
    # (0 = any free port; the bound one is `CacheServer.health_port`).
    health_port: int | None = None
    # None = plaintext; else TLS on `port` (mTLS when it has a CA).
    tls: TlsConfig | None = None
    # None = no service authentication (logged as event=auth_disabled); else only these callers,
    # each limited to its role's RPCs (service_shell/auth.py) and its own pools (access.py).
    auth: ServiceIdentities | None = None
    limits: CacheLimits = CacheLimits()
    max_message_mb: int = 64
    # Each Subscribe stream holds a worker thread for its whole life, so subscriptions are capped
    # below the pool size: Step calls (once per engine step) must never wait for a thread.
    max_workers: int = 64
    max_subscriptions: int = 48
    # Drain: readiness goes NOT_SERVING, `drain_delay_s` later the server stops accepting calls,
    # and in-flight unary calls get `grace_s` to finish.
    grace_s: float = 5.0
    drain_delay_s: float = 0.0
    # Server pings idle connections so a dead subscriber's stream is torn down; clients may ping
    # as often as `min_ping_interval_s` on quiet connections without being sent GOAWAY.
    keepalive_time_s: float = 20.0
    keepalive_timeout_s: float = 10.0
    min_ping_interval_s: float = 5.0
    expire_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.max_subscriptions < self.max_workers:
            raise ValueError(f"max_subscriptions must be in [1, max_workers - 1], got "
                             f"{self.max_subscriptions} with max_workers={self.max_workers}")
        if self.max_message_mb < 1:
            raise ValueError(f"max_message_mb must be >= 1, got {self.max_message_mb}")

    def grpc_options(self) -> list[tuple[str, int]]:
        return server_options(self.max_message_mb, keepalive_time_s=self.keepalive_time_s,
                              keepalive_timeout_s=self.keepalive_timeout_s,
                              min_ping_interval_s=self.min_ping_interval_s)


_MEDIUM_LABEL = {common_pb2.MEDIUM_DEVICE: "device", common_pb2.MEDIUM_HOST: "host",
                 common_pb2.MEDIUM_REMOTE: "remote"}
_LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
                    2.5)


class _PoolStatsCollector(Collector):
    """Pool gauges read from `core.get_stats` at scrape time, so they are never stale."""

    def __init__(self, core: CacheCore):
        self._core = core

    def collect(self) -> Iterator[prometheus_client.Metric]:
        stats = self._core.get_stats(pb.GetStatsRequest())
        pages = GaugeMetricFamily("prefixcache_cache_pages", "Pages of a pool by medium and state.",
                                  labels=["pool", "medium", "state"])
        evictions = CounterMetricFamily("prefixcache_cache_evictions",
                                        "Pages evicted from a medium.", labels=["pool", "medium"])
        queried = CounterMetricFamily("prefixcache_cache_queried_tokens",
                                      "Prompt tokens of first matches.", labels=["pool"])
        hits = CounterMetricFamily("prefixcache_cache_hit_tokens",
                                   "Matched tokens served from cache, by medium found on.",
                                   labels=["pool", "medium"])
        prefill = CounterMetricFamily("prefixcache_cache_prefill_tokens",
                                      "Prefill tokens skipped thanks to the cache or computed.",
                                      labels=["pool", "kind"])
        leases = GaugeMetricFamily("prefixcache_cache_active_leases", "Live leases.",
                                   labels=["pool"])
        expiries = CounterMetricFamily("prefixcache_cache_lease_expiries",
                                       "Leases that expired without release.", labels=["pool"])
        mamba = GaugeMetricFamily("prefixcache_cache_mamba_slots",
                                  "Mamba checkpoint slots by state.", labels=["pool", "state"])
        retained = GaugeMetricFamily("prefixcache_cache_retained_pages", "Device pages protected "
                                     "for prompt_cache_retention requests.", labels=["pool"])
        retention = CounterMetricFamily("prefixcache_cache_retention_requests", "Requests with "
                                        "prompt_cache_retention 24h, by outcome (protected, or "
                                        "ignored: the namespace's budget was full).",
                                        labels=["pool", "outcome"])
        for pool in stats.pools:
            p = pool.pool_id
            retained.add_metric([p], pool.retained_pages)
            retention.add_metric([p, "protected"], pool.retained_requests)
            retention.add_metric([p, "ignored"], pool.retention_ignored)
            for medium in pool.media:
                m = _MEDIUM_LABEL.get(medium.medium, "unspecified")
                for state in ("total", "free", "used", "cached", "evictable", "pinned"):
                    pages.add_metric([p, m, state], getattr(medium, f"{state}_pages"))
                evictions.add_metric([p, m], medium.evictions)
            queried.add_metric([p], pool.queried_tokens)
            hits.add_metric([p, "device"], pool.hit_tokens_device)
            hits.add_metric([p, "host"], pool.hit_tokens_host)
            hits.add_metric([p, "remote"], pool.hit_tokens_remote)
            prefill.add_metric([p, "skipped"], pool.skipped_prefill_tokens)
            prefill.add_metric([p, "computed"], pool.computed_prefill_tokens)
            leases.add_metric([p], pool.active_leases)
            expiries.add_metric([p], pool.lease_expiries)
            mamba.add_metric([p, "total"], pool.mamba_slots_total)
            mamba.add_metric([p, "used"], pool.mamba_slots_used)
        yield from (pages, evictions, queried, hits, prefill, leases, expiries, mamba, retained,
                    retention)


class ServerMetrics:
    """Prometheus metrics of one server, in their own registry (several servers per process)."""

    def __init__(self, core: CacheCore):
        self.registry = prometheus_client.CollectorRegistry()
        self.rpcs = prometheus_client.Counter(
            "prefixcache_cache_rpcs", "Finished RPCs by method and status code.",
            ["method", "code"], registry=self.registry)
        self.latency = prometheus_client.Histogram(
            "prefixcache_cache_rpc_duration_seconds", "Unary RPC latency by method.", ["method"],
            buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.active_subscriptions = prometheus_client.Gauge(
            "prefixcache_cache_active_subscriptions", "Open Subscribe streams.",
            registry=self.registry)
        self.registry.register(_PoolStatsCollector(core))
        if core.remote is not None:  # L3 reachability (design.md §4): a gauge, not readiness
            l3_up = prometheus_client.Gauge(
                "prefixcache_cache_l3_up", "1 while the L3 Redis (every master of a cluster) "
                "answers; 0 from a failed start check or an opened breaker until it does.",
                registry=self.registry)
            l3_up.set_function(lambda: 0.0 if core.remote.up is False else 1.0)
        prometheus_client.ProcessCollector(registry=self.registry)

    def finished(self, method: str, code: grpc.StatusCode, seconds: float | None) -> None:
        self.rpcs.labels(method, code.name).inc()
        if seconds is not None:
            self.latency.labels(method).observe(seconds)


class CacheServicer(pb_grpc.CacheServiceServicer):
    """Maps each RPC onto the core method of the same name and `CacheError` onto its status."""

    def __init__(self, core: CacheCore, metrics: ServerMetrics, max_subscriptions: int,
                 draining: threading.Event, access: CacheAccess):
        self._core = core
        self._access = access
        self._metrics = metrics
        self._subscription_slots = threading.BoundedSemaphore(max_subscriptions)
        self._max_subscriptions = max_subscriptions
        self._draining = draining

    def RegisterPool(self, request, context):
        with self._access.pool_call("RegisterPool", request, context):
            return self._unary("RegisterPool", self._core.register_pool, request, context)

    def UnregisterPool(self, request, context):
        with self._access.pool_call("UnregisterPool", request, context):
            return self._unary("UnregisterPool", self._core.unregister_pool, request, context)

    def ListPools(self, request, context):
        return self._unary("ListPools", self._core.list_pools, request, context)

    def Step(self, request, context):
        parent = tracing.joined(context.invocation_metadata())  # traced requests' Steps only
        span = tracing.start(_TRACER, "cache_service.Step", parent, tracing.SpanKind.SERVER,
                             **{"prefixcache.pool_id": request.pool_id}) if parent else None
        try:
            with self._access.pool_call("Step", request, context):
                return self._unary("Step", self._core.step, request, context)
        finally:
            tracing.end(span)

    def EvictNamespace(self, request, context):
        with self._access.pool_call("EvictNamespace", request, context):
            return self._unary("EvictNamespace", self._core.evict_namespace, request, context)

    def GetStats(self, request, context):
        return self._unary("GetStats", self._core.get_stats, request, context)

    def Subscribe(self, request: pb.SubscribeRequest, context: grpc.ServicerContext):
        # The caller's own share first (auth on), so that one identity's flood never holds the
        # slots every other subscriber (the gateway) needs.
        with self._access.subscription(request, context):
            yield from self._subscribe(request, context)

    def _subscribe(self, request: pb.SubscribeRequest, context: grpc.ServicerContext):
        if not self._subscription_slots.acquire(blocking=False):
            self._metrics.finished("Subscribe", grpc.StatusCode.RESOURCE_EXHAUSTED, None)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"too many subscriptions (limit {self._max_subscriptions}); retry later")
        code, message, sent = grpc.StatusCode.OK, "", 0
        self._metrics.active_subscriptions.inc()
        log.info(kv("subscription_started", pool=request.pool_id, epoch=request.epoch,
                    after_seq=request.after_seq, peer=context.peer()))
        try:
            for item in self._core.subscribe(request, is_active=context.is_active):
                yield item
                sent += 1
        except CacheError as exc:
            code, message = grpc.StatusCode[exc.code.value], exc.message
        except GeneratorExit:
            code = grpc.StatusCode.CANCELLED  # gRPC closes the generator when the client left
            raise
        except Exception:
            log.exception(kv("subscription_failed", pool=request.pool_id))
            code, message = grpc.StatusCode.INTERNAL, "internal error; see the cache service log"
        else:
            if self._draining.is_set():
                # The core ended the stream because the server is going away, not because the
                # pool was unregistered: UNAVAILABLE tells the client to resubscribe.
                code, message = grpc.StatusCode.UNAVAILABLE, "server is shutting down; resubscribe"
        finally:
            self._subscription_slots.release()
            self._metrics.active_subscriptions.dec()
            self._metrics.finished("Subscribe", code, None)
            log.info(kv("subscription_ended", pool=request.pool_id, code=code.name, sent=sent,
                        peer=context.peer()))
        if code != grpc.StatusCode.OK:
            context.abort(code, message)

    def _unary(self, method: str, call: Callable, request, context: grpc.ServicerContext):
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            return call(request)
        except CacheError as exc:
            code = grpc.StatusCode[exc.code.value]
            log.info(kv("rpc_rejected", method=method, code=code.name, message=exc.message))
            context.abort(code, exc.message)
        except Exception:
            code = grpc.StatusCode.INTERNAL
            log.exception(kv("rpc_failed", method=method))
            context.abort(code, f"internal error in {method}; see the cache service log")
        finally:
            seconds = time.perf_counter() - start
            self._metrics.finished(method, code, seconds)
            if code == grpc.StatusCode.OK and log.isEnabledFor(logging.DEBUG):
                log.debug(kv("rpc", method=method, code="OK", ms=seconds * 1000))


class CacheServer(ShellPorts):
    """A running cache service: gRPC server, health, reflection, metrics and lease expiry."""

    def __init__(self, core: CacheCore, config: ServerConfig | None = None,
                 kv_events: ZmqEventPublisher | None = None):
        """`kv_events`: also publish every pool's events in vLLM's format (off when None)."""
        self.core = core
        self.config = cfg = config or ServerConfig()
        self.metrics = ServerMetrics(core)
        self.kv_events = kv_events
        if kv_events is not None:
            self.metrics.registry.register(kv_events.collector())
        auth, refusals = interceptors(cfg.auth, SERVICE_NAME, CACHE_POLICY, self.metrics.registry)
        self._shell = ServiceShell(
            SERVICE_NAME, host=cfg.host, port=cfg.port, max_workers=cfg.max_workers,
            thread_name_prefix="cache-rpc", options=cfg.grpc_options(),
            registry=self.metrics.registry, metrics_port=cfg.metrics_port,
            health_port=cfg.health_port, tls=cfg.tls, interceptors=auth)
        self.health = self._shell.health
        self._draining = threading.Event()
        self._stopped = threading.Event()
        self._drain_lock = threading.Lock()
        self._expirer = threading.Thread(target=self._expire_loop, name="lease-expirer",
                                         daemon=True)
        servicer = CacheServicer(core, self.metrics, cfg.max_subscriptions, self._draining,
                                 CacheAccess(cfg.limits, refusals))
        pb_grpc.add_CacheServiceServicer_to_server(servicer, self._shell.server)

    def start(self) -> CacheServer:
        cfg = self.config
        if self.kv_events is not None:
            self.kv_events.start()
        self._shell.start()
        self._expirer.start()
        self.health.set_ready(True)
        if self.core.remote is not None:  # health name "l3": SERVING while Redis answers
            self.core.remote.on_change(lambda up: self.health.set_detail("l3", up))
        log.info(kv("server_started", address=self.address, metrics_port=self.metrics_port,
                    health_port=self.health_port, tls=tls_mode(cfg.tls),
                    auth="on" if cfg.auth is not None else "off",
                    max_message_mb=cfg.max_message_mb, max_workers=cfg.max_workers))
        return self

    def drain(self, grace_s: float | None = None) -> None:
        """Graceful stop; idempotent and safe from any thread. Returns once fully stopped."""
        with self._drain_lock:
            first = not self._draining.is_set()
            self._draining.set()
        if not first:
            self._stopped.wait()
            return
        grace = self.config.grace_s if grace_s is None else grace_s
        log.info(kv("drain_started", grace_s=grace, drain_delay_s=self.config.drain_delay_s))
        # Readiness first, so load balancers stop sending new work while we still serve it.
        self.health.set_ready(False)
        if self.config.drain_delay_s > 0:
            time.sleep(self.config.drain_delay_s)
        self.health.shutdown()
        stopped = self._shell.stop(grace)  # new calls are refused from here on
        # Subscriptions would otherwise hold the grace period to the end: end them now, and
        # they finish with UNAVAILABLE so clients resubscribe (here after a restart, or elsewhere).
        self.core.close()
        stopped.wait()
        if self.kv_events is not None:
            self.kv_events.close()
        self._shell.close()
        self._stopped.set()
        self._expirer.join(timeout=self.config.expire_interval_s + 1)
        log.info(kv("server_stopped", address=self.address))

    def wait(self, timeout_s: float | None = None) -> bool:
        """Blocks until drained; True when stopped."""
        return self._stopped.wait(timeout_s)

    def _expire_loop(self) -> None:
        while not self._stopped.wait(self.config.expire_interval_s):
            try:
                expired = self.core.expire_leases()
            except Exception:  # the loop must survive a core bug; it is logged loudly
                log.exception(kv("lease_expiry_failed"))
                continue
            if expired:
                log.info(kv("leases_expired", count=expired))


def serve(core: CacheCore, config: ServerConfig | None = None,
          kv_events: ZmqEventPublisher | None = None) -> CacheServer:
    """Builds and starts a server."""
    return CacheServer(core, config, kv_events).start()
