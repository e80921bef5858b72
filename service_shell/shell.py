"""`ServiceShell`: the gRPC server of one service with everything design.md §8 puts around it, so a
service adds only its servicer and its drain."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import grpc
import prometheus_client

from service_shell.grpc_server import bind, enable_reflection, new_server
from service_shell.health import HealthPort, HealthProbes
from service_shell.metrics import MetricsEndpoint
from service_shell.signals import ExitGuard, ShutdownSignal
from service_shell.tls import TlsConfig


class ServiceShell:
    """A gRPC server (`server`: add the service's servicer to it before `start`) with health
    probes (`health`) and reflection on its port, TLS when `tls` is given, and optionally the
    Prometheus endpoint of `registry` and a dedicated plaintext health port.

    Ports: `port` 0 binds any free one, and so do `metrics_port` / `health_port`, where None
    means none at all. The bound ports are the attributes of the same names after `start`.

    A drain is the service's own: it turns `health` not ready, waits as it sees fit, calls
    `health.shutdown()`, then `stop(grace)`, and `close()` once the server stopped.
    """

    def __init__(self, service_name: str, *, host: str, port: int, max_workers: int,
                 thread_name_prefix: str, options: list[tuple[str, int | str]],
                 registry: prometheus_client.CollectorRegistry,
                 metrics_port: int | None = None, health_port: int | None = None,
                 tls: TlsConfig | None = None,
                 interceptors: Sequence[grpc.ServerInterceptor] = ()):
        self.host = host
        self.health = HealthProbes(service_name)
        # `interceptors`: service authentication (service_shell/auth.py), when on.
        self.server = new_server(max_workers, thread_name_prefix, options, interceptors)
        self.health.add_to(self.server)
        enable_reflection(self.server, service_name)
        self.tls = tls
        self.port = 0
        self.metrics_port: int | None = None
        self.health_port: int | None = None
        self._requested = (port, metrics_port, health_port)
        self._registry = registry
        self._metrics: MetricsEndpoint | None = None
        self._health_port: HealthPort | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        """Binds every port and starts serving; OSError (and nothing left open) when a port
        cannot be bound."""
        port, metrics_port, health_port = self._requested
        # Credentials first: a bad certificate fails the start before any port is taken.
        credentials = self.tls.server_credentials() if self.tls is not None else None
        try:
            self.port = bind(self.server, self.host, port, credentials)
            if metrics_port is not None:
                self._metrics = MetricsEndpoint(self.host, metrics_port, self._registry)
                self.metrics_port = self._metrics.port
            if health_port is not None:
                self._health_port = HealthPort(self.health, self.host, health_port)
                self.health_port = self._health_port.port
        except BaseException:
            self.server.stop(None)
            self.close()
            raise
        self.server.start()

    def stop(self, grace_s: float | None) -> threading.Event:
        """Refuses new calls and gives running ones `grace_s`; the event is set once stopped."""
        return self.server.stop(grace_s)

    def close(self) -> None:
        """Closes the metrics endpoint and the health port: the last step of a drain, so that
        probes see NOT_SERVING (not a refused connection) for as long as the drain lasts."""
        if self._health_port is not None:
            self._health_port.close()
            self._health_port = None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None


    @staticmethod
    def announce(server: ShellPorts, host: str, *, first: Sequence[str] = (),
                 last: Sequence[str] = ()) -> None:
        """The start-up lines on stdout that scripts and tests read, flushed: `listening on
        HOST:PORT` (the bound port), the service's `first` lines, `metrics on HOST:PORT` and
        `health on HOST:PORT` when those ports are open, then its `last` lines."""
        lines = [f"listening on {server.address}", *first]
        if server.metrics_port is not None:
            lines.append(f"metrics on {host}:{server.metrics_port}")
        if server.health_port is not None:
            lines.append(f"health on {host}:{server.health_port}")
        for line in [*lines, *last]:
            print(line, flush=True)

    @staticmethod
    def serve_until_signal(shutdown: ShutdownSignal, drain: Callable[[], None], *,
                           grace_s: float, log: logging.Logger) -> int:
        """A service's main loop once it serves: waits for SIGTERM/SIGINT (`shutdown`, installed
        before the start), then runs `drain` on the main thread (not in the signal handler, so
        that it may block) under an `ExitGuard` of `grace_s` (the drain delay plus the grace),
        which also bounds the interpreter's exit. Returns the exit status, 0."""
        shutdown.wait()
        guard = ExitGuard(log, grace_s=grace_s)
        drain()
        guard.drained()
        return 0


class ShellPorts:
    """`port`, `metrics_port`, `health_port` and `address` of a service server that keeps its
    `ServiceShell` in `self._shell` (bound values after `start`)."""

    _shell: ServiceShell

    @property
    def port(self) -> int:
        return self._shell.port

    @property
    def metrics_port(self) -> int | None:
        return self._shell.metrics_port

    @property
    def health_port(self) -> int | None:
        return self._shell.health_port

    @property
    def address(self) -> str:
        return self._shell.address
