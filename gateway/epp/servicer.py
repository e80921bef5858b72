"""`envoy.service.ext_proc.v3.ExternalProcessor/Process`: one bidirectional stream per HTTP
request the data plane (Envoy) forwards to the InferencePool, from its headers to the end of its
response (design.md §6, "The gateway as an Endpoint Picker").

The picked endpoint is a worker's compute address (pod IP:50052, the InferencePool's
podIP:targetPort): clients call `prefixcache.v1.ComputeService` through the data plane, which
sends the call straight to the worker the gateway's router picks, with the gateway's policy and
index, exactly as its own Generate path would (`GenerateProxy.prepare`: tenant, tokenizer, page
hashes in the tenant's namespace). Headers the EPP sets on the forwarded request, so that the
worker sees what the gateway's own call would send: `x-prefixcache-salt` is the tenant's salt
(or removed: a client's own is never forwarded), the tenant's `authorization` is removed, and a
client's `x-prefixcache-service-token` is removed, and `x-prefixcache-request-scope` is the
tenant's request-id scope (service_shell/metadata.py). The EPP never hands out a credential: the
data plane reaches workers with its own (role `dataplane`, a static header Envoy adds after
this filter), and only the data plane may call the EPP at all (gateway/epp/server.py).

Processing modes (the data plane's `protocol_config`): FULL_DUPLEX_STREAMED, what the EPP
protocol requires, holds the headers answer until the body is complete, then answers headers
(destination) and hands the body back; BUFFERED answers the headers at once and names the
destination on the body. (STREAMED cannot work: the data plane routes on the headers before any
body chunk comes.) A request without a body (headers end_of_stream) is picked on its headers. A Generate stays counted on its worker (the router's load) until this stream ends; its
first response body chunk is its first token.

Only Generate (by prefix) and Abort (only to the worker running that tenant's request, through
the data plane or the gateway) are routed: they are all the data plane's identity may call on a
worker. GetModelInfo and GetTokenizer are the gateway's own (its gRPC port).

With `model_servers` (--epp-model-server-port), the workers also run model servers (`python -m
gateway --model-server`, the OpenAI HTTP API of one worker, gateway/core/dataplane_tenants.py)
and the picker routes OpenAI HTTP to them as the Inference Extension's reference deployment
routes to vLLM pods: POST /v1/completions and /v1/chat/completions by their prompt's prefix
(the body read as the gateway's HTTP API reads it: gateway/epp/openai_body.py), GET /v1/models
and /health to the least loaded; the same tenant headers are set, the endpoint is the worker's
model server. Refusals are ImmediateResponses: 401 (unauthenticated), 400 (a body that
is not one uncompressed request message, a bad prompt), 404 (any other call, an Abort of nothing
running, an unknown model), 413 (over --max-message-mb), 503 (no worker, none in the data
plane's subset, or draining); a gRPC client gets the matching gRPC status, an HTTP one an
OpenAI error object.
"""
from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterator

import grpc
import prometheus_client

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from gateway.core.policies.base import RouteRequest
from gateway.core.proxy import GenerateProxy, ProxyError
from gateway.core.request_checks import check_request, check_request_id
from gateway.core.router import Router
from gateway.core.running_calls import RunningCalls
from gateway.core.tenants import AUTH_METADATA_KEY, AuthError, Tenant
from gateway.epp import openai_body, protocol as wire
from gateway.epp.protocol import Refusal
from prefixcache_client.limits import quote_untrusted
from service_shell import REQUEST_SCOPE_METADATA_KEY, SALT_METADATA_KEY, kv, request_scope
from service_shell.auth import SERVICE_TOKEN_METADATA_KEY

log = logging.getLogger("gateway.epp")

_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
_HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
                grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
                grpc.StatusCode.UNAVAILABLE: 503}


class EppMetrics:
    def __init__(self, registry: prometheus_client.CollectorRegistry) -> None:
        self.picks = prometheus_client.Counter(
            "prefixcache_gateway_epp_picks", "Endpoint Picker answers by worker and outcome "
            "(picked, or the refusal: bad_request, unauthenticated, too_large, unavailable).",
            ["worker", "outcome"], registry=registry)
        self.streams = prometheus_client.Gauge(
            "prefixcache_gateway_epp_streams", "Open ext_proc streams (HTTP requests in "
            "flight through the data plane).", registry=registry)


