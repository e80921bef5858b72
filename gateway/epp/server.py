"""The Endpoint Picker's own gRPC port (`--epp-port`): ExternalProcessor and the health services
the EPP protocol names ("liveness", "readiness" and `envoy.service.ext_proc.v3.ExternalProcessor`,
the last two following the gateway's readiness), with the gateway's TLS when it has one.

Only the data plane may call ExternalProcessor: a caller presents a service token (the
`x-prefixcache-service-token` ext_proc gRPC metadata Envoy's `grpc_service.initial_metadata`
adds) or, on a TLS port, a client certificate, of an identity with role `dataplane` in
`callers` (the gateway's --service-identities-file); anyone else is UNAUTHENTICATED (no or an
unknown credential) or PERMISSION_DENIED (another role). Without `callers` every caller is
refused. Health and reflection stay open for probes.

A port of its own, not the gateway's: the data plane's ext_proc cluster and its health checks
point at it, and the gateway's `--max-streams` bounds it separately (each ext_proc stream holds
a server thread for its whole HTTP request, a Generate's whole stream)."""
from __future__ import annotations

from collections.abc import Callable

import threading

import prometheus_client

from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from gateway.core.proxy import GenerateProxy
from gateway.core.router import Router
from gateway.core.running_calls import RunningCalls
from gateway.epp.protocol import EXT_PROC_SERVICE
from gateway.epp.servicer import EndpointPicker, EppMetrics
from service_shell import (HealthProbes, TlsConfig, bind, enable_reflection, new_server,
                           server_options)
from service_shell.auth import EPP_POLICY, AuthInterceptor, Refusals, ServiceIdentities


class EppServer:
    def __init__(self, proxy: GenerateProxy, router: Router,
                 registry: prometheus_client.CollectorRegistry, *, host: str, port: int,
                 max_streams: int, max_message_mb: int, tls: TlsConfig | None = None,
                 callers: ServiceIdentities | None = None,
                 gateway_calls: RunningCalls | None = None,
                 model_servers: Callable[[str], str] | None = None) -> None:
        self.host, self._port, self.tls = host, port, tls
        self.port = 0
        self.picker = EndpointPicker(proxy, router, EppMetrics(registry), max_message_mb << 20,
                                     gateway_calls, model_servers)
        self.refusals = Refusals(registry, "gateway-epp")
        auth = AuthInterceptor(callers if callers is not None else ServiceIdentities(),
                               EXT_PROC_SERVICE, EPP_POLICY, self.refusals)
        self.server = new_server(max_streams + 16, "gateway-epp", server_options(max_message_mb),
                                 (auth,))
        ep_grpc.add_ExternalProcessorServicer_to_server(self.picker, self.server)
        self.health = HealthProbes(EXT_PROC_SERVICE)
        self.health.add_to(self.server)
        enable_reflection(self.server, EXT_PROC_SERVICE)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> EppServer:
        credentials = self.tls.server_credentials() if self.tls is not None else None
        try:
            self.port = bind(self.server, self.host, self._port, credentials)
        except BaseException:
            self.server.stop(None)
            raise
        self.server.start()
        return self

    def set_ready(self, ready: bool) -> None:
        self.health.set_ready(ready)

    def stop(self, grace_s: float) -> threading.Event:
        """NOT_SERVING for good and no new streams; streams in flight (requests the data plane
        is still proxying) get `grace_s`. The event is set once the port closed."""
        self.health.shutdown()
        return self.server.stop(grace_s)
