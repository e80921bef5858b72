"""uvicorn serving the HTTP app inside the gateway process, on its own thread and event loop.

Why in process and not a second server: the HTTP API is a front end of the same routing state
(the index, the load, the running calls), which lives in this process.

Lifecycle, tied to the gateway's (gateway/assembly.py):
- `start()` binds the port itself (so port 0 picks a free one and a port in use fails the
  gateway's start, before anything is served), then runs uvicorn on a thread and waits until
  it serves. uvicorn installs no signal handlers off the main thread: SIGTERM stays the
  gateway's, which drains both front ends.
- `stop_accepting()` is the drain's first step: uvicorn closes the listening socket, closes idle
  keep-alive connections, and lets running responses (streams included) finish.
- `stop(timeout_s)` waits for that, up to `timeout_s`; then uvicorn cancels what is left.
With TLS configured, the port serves TLS with the gRPC port's certificate (and requires client
certificates when a CA is given), read at start.
"""
from __future__ import annotations

import logging
import socket
import ssl
import threading

import uvicorn
from fastapi import FastAPI

from service_shell import TlsConfig, kv

log = logging.getLogger("gateway.http")


def _bind(host: str, port: int) -> socket.socket:
    host = host.strip("[]")
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and host in ("::", ""):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4 too
        sock.bind(address)
        sock.listen(2048)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class HttpServer:
    def __init__(self, app: FastAPI, host: str, port: int, *, tls: TlsConfig | None = None,
                 graceful_s: float = 30.0, start_timeout_s: float = 30.0):
        self._sock = _bind(host, port)
        self.host, self.port = host, self._sock.getsockname()[1]
        tls_args = {}
        if tls is not None and tls.cert:
            tls_args = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key,
                        "ssl_ca_certs": tls.ca,
                        "ssl_cert_reqs": ssl.CERT_REQUIRED if tls.ca else ssl.CERT_NONE}
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=graceful_s, server_header=False,
                                **tls_args)
        self._server = uvicorn.Server(config)
        self._start_timeout_s = start_timeout_s
        self._thread = threading.Thread(target=self._run, name="gateway-http", daemon=True)
        self._failed: BaseException | None = None

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        except BaseException as exc:  # SystemExit from a failed startup included
            self._failed = exc
            log.exception(kv("http_server_failed"))

    def start(self) -> HttpServer:
        self._thread.start()
        waited = 0.0
        while not self._server.started:
            if not self._thread.is_alive() or waited > self._start_timeout_s:
                self._sock.close()
                raise RuntimeError(f"HTTP server on port {self.port} did not start: "
                                   f"{self._failed!r}")
            self._thread.join(0.01)
            waited += 0.01
        return self

    @property
    def serving(self) -> bool:
        return self._server.started and self._thread.is_alive() and not self._server.should_exit

    def stop_accepting(self) -> None:
        self._server.should_exit = True

    def stop(self, timeout_s: float) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(5.0)
        self._sock.close()
