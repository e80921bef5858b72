"""`python -m cache_service`: serve the cache service until SIGTERM/SIGINT, then drain and exit 0.

Every flag falls back to an environment variable (PREFIXCACHE_*), then to a default. The first
line on stdout is `listening on HOST:PORT` (with the real port when --port 0 was given).

--tls-cert/--tls-key make the gRPC port TLS, and --tls-ca mutual TLS; --health-port serves
health on a port of its own, plaintext even then, for Kubernetes `grpc:` probes (which cannot
present a client certificate). --service-identities-file admits only the service identities it
lists, each to its role's RPCs and its own pools (service_shell/auth.py, cache_service/access.py);
without it every caller is served and `event=auth_disabled` is logged.

--kv-events-zmq-endpoint also publishes every pool's KV events in vLLM's format over ZMQ (the
second line on stdout is then `kv events on ENDPOINT [replay ENDPOINT]`; docs/kv-events.md).
"""
from __future__ import annotations

import argparse
import logging
import sys

from cache_service import chain_hash
from cache_service.access import CacheLimits
from cache_service.core import CacheCore
from cache_service.eviction import POLICIES
from cache_service.retention import RetentionConfig
from cache_service.l3_loss import StoreWatch
from cache_service.server import CacheServer, ServerConfig
from cache_service.zmq_publisher import ZmqEventPublisher, add_kv_events_flags, kv_events_from_args
from pagestore.client import L3Client, L3Config
from service_shell import tracing
from service_shell import (ServiceShell, ShutdownSignal, add_flag, add_server_flags,
                           configure_logging, tls_from_args)
from prefixcache_client.hash import NS_DOMAIN
from service_shell.auth_flags import (add_identities_flag, add_network_flag,
                                      check_network_exposure, identities_from_args)
from service_shell.config import add_native_flags
from service_shell.redis_flags import add_redis_flags, settings_from_args

log = logging.getLogger("cache_service")


