"""The gateway process: builds the one routing core all front ends share (gateway/core/: the
router with its index and policy, the fleet and its workers, the tokenizer, the running calls,
the proxy, the metrics) and serves it through the front ends, with health, reflection, metrics,
TLS and drain from `service_shell` (design.md §6, §8).

- gRPC (gateway/grpc_api/), on `port`: ComputeService (Generate, routed) and GatewayService
  (RoutePreview, ListWorkers); its docstring is the contract of Generate.
- With `http_port`, the OpenAI-compatible HTTP API (gateway/http/) over the same core
  (`GenerateProxy.open`): its calls are routed, counted and drained like gRPC ones. Readiness
  requires it serving; the drain closes its listener when it starts refusing new gRPC calls and
  lets its running responses finish within the same grace.
- With `epp_port`, an Endpoint Picker of the Gateway API Inference Extension (gateway/epp/):
  Envoy asks it over ext_proc which worker a request goes to, and gets the choice of the same
  router. Its health follows readiness; the drain refuses new ext_proc streams with the gRPC port
  and gives those in flight the same grace.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.core.dataplane_tenants import DataplaneTenants
from gateway.core.discovery import WorkerAddress
from gateway.core.gc_tuning import FreezeAfterWarmup
from gateway.core.index import IndexConfig
from gateway.core.index_checkpoint import IndexCheckpointer
from gateway.core.indexer_roles import IndexerRoles
from gateway.core.metrics import GatewayMetrics
from gateway.core.policies import make_policy
from gateway.core.proxy import GenerateProxy
from gateway.core.router import Router
from gateway.core.running_calls import RunningCalls
from gateway.core.shared_index import SharedIndexConfig, SharedIndexStore, SharedIndexView
from gateway.core.tenants import TenantDirectory
from gateway.core.tokenize import AUTO, load_tokenizer
from gateway.core.workers import Fleet, WorkerSet, WorkerSettings
from gateway.grpc_api.servicer import GATEWAY_SERVICE_NAME, register
from prefixcache_client.hash import NS_DOMAIN
from service_shell import ServiceShell, ShellPorts, TlsConfig, kv, server_options, tls_mode
from service_shell.auth import ServiceIdentities

if TYPE_CHECKING:  # the `gateway` extra: imported where the HTTP API starts
    from gateway.http.limits import TenantLimits
    from gateway.http.bounds import HttpLimits
    from gateway.http.turns import TurnMemoryConfig

log = logging.getLogger("gateway.server")

# The shell registers one service name for health; readiness covers the whole server.
_HEALTH_NAME = GATEWAY_SERVICE_NAME
# How often readiness is re-evaluated (a worker's stream going live or stale flips it).
_READINESS_TICK_S = 0.25


@dataclass(slots=True)
class GatewayConfig:
    # Where the workers are: called every `resolve_interval_s` (discovery.parse_static /
    # DnsWorkers, or a test's own list).
    workers: Callable[[], list[WorkerAddress]] = list
    host: str = "[::]"
    port: int = 50050
    metrics_port: int | None = None
    health_port: int | None = None
    # The OpenAI-compatible HTTP API (gateway/http/); None = off, 0 = any free port.
    http_port: int | None = None
    # The HTTP API's per-tenant limits (defaults; the tenants file overrides them per tenant)
    # and its slow-client bounds (gateway/http/limits.py, gateway/http/server.py). None: no
    # tenant limits (unless the tenants file sets a tenant's) and HttpLimits' defaults;
    # `python -m gateway` always passes its flags' values (50/s, burst 100, 64 in flight).
    http_tenant_limits: TenantLimits | None = None
    http_limits: HttpLimits | None = None
    # One logfmt line per HTTP request on logger gateway.access (gateway/http/request_log.py).
    http_access_log: bool = True
    # Token-exact chat turns (gateway/http/turns.py); None = off.
    http_turn_memory: TurnMemoryConfig | None = None
    # The Endpoint Picker (gateway/epp/): Envoy's ext_proc protocol; None = off, 0 = any port.
    epp_port: int | None = None
    # Who may call the Endpoint Picker: identities of role `dataplane` (service_shell/auth.py);
    # None = nobody (every ext_proc stream is UNAUTHENTICATED).
    epp_callers: ServiceIdentities | None = None
    # A worker's compute address -> its model server's endpoint (`--model-server` gateways
    # beside the workers, the InferencePool's targetPort): the Endpoint Picker then routes
    # OpenAI HTTP requests there. None = it routes gRPC Generate only.
    epp_model_servers: Callable[[str], str] | None = None
    # A model server's own worker (its compute address; `workers` names its peers too,
    # gateway/core/resume_peers.py): new requests go there only, readiness follows it alone, and
    # the peers take a stream its worker fails (gateway/core/proxy.py). None = every worker.
    home_worker: str | None = None
    # A model server's worker's own metrics (its vLLM names): served after the gateway's on
    # GET /metrics of the HTTP port, where an InferencePool's scrapers look. "" = none.
    upstream_metrics_url: str = ""
    tls: TlsConfig | None = None
    max_message_mb: int = 64
    # Each Generate stream holds a server thread for its whole life.
    max_streams: int = 512
    policy: str = "affinity"
    # Who calls, as which tenant: bearer tokens (TenantDirectory), or, for a model server
    # (`--model-server`), the data plane forwarding the tenant its Endpoint Picker named
    # (gateway/core/dataplane_tenants.py).
    tenants: TenantDirectory | DataplaneTenants = field(
        default_factory=lambda: TenantDirectory({}, True))
    # `auto`: the workers' own (GetTokenizer); `byte` or a checkpoint directory (tokenize.py).
    tokenizer: str = AUTO
    # None: from the first worker; workers with another value are refused.
    model_id: str | None = None
    page_size: int | None = None
    # A worker's event stream silent for `stale_after_s` loses routing confidence; after
    # `dead_after_s` the worker is not routed to.
    stale_after_s: float = 5.0
    dead_after_s: float = 30.0
    # Memory the routing index may use (gateway/core/index.py: its bound in keys).
    index_memory_mb: float = 1024.0
    # `memory`: this replica's own index, fed by every worker's events. `redis`: the index many
    # replicas share (gateway/core/shared_index.py) at `index_redis_url`, under
    # `index_namespace`; this replica runs an indexer per worker (gateway/core/indexer_roles.py).
    index_backend: str = "memory"
    index_redis_url: str = ""
    index_namespace: str = "default"
    # How to reach it (gateway/core/index_redis.py): the ACL password's file, TLS files.
    index_redis_password_file: str | None = None
    index_redis_tls_ca: str | None = None
    index_redis_tls_cert: str | None = None
    index_redis_tls_key: str | None = None
    # `memory` backend: the index written to this file every `index_checkpoint_interval_s` and
    # at a clean shutdown, and loaded at start (gateway/core/index_checkpoint.py); "" for none.
    index_checkpoint: str = ""
    index_checkpoint_interval_s: float = 30.0
    resolve_interval_s: float = 10.0
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    # Worker-call deadline when the client set none.
    generate_timeout_s: float = 600.0
    # Drain: readiness NOT_SERVING; `drain_delay_s` later new calls are refused; running streams
    # get `grace_s`, then are aborted on their workers and get `abort_wait_s` to end.
    grace_s: float = 20.0
    drain_delay_s: float = 0.0
    abort_wait_s: float = 5.0
    # Once every worker that is up delivered its snapshot, freeze the objects alive then out of
    # the garbage collector's walks (gateway/core/gc_tuning.py): full collections then no longer
    # pause routing decisions for the whole warm state. Process-wide, so off for a gateway
    # embedded in another program (tests); `python -m gateway` turns it on by default.
    gc_freeze_after_warmup: bool = False

    @property
    def max_workers(self) -> int:
        return self.max_streams + 16


class GatewayServer(ShellPorts):
    """A running gateway. `start()`, then `drain()` (idempotent, any thread)."""

    def __init__(self, config: GatewayConfig):
        self.config = cfg = config
        self.metrics = GatewayMetrics()
        tokenizer = load_tokenizer(cfg.tokenizer, self.metrics)
        index_config = IndexConfig(stale_after_s=cfg.stale_after_s,
                                   dead_after_s=cfg.dead_after_s,
                                   memory_budget_mb=cfg.index_memory_mb)
        shared, self.indexers = self._shared_index(index_config)
        self.router = Router(make_policy(cfg.policy), self.metrics, index_config, index=shared)
        self._gc_freeze = FreezeAfterWarmup(cfg.gc_freeze_after_warmup, self.router.warm)
        self.checkpointer = self._index_checkpointer()
        self.fleet = Fleet(cfg.model_id, cfg.page_size, tokenizer)
        self.workers = WorkerSet(cfg.workers, self.router, self.fleet, cfg.worker,
                                 indexers=self.indexers)
        self.running = RunningCalls()
        self._draining = threading.Event()
        self.proxy = GenerateProxy(self.router, self.fleet, cfg.tenants, tokenizer, self.metrics,
                                   self.running, self._draining, cfg.generate_timeout_s,
                                   cfg.home_worker)
        self._shell = ServiceShell(
            _HEALTH_NAME, host=cfg.host, port=cfg.port, max_workers=cfg.max_workers,
            thread_name_prefix="gateway-rpc", options=server_options(cfg.max_message_mb),
            registry=self.metrics.registry, metrics_port=cfg.metrics_port,
            health_port=cfg.health_port, tls=cfg.tls)
        self.health = self._shell.health
        register(self._shell.server, self.proxy, self.router, cfg.generate_timeout_s)
        self.http = None  # gateway.http.server.HttpServer once started
        self.epp = None  # gateway.epp.server.EppServer once started
        self._ready = False
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._drain_lock = threading.Lock()
        self._drain_started = False
        self._loop = threading.Thread(target=self._watch, name="gateway-watch", daemon=True)

    def _shared_index(self, index_config: IndexConfig
                      ) -> tuple[SharedIndexView | None, IndexerRoles | None]:
        """`index_backend` redis: the view the router reads and this replica's indexer roles,
        with their metrics; (None, None) for the in-process index."""
        cfg = self.config
        if cfg.index_backend == "memory":
            return None, None
        if cfg.index_backend != "redis" or not cfg.index_redis_url:
            raise ValueError(f"index backend {cfg.index_backend!r}: 'memory', or 'redis' with "
                             "a Redis URL")
        store = SharedIndexStore(SharedIndexConfig(
            cfg.index_redis_url, cfg.index_namespace,
            password_file=cfg.index_redis_password_file, tls_ca=cfg.index_redis_tls_ca,
            tls_cert=cfg.index_redis_tls_cert, tls_key=cfg.index_redis_tls_key))
        # The indexers' Subscribe channels are the feeds' (TLS, service token).
        roles = IndexerRoles(store, cfg.worker.cache_channel)
        view = None

        def health() -> tuple[bool, int, int]:
            h = view.health
            return h.redis_down, h.lookups, h.lookup_failures

        observe = self.metrics.shared_index(health, roles.held)
        view = SharedIndexView(store, index_config, on_round_trip=observe)
        return view, roles

    def _index_checkpointer(self) -> IndexCheckpointer | None:
        """--index-checkpoint with the in-process index: loaded now, before any worker is
        admitted (their feeds then resume from it); written from `start()` on."""
        cfg = self.config
        if not cfg.index_checkpoint or self.router.shared:
            return None
        checkpointer = IndexCheckpointer(self.router, cfg.index_checkpoint,
                                         cfg.index_checkpoint_interval_s, cfg.index_namespace,
                                         NS_DOMAIN.decode(), cfg.dead_after_s)
        checkpointer.restore()
        return checkpointer

    @property
    def http_port(self) -> int | None:
        return self.http.port if self.http is not None else None

    def start(self) -> GatewayServer:
        cfg = self.config
        self._shell.start()
        if cfg.http_port is not None:
            try:
                self.http = self._start_http()
            except BaseException:
                self._shell.stop(0).wait()
                self._shell.close()
                raise
        if cfg.epp_port is not None:
            try:
                self.epp = self._start_epp()
            except BaseException:
                if self.http is not None:
                    self.http.stop(0.0)
                self._shell.stop(0).wait()
                self._shell.close()
                raise
        self.workers.refresh()
        self._loop.start()
        if self.checkpointer is not None:
            self.checkpointer.start()
        log.info(kv("server_started", address=self.address, metrics_port=self.metrics_port,
                    health_port=self.health_port, http_port=self.http_port,
                    tls=tls_mode(cfg.tls), policy=cfg.policy,
                    tokenizer=cfg.tokenizer, tenants=len(cfg.tenants),
                    anonymous=cfg.tenants.allow_anonymous))
        return self

    def _start_http(self):
        # Imported here: a gRPC-only gateway runs without the `gateway` extra.
        from gateway.http.app import create_app
        from gateway.http.server import HttpServer

        cfg = self.config
        app = create_app(self.proxy, self.router, lambda: self._ready, cfg.max_streams,
                         max_body_bytes=cfg.max_message_mb << 20,
                         tenant_limits=cfg.http_tenant_limits, registry=self.metrics.registry,
                         access_log=cfg.http_access_log, turn_memory=cfg.http_turn_memory)
        app.state.upstream_metrics = cfg.upstream_metrics_url  # GET /metrics (service.py)
        return HttpServer(app, cfg.host, cfg.http_port, tls=cfg.tls,
                          graceful_s=cfg.grace_s + cfg.abort_wait_s + 5.0,
                          limits=cfg.http_limits, registry=self.metrics.registry).start()

    def _start_epp(self):
        # Imported here: the ext_proc protos come with the `gateway` extra (xds-protos).
        from gateway.epp.server import EppServer

        cfg = self.config
        return EppServer(self.proxy, self.router, self.metrics.registry, host=cfg.host,
                         port=cfg.epp_port, max_streams=cfg.max_streams,
                         max_message_mb=cfg.max_message_mb, tls=cfg.tls,
                         callers=cfg.epp_callers, gateway_calls=self.running,
                         model_servers=cfg.epp_model_servers).start()

    def _watch(self) -> None:
        """Readiness (a worker with a live stream) and periodic discovery."""
        next_resolve = time.monotonic() + self.config.resolve_interval_s
        ready = False
        while not self._stop.wait(_READINESS_TICK_S):
            if time.monotonic() >= next_resolve:
                next_resolve = time.monotonic() + self.config.resolve_interval_s
                try:
                    self.workers.refresh()
                except Exception:  # a bad answer must not end discovery for good
                    log.exception(kv("discovery_failed"))
            self.router.refresh_shared_index()
            self._gc_freeze.poll()
            now_ready = (self.router.ready(self.config.home_worker) and not self._draining.is_set()
                         and (self.http is None or self.http.serving))
            if now_ready != ready and not self._drain_started:
                ready = self._ready = now_ready
                self.health.set_ready(ready)
                if self.epp is not None:
                    self.epp.set_ready(ready)
                log.info(kv("readiness", ready=ready, workers=len(self.router.names())))

    def drain(self, grace_s: float | None = None) -> None:
        with self._drain_lock:
            first, self._drain_started = not self._drain_started, True
        if not first:
            self._stopped.wait()
            return
        cfg = self.config
        grace = cfg.grace_s if grace_s is None else grace_s
        log.info(kv("drain_started", grace_s=grace, open_requests=len(self.running)))
        self._ready = False
        self.health.set_ready(False)
        if self.epp is not None:
            self.epp.set_ready(False)
        if cfg.drain_delay_s > 0:
            time.sleep(cfg.drain_delay_s)
        self._draining.set()
        if self.http is not None:  # no new connections; running responses go on
            self.http.stop_accepting()
        # No new ext_proc streams; requests the data plane is proxying get the same grace.
        epp_stopped = self.epp.stop(grace) if self.epp is not None else None
        if not self.running.wait_empty(grace):
            log.info(kv("drain_aborting", requests=len(self.running)))
            self.proxy.abort_all()
            if not self.running.wait_empty(cfg.abort_wait_s):
                log.warning(kv("drain_abort_timeout", requests=len(self.running)))
        if self.http is not None:  # the last chunks of streams whose calls ended
            self.http.stop(5.0)
        if epp_stopped is not None:
            epp_stopped.wait()
        self.health.shutdown()
        self._shell.stop(1.0).wait()
        self._stop.set()
        self._loop.join(5)
        if self.checkpointer is not None:  # before the feeds stop: the workers are still known
            try:
                self.checkpointer.stop()
            except Exception:
                log.exception(kv("index_checkpoint_failed", path=cfg.index_checkpoint))
        self.workers.close()
        close_source = getattr(cfg.workers, "close", None)  # an InferencePool's watch
        if close_source is not None:
            close_source()
        self._shell.close()
        self._stopped.set()
        log.info(kv("server_stopped", address=self.address))

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._stopped.wait(timeout_s)


def serve(config: GatewayConfig) -> GatewayServer:
    return GatewayServer(config).start()
