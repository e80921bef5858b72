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
certificates when a CA is given). The files are checked every `tls_reload_s` and a renewed set
is loaded into the same SSLContext uvicorn serves with (service_shell.tls.SslContextReloader), so
new connections get it, as on the gRPC port.

Slow and idle clients (issue 25, finding 10), `HttpLimits`:
- a connection whose request head (request line and headers) is not complete
  `header_timeout_s` after it opened (or after its previous response) is closed, and so is one
  whose body is not complete `body_timeout_s` after its head: a slowloris client sending a byte
  every few seconds holds a socket for at most that long (uvicorn with httptools has no such
  timeout of its own);
- an idle keep-alive connection is closed after `keep_alive_s` (uvicorn's timeout_keep_alive);
- at most `max_connections` connections are open: one more is closed as soon as it is accepted;
- h11's largest incomplete event (uvicorn's h11_max_incomplete_event_size) bounds a head too.
Each closed connection is counted in `prefixcache_gateway_http_connections_closed_total{reason}`
(header_timeout, body_timeout, connection_cap).
"""
from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading

import prometheus_client
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service_shell import TlsConfig, kv
from service_shell.tls import SslContextReloader
from gateway.http.bounds import HttpLimits

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




def closed_counter(registry: prometheus_client.CollectorRegistry | None
                   ) -> prometheus_client.Counter:
    return prometheus_client.Counter(
        "prefixcache_gateway_http_connections_closed", "HTTP connections the gateway closed "
        "for a slow request or past its connection cap, by reason (header_timeout, "
        "body_timeout, connection_cap).", ["reason"], registry=registry)


def guarded_protocol(limits: HttpLimits, closed: prometheus_client.Counter) -> type:
    """uvicorn's httptools protocol with `limits`' read deadlines and connection cap."""

    class GuardedProtocol(HttpToolsProtocol):
        _deadline: asyncio.TimerHandle | None = None

        def _arm(self, seconds: float, reason: str) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._expired, reason, seconds)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self, reason: str, seconds: float) -> None:
            self._deadline = None
            if self.transport is not None and not self.transport.is_closing():
                closed.labels(reason).inc()
                log.info(kv("http_connection_closed", reason=reason, after_s=seconds,
                            client=(self.client or ("", 0))[0]))
                self.transport.close()

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                closed.labels("connection_cap").inc()
                log.warning(kv("http_connection_refused", reason="connection_cap",
                               max_connections=limits.max_connections))
                transport.close()
                return
            self._arm(limits.header_timeout_s, "header_timeout")

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._deadline is None:  # a keep-alive connection's next request
                self._arm(limits.header_timeout_s, "header_timeout")

        def on_headers_complete(self) -> None:
            self._arm(limits.body_timeout_s, "body_timeout")
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

    return GuardedProtocol


class HttpServer:
    def __init__(self, app: FastAPI, host: str, port: int, *, tls: TlsConfig | None = None,
                 graceful_s: float = 30.0, start_timeout_s: float = 30.0,
                 limits: HttpLimits | None = None,
                 registry: prometheus_client.CollectorRegistry | None = None,
                 tls_reload_s: float = 5.0):
        limits = limits or HttpLimits()
        self._sock = _bind(host, port)
        self.host, self.port = host, self._sock.getsockname()[1]
        tls_args = {}
        if tls is not None and tls.cert:
            tls_args = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key,
                        "ssl_ca_certs": tls.ca,
                        "ssl_cert_reqs": ssl.CERT_REQUIRED if tls.ca else ssl.CERT_NONE}
        self.closed = closed_counter(registry)
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=graceful_s, server_header=False,
                                http=guarded_protocol(limits, self.closed),
                                timeout_keep_alive=limits.keep_alive_s,
                                h11_max_incomplete_event_size=limits.max_head_bytes,
                                **tls_args)
        self._server = uvicorn.Server(config)
        # Checks the files from the start, so a renewal during startup is not missed.
        self._reloader = SslContextReloader(tls) if tls_args else None
        self._tls_reload_s = tls_reload_s
        self._start_timeout_s = start_timeout_s
        self._thread = threading.Thread(target=self._run, name="gateway-http", daemon=True)
        self._failed: BaseException | None = None

    async def _serve(self) -> None:
        watch = None
        if self._reloader is not None:
            watch = asyncio.get_running_loop().create_task(self._watch_certificates())
        try:
            await self._server.serve(sockets=[self._sock])
        finally:
            if watch is not None:
                watch.cancel()

    async def _watch_certificates(self) -> None:
        # On the server's own loop: the SSLContext is changed between handshakes, never during.
        while True:
            await asyncio.sleep(self._tls_reload_s)
            if self._server.started and self._server.config.ssl is not None:
                self._reloader.check(self._server.config.ssl)

    def _run(self) -> None:
        try:
            # uvicorn's own loop (uvloop when installed), as Server.run would choose it.
            with asyncio.Runner(loop_factory=self._server.config.get_loop_factory()) as runner:
                runner.run(self._serve())
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
