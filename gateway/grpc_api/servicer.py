"""The gateway's gRPC front end: prefixcache.v1.ComputeService (the workers' API, routed) and
GatewayService (RoutePreview, ListWorkers), thin adapters over `gateway.core.proxy.GenerateProxy`.
Everything here translates between a grpc.ServicerContext and the core: metadata -> tenant, the
client's deadline -> the call's timeout, the client leaving -> cancel, `ProxyError` -> the call's
status. `register` adds both services, and reflection, to the gateway's gRPC server.

Generate: authenticate the caller (core/tenants.py), tokenize a text prompt as the worker would
(core/tokenize.py), hash the prompt's pages in the request's namespace (model id, adapter, tenant
salt), let the policy pick a worker, and proxy the stream with the token ids and the tenant's
salt as `x-prefixcache-salt` metadata. Salt metadata sent by the client is never forwarded. The
client's deadline becomes the worker call's; a client that leaves cancels the worker call, which
aborts the request there. A worker that fails before the first token (UNAVAILABLE: refused,
dead, draining) is retried once on the next best one; after the first token the client gets
UNAVAILABLE naming the worker, never a silently truncated stream.

Status codes: UNAUTHENTICATED names the `authorization` header; INVALID_ARGUMENT names the field
(`prompt`, `request_id`); ALREADY_EXISTS: the tenant already runs `request_id`; UNAVAILABLE: no
worker can take the request, the gateway is draining, or the worker failed; the workers' own
codes (INVALID_ARGUMENT, OUT_OF_RANGE, NOT_FOUND, ...) pass through unchanged.
"""
from __future__ import annotations

import logging

import grpc

from gateway.core.proxy import GenerateProxy, ProxyError
from gateway.core.request_checks import check_request, check_request_id
from gateway.core.router import Router
from gateway.core.tenants import AuthError, Tenant
from gateway.core.tokenize import TokenizerUnavailable
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache.v1 import compute_service_pb2_grpc as pb_grpc
from prefixcache.v1 import gateway_pb2 as gpb
from prefixcache.v1 import gateway_pb2_grpc as gpb_grpc
from prefixcache_client.limits import request_id_too_long
from service_shell import SALT_METADATA_KEY, enable_reflection, kv, tracing

log = logging.getLogger("gateway.servicer")

COMPUTE_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ComputeService"].full_name
GATEWAY_SERVICE_NAME = gpb.DESCRIPTOR.services_by_name["GatewayService"].full_name
_TRACER = tracing.tracer("prefixcache.gateway")
# X-Request-Id, as gRPC metadata keys are lowercase: a client that names its call this way (as
# it does over HTTP) gets it as the request id when the request sets none, and back.
REQUEST_ID_METADATA_KEY = "x-request-id"
# gRPC reports "no deadline" as ~2^63 s.
_NO_DEADLINE_S = 1e9


def authenticate(proxy: GenerateProxy, context: grpc.ServicerContext) -> Tenant:
    """The caller's tenant, or the call aborted with UNAUTHENTICATED naming the header."""
    try:
        return proxy.tenants.authenticate(context.invocation_metadata())
    except AuthError as exc:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        raise  # unreachable: abort raises


def request_id_of_header(request: pb.GenerateRequest, metadata, context: grpc.ServicerContext
                         ) -> None:
    """`x-request-id` metadata becomes the request id when the request has none (the field wins
    when both are set), and the request id is echoed as `x-request-id` initial metadata. The
    id stays tenant-scoped like any request id (the proxy checks it: length, duplicates)."""
    if not request.request_id:
        request.request_id = next((v for k, v in metadata if k == REQUEST_ID_METADATA_KEY
                                   and isinstance(v, str)), "")
    rid = request.request_id
    # Only what a metadata value may carry; an id too long is refused by the proxy anyway.
    if rid and rid.isascii() and rid.isprintable() and request_id_too_long(rid) is None:
        context.send_initial_metadata(((REQUEST_ID_METADATA_KEY, rid),))


