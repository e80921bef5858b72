"""The flags every server shares, and the argparse types of the services' flags. Each falls back
to a PREFIXCACHE_* environment variable (how the manifests configure every service) through
service_shell/config.py, the one place that reads them."""
from __future__ import annotations

import argparse

from service_shell.config import add_flag
from service_shell.logs import LOG_LEVELS
from service_shell.tls import SETTINGS as TLS_SETTINGS
from service_shell.tls import TlsConfig
from service_shell.tracing import add_tracing_flags


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    """--tls-cert/--tls-key/--tls-ca/--tls-server-name; `TlsConfig.from_args` reads them."""
    helps = {"cert": "PEM certificate (chain) this process presents, as a server and as a "
                     "client; with --tls-key, the gRPC port serves TLS",
             "key": "PEM private key of --tls-cert",
             "ca": "PEM CA bundle: servers require client certificates signed by it (mTLS), "
                   "clients verify servers against it",
             "server_name": "name clients check server certificates against instead of the "
                            "target's host (for servers dialed by IP)"}
    for field, (flag, env) in TLS_SETTINGS.items():
        add_flag(parser, flag, env.removeprefix("PREFIXCACHE_"), None, helps[field])


def add_server_flags(parser: argparse.ArgumentParser, *, env_prefix: str, host: str, port: int,
                     max_message_mb: int) -> None:
    """Flags every server has: --host, --port (env PREFIXCACHE_<env_prefix>_HOST/_PORT),
    --metrics-port, --health-port, --max-message-mb, the TLS flags, --log-level and the
    tracing flags (--tracing, --otlp-endpoint: service_shell.tracing)."""
    add_flag(parser, "--host", f"{env_prefix}_HOST", host, "address to bind")
    add_flag(parser, "--port", f"{env_prefix}_PORT", port, "gRPC port, 0 = any free port",
             type=int)
    add_flag(parser, "--metrics-port", "METRICS_PORT", 0, "Prometheus HTTP port, 0 = off",
             type=int)
    add_flag(parser, "--health-port", "HEALTH_PORT", 0,
             "plaintext gRPC port serving only grpc.health.v1 (liveness/readiness), for "
             "Kubernetes grpc probes; 0 = off: health on the gRPC port only", type=int)
    add_flag(parser, "--max-message-mb", "MAX_MESSAGE_MB", max_message_mb,
             "max gRPC message size, both ways", type=int)
    add_tls_flags(parser)
    add_flag(parser, "--log-level", "LOG_LEVEL", "INFO", "log level", choices=LOG_LEVELS,
             type=str.upper)
    add_tracing_flags(parser)



def tls_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> TlsConfig | None:
    """The TLS flags as a config; an inconsistent set (a cert without its key) is a usage error."""
    try:
        return TlsConfig.from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
