"""`python -m gateway`: route Generate calls to the worker that holds their prefix, until
SIGTERM/SIGINT, then drain and exit 0.

Workers come from --workers (`COMPUTE_ADDR[@CACHE_ADDR]`, comma separated; the cache address
defaults to the compute host with --cache-port) or --workers-dns (a headless Kubernetes Service,
re-resolved every --resolve-interval-s). Callers authenticate with `authorization: Bearer TOKEN`
metadata, mapped to a tenant and its cache salt by --tenants-file
(`{"tokens": {"TOKEN": {"tenant": "NAME", "salt": "SALT"}}}`); with --allow-anonymous, calls
without a token, or with one no tenant holds (vLLM without --api-key takes any key), are the
tenant "anonymous" with salt "".

With --http-port the gateway also serves an OpenAI-compatible HTTP API (gateway/http/) on that
port, with the same tenants (`Authorization: Bearer TOKEN` headers), routing and drain.
With --epp-port it is also an Endpoint Picker of the Gateway API Inference Extension on that
port (gateway/epp/): Envoy's ext_proc protocol, the same tenants, router and drain; only the
data plane's identity (role dataplane in --service-identities-file) may call it; with
--epp-model-server-port it also routes OpenAI HTTP to the workers' model servers.

With --model-server it is such a model server: beside one worker (--workers localhost:50052),
the OpenAI HTTP API of that worker alone, called only by the data plane, for the tenant the
Endpoint Picker named (gateway/core/dataplane_tenants.py): an InferencePool of these looks to
the Inference Extension like a pool of vLLM pods. With --resume-peers or --resume-peers-dns it
also knows the pool's other workers: a stream its own worker fails mid-way goes on there.

Every flag falls back to an environment variable (PREFIXCACHE_*), then to a default. The first
line on stdout is `listening on HOST:PORT`. Readiness turns SERVING once a worker is known and
its event stream is live. A failed start exits 1, bad flags exit 2.
"""
from __future__ import annotations

import argparse
import functools
import logging
import sys

from gateway.assembly import GatewayConfig, GatewayServer
from gateway.core import index_native, thread_priority
from gateway.core.dataplane_tenants import DataplaneTenants
from gateway.core.discovery import DnsWorkers, parse_static, static_workers
from gateway.core.index_redis import IndexRedis
from gateway.core.policies import POLICY_NAMES
from gateway.core.resume_peers import ModelServerWorkers
from gateway.core.shared_index import prefix_of
from gateway.core.tenants import TenantDirectory
from gateway.core.tokenize import AUTO
from gateway.core.workers import WorkerSettings
from gateway.index_flags import add_index_flags, add_ingest_flags
from gateway.http.bounds import HttpLimits  # no HTTP stack: only the bounds' defaults
from prefixcache_client.hash import NS_DOMAIN
from service_shell import tracing
from service_shell import (ServiceShell, ShutdownSignal, add_bool_flag, add_flag, add_server_flags,
                           configure_logging, finite_float, kv, tls_from_args)
from service_shell.auth_flags import (add_identities_flag, add_token_flag, identities_from_args,
                                      token_from_args)

log = logging.getLogger("gateway")


