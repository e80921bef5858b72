"""The gateway's gRPC front end: prefixcache.v1.ComputeService (the workers' API, routed) and
GatewayService (RoutePreview, ListWorkers), thin adapters over `gateway.proxy.GenerateProxy`
(see gateway/server.py's docstring for the contract). Everything here translates between a
grpc.ServicerContext and the core: metadata -> tenant, the client's deadline -> the call's
timeout, the client leaving -> cancel, `ProxyError` -> the call's status."""
from __future__ import annotations

import logging

import grpc

from gateway.proxy import GenerateProxy, ProxyError
from gateway.request_checks import check_request
from gateway.routing import Router
from gateway.tenants import AuthError, Tenant
from gateway.tokenize import TokenizerUnavailable
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache.v1 import compute_service_pb2_grpc as pb_grpc
from prefixcache.v1 import gateway_pb2 as gpb
from prefixcache.v1 import gateway_pb2_grpc as gpb_grpc
from service_shell import SALT_METADATA_KEY, kv

log = logging.getLogger("gateway.servicer")

# gRPC reports "no deadline" as ~2^63 s.
_NO_DEADLINE_S = 1e9


def authenticate(proxy: GenerateProxy, context: grpc.ServicerContext) -> Tenant:
    """The caller's tenant, or the call aborted with UNAUTHENTICATED naming the header."""
    try:
        return proxy.tenants.authenticate(context.invocation_metadata())
    except AuthError as exc:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        raise  # unreachable: abort raises


class ComputeServicer(pb_grpc.ComputeServiceServicer):
    def __init__(self, proxy: GenerateProxy, default_timeout_s: float):
        self._proxy, self._default_timeout_s = proxy, default_timeout_s

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        proxy = self._proxy
        try:
            proxy.check_open()
            tenant = authenticate(proxy, context)
            if any(k == SALT_METADATA_KEY for k, _ in context.invocation_metadata() or ()):
                # Never trusted from a client: the tenant's salt replaces it.
                log.debug(kv("client_salt_ignored", tenant=tenant.name, peer=context.peer()))
            check_request(request, proxy.fleet)
            stream = proxy.open(request, tenant, self._deadline(context),
                                active=context.is_active)
        except ProxyError as exc:
            context.abort(exc.code, exc.message)
        try:
            if not context.add_callback(stream.cancel):
                stream.cancel()
            yield from stream
        except ProxyError as exc:
            context.abort(exc.code, exc.message)
        finally:
            stream.close()

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        tenant = authenticate(self._proxy, context)
        if not request.request_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty")
        try:
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
        """The gateway's tokenizer, as a worker answers it (gateway/tokenize.py); a tenant's
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
