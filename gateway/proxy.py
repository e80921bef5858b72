"""ComputeService at the gateway: authenticate, tokenize, hash, route, and proxy each Generate
stream to the chosen worker (see gateway/server.py's docstring for the contract)."""
from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass, field

import grpc

from gateway.metrics import MEDIA, GatewayMetrics
from gateway.policies import RouteRequest
from gateway.routing import Router, Worker
from gateway.tenants import AuthError, Tenant, TenantDirectory
from gateway.tokenize import PromptTokenizer, prompt_ids
from gateway.workers import Fleet
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache.v1 import compute_service_pb2_grpc as pb_grpc
from prefixcache_client.compute import ComputeClientError, GenerateStream
from prefixcache_client.hash import chain_hashes, namespace_seed, token_bytes
from service_shell import SALT_METADATA_KEY, kv

log = logging.getLogger("gateway.proxy")

MAX_REQUEST_ID_BYTES = 128  # the workers' limit
# Failures before the first token that another worker may not have: nothing was streamed, so
# the request can move. (Other codes are about the request itself and pass through.)
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
_NO_DEADLINE_S = 1e9
_OUTCOME = {pb.FINISH_REASON_STOP: "ok", pb.FINISH_REASON_LENGTH: "ok",
            pb.FINISH_REASON_ABORT: "abort"}


