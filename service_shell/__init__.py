"""The service shell every gRPC server of this project wires the same way (design.md §8): server
and channel options, health probes (also on a dedicated plaintext port), reflection, TLS/mTLS
from files, the Prometheus endpoint, the SIGTERM wait, structured logs and flags that fall back
to PREFIXCACHE_* environment variables.

torch-free, so the cache service, the compute service's client and the gateway can all use it.
"""
from service_shell.config import (ConfigError, add_bool_flag, add_flag, declared_variables,
                                  env_default, finite_float, parse_bool)
from service_shell.flags import add_server_flags, add_tls_flags, tls_from_args
from service_shell.grpc_server import bind, enable_reflection, new_server
from service_shell.health import HealthPort, HealthProbes
from service_shell.logs import LOG_LEVELS, configure_logging, kv
from service_shell.metadata import (REQUEST_SCOPE_METADATA_KEY, SALT_METADATA_KEY,
                                    request_scope)
from service_shell.metrics import MetricsEndpoint
from service_shell.options import channel_options, server_options
from service_shell.shell import ServiceShell, ShellPorts
from service_shell.signals import ExitGuard, ShutdownSignal, sleep_until_interrupted
from service_shell.tls import TlsConfig, open_channel, tls_mode

__all__ = ["ConfigError", "LOG_LEVELS", "REQUEST_SCOPE_METADATA_KEY", "SALT_METADATA_KEY", "ExitGuard", "HealthPort", "HealthProbes",
           "MetricsEndpoint", "ServiceShell", "ShellPorts", "ShutdownSignal", "TlsConfig", "add_bool_flag", "add_flag",
           "add_server_flags", "add_tls_flags", "bind", "channel_options", "configure_logging",
           "declared_variables", "enable_reflection", "env_default", "finite_float", "kv", "new_server", "open_channel",
           "parse_bool", "request_scope", "server_options", "sleep_until_interrupted", "tls_from_args", "tls_mode"]