def build_parser() -> argparse.ArgumentParser:
    """Every flag of the cache service; `declared_variables(build_parser())` lists the
    PREFIXCACHE_* variables it reads."""
    defaults = ServerConfig()
    p = argparse.ArgumentParser(prog="python -m cache_service", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_flags(p, env_prefix="CACHE", host=defaults.host, port=defaults.port,
                     max_message_mb=defaults.max_message_mb)
    add_flag(p, "--replay-events", "REPLAY_EVENTS", 200_000,
             "event batches kept per pool for resuming subscribers", type=int)
    add_flag(p, "--grace-s", "GRACE_S", defaults.grace_s,
             "seconds in-flight calls get on SIGTERM", type=float)
    add_flag(p, "--drain-delay-s", "DRAIN_DELAY_S", defaults.drain_delay_s,
             "seconds between readiness NOT_SERVING and refusing calls on SIGTERM", type=float)
    add_redis_flags(p, "L3 page store probed for remote lookups")
    add_flag(p, "--eviction-policy", "EVICTION_POLICY", "lru", "how runs are ranked for "
             "eviction (cache_service/eviction.py): lru, frequency (last use + 2 x the mean "
             "reuse gap x log2(1 + uses): runs used often outlive runs used once), or adaptive "
             "(set dueling: follows whichever of the two its shadow caches show ahead)",
             choices=list(POLICIES))
    retention = RetentionConfig()
    add_flag(p, "--retention-pages", "RETENTION_PAGES", retention.pages_per_namespace,
             "device pages one namespace (tenant) may keep protected at once for requests with "
             "prompt_cache_retention 24h (cache_service/retention.py); beyond it the hint is "
             "ignored and counted; 0: never honoured", type=int)
    add_flag(p, "--retention-max-s", "RETENTION_MAX_S", retention.max_protect_s,
             "longest a retained prefix stays protected from device eviction", type=float)
    add_flag(p, "--retention-pool-fraction", "RETENTION_POOL_FRACTION",
             retention.max_pool_fraction, "protected pages of all tenants together, as a "
             "fraction of a pool's device pages; beyond it the hint is ignored and counted",
             type=float)
    add_flag(p, "--l3-prefix", "L3_PREFIX", "pc", "key prefix in Redis")
    add_flag(p, "--l3-timeout-ms", "L3_TIMEOUT_MS", 100,
             "per-call Redis timeout; a slower Redis is a miss", type=float)
    add_flag(p, "--l3-max-connections", "L3_MAX_CONNECTIONS", 16,
             "Redis connection pool size", type=int)
    limits = CacheLimits()
    add_identities_flag(p)
    add_network_flag(p)
    add_flag(p, "--max-pool-pages", "MAX_POOL_PAGES", limits.max_pool_pages,
             "largest device_pages, host_pages and mamba_slots a RegisterPool may ask for", type=int)
    add_flag(p, "--max-lease-ttl-s", "MAX_LEASE_TTL_S", limits.max_lease_ttl_s,
             "longest lease TTL a RegisterPool or a Step's match may ask for", type=float)
    add_flag(p, "--max-subscriptions-per-identity", "MAX_SUBSCRIPTIONS_PER_IDENTITY",
             limits.max_subscriptions_per_identity,
             "concurrent Subscribe streams one service identity may hold (with "
             "--service-identities-file)", type=int)
    add_flag(p, "--max-pools-per-identity", "MAX_POOLS_PER_IDENTITY",
             limits.max_pools_per_identity,
             "pools one worker identity may have registered at once (with "
             "--service-identities-file); RegisterPool past it is RESOURCE_EXHAUSTED", type=int)
    add_flag(p, "--max-total-pages", "MAX_TOTAL_PAGES", None,
             "device_pages + host_pages + mamba_slots summed over every registered pool; "
             "RegisterPool past it is RESOURCE_EXHAUSTED (default 4 x --max-pool-pages)", type=int)
    add_kv_events_flags(p)
    add_flag(p, "--hash-spec", "HASH_SPEC", NS_DOMAIN.decode(), "page-hash spec the deployment "
             "expects; anything but this build's is refused")
    add_native_flags(p, cpu_kernels=False)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = ServerConfig()
    p = build_parser()
    args = p.parse_args(argv)
    if args.hash_spec != NS_DOMAIN.decode():
        p.error(f"--hash-spec {args.hash_spec!r}: this cache service implements "
                f"{NS_DOMAIN.decode()!r} only")
    args.tls = tls_from_args(p, args)
    args.redis = settings_from_args(p, args)
    args.kv_events = kv_events_from_args(p, args)
    args.auth = identities_from_args(p, args)
    check_network_exposure(p, args, args.auth)
    try:
        args.limits = CacheLimits(args.max_pool_pages, args.max_lease_ttl_s,
                                  args.max_subscriptions_per_identity,
                                  args.max_pools_per_identity, args.max_total_pages)
    except ValueError as exc:
        p.error(f"--{str(exc).replace('_', '-')}")
    if args.max_subscriptions_per_identity > defaults.max_subscriptions:
        p.error(f"--max-subscriptions-per-identity: must be <= {defaults.max_subscriptions}, the "
                "server's limit on all subscriptions")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level)
    tracing.configure("prefixcache-cache", args)
    chain_hash.configure(args.cache_native, args.kernel_cache)
    shutdown = ShutdownSignal(log)
    config = ServerConfig(host=args.host, port=args.port,
                          metrics_port=args.metrics_port or None,
                          health_port=args.health_port or None, tls=args.tls,
                          auth=args.auth, limits=args.limits,
                          max_message_mb=args.max_message_mb, grace_s=args.grace_s,
                          drain_delay_s=args.drain_delay_s)
    remote = None
    if args.redis_url:
        remote = L3Client(L3Config(args.redis_url, prefix=args.l3_prefix,
                                   timeout_s=args.l3_timeout_ms / 1000,
                                   max_connections=args.l3_max_connections, redis=args.redis))
        # A wrong URL shows at start (log, "l3" health name, l3_up gauge); lookups miss until
        # Redis answers, and a background re-check notices when it does.
        remote.check(1.0)
        remote.watch()
        StoreWatch(remote).start()  # a store that lost its data is written again
    core = CacheCore(replay_events=args.replay_events, remote=remote,
                     eviction=args.eviction_policy,
                     retention=RetentionConfig(args.retention_pages, args.retention_max_s,
                                               args.retention_pool_fraction))
    kv_events = None if args.kv_events is None else ZmqEventPublisher(core, args.kv_events)
    server = CacheServer(core, config, kv_events).start()
    kv_lines = [] if kv_events is None else [
        f"kv events on {kv_events.endpoint}"
        + (f" replay {kv_events.replay_endpoint}" if kv_events.replay_endpoint else "")]
    ServiceShell.announce(server, args.host, first=kv_lines)
    return ServiceShell.serve_until_signal(shutdown, server.drain,
                                           grace_s=args.drain_delay_s + args.grace_s, log=log)


if __name__ == "__main__":
    sys.exit(main())