class ComputeServicer(pb_grpc.ComputeServiceServicer):
    def __init__(self, proxy: GenerateProxy, default_timeout_s: float):
        self._proxy, self._default_timeout_s = proxy, default_timeout_s

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        metadata = context.invocation_metadata() or ()
        request_id_of_header(request, metadata, context)
        span = tracing.start(_TRACER, "gateway.Generate", tracing.extract(metadata),
                             tracing.SpanKind.SERVER, **{"rpc.system": "grpc",
                                                         "prefixcache.request_id":
                                                         request.request_id or None})
        try:
            yield from self._generate(request, context, metadata, tracing.context_of(span))
        finally:
            tracing.end(span)

    def _generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext,
                  metadata, trace):
        proxy = self._proxy
        try:
            proxy.check_open()
            tenant = authenticate(proxy, context)
            if any(k == SALT_METADATA_KEY for k, _ in metadata):
                # Never trusted from a client: the tenant's salt replaces it.
                log.debug(kv("client_salt_ignored", tenant=tenant.name, peer=context.peer()))
            check_request(request, proxy.fleet)
            stream = proxy.open(request, tenant, self._deadline(context),
                                active=context.is_active, trace=trace)
        except ProxyError as exc:
            tracing.fail(trace, exc.code.name, exc.message)
            context.abort(exc.code, exc.message)
        try:
            if not context.add_callback(stream.cancel):
                stream.cancel()
            yield from stream
        except ProxyError as exc:
            tracing.fail(trace, exc.code.name, exc.message)
            context.abort(exc.code, exc.message)
        finally:
            stream.close()

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        tenant = authenticate(self._proxy, context)
        try:
            check_request_id(request.request_id)
            return pb.AbortResponse(aborted=self._proxy.abort(tenant, request.request_id))
        except ProxyError as exc:
            context.abort(exc.code, exc.message)

    def GetModelInfo(self, request: pb.GetModelInfoRequest,
                     context: grpc.ServicerContext) -> pb.GetModelInfoResponse:
        # A tenant's call, like HTTP GET /v1/models: it names the model, the loaded adapters and
        # a worker (design.md §8, "Service identities"); anonymous only with --allow-anonymous.
        authenticate(self._proxy, context)
        info = self._proxy.model_info()
        if info is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is known yet; retry later")
        return info

    def GetTokenizer(self, request: pb.GetTokenizerRequest,
                     context: grpc.ServicerContext) -> pb.GetTokenizerResponse:
        """The gateway's tokenizer, as a worker answers it (gateway/core/tokenize.py); a tenant's
        call, like GetModelInfo."""
        authenticate(self._proxy, context)
        try:
            return self._proxy.tokenizer.tokenizer_response()
        except TokenizerUnavailable as exc:
            context.abort(exc.code, str(exc))

    def LoadAdapter(self, request, context):
        context.abort(grpc.StatusCode.UNIMPLEMENTED,
                      "LoadAdapter: the gateway does not manage adapters; load them on each worker")

    def UnloadAdapter(self, request, context):
        context.abort(grpc.StatusCode.UNIMPLEMENTED,
                      "UnloadAdapter: the gateway does not manage adapters; unload them on each "
                      "worker")

    def _deadline(self, context: grpc.ServicerContext) -> float:
        """The client's remaining time for the worker call; the default when it set none."""
        remaining = context.time_remaining()
        if remaining is None or remaining > _NO_DEADLINE_S:
            return self._default_timeout_s
        return remaining


class GatewayServicer(gpb_grpc.GatewayServiceServicer):
    def __init__(self, proxy: GenerateProxy, router: Router):
        self._proxy, self._router = proxy, router

    def RoutePreview(self, request: gpb.RoutePreviewRequest,
                     context: grpc.ServicerContext) -> gpb.RoutePreviewResponse:
        tenant = authenticate(self._proxy, context)
        try:
            # What Generate would refuse is not previewed (the vocabulary bound, the floats).
            check_request(request.request, self._proxy.fleet)
            route_request = self._proxy.prepare(request.request, tenant,
                                                request.request.request_id or "preview")
        except ProxyError as exc:
            context.abort(exc.code, exc.message)
        return self._router.preview(route_request)

    def ListWorkers(self, request: gpb.ListWorkersRequest,
                    context: grpc.ServicerContext) -> gpb.ListWorkersResponse:
        authenticate(self._proxy, context)
        return self._router.list_workers()


def register(server: grpc.Server, proxy: GenerateProxy, router: Router,
             default_timeout_s: float) -> None:
    """ComputeService and GatewayService over `proxy` and `router` on `server`, and reflection
    listing both."""
    pb_grpc.add_ComputeServiceServicer_to_server(ComputeServicer(proxy, default_timeout_s), server)
    gpb_grpc.add_GatewayServiceServicer_to_server(GatewayServicer(proxy, router), server)
    # The shell's reflection names one service; this registration (the later one wins)
    # lists both. TODO(service_shell): take several service names.
    enable_reflection(server, COMPUTE_SERVICE_NAME, GATEWAY_SERVICE_NAME)