class EndpointPicker(ep_grpc.ExternalProcessorServicer):
    def __init__(self, proxy: GenerateProxy, router: Router, metrics: EppMetrics,
                 max_body_bytes: int, gateway_calls: RunningCalls | None = None,
                 model_servers: Callable[[str], str] | None = None) -> None:
        self.proxy, self.router, self.metrics = proxy, router, metrics
        # A worker's compute address -> its model server's endpoint (the InferencePool's
        # podIP:targetPort), where OpenAI HTTP requests go; None: they are not routed here.
        self.model_servers = model_servers
        # The gateway's own calls in progress (an Abort may name one of them).
        self.gateway_calls = gateway_calls if gateway_calls is not None else RunningCalls()
        self.max_body_bytes = max_body_bytes
        # (tenant, request id) -> worker address of Generates in flight: an Abort through the
        # data plane goes to the worker that runs the request.
        self._running: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()

    def Process(self, request_iterator: Iterator[ep.ProcessingRequest],
                context: grpc.ServicerContext) -> Iterator[ep.ProcessingResponse]:
        exchange = _Exchange(self)
        self.metrics.streams.inc()
        try:
            for request in request_iterator:
                yield from exchange.handle(request)
                if exchange.done:
                    return
        finally:
            exchange.close()
            self.metrics.streams.dec()

    # ----- picking ------------------------------------------------------------------------------

    def pick(self, ex: _Exchange, body: bytes) -> tuple[str, dict[str, str | None]]:
        """(endpoint, headers to set or remove) for the exchange's request; Refusal."""
        openai = self.model_servers is not None and ex.path in openai_body.PATHS
        if not openai and ex.path not in (wire.GENERATE_PATH, wire.ABORT_PATH):
            raise Refusal(404, f"{ex.path or 'the request'}: not routed here; the pool serves "
                               "prefixcache.v1.ComputeService Generate and Abort over gRPC"
                               + (", and POST /v1/completions, /v1/chat/completions, GET "
                                  "/v1/models over HTTP" if self.model_servers else
                                  " (the OpenAI API is the gateway's own HTTP port, or the "
                                  "workers' model servers with --epp-model-server-port)"))
        ex.openai = openai
        tenant = self._tenant(ex)
        try:
            self.proxy.check_open()
        except ProxyError as exc:
            raise Refusal(503, exc.message) from None
        if self.proxy.fleet.model_id is None or self.proxy.fleet.page_size is None:
            raise Refusal(503, "no worker is known yet; retry later")
        if ex.path == wire.ABORT_PATH:
            endpoint = self._running_on(tenant, wire.abort_request(body))
            if ex.subset is not None and endpoint not in ex.subset:
                raise Refusal(503, f"the request runs on {endpoint}, outside the data "
                                   "plane's subset")
            names = [n for n in self.router.names()
                     if (w := self.router.get(n)) is not None and w.address == endpoint]
            self.metrics.picks.labels(names[0] if names else "", "picked").inc()
            return endpoint, self._headers(tenant)
        return self._route(ex, tenant, self._route_request(ex, tenant, body)), \
            self._headers(tenant)

    def _route_request(self, ex: _Exchange, tenant: Tenant, body: bytes) -> RouteRequest:
        """What the router scores for this exchange: its prompt's pages in the tenant's
        namespace (no prompt, for GET /v1/models: any worker, the least loaded)."""
        if ex.openai and ex.path not in openai_body.PROMPT_PATHS:
            return RouteRequest(uuid.uuid4().hex, [], 0, self.proxy.fleet.page_size)
        if ex.openai:
            request, fingerprint = openai_body.prompt_request(ex.path, body, self.proxy,
                                                              self.router)
        else:
            request, fingerprint = wire.generate_request(body), None
        try:
            # What the gateway's own Generate refuses, refused before the prompt is
            # tokenized and hashed (gateway/core/request_checks.py).
            check_request(request, self.proxy.fleet)
            route = self.proxy.prepare(request, tenant, uuid.uuid4().hex, fingerprint)
        except ProxyError as exc:
            raise Refusal(_HTTP_STATUS.get(exc.code, 400), exc.message) from None
        if request.request_id:
            ex.running_key = (tenant.name, request.request_id)
        return route

    def _route(self, ex: _Exchange, tenant: Tenant, route: RouteRequest) -> str:
        chosen = self.router.route(route, exclude=self._outside(ex.subset, ex.openai))
        if chosen is None:
            why = ("no worker in the data plane's subset "
                   f"({', '.join(sorted(ex.subset))}) is available"
                   if ex.subset is not None else "no worker is available")
            raise Refusal(503, why)
        endpoint = self._endpoint(chosen.worker.address, ex.openai)
        # Counted on its worker until the stream ends.
        ex.routed = route.request_id
        if ex.running_key is not None:
            with self._lock:
                self._running[ex.running_key] = endpoint
        self.metrics.picks.labels(chosen.worker.name, "picked").inc()
        log.debug(kv("epp_pick", path=ex.path, worker=chosen.worker.name, endpoint=endpoint,
                     reason=chosen.decision.reason))
        return endpoint

    def _endpoint(self, address: str, openai: bool) -> str:
        """A worker's endpoint for this request: its compute address (gRPC), or its model
        server's (OpenAI HTTP)."""
        return self.model_servers(address) if openai else address

    def _running_on(self, tenant: Tenant, abort) -> str:
        """The worker running the tenant's request (sent through the data plane, or through
        the gateway itself). Never another: workers know request ids, not tenants, and an
        Abort sent elsewhere with the gateway's identity could end another tenant's request."""
        try:
            check_request_id(abort.request_id)
        except ProxyError as exc:
            raise Refusal(400, exc.message) from None
        with self._lock:
            running = self._running.get((tenant.name, abort.request_id))
        if running is None:
            call = self.gateway_calls.get(tenant, abort.request_id)
            running = call.worker.address if call is not None and call.worker else None
        if running is None:
            raise Refusal(404, f"request_id: {quote_untrusted(abort.request_id)} is not running "
                               "for this "
                               "tenant", wire.GRPC_NOT_FOUND)
        return running

    def _tenant(self, ex: _Exchange) -> Tenant:
        values = ex.headers.get(AUTH_METADATA_KEY, [])
        try:
            return self.proxy.tenants.authenticate([(AUTH_METADATA_KEY, v) for v in values])
        except AuthError as exc:
            raise Refusal(401, str(exc)) from None

    def _headers(self, tenant: Tenant) -> dict[str, str | None]:
        # No credential ever goes back to the caller: the data plane presents its own to the
        # worker (a header Envoy adds after this filter); a client's own is removed.
        # The tenant's request-id scope, as the gateway's own calls carry it (a client's own is
        # replaced): on the worker, ids are unique per tenant, and an Abort reaches only the
        # tenant's own requests.
        return {SALT_METADATA_KEY: tenant.salt or None, AUTH_METADATA_KEY: None,
                SERVICE_TOKEN_METADATA_KEY: None,
                REQUEST_SCOPE_METADATA_KEY: request_scope(tenant.name)}

    def _outside(self, subset: set[str] | None, openai: bool = False) -> list[str]:
        """Workers whose endpoint the data plane's subset leaves out."""
        if subset is None:
            return []
        out = []
        for name in self.router.names():
            worker = self.router.get(name)
            if worker is None or self._endpoint(worker.address, openai) not in subset:
                out.append(name)
        return out

    def finished(self, ex: _Exchange) -> None:
        if ex.routed is not None:
            self.router.finish(ex.routed)
            ex.routed = None
        if ex.running_key is not None:
            with self._lock:
                self._running.pop(ex.running_key, None)
            ex.running_key = None


