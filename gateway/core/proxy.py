"""ComputeService at the gateway: authenticate, tokenize, hash, route, and proxy each Generate
stream to the chosen worker (gateway/grpc_api/servicer.py's docstring is the contract).

The routing and proxying core (`GenerateProxy.open` -> `ProxiedStream`) takes a request and an
authenticated tenant and needs no grpc.ServicerContext: the gRPC servicers (gateway/grpc_api/)
and the OpenAI-compatible HTTP app (gateway/http/) are two front ends of the same calls, so
retries, cancellation, load accounting and the drain behave alike on both. Refusals and failures are
`ProxyError`s carrying the gRPC status each front end translates.

Longer than 400 lines: one stream's routing, retry, resume and outcome accounting, whose
invariants (ProxiedStream's docstring) hold only together."""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

from gateway.core.metrics import MEDIA, GatewayMetrics
from gateway.core.policies import RouteRequest
from gateway.core.router import Router, Worker
from gateway.core.running_calls import ProxiedCall, RunningCalls
from gateway.core.tenants import Tenant, TenantDirectory
from gateway.core.tokenize import (PromptTokenizer, TokenizerUnavailable, prompt_fingerprint,
                              prompt_ids)
from gateway.core.workers import Fleet
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache_client.compute import ComputeClientError, GenerateStream
from prefixcache_client.hash import chain_hashes, namespace_seed, token_bytes
from prefixcache_client.limits import quote_untrusted, request_id_too_long
from service_shell import kv, tracing

log = logging.getLogger("gateway.proxy")

# Failures before the first token that another worker may not have: nothing was streamed, so
# the request can move. (Other codes are about the request itself and pass through.)
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
# RESOURCE_EXHAUSTED that gRPC itself raised on a response over a size limit (metadata or
# message) is about this request, not the worker's load: another worker would answer the same.
_SIZE_LIMIT = ("metadata size exceeds", "larger than max", "exceeds limit")


def _retryable(exc: ComputeClientError) -> bool:
    if exc.status == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return not any(s in exc.message for s in _SIZE_LIMIT)
    return exc.status in _RETRYABLE
# A stream whose worker failed after it sent tokens moves at most this many times (design.md §6,
# "Resuming a stream").
MAX_RESUMES = 2
_OUTCOME = {pb.FINISH_REASON_STOP: "ok", pb.FINISH_REASON_LENGTH: "ok",
            pb.FINISH_REASON_ABORT: "abort"}


