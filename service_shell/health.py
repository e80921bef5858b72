"""`grpc.health.v1` as probes ask for it, on the service's own port and, optionally, on a
dedicated plaintext port of its own (`HealthPort`) for Kubernetes `grpc:` probes."""
from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from service_shell.grpc_server import bind, enable_reflection, new_server
from service_shell.options import server_options

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthProbes:
    """`grpc.health.v1` with the names probes ask for: "liveness" (the process answers) and
    "readiness" (it should get traffic); "" (the whole server, by gRPC convention) and the
    service's own name follow readiness. Starts live and not ready."""

    def __init__(self, service_name: str):
        # Blocking Watch (one worker thread per watcher): the non-blocking mode sends updates
        # synchronously under the servicer's lock, and deadlocks with the gRPC poller thread when a
        # watcher cancels while the status changes (seen on SIGTERM with grpcio-health 1.85).
        self.servicer = health.HealthServicer(experimental_non_blocking=False)
        self._ready_names = ("readiness", "", service_name)
        self.servicer.set("liveness", _SERVING)
        self.set_ready(False)

    def add_to(self, server: grpc.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    def set_ready(self, ready: bool) -> None:
        for name in self._ready_names:
            self.servicer.set(name, _SERVING if ready else _NOT_SERVING)

    def set_detail(self, name: str, ok: bool) -> None:
        """The state of a part the service runs without when it fails (e.g. "l3": the Redis
        page store), under its own health name: readiness does not follow it, since taking the
        service out of traffic would not bring the part back."""
        self.servicer.set(name, _SERVING if ok else _NOT_SERVING)

    def shutdown(self) -> None:
        """Everything NOT_SERVING for good (later `set_ready` calls are ignored)."""
        self.servicer.enter_graceful_shutdown()


class HealthPort:
    """The same health servicer on a second, small gRPC server of its own port.

    Plaintext even when the service port uses (m)TLS: kubelet `grpc:` probes cannot present a
    client certificate, and a probe answer carries nothing but SERVING/NOT_SERVING. Its own port
    also keeps probes answering while the service port's threads are all busy with streams.
    """

    # Check calls take microseconds; blocking Watch streams (grpcurl, debugging) hold one each.
    _WORKERS = 4

    def __init__(self, probes: HealthProbes, host: str, port: int):
        self._server = new_server(self._WORKERS, "health", server_options(1))
        probes.add_to(self._server)
        enable_reflection(self._server)  # health (and reflection) only
        self.port = bind(self._server, host, port)
        self._server.start()

    def close(self) -> None:
        """Stops at once: it is closed after the service's own port, at the end of a drain."""
        self._server.stop(0).wait()
