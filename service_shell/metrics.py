"""The Prometheus endpoint of one server."""
from __future__ import annotations

from http.server import ThreadingHTTPServer

import prometheus_client


class MetricsEndpoint:
    """Prometheus text over HTTP for one registry (a process may run several servers, each with
    a registry of its own). Plaintext, like the health port (see `service_shell.tls`)."""

    def __init__(self, host: str, port: int, registry: prometheus_client.CollectorRegistry):
        httpd, _ = prometheus_client.start_http_server(port, addr=host.strip("[]"),
                                                       registry=registry)
        self._httpd: ThreadingHTTPServer = httpd
        self.port: int = httpd.server_port

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