def build_parser() -> argparse.ArgumentParser:
    """Every flag of the gateway; `declared_variables(build_parser())` lists the PREFIXCACHE_*
    variables it reads."""
    cfg, workers, bounds = GatewayConfig(), WorkerSettings(), HttpLimits()
    p = argparse.ArgumentParser(prog="python -m gateway", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    flag = functools.partial(add_flag, p)
    add_server_flags(p, env_prefix="GATEWAY", host=cfg.host, port=cfg.port,
                     max_message_mb=cfg.max_message_mb)
    flag("--workers", "WORKERS", None, "static workers: COMPUTE_ADDR[@CACHE_ADDR],...")
    flag("--workers-dns", "WORKERS_DNS", None, "HOST:PORT of a headless Service whose A/AAAA "
         "records are the workers' compute addresses")
    flag("--workers-inferencepool", "WORKERS_INFERENCEPOOL", None, "[NAMESPACE/]NAME of an "
         "InferencePool (inference.networking.k8s.io/v1; default namespace: the pod's own) "
         "whose Ready pods, at its target "
         "port, are the workers, watched through the Kubernetes API (in-cluster credentials; "
         "gateway/core/inferencepool.py)")
    flag("--resolve-interval-s", "RESOLVE_INTERVAL_S", cfg.resolve_interval_s,
         "seconds between DNS resolutions of --workers-dns", type=float)
    flag("--cache-port", "CACHE_PORT", 50051, "cache service port of a worker whose address "
         "names none (its sidecar, at the worker's host)", type=int)
    _add_http_flags(p, bounds)
    _add_endpoint_picker_flags(p)
    flag("--policy", "POLICY", cfg.policy, "routing policy", choices=POLICY_NAMES)
    flag("--tenants-file", "TENANTS_FILE", None,
         'JSON {"tokens": {"TOKEN": {"tenant": "NAME", "salt": "SALT"}}}')
    add_bool_flag(p, "--allow-anonymous", "ALLOW_ANONYMOUS", 'calls without a token, or with one '
                  'no tenant holds, are tenant "anonymous", salt ""; otherwise UNAUTHENTICATED',
                  "off")
    flag("--tokenizer", "TOKENIZER", AUTO, "'auto': the workers' own tokenizer, fetched from "
         "the first worker that has one (GetTokenizer); 'byte' or a checkpoint directory with "
         "tokenizer.json: that one. Text and chats are tokenized here and sent only to workers "
         "with the same tokenizer")
    flag("--model-id", "MODEL_ID", None, "model id of the fleet; default: the first worker's")
    flag("--page-size", "PAGE_SIZE", None, "tokens per page; default: the first worker's",
         type=int)
    flag("--hash-spec", "HASH_SPEC", NS_DOMAIN.decode(), "page-hash spec the deployment "
         "expects; anything but this build's is refused")
    flag("--stale-after-s", "STALE_AFTER_S", cfg.stale_after_s, "seconds of silence after "
         "which a worker's index entries count less", type=float)
    flag("--dead-after-s", "DEAD_AFTER_S", cfg.dead_after_s, "seconds of silence after which "
         "a worker is not routed to", type=float)
    flag("--index-memory-mb", "INDEX_MEMORY_MB", cfg.index_memory_mb, "memory the routing "
         "index may use, in MiB; past it the least useful entries are evicted, counted "
         "(prefixcache_gateway_index_evictions_total) and warned about (event=kv_index_full)",
         type=finite_float(1.0, 1e9))
    add_bool_flag(p, "--gc-freeze-after-warmup", "GC_FREEZE_AFTER_WARMUP", "once every "
                  "worker that is up has delivered its snapshot, freeze the objects alive then "
                  "out of the garbage collector's walks (gc.freeze): full collections no longer "
                  "pause routing decisions for the whole warm state (gateway/core/gc_tuning.py)",
                  "on")
    add_ingest_flags(flag, workers)
    add_bool_flag(p, "--feed-process", "FEED_PROCESS", "read the workers' event streams in a "
                  "process of its own, which sends this one stream frames: gRPC and decoding "
                  "off the routing process's GIL, for fleets of hundreds of workers "
                  "(gateway/core/feed_process.py)", "off")
    add_index_flags(flag, cfg)
    flag("--probe-interval-s", "PROBE_INTERVAL_S", workers.probe_interval_s,
         "seconds between readiness probes of each worker", type=float)
    flag("--heartbeat-interval-s", "HEARTBEAT_INTERVAL_S", workers.heartbeat_interval_s,
         "heartbeat interval asked of the cache services, in [0.05, 60] (the cache service's "
         "bounds)", type=finite_float(0.05, 60.0))
    flag("--max-streams", "MAX_STREAMS", cfg.max_streams, "concurrent Generate streams",
         type=int)
    flag("--generate-timeout-s", "GENERATE_TIMEOUT_S", cfg.generate_timeout_s,
         "deadline of a worker call when the client set none", type=float)
    flag("--grace-s", "GRACE_S", cfg.grace_s, "seconds running streams get to finish on "
         "SIGTERM before they are aborted", type=float)
    flag("--drain-delay-s", "DRAIN_DELAY_S", cfg.drain_delay_s, "seconds between readiness "
         "NOT_SERVING and refusing new calls on SIGTERM", type=float)
    add_token_flag(p, to="the workers' compute and cache services")
    add_identities_flag(p, "JSON file of service identities (service_shell/auth.py); those of "
                        "role 'dataplane' may call the Endpoint Picker (--epp-port), nobody "
                        "else; required with --epp-port")
    return p


def _add_http_flags(p: argparse.ArgumentParser, bounds: HttpLimits) -> None:
    """The OpenAI-compatible HTTP API: its port, its per-tenant limits, its slow-client
    bounds."""
    flag = functools.partial(add_flag, p)
    flag("--http-port", "HTTP_PORT", 0, "port of the OpenAI-compatible HTTP API "
         "(/v1/completions, /v1/chat/completions, /v1/models, /health), 0 = off", type=int)
    flag("--http-rate-per-s", "HTTP_RATE_PER_S", 50.0, "HTTP API: requests per second each "
         "tenant may send (a token bucket; a tenants-file entry's rate_per_s overrides it); "
         "past it 429 with Retry-After; 0 = unlimited", type=float)
    flag("--http-burst", "HTTP_BURST", 100, "HTTP API: requests a tenant may send at once "
         "above its rate (the bucket's size; the entry's burst overrides it)", type=int)
    flag("--http-max-in-flight", "HTTP_MAX_IN_FLIGHT", 64, "HTTP API: requests of one tenant "
         "running at once, streams included (the entry's max_in_flight overrides it); past it "
         "429; 0 = unlimited", type=int)
    flag("--http-header-timeout-s", "HTTP_HEADER_TIMEOUT_S", bounds.header_timeout_s,
         "HTTP API: seconds a connection has to send a complete request head; a slower one is "
         "closed", type=float)
    flag("--http-body-timeout-s", "HTTP_BODY_TIMEOUT_S", bounds.body_timeout_s,
         "HTTP API: seconds a request has to send its body after its head; a slower one is "
         "closed", type=float)
    flag("--http-keep-alive-s", "HTTP_KEEP_ALIVE_S", bounds.keep_alive_s,
         "HTTP API: seconds an idle keep-alive connection stays open", type=float)
    flag("--http-max-connections", "HTTP_MAX_CONNECTIONS", bounds.max_connections,
         "HTTP API: open connections; one more is closed as soon as it is accepted", type=int)
    flag("--http-turn-memory-tokens", "HTTP_TURN_MEMORY_TOKENS", 0, "HTTP API: token-exact "
         "chat turns: token ids of chat answers remembered (all tenants together, least "
         "recently used dropped first) so that an answer sent back in a later chat is the ids "
         "the model generated, not its text re-encoded; 0 = off", type=int)
    flag("--http-turn-memory-ttl-s", "HTTP_TURN_MEMORY_TTL_S", 600.0, "HTTP API: seconds a "
         "remembered chat answer is kept after it was last stored or used", type=float)
    add_bool_flag(p, "--http-access-log", "HTTP_ACCESS_LOG", "one logfmt line per HTTP request "
                  "on logger gateway.access (method, path, status, duration_ms, tenant, "
                  "request_id, prompt/cached/completion tokens)", "on")


def _add_endpoint_picker_flags(p: argparse.ArgumentParser) -> None:
    """The Gateway API Inference Extension's side: the Endpoint Picker, and the model server
    that runs beside each worker."""
    flag = functools.partial(add_flag, p)
    flag("--epp-port", "EPP_PORT", 0, "port of the Endpoint Picker (Gateway API Inference "
         "Extension: Envoy's ext_proc gRPC protocol, gateway/epp/), 0 = off", type=int)
    flag("--epp-model-server-port", "EPP_MODEL_SERVER_PORT", 0, "port of the workers' model "
         "servers (--model-server gateways beside them; the InferencePool's targetPort): the "
         "Endpoint Picker then routes OpenAI HTTP (/v1/completions, /v1/chat/completions, "
         "/v1/models) to a worker's host at this port; 0 = it routes gRPC Generate only",
         type=int)
    add_bool_flag(p, "--model-server", "MODEL_SERVER", "serve the one worker of --workers to "
                  "an InferencePool's data plane (the OpenAI HTTP API of --http-port, as a vLLM "
                  "pod serves it): callers are identities of role dataplane in "
                  "--service-identities-file, forwarding the tenant the Endpoint Picker named; "
                  "no tenants file, no anonymous caller", "off")
    flag("--resume-peers", "RESUME_PEERS", None, "with --model-server: the pool's other "
         "workers (COMPUTE_ADDR[@CACHE_ADDR],...), where a stream goes on when this model "
         "server's own worker fails mid-way (its engine crashed) or is down when a request "
         "arrives; new requests still go to its own worker only")
    flag("--resume-peers-dns", "RESUME_PEERS_DNS", None, "with --model-server: as "
         "--resume-peers, from the A/AAAA records of a headless Service (HOST:PORT), "
         "re-resolved every --resolve-interval-s; this pod's own record is skipped")
    flag("--model-server-metrics-url", "MODEL_SERVER_METRICS_URL", "", "with --model-server: "
         "its worker's metrics endpoint (e.g. http://localhost:9092/metrics), served after the "
         "gateway's own on GET /metrics of the HTTP port (vLLM's metric names, where an "
         "InferencePool's scrapers look); empty = the gateway's only")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    args.allow_anonymous = bool(args.allow_anonymous)
    args.tls = tls_from_args(p, args)
    args.service_token = token_from_args(p, args)
    args.epp_callers = identities_from_args(p, args)
    if args.epp_port and args.epp_callers is None:
        p.error("--epp-port needs --service-identities-file (PREFIXCACHE_SERVICE_IDENTITIES_FILE):"
                " the Endpoint Picker serves only the data plane's identity (role dataplane)")
    if sum(x is not None for x in (args.workers, args.workers_dns,
                                   args.workers_inferencepool)) != 1:
        p.error("give exactly one of --workers (PREFIXCACHE_WORKERS), --workers-dns "
                "(PREFIXCACHE_WORKERS_DNS) and --workers-inferencepool "
                "(PREFIXCACHE_WORKERS_INFERENCEPOOL)")
    if args.index_backend == "redis" and not args.index_redis_url:
        p.error("--index-backend redis needs --index-redis-url (PREFIXCACHE_INDEX_REDIS_URL): "
                "the Redis the gateway replicas share the index in")
    _check_index_redis(p, args)
    if args.hash_spec != NS_DOMAIN.decode():
        p.error(f"--hash-spec {args.hash_spec!r}: this gateway implements "
                f"{NS_DOMAIN.decode()!r} only")
    args.model_server = bool(args.model_server)
    if args.model_server:
        _check_model_server(p, args)
    elif args.resume_peers is not None or args.resume_peers_dns is not None:
        p.error("--resume-peers / --resume-peers-dns are a model server's (--model-server); a "
                "gateway resumes on any of its --workers")
    elif args.tenants_file is None and not args.allow_anonymous:
        p.error("--tenants-file or --allow-anonymous is required: without either every call "
                "would be UNAUTHENTICATED")
    for name in ("http_burst", "http_max_in_flight"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')}: must be >= 0")
    if args.http_max_connections < 1:
        p.error("--http-max-connections: must be >= 1")
    for name in ("http_header_timeout_s", "http_body_timeout_s", "http_keep_alive_s"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')}: must be > 0")
    try:
        prefix_of(args.index_namespace)
        args.source = _worker_source(args)
        args.tenants = (DataplaneTenants(args.epp_callers) if args.model_server
                        else TenantDirectory.from_file(args.tenants_file, args.allow_anonymous))
    except ValueError as exc:
        p.error(str(exc))
    return args


def _worker_source(args: argparse.Namespace):
    """The workers' addresses, as the flags say; ValueError naming the flag."""
    if args.workers is not None:
        workers = parse_static(args.workers, args.cache_port)
        if args.model_server and args.resume_peers is not None:
            return ModelServerWorkers(workers[0], static_workers(
                parse_static(args.resume_peers, args.cache_port)))
        if args.model_server and args.resume_peers_dns is not None:
            return ModelServerWorkers(workers[0], DnsWorkers(args.resume_peers_dns,
                                                             args.cache_port))
        return static_workers(workers)
    if args.workers_dns is not None:
        return DnsWorkers(args.workers_dns, args.cache_port)
    # Imported here: only this source reads the Kubernetes API (its watch thread starts now).
    from gateway.core.inferencepool import InferencePoolWorkers
    return InferencePoolWorkers(args.workers_inferencepool, args.cache_port)


def _check_index_redis(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The index Redis's flags: consistent (gateway/core/index_redis.py); a usage error naming
    the flag."""
    names = ("index_redis_url", "index_redis_password_file", "index_redis_tls_ca",
             "index_redis_tls_cert", "index_redis_tls_key")
    if not args.index_redis_url:
        for name in names[1:]:
            if getattr(args, name):
                p.error(f"--{name.replace('_', '-')} needs --index-redis-url")
        return
    try:
        IndexRedis(*(getattr(args, name) for name in names))
    except ValueError as exc:
        p.error(str(exc))


def _check_model_server(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.epp_callers is None:
        p.error("--model-server needs --service-identities-file: only the data plane's identity "
                "(role dataplane) may call a model server")
    if args.tenants_file is not None or args.allow_anonymous:
        p.error("--model-server takes its tenants from the data plane (the Endpoint Picker's "
                "headers): drop --tenants-file / --allow-anonymous")
    if args.workers is None or "," in args.workers or not args.http_port:
        p.error("--model-server serves one worker: give --workers with exactly one address "
                "(its own, e.g. localhost:50052) and --http-port")
    if args.epp_port:
        p.error("--model-server and --epp-port: the picker runs in the gateway, not beside a "
                "worker")
    if args.resume_peers is not None and args.resume_peers_dns is not None:
        p.error("give at most one of --resume-peers and --resume-peers-dns")


def _model_server_endpoint(port: int):
    """A worker's compute address -> its model server's: the same host at `port`."""
    def endpoint(address: str) -> str:
        return f"{address.rpartition(':')[0]}:{port}"
    return endpoint


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        workers=args.source, host=args.host, port=args.port,
        metrics_port=args.metrics_port or None, health_port=args.health_port or None,
        http_port=args.http_port or None, epp_port=args.epp_port or None,
        epp_callers=args.epp_callers,
        epp_model_servers=(_model_server_endpoint(args.epp_model_server_port)
                           if args.epp_model_server_port else None),
        upstream_metrics_url=args.model_server_metrics_url if args.model_server else "",
        home_worker=args.source.own.compute if isinstance(args.source, ModelServerWorkers)
        else None,
        tls=args.tls, max_message_mb=args.max_message_mb, max_streams=args.max_streams,
        policy=args.policy, tenants=args.tenants, tokenizer=args.tokenizer,
        model_id=args.model_id, page_size=args.page_size, stale_after_s=args.stale_after_s,
        dead_after_s=args.dead_after_s, index_memory_mb=args.index_memory_mb,
        index_backend=args.index_backend, index_redis_url=args.index_redis_url or "",
        index_redis_password_file=args.index_redis_password_file,
        index_redis_tls_ca=args.index_redis_tls_ca, index_redis_tls_cert=args.index_redis_tls_cert,
        index_redis_tls_key=args.index_redis_tls_key,
        index_namespace=args.index_namespace,
        index_checkpoint=args.index_checkpoint or "",
        index_checkpoint_interval_s=args.index_checkpoint_interval_s,
        resolve_interval_s=args.resolve_interval_s,
        worker=WorkerSettings(tls=args.tls, service_token=args.service_token,
                              max_message_mb=args.max_message_mb,
                              probe_interval_s=args.probe_interval_s,
                              heartbeat_interval_s=args.heartbeat_interval_s,
                              ingest_slice_s=args.ingest_slice_ms / 1e3,
                              feed_process=bool(args.feed_process)),
        generate_timeout_s=args.generate_timeout_s, grace_s=args.grace_s,
        drain_delay_s=args.drain_delay_s,
        gc_freeze_after_warmup=args.gc_freeze_after_warmup is not False,
        http_access_log=args.http_access_log is not False, **_http_limits(args))


def _http_limits(args: argparse.Namespace) -> dict:
    """The HTTP API's limits; imported only with --http-port (the `gateway` extra)."""
    if not args.http_port:
        return {}
    from gateway.http.limits import TenantLimits
    from gateway.http.turns import TurnMemoryConfig
    return {"http_turn_memory": TurnMemoryConfig(args.http_turn_memory_tokens,
                                                 args.http_turn_memory_ttl_s),
            "http_tenant_limits": TenantLimits(args.http_rate_per_s, args.http_burst,
                                               args.http_max_in_flight),
            "http_limits": HttpLimits(args.http_header_timeout_s, args.http_body_timeout_s,
                                      args.http_keep_alive_s, args.http_max_connections)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level)
    tracing.configure("prefixcache-gateway", args)
    shutdown = ShutdownSignal(log)
    try:
        index_native.configure(args.index_native, args.kernel_cache)
        thread_priority.configure(args.ingest_priority, args.switch_interval_ms / 1e3)
        reason = {"reason": index_native.TABLE.reason} if index_native.TABLE.reason else {}
        log.info(kv("index_table", implementation=index_native.implementation(), **reason))
        server = GatewayServer(config_from_args(args)).start()
    except Exception:  # an unreadable tokenizer, a port in use, a bad certificate
        log.exception(kv("startup_failed"))
        return 1
    last = [f"http on {args.host}:{server.http_port}"] if server.http_port is not None else []
    last += [f"epp on {server.epp.address}"] if server.epp is not None else []
    ServiceShell.announce(server, args.host, last=last)
    return ServiceShell.serve_until_signal(shutdown, server.drain,
                                           grace_s=args.drain_delay_s + args.grace_s, log=log)


if __name__ == "__main__":
    sys.exit(main())