class _Exchange:
    """The state of one ext_proc stream (one HTTP request)."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker
        self.duplex = self.duplex_response = False
        self.headers: dict[str, list[str]] = {}
        self.path = ""
        self.grpc = False
        self.subset: set[str] | None = None
        self.body = bytearray()
        self.picked = self.first_token = self.done = False
        self.routed: str | None = None  # the router's request id while it counts the load
        self.openai = False  # an OpenAI HTTP request to a model server
        self.running_key: tuple[str, str] | None = None

    def handle(self, req: ep.ProcessingRequest) -> Iterator[ep.ProcessingResponse]:
        if req.HasField("protocol_config"):  # sent with the first message of the stream
            cfg = req.protocol_config
            self.duplex = cfg.request_body_mode == _DUPLEX
            self.duplex_response = cfg.response_body_mode == _DUPLEX
        kind = req.WhichOneof("request")
        try:
            if kind == "request_headers":
                yield from self._request_headers(req)
            elif kind == "request_body":
                yield from self._request_body(req.request_body)
            elif kind == "request_trailers":
                if not self.picked:
                    yield from self._picked(end_of_stream=False)
                yield ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
            elif kind == "response_headers":
                yield ep.ProcessingResponse(response_headers=ep.HeadersResponse())
            elif kind == "response_body":
                yield from self._response_body(req.response_body)
            elif kind == "response_trailers":
                yield ep.ProcessingResponse(response_trailers=ep.TrailersResponse())
                self.picker.finished(self)
        except Refusal as exc:
            self.picker.metrics.picks.labels("", _OUTCOMES.get(exc.status, "refused")).inc()
            log.info(kv("epp_refused", path=self.path, status=exc.status, message=exc.message))
            self.done = True
            yield wire.immediate(exc.status, exc.message, self.grpc, exc.grpc_status,
                                 openai_body.error_body(exc.status, exc.message)
                                 if self.openai else None)

    def _request_headers(self, req: ep.ProcessingRequest) -> Iterator[ep.ProcessingResponse]:
        self.headers = wire.header_map(req.request_headers)
        self.path = self.headers.get(":path", [""])[0].partition("?")[0]
        self.grpc = self.headers.get("content-type", [""])[0].startswith("application/grpc")
        self.subset = wire.subset_hint(req)
        if req.request_headers.end_of_stream:
            yield from self._picked(end_of_stream=True, headers_only=True)
        elif not self.duplex:  # BUFFERED: the destination goes with the body's answer
            yield wire.headers_response()

    def _request_body(self, body: ep.HttpBody) -> Iterator[ep.ProcessingResponse]:
        if len(self.body) + len(body.body) > self.picker.max_body_bytes:
            raise Refusal(413, f"body: over {self.picker.max_body_bytes} bytes "
                               "(--max-message-mb)")
        self.body += body.body
        if body.end_of_stream:
            yield from self._picked(end_of_stream=True)
        elif not self.duplex:  # STREAMED: each chunk is answered (it went on unchanged)
            yield wire.body_response()

    def _picked(self, end_of_stream: bool,
                headers_only: bool = False) -> Iterator[ep.ProcessingResponse]:
        endpoint, set_headers = self.picker.pick(self, bytes(self.body))
        self.picked = True
        common = wire.destination(endpoint, set_headers)
        meta = wire.destination_metadata(endpoint)
        if headers_only:
            yield wire.headers_response(common, meta)
        elif self.duplex:
            yield wire.headers_response(common, meta)
            yield from wire.streamed_body(bytes(self.body), end_of_stream)
        else:
            yield wire.body_response(common, meta)
        self.body = bytearray()
        self.picker.router.settle()  # the decision's bookkeeping, once its answer is sent

    def _response_body(self, body: ep.HttpBody) -> Iterator[ep.ProcessingResponse]:
        if not self.first_token and body.body and self.routed is not None:
            self.first_token = True
            self.picker.router.first_token(self.routed)
        if self.duplex_response:
            yield from wire.streamed_body(body.body, body.end_of_stream, response=True)
        else:
            yield ep.ProcessingResponse(response_body=ep.BodyResponse())
        if body.end_of_stream:
            self.picker.finished(self)

    def close(self) -> None:
        self.picker.finished(self)


_OUTCOMES = {400: "bad_request", 401: "unauthenticated", 404: "not_found", 413: "too_large",
             503: "unavailable"}