class ProxyError(Exception):
    """A call refused or failed, as the gRPC status the gateway answers: the gRPC servicer aborts
    with it, the HTTP app maps it to an HTTP status (gateway/http/errors.py)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(code, message)
        self.code, self.message = code, message


class ProxiedStream(Iterator[pb.GenerateResponse]):
    """One routed Generate call: the worker's messages, as they come.

    Invariants, whoever consumes it (the gRPC servicer, the HTTP app, a test):
    - The worker call is started by `GenerateProxy.open`, not by the first read: N streams opened
      back to back reach the worker together, routed one after the other under the routing lock,
      so the policy's memory of recent pages sends samples of one prompt to one worker (twins).
    - Before the first message, a worker failing with UNAVAILABLE or RESOURCE_EXHAUSTED (its load
      shed; not gRPC's own refusal of a response over a size limit, which every worker would
      repeat) is retried once on the next best one; any other failure raises `ProxyError` with
      the worker's code and message.
    - After the first message, a worker failing with UNAVAILABLE (it died or went away) hands
      the request to the next best worker with the output tokens streamed so far
      (GenerateRequest.resume_output), which goes on after them: the caller sees one stream.
      Not for a request with a seed (the other worker's draws would not be the seed's: it fails
      with an error that says so), and at most MAX_RESUMES times. Otherwise the failure raises
      UNAVAILABLE naming the worker: a truncated stream never passes for a complete one.
    - In a model server (`GenerateProxy.home`: its own worker's address), a new request goes
      to that worker only while it is up; the other workers it knows (its peers) are where a
      retry or a resume goes.
    - The last message carries `stats`; after it the iterator ends. A cancelled call ends
      without raising (whoever cancelled knows why).
    - The call leaves `RunningCalls` and the router's load exactly once: when the stream ends,
      fails, or `close()`s. `cancel()` is safe from any thread (a blocked read then ends).
    """

    def __init__(self, proxy: GenerateProxy, request: pb.GenerateRequest, route: _PromptRoute,
                 call: ProxiedCall, timeout_s: float, active: Callable[[], bool],
                 trace: tracing.Context | None = None):
        self._proxy, self._request, self._route, self._call = proxy, request, route, call
        self._trace = trace  # the front end's span: each worker call carries it (traceparent)
        self._deadline = time.monotonic() + timeout_s
        self._active = active
        self._failed: list[str] = []
        self._output: list[int] = []  # the tokens streamed so far, for a resume
        self._resumes = 0
        self._fresh = False  # no message yet from the current worker's stream
        self._stream: GenerateStream | None = None
        self._worker: Worker | None = None
        self._routed = self._ended = False
        self._lock = threading.Lock()
        self.sent = 0
        # Why the policy chose the worker (RouteDecision.reason), for callers that report it.
        self.route_reason = ""

    @property
    def worker(self) -> str:
        return self._worker.name if self._worker is not None else ""

    @property
    def prompt_ids(self) -> list[int]:
        return self._route.ids

    def cancel(self) -> None:
        """The caller left: cancelling the worker call aborts the request on the worker."""
        self._call.cancel()

    def abort(self) -> bool:
        """Asks the worker to abort the request. Unlike `cancel()`, its stream then ends
        normally, with FINISH_REASON_ABORT and its stats (what the HTTP app's usage needs after
        a stop string). Falls back to `cancel()` when the worker does not answer; False when it
        no longer ran the request."""
        worker = self._call.worker
        if worker is None:
            self.cancel()
            return False
        try:
            return worker.client.abort(self._call.request_id, timeout_s=2.0,
                                       scope=self._call.scope)
        except ComputeClientError:
            self.cancel()
            return False

    def close(self) -> None:
        """Cancels the call if it is still running and releases it (idempotent)."""
        if not self._ended:
            self._call.cancel()
        self._end()

    def _start(self) -> None:
        proxy, route = self._proxy, self._route
        chosen = None
        if proxy.home is not None and not self._failed and not self._output:
            # A model server's new request goes to its own worker (the picker chose this pod);
            # its peers take only what that worker could not (before or after the first token)
            # and, with it known down already, the request itself.
            chosen = proxy._router.route(route, exclude=proxy._router.names_elsewhere(proxy.home))
        if chosen is None:
            chosen = proxy._router.route(route, exclude=self._failed)
        if chosen is None:
            if not self._output:  # a resume that finds no worker fails as the stream it was
                proxy._count("", "unavailable")
            why = (f"; {', '.join(self._failed)} failed before the first token"
                   if self._failed and not self._output else "")
            raise ProxyError(grpc.StatusCode.UNAVAILABLE, f"no worker is available{why}")
        with self._lock:
            self._worker, self._routed = chosen.worker, True
        self.route_reason = chosen.decision.reason
        proxy._metrics.routed(chosen.decision.policy, chosen.decision.reason)
        req, call = self._request, self._call
        stream = chosen.worker.client.generate(
            route.ids, req.sampling, request_id=call.request_id, adapter=req.adapter,
            salt=call.tenant.salt, timeout_s=max(0.001, self._deadline - time.monotonic()),
            resume_output=self._output, scope=call.scope,
            trace_metadata=tracing.inject((), self._trace),
            prompt_cache_retention=req.prompt_cache_retention)
        tracing.annotate(self._trace, **{"prefixcache.worker": chosen.worker.name,
                                         "prefixcache.route_reason": self.route_reason})
        self._stream, self._fresh = stream, True
        call.attach(chosen.worker, stream)
        proxy._router.settle()  # the decision's bookkeeping, now that the call is on its way

    def _unroute(self) -> None:
        with self._lock:
            routed, self._routed = self._routed, False
        if routed:
            self._proxy._router.finish(self._route.request_id)

    def _end(self) -> None:
        with self._lock:
            ended, self._ended = self._ended, True
        if not ended:
            self._unroute()
            self._proxy._running.remove(self._call)

    def __next__(self) -> pb.GenerateResponse:
        if self._ended:
            raise StopIteration
        try:
            msg = self._read()
        except BaseException:
            self._end()
            raise
        if msg is None:
            self._end()
            raise StopIteration
        return msg

    def _read(self) -> pb.GenerateResponse | None:
        proxy = self._proxy
        while True:
            worker, stream = self._worker, self._stream
            assert worker is not None and stream is not None
            try:
                msg = next(stream)
            except StopIteration:
                # Ended without its final message: never pass that off as a complete answer.
                exc = ComputeClientError("Generate", grpc.StatusCode.UNAVAILABLE,
                                         "stream ended without its final message")
            except ComputeClientError as err:
                exc = err
            else:
                if self._fresh:  # the router counts a worker's load until its first token
                    proxy._router.first_token(self._route.request_id)
                    self._fresh = False
                self.sent += 1
                self._output.extend(msg.token_ids)
                if msg.HasField("stats"):
                    proxy._finished(worker, msg.stats)
                    self._end()
                return msg
            self._unroute()
            if self._call.cancelled or not self._active():
                proxy._count(worker.name, "cancelled")
                return None
            if self.sent == 0 and _retryable(exc) and not self._failed:
                proxy._retry(worker, exc)
                self._failed.append(worker.name)
                self._start()
                continue
            if self._resumable(exc):
                proxy._resume(worker, exc, len(self._output))
                self._failed.append(worker.name)
                self._resumes += 1
                try:
                    self._start()
                    continue
                except ProxyError:
                    pass  # no worker left to take it: fail as the stream it was
            raise proxy._failure(worker, exc, self.sent, self._failed,
                                 seeded=self._request.sampling.HasField("seed"))

    def _resumable(self, exc: ComputeClientError) -> bool:
        """Whether another worker may go on with this stream (see the class docstring)."""
        sampling = self._request.sampling
        return (self.sent > 0 and bool(self._output) and exc.status == grpc.StatusCode.UNAVAILABLE
                and not sampling.HasField("seed") and self._resumes < MAX_RESUMES
                and not 0 < sampling.max_tokens <= len(self._output))


class GenerateProxy:
    """The gateway's Generate path, callable from Python: `open` takes a request and an
    authenticated tenant and returns a `ProxiedStream`. The gRPC servicer
    (gateway/grpc_api/servicer.py), the HTTP app (gateway/http/) and the Endpoint Picker
    (gateway/epp/) are its front ends."""

    def __init__(self, router: Router, fleet: Fleet, tenants: TenantDirectory,
                 tokenizer: PromptTokenizer, metrics: GatewayMetrics, running: RunningCalls,
                 draining: threading.Event, default_timeout_s: float,
                 home: str | None = None):
        self._router, self._fleet, self._tenants = router, fleet, tenants
        self._tokenizer, self._metrics, self._running = tokenizer, metrics, running
        self._draining, self._default_timeout_s = draining, default_timeout_s
        # A model server's own worker (compute address): new requests go there; None = any.
        self.home = home

    @property
    def tenants(self) -> TenantDirectory:
        return self._tenants

    @property
    def tokenizer(self) -> PromptTokenizer:
        return self._tokenizer

    @property
    def fleet(self) -> Fleet:
        return self._fleet

    def check_open(self) -> None:
        """ProxyError(UNAVAILABLE) once the drain refuses new calls."""
        if self._draining.is_set():
            self._count("", "unavailable")
            raise ProxyError(grpc.StatusCode.UNAVAILABLE, "gateway is draining; retry on another")

    def prepare(self, request: pb.GenerateRequest, tenant: Tenant, request_id: str,
                tokenizer_fingerprint: str | None = None) -> _PromptRoute:
        """The prompt's ids and page hashes in the request's namespace. ProxyError:
        INVALID_ARGUMENT naming the field, or UNAVAILABLE before any worker is known.
        `tokenizer_fingerprint`: the tokenizer a worker must have, for token ids the caller
        made with the gateway's tokenizer (a chat); None: as the prompt says (tokenize.py)."""
        model_id, page_size = self._fleet.model_id, self._fleet.page_size
        if model_id is None or page_size is None:
            raise ProxyError(grpc.StatusCode.UNAVAILABLE, "no worker is known yet; retry later")
        try:
            ids = prompt_ids(request, self._tokenizer)
            data = token_bytes(ids, "prompt.token_ids")
        except TokenizerUnavailable as exc:
            raise ProxyError(exc.code, str(exc)) from None
        except ValueError as exc:
            raise ProxyError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        hashes = chain_hashes(namespace_seed(model_id, request.adapter, tenant.salt), data,
                              page_size)
        if tokenizer_fingerprint is None:
            tokenizer_fingerprint = prompt_fingerprint(request, self._tokenizer)
        # Keys are scoped by the namespace salt: tenants (and cache_salts) that share no pages
        # never share a key's worker.
        cache_key = (tenant.salt, request.prompt_cache_key) if request.prompt_cache_key else None
        return _PromptRoute(request_id, hashes, len(ids), page_size, ids,
                            tokenizer_fingerprint=tokenizer_fingerprint, cache_key=cache_key)

    def open(self, request: pb.GenerateRequest, tenant: Tenant, timeout_s: float | None = None,
             *, active: Callable[[], bool] | None = None,
             tokenizer_fingerprint: str | None = None,
             trace: tracing.Context | None = None) -> ProxiedStream:
        """Routes `request` for `tenant` and starts the worker call (see ProxiedStream).
        `timeout_s`: the whole call's deadline (None: the gateway's default); `active`: False
        once the caller is gone (a failure then counts as a cancel); `tokenizer_fingerprint`:
        as `prepare`'s; `trace`: the front end's span context, which the worker's spans join. ProxyError when the call is refused: draining, a bad request, a
        duplicate request id, no worker."""
        self.check_open()
        request_id = request.request_id or uuid.uuid4().hex
        problem = request_id_too_long(request_id)
        if problem is not None:
            raise ProxyError(grpc.StatusCode.INVALID_ARGUMENT, problem)
        # The load tracker keys requests by id, and ids are only unique per tenant: it gets
        # one of the gateway's own.
        route = self.prepare(request, tenant, uuid.uuid4().hex, tokenizer_fingerprint)
        call = ProxiedCall(tenant, request_id)
        if not self._running.add(call):
            raise ProxyError(grpc.StatusCode.ALREADY_EXISTS,
                             f"request_id: {quote_untrusted(request_id)} is already running")
        stream = ProxiedStream(self, request, route, call,
                               self._default_timeout_s if timeout_s is None else timeout_s,
                               active or (lambda: True), trace)
        try:
            stream._start()
        except BaseException:
            stream.close()
            raise
        return stream

    def abort_all(self) -> None:
        """Drain: asks each running call's worker to abort it (its stream then ends normally,
        with FINISH_REASON_ABORT and its stats)."""
        for call in self._running.snapshot():
            worker = call.worker
            if worker is not None:
                try:
                    worker.client.abort(call.request_id, timeout_s=2.0, scope=call.scope)
                except ComputeClientError:
                    call.cancel()

    def abort(self, tenant: Tenant, request_id: str) -> bool:
        """Asks the worker running `tenant`'s `request_id` to abort it; False when none runs.
        ProxyError(UNAVAILABLE) when the worker does not answer."""
        call = self._running.get(tenant, request_id)
        worker = call.worker if call is not None else None
        if worker is None:
            return False
        try:
            return worker.client.abort(request_id, scope=call.scope)
        except ComputeClientError as exc:
            raise ProxyError(grpc.StatusCode.UNAVAILABLE,
                             f"worker {worker.name} ({worker.address}) did not answer Abort: "
                             f"{exc.status.name}: {exc.message}") from None

    def model_info(self) -> pb.GetModelInfoResponse | None:
        """The fleet's answer: the first worker's info with the tightest context of all
        workers, and no single worker's name. None before any worker is known."""
        info = self._fleet.info
        if info is None:
            return None
        out = pb.GetModelInfoResponse()
        out.CopyFrom(info)
        out.max_context_tokens = self._router.max_context_tokens() or info.max_context_tokens
        out.worker = ""
        self._tokenizer.fill_model_info(out)
        return out

    # ----- outcomes -----------------------------------------------------------------------------

    def _retry(self, worker: Worker, exc: ComputeClientError) -> None:
        if exc.status == grpc.StatusCode.UNAVAILABLE and self._router.set_up(worker.name, False):
            log.info(kv("worker_down", worker=worker.name, reason=exc.message))
        self._metrics.retries.labels(worker.name).inc()
        log.info(kv("generate_retry", worker=worker.name, code=exc.status.name,
                    message=exc.message))

    def _resume(self, worker: Worker, exc: ComputeClientError, tokens: int) -> None:
        if self._router.set_up(worker.name, False):
            log.info(kv("worker_down", worker=worker.name, reason=exc.message))
        self._metrics.resumes.labels(worker.name).inc()
        log.warning(kv("generate_resumed", worker=worker.name, tokens=tokens,
                       code=exc.status.name, message=exc.message))

    def _failure(self, worker: Worker, exc: ComputeClientError, sent: int,
                 failed: list[str], seeded: bool = False) -> ProxyError:
        if sent == 0 and _retryable(exc):  # the retry failed too
            self._count(worker.name, exc.status.name.lower())
            return ProxyError(exc.status, f"worker {worker.name} ({worker.address}) failed "
                              f"before the first token, after {', '.join(failed)} did: "
                              f"{exc.message}")
        if sent == 0 or exc.status == grpc.StatusCode.DEADLINE_EXCEEDED:
            # The worker's verdict on the request (or the client's deadline): as it said it.
            self._count(worker.name, exc.status.name.lower())
            return ProxyError(exc.status, exc.message)
        self._count(worker.name, "failed_mid_stream")
        if exc.status == grpc.StatusCode.UNAVAILABLE and self._router.set_up(worker.name, False):
            log.info(kv("worker_down", worker=worker.name, reason=exc.message))
        log.warning(kv("worker_failed_mid_stream", worker=worker.name, messages=sent,
                       code=exc.status.name, message=exc.message))
        return ProxyError(grpc.StatusCode.UNAVAILABLE,
                          f"worker {worker.name} ({worker.address}) failed mid-stream after "
                          f"{sent} messages: {exc.status.name}: {exc.message}; the output is "
                          "incomplete" + ("; a request with a seed is not resumed on another "
                                          "worker (its draws would not be the seed's)"
                                          if seeded else ""))

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