class _Rejected(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(code, message)
        self.code, self.message = code, message


@dataclass(eq=False)
class ProxiedCall:
    """One Generate call at the gateway: whom it runs on, and how to cancel it from any thread."""
    tenant: Tenant
    request_id: str
    worker: Worker | None = None
    stream: GenerateStream | None = None
    cancelled: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def attach(self, worker: Worker, stream: GenerateStream) -> None:
        with self._lock:
            self.worker, self.stream = worker, stream
            if self.cancelled:  # the client left while the call was being routed
                stream.cancel()

    def cancel(self) -> None:
        """The client left: cancelling the worker call aborts the request on the worker."""
        with self._lock:
            self.cancelled = True
            if self.stream is not None:
                self.stream.cancel()


class RunningCalls:
    """Calls in progress by (tenant, request id): ids are unique per tenant, Abort and the drain
    find calls here."""

    def __init__(self) -> None:
        self._calls: dict[tuple[str, str], ProxiedCall] = {}
        self._changed = threading.Condition()

    def add(self, call: ProxiedCall) -> bool:
        with self._changed:
            key = (call.tenant.name, call.request_id)
            if key in self._calls:
                return False
            self._calls[key] = call
            return True

    def remove(self, call: ProxiedCall) -> None:
        with self._changed:
            self._calls.pop((call.tenant.name, call.request_id), None)
            self._changed.notify_all()

    def get(self, tenant: Tenant, request_id: str) -> ProxiedCall | None:
        with self._changed:
            return self._calls.get((tenant.name, request_id))

    def snapshot(self) -> list[ProxiedCall]:
        with self._changed:
            return list(self._calls.values())

    def wait_empty(self, timeout_s: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: not self._calls, timeout_s)

    def __len__(self) -> int:
        return len(self._calls)


class GenerateProxy(pb_grpc.ComputeServiceServicer):
    def __init__(self, router: Router, fleet: Fleet, tenants: TenantDirectory,
                 tokenizer: PromptTokenizer, metrics: GatewayMetrics, running: RunningCalls,
                 draining: threading.Event, default_timeout_s: float):
        self._router, self._fleet, self._tenants = router, fleet, tenants
        self._tokenizer, self._metrics, self._running = tokenizer, metrics, running
        self._draining, self._default_timeout_s = draining, default_timeout_s

    # ----- request preparation (shared with GatewayService) --------------------------------

    def authenticate(self, context: grpc.ServicerContext) -> Tenant:
        try:
            return self._tenants.authenticate(context.invocation_metadata())
        except AuthError as exc:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
            raise  # unreachable: abort raises

    def route_request(self, request: pb.GenerateRequest, tenant: Tenant,
                      context: grpc.ServicerContext, request_id: str) -> RouteRequest:
        """The prompt's ids and page hashes in the request's namespace; aborts the call with
        INVALID_ARGUMENT naming the field, or UNAVAILABLE before any worker is known."""
        model_id, page_size = self._fleet.model_id, self._fleet.page_size
        if model_id is None or page_size is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is known yet; retry later")
        try:
            ids = prompt_ids(request, self._tokenizer)
            data = token_bytes(ids, "prompt.token_ids")
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        hashes = chain_hashes(namespace_seed(model_id, request.adapter, tenant.salt), data,
                              page_size)
        return _PromptRoute(request_id, hashes, len(ids), page_size, ids)

    # ----- ComputeService ---------------------------------------------------------------------

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        if self._draining.is_set():
            self._count("", "unavailable")
            context.abort(grpc.StatusCode.UNAVAILABLE, "gateway is draining; retry on another")
        tenant = self.authenticate(context)
        if any(k == SALT_METADATA_KEY for k, _ in context.invocation_metadata() or ()):
            # Never trusted from a client: the tenant's salt replaces it.
            log.debug(kv("client_salt_ignored", tenant=tenant.name, peer=context.peer()))
        request_id = request.request_id or uuid.uuid4().hex
        if len(request_id.encode()) > MAX_REQUEST_ID_BYTES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"request_id: must be at most {MAX_REQUEST_ID_BYTES} UTF-8 bytes")
        # The load tracker keys requests by id, and ids are only unique per tenant: it gets
        # one of the gateway's own.
        route = self.route_request(request, tenant, context, uuid.uuid4().hex)
        call = ProxiedCall(tenant, request_id)
        if not self._running.add(call):
            context.abort(grpc.StatusCode.ALREADY_EXISTS,
                          f"request_id: '{request_id}' is already running")
        try:
            if not context.add_callback(call.cancel):
                call.cancel()
            yield from self._proxy(request, route, call, context)
        finally:
            self._running.remove(call)

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        tenant = self.authenticate(context)
        if not request.request_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty")
        call = self._running.get(tenant, request.request_id)
        worker = call.worker if call is not None else None
        if worker is None:
            return pb.AbortResponse(aborted=False)
        try:
            return pb.AbortResponse(aborted=worker.client.abort(request.request_id))
        except ComputeClientError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"worker {worker.name} ({worker.address}) did not answer Abort: "
                          f"{exc.status.name}: {exc.message}")

    def GetModelInfo(self, request: pb.GetModelInfoRequest,
                     context: grpc.ServicerContext) -> pb.GetModelInfoResponse:
        info = self._fleet.info
        if info is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is known yet; retry later")
        out = pb.GetModelInfoResponse()
        out.CopyFrom(info)
        # The fleet's answer: the tightest context of its workers, and no single worker's name.
        out.max_context_tokens = self._router.max_context_tokens() or info.max_context_tokens
        out.worker = ""
        return out

    def LoadAdapter(self, request, context):
        context.abort(grpc.StatusCode.UNIMPLEMENTED,
                      "LoadAdapter: the gateway does not manage adapters; load them on each worker")

    def UnloadAdapter(self, request, context):
        context.abort(grpc.StatusCode.UNIMPLEMENTED,
                      "UnloadAdapter: the gateway does not manage adapters; unload them on each "
                      "worker")

    def abort_all(self) -> None:
        """Drain: asks each running call's worker to abort it (its stream then ends normally,
        with FINISH_REASON_ABORT and its stats)."""
        for call in self._running.snapshot():
            worker = call.worker
            if worker is not None:
                try:
                    worker.client.abort(call.request_id, timeout_s=2.0)
                except ComputeClientError:
                    call.cancel()

    # ----- proxying ---------------------------------------------------------------------------

    def _proxy(self, request: pb.GenerateRequest, route: _PromptRoute, call: ProxiedCall,
               context: grpc.ServicerContext):
        failed: list[str] = []
        while True:
            chosen = self._router.route(route, exclude=failed)
            if chosen is None:
                self._count("", "unavailable")
                why = f"; {', '.join(failed)} failed before the first token" if failed else ""
                context.abort(grpc.StatusCode.UNAVAILABLE, f"no worker is available{why}")
            worker, sent = chosen.worker, 0
            try:
                stream = worker.client.generate(
                    route.ids, request.sampling, request_id=call.request_id,
                    adapter=request.adapter, salt=call.tenant.salt,
                    timeout_s=self._deadline(context))
                call.attach(worker, stream)
                for msg in stream:
                    if sent == 0:
                        self._router.first_token(route.request_id)
                    sent += 1
                    yield msg
                    if msg.HasField("stats"):
                        self._finished(worker, msg.stats)
                        return
                # Ended without its final message: never pass that off as a complete answer.
                raise ComputeClientError("Generate", grpc.StatusCode.UNAVAILABLE,
                                         "stream ended without its final message")
            except ComputeClientError as exc:
                if call.cancelled or not context.is_active():
                    self._count(worker.name, "cancelled")
                    return
                if sent == 0 and exc.status in _RETRYABLE and not failed:
                    self._retry(worker, exc)
                    failed.append(worker.name)
                    continue
                self._fail(worker, exc, sent, failed, context)
            finally:
                self._router.finish(route.request_id)

    def _deadline(self, context: grpc.ServicerContext) -> float:
        """The client's remaining time for the worker call; the default when it set none (gRPC
        reports "none" as ~2^63 s)."""
        remaining = context.time_remaining()
        if remaining is None or remaining > _NO_DEADLINE_S:
            return self._default_timeout_s
        return remaining

    def _retry(self, worker: Worker, exc: ComputeClientError) -> None:
        if exc.status == grpc.StatusCode.UNAVAILABLE and self._router.set_up(worker.name, False):
            log.info(kv("worker_down", worker=worker.name, reason=exc.message))
        self._metrics.retries.labels(worker.name).inc()
        log.info(kv("generate_retry", worker=worker.name, code=exc.status.name,
                    message=exc.message))

    def _fail(self, worker: Worker, exc: ComputeClientError, sent: int, failed: list[str],
              context: grpc.ServicerContext) -> None:
        if sent == 0 and exc.status in _RETRYABLE:  # the retry failed too
            self._count(worker.name, exc.status.name.lower())
            context.abort(exc.status, f"worker {worker.name} ({worker.address}) failed before "
                          f"the first token, after {', '.join(failed)} did: {exc.message}")
        if sent == 0 or exc.status == grpc.StatusCode.DEADLINE_EXCEEDED:
            # The worker's verdict on the request (or the client's deadline): as it said it.
            self._count(worker.name, exc.status.name.lower())
            context.abort(exc.status, exc.message)
        self._count(worker.name, "failed_mid_stream")
        if exc.status == grpc.StatusCode.UNAVAILABLE and self._router.set_up(worker.name, False):
            log.info(kv("worker_down", worker=worker.name, reason=exc.message))
        log.warning(kv("worker_failed_mid_stream", worker=worker.name, messages=sent,
                       code=exc.status.name, message=exc.message))
        context.abort(grpc.StatusCode.UNAVAILABLE,
                      f"worker {worker.name} ({worker.address}) failed mid-stream after {sent} "
                      f"messages: {exc.status.name}: {exc.message}; the output is incomplete")

    def _finished(self, worker: Worker, stats: pb.GenerateStats) -> None:
        self._count(worker.name, _OUTCOME.get(stats.finish_reason, "ok"))
        for medium, tokens in zip(MEDIA, (stats.cached_tokens_device, stats.cached_tokens_host,
                                          stats.cached_tokens_remote)):
            self._metrics.cached_tokens.labels(medium).inc(tokens)

    def _count(self, worker: str, outcome: str) -> None:
        self._metrics.requests.labels(worker, outcome).inc()


@dataclass(slots=True)
class _PromptRoute(RouteRequest):
    """A route request that also carries the prompt's ids (what the worker is sent)."""
    ids: list[int] = field(default_factory=list)
