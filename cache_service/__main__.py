"""`python -m cache_service`: serve the cache service until SIGTERM/SIGINT, then drain and exit 0.

Every flag falls back to an environment variable (PREFIXCACHE_*), then to a default. The first
line on stdout is `listening on HOST:PORT` (with the real port when --port 0 was given).

--tls-cert/--tls-key make the gRPC port TLS, and --tls-ca mutual TLS; --health-port serves
health on a port of its own, plaintext even then, for Kubernetes `grpc:` probes (which cannot
present a client certificate).
"""
from __future__ import annotations

import argparse
import logging
import sys

from cache_service.core import CacheCore
from cache_service.l3 import L3Client, L3Config
from cache_service.server import CacheServer, ServerConfig
from service_shell import (ExitGuard, ShutdownSignal, add_flag, add_server_flags, configure_logging,
                           tls_from_args)

log = logging.getLogger("cache_service")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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
    add_flag(p, "--redis-url", "REDIS_URL", "",
             "L3 page store, redis://[:password@]host:port/db or rediss:// for TLS; "
             "empty = no L3 lookups")
    add_flag(p, "--l3-prefix", "L3_PREFIX", "pc", "key prefix in Redis")
    add_flag(p, "--l3-timeout-ms", "L3_TIMEOUT_MS", 100,
             "per-call Redis timeout; a slower Redis is a miss", type=float)
    add_flag(p, "--l3-max-connections", "L3_MAX_CONNECTIONS", 16,
             "Redis connection pool size", type=int)
    args = p.parse_args(argv)
    args.tls = tls_from_args(p, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level)
    shutdown = ShutdownSignal(log)
    config = ServerConfig(host=args.host, port=args.port,
                          metrics_port=args.metrics_port or None,
                          health_port=args.health_port or None, tls=args.tls,
                          max_message_mb=args.max_message_mb, grace_s=args.grace_s,
                          drain_delay_s=args.drain_delay_s)
    remote = None
    if args.redis_url:
        remote = L3Client(L3Config(args.redis_url, prefix=args.l3_prefix,
                                   timeout_s=args.l3_timeout_ms / 1000,
                                   max_connections=args.l3_max_connections))
    server = CacheServer(CacheCore(replay_events=args.replay_events, remote=remote), config).start()
    print(f"listening on {server.address}", flush=True)
    if server.metrics_port is not None:
        print(f"metrics on {args.host}:{server.metrics_port}", flush=True)
    if server.health_port is not None:
        print(f"health on {args.host}:{server.health_port}", flush=True)
    # Drain runs here, on the main thread, not inside the signal handler, so that it may block.
    shutdown.wait()
    guard = ExitGuard(log, grace_s=args.drain_delay_s + args.grace_s)
    server.drain()
    guard.drained()
    return 0


if __name__ == "__main__":
    sys.exit(main())
