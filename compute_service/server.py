"""The gRPC shell over `Engine`: ComputeService, health, reflection, metrics and drain.

The engine decides everything (scheduling, caching, sampling); this module translates between
gRPC and the engine (the message checks and conversions are in compute_service.server_messages)
and adds what every production server needs (design.md §8). The server starts
before the model is loaded (liveness SERVING, readiness NOT_SERVING, Generate UNAVAILABLE) and
becomes ready when `attach` hands it an engine whose pool is registered.

Longer than 400 lines: the servicer and the server's lifecycle (start, attach, drain with its
hand-backs) share the request registry and the drain state, and are read together.

Status codes; every message starts with the field it is about:
- FAILED_PRECONDITION: `prompt.text` on a worker without a tokenizer (a checkpoint without
  tokenizer.json serves token-id prompts only); GetTokenizer on such a worker.
- INVALID_ARGUMENT: malformed input: `request_id` over 128 bytes, `prompt` unset or empty,
  `prompt.token_ids` outside the vocabulary, `sampling.*` out of range (temperature, top_k, top_p,
  min_tokens > max_tokens, stop_token_ids outside the vocabulary), an `x-prefixcache-salt`
  metadata value over 256 bytes or sent twice.
- OUT_OF_RANGE: a well-formed request that does not fit this worker's context
  (`max_context_tokens` of GetModelInfo): the prompt alone (`prompt`) or prompt + max_tokens
  (`sampling.max_tokens`). Not INVALID_ARGUMENT because the same request may fit a worker with a
  longer context; gRPC defines OUT_OF_RANGE for exactly that ("may be fixed if the system state
  changes"), so a gateway can route it elsewhere instead of failing it.
- NOT_FOUND: `adapter` not loaded on this worker (Generate); `name` not loaded (UnloadAdapter).
- ALREADY_EXISTS: `request_id` names a request still running here in the caller's request-id
  scope (`x-prefixcache-request-scope` metadata, the tenant's: ids are unique per tenant, and
  answers name the client's id unchanged); LoadAdapter of a `name`
  already loaded (unload it first: a name always means one set of weights).
- RESOURCE_EXHAUSTED: more concurrent Generate streams than `max_streams`; LoadAdapter with
  every adapter slot in use (`--max-loaded-adapters`; an unloaded adapter's slot is free once
  the requests still using it ended).
- INVALID_ARGUMENT for LoadAdapter: `name` not 1..256 characters of [A-Za-z0-9._-], `path`
  empty or not a readable PEFT adapter directory, or the adapter's own field that this worker
  cannot serve (`r` above `--max-lora-rank`, `target_modules`, `use_dora`, ...).
- UNAVAILABLE: the model is still loading, or the server is draining: retry on another worker
  (also a request a drain handed back before its first token: queued, or past the grace);
  UnloadAdapter when the cache service could not be reached to evict the adapter's namespace
  (the adapter itself is unloaded; its cached pages age out by LRU).

LoadAdapter reads a directory on the worker's own file system: an operator's call (callers by
role: service_shell/auth.py); expose the compute port to clients only through the gateway.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from prefixcache_client.cache import CacheClientError
from prefixcache_client.errors import CacheError
from compute_service.engine import Engine, Output
from compute_service.lora import (AdapterConfigError, AdapterExistsError, AdapterNotFoundError,
                                  NoFreeSlotError, validate_adapter_name)
from compute_service.request_streams import RequestStream, RunningRequests
from compute_service.model import SamplingDefaults
from compute_service.server_messages import (Rejected, check_fits, check_names, is_read_error,
                                             model_info, prompt_of, request_id_of, response,
                                             retain_s_of, salt_of, sampling_of, scope_of,
                                             scoped_request_id,
                                             tokenizer_response)
from compute_service.server_metrics import ComputeMetrics
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache_client.limits import quote_untrusted, request_id_too_long
from prefixcache.v1 import compute_service_pb2_grpc as pb_grpc
from service_shell import (ServiceShell, ShellPorts, TlsConfig, kv, server_options,
                           tls_mode)
from service_shell import tracing
from service_shell.auth import COMPUTE_POLICY, ServiceIdentities, interceptors
from compute_service.engine.step_traces import request_attributes

log = logging.getLogger("compute_service.server")
_TRACER = tracing.tracer("prefixcache.compute")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ComputeService"].full_name
# How often a stream waiting for its next token checks that its client is still there (the
# done-callback is the main path; this bounds a handler thread's life if it was missed).
_POLL_S = 1.0
# After the last request of a drain ended, how long its final message gets to reach the client.
_FLUSH_S = 2.0


@dataclass(slots=True)
class ServerConfig:
    # Loopback unless told otherwise (the manifests set [::], with identities on): a server
    # without an identities file serves anyone who reaches it (service_shell/auth_flags.py).
    host: str = "127.0.0.1"
    # 0 = any free port (the bound one is `ComputeServer.port`).
    port: int = 50052
    # None = no metrics endpoint; 0 = any free port (the bound one is `ComputeServer.metrics_port`).
    metrics_port: int | None = None
    # None = health on `port` only; else also on this plaintext port, for kubelet probes
    # (0 = any free port; the bound one is `ComputeServer.health_port`).
    health_port: int | None = None
    # None = plaintext; else TLS on `port` (mTLS when it has a CA).
    tls: TlsConfig | None = None
    # None = no service authentication (event=auth_disabled); else callers by role (auth.py).
    auth: ServiceIdentities | None = None
    max_message_mb: int = 64
    # Each Generate stream holds a server thread for its whole life; the pool has a few more so
    # that Abort, GetModelInfo and health checks always find one.
    max_streams: int = 256
    # Drain: readiness goes NOT_SERVING; `drain_delay_s` later new Generate calls are refused
    # and queued ones handed back (UNAVAILABLE); running requests get `grace_s` to finish, then
    # the rest are aborted (handed back if they sent nothing) and get `abort_wait_s` to send
    # their last message.
    grace_s: float = 20.0
    drain_delay_s: float = 0.0
    abort_wait_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {self.max_streams}")

    @property
    def max_workers(self) -> int:
        # + 32 for the health Watch streams gateways hold (one thread each, for the worker's
        # life: gateway/core/workers.py learns of a drain through them).
        return self.max_streams + 16 + 32


class ComputeServicer(pb_grpc.ComputeServiceServicer):
    """Maps Generate onto `Engine.submit` and its sink, Abort onto `Engine.abort`."""

    def __init__(self, metrics: ComputeMetrics, running: RunningRequests, max_streams: int,
                 draining: threading.Event):
        self.engine: Engine | None = None  # set by ComputeServer.attach
        self.info: pb.GetModelInfoResponse | None = None
        self.defaults = SamplingDefaults()  # the checkpoint's, set by ComputeServer.attach
        self._metrics = metrics
        self._running = running
        self._stream_slots = threading.BoundedSemaphore(max_streams)
        self._max_streams = max_streams
        self._draining = draining

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        try:
            stream = self._submit(request, context)
        except Rejected as exc:
            self._metrics.rpcs.labels("Generate", exc.code.name).inc()
            log.info(kv("request_rejected", code=exc.code.name, message=exc.message,
                        peer=context.peer()))
            context.abort(exc.code, exc.message)
        code = grpc.StatusCode.CANCELLED
        try:
            while True:
                outs = stream.take(_POLL_S)
                if not outs:
                    if not context.is_active():
                        return  # the done-callback already asked the engine to abort
                    continue
                if stream.handed_back and not stream.sent and outs[-1].stats is not None:
                    code = grpc.StatusCode.UNAVAILABLE  # the client saw nothing: retry elsewhere
                    context.abort(code, "worker is draining; request handed back before its "
                                        "first token; retry on another worker")
                stream.sent = True
                yield response(outs, stream.client_id)
                if outs[-1].stats is not None:
                    code = grpc.StatusCode.OK
                    return
        finally:  # also when gRPC drops this generator after the client left
            self._stream_slots.release()
            self._metrics.rpcs.labels("Generate", code.name).inc()
            tracing.end(stream.span)

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        def abort() -> pb.AbortResponse:
            if not request.request_id:
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty")
            problem = request_id_too_long(request.request_id)
            if problem is not None:
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, problem)
            try:
                scope = scope_of(context.invocation_metadata())
            except ValueError as exc:
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            # Only the caller's tenant's request of that id (ids are unique per tenant).
            request_id = scoped_request_id(scope, request.request_id)
            stream = self._running.get(request_id)
            if stream is None:
                return pb.AbortResponse(aborted=False)
            self.cancel(stream)
            log.info(kv("request_abort_requested", request=request_id, peer=context.peer()))
            return pb.AbortResponse(aborted=True)
        return self._unary("Abort", abort, context)

    def GetModelInfo(self, request: pb.GetModelInfoRequest,
                     context: grpc.ServicerContext) -> pb.GetModelInfoResponse:
        def info() -> pb.GetModelInfoResponse:
            resp = pb.GetModelInfoResponse()
            resp.CopyFrom(self.info)
            resp.adapters[:] = self.engine.adapter_names()
            return resp
        return self._unary("GetModelInfo", info, context)

    def GetTokenizer(self, request: pb.GetTokenizerRequest,
                     context: grpc.ServicerContext) -> pb.GetTokenizerResponse:
        return self._unary("GetTokenizer", lambda: tokenizer_response(self.engine.tokenizer),
                           context)

    def LoadAdapter(self, request: pb.LoadAdapterRequest,
                    context: grpc.ServicerContext) -> pb.LoadAdapterResponse:
        def load() -> pb.LoadAdapterResponse:
            name, path = request.name, request.path
            try:
                # The name first, whatever the worker's adapter support: a bad name is bad input.
                validate_adapter_name(name)
                if not path:
                    raise AdapterConfigError("path", "must not be empty")
                started = time.monotonic()
                info = self.engine.load_adapter(name, path)
            except AdapterExistsError as exc:  # an AdapterConfigError: test it first
                raise Rejected(grpc.StatusCode.ALREADY_EXISTS, str(exc)) from None
            except AdapterConfigError as exc:
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            except NoFreeSlotError as exc:
                raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED, f"name: {exc}") from None
            except Exception as exc:  # unreadable files: not a server fault, nothing loaded
                if not is_read_error(exc):
                    raise
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                               f"path: cannot read the adapter at {quote_untrusted(path)}: "
                               f"{type(exc).__name__}: {exc}") from None
            log.info(kv("adapter_loaded", name=name, path=path, rank=info.rank, slot=info.slot,
                        targets=",".join(info.target_modules), peer=context.peer(),
                        seconds=round(time.monotonic() - started, 3)))
            return pb.LoadAdapterResponse(rank=info.rank, target_modules=info.target_modules)
        return self._unary("LoadAdapter", load, context)

    def UnloadAdapter(self, request: pb.UnloadAdapterRequest,
                      context: grpc.ServicerContext) -> pb.UnloadAdapterResponse:
        def unload() -> pb.UnloadAdapterResponse:
            name = request.name
            try:
                validate_adapter_name(name)
                removed, deferred = self.engine.unload_adapter(name)
            except AdapterConfigError as exc:
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            except AdapterNotFoundError as exc:
                raise Rejected(grpc.StatusCode.NOT_FOUND, str(exc)) from None
            except (CacheError, CacheClientError) as exc:
                # The weights are unloaded (new requests get NOT_FOUND); only the eviction of
                # its cached pages failed, and they can never be hit again: LRU takes them.
                log.warning(kv("adapter_evict_failed", name=name, error=exc))
                raise Rejected(grpc.StatusCode.UNAVAILABLE,
                               f"name: adapter '{name}' is unloaded, but the cache service "
                               f"could not evict its cached pages ({exc})") from None
            log.info(kv("adapter_unloaded", name=name, removed_pages=removed,
                        deferred_pages=deferred, peer=context.peer()))
            return pb.UnloadAdapterResponse(removed_pages=removed, deferred_pages=deferred)
        return self._unary("UnloadAdapter", unload, context)

    def cancel(self, stream: RequestStream) -> None:
        """Asks the engine to abort `stream`'s request; never blocks (runs in gRPC callbacks)."""
        stream.cancel_requested = True
        # Engine.abort only marks the request under the engine's lock (held briefly, never across
        # a step) if it is live: one not submitted yet (cancelled between RunningRequests.add and
        # Engine.submit) is not, and the sink repeats the abort at its next token until it takes.
        self.engine.abort(stream.request_id)

    def _submit(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> RequestStream:
        engine = self.engine
        if self._draining.is_set():
            raise Rejected(grpc.StatusCode.UNAVAILABLE,
                           "server is draining; retry on another worker")
        if engine is None:
            raise Rejected(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry later")
        if not self._stream_slots.acquire(blocking=False):
            raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"too many concurrent Generate streams (limit {self._max_streams}); "
                           "retry later")
        stream: RequestStream | None = None
        try:
            client_id = request_id_of(request)
            check_names(request)
            request_id = scoped_request_id(scope_of(context.invocation_metadata()), client_id)
            salt = salt_of(context.invocation_metadata())
            prompt = prompt_of(request, engine.tokenizer, self.info.max_context_tokens)
            sampling = sampling_of(request.sampling, engine.vocab_size, self.defaults)
            check_fits(len(prompt), sampling.max_tokens, self.info.max_context_tokens)
            stream = RequestStream(request_id, client_id)
            stream.span = tracing.start(
                _TRACER, "worker.Generate", tracing.extract(context.invocation_metadata()),
                tracing.SpanKind.SERVER, **{"prefixcache.request_id": client_id or None,
                                            "prefixcache.prompt_tokens": len(prompt)})
            if not self._running.add(stream):
                tracing.end(stream.span)
                stream = None  # the running one is not ours to remove
                raise Rejected(grpc.StatusCode.ALREADY_EXISTS,
                               f"request_id: '{client_id}' is already running")
            engine.submit(prompt, sampling, lambda out: self._sink(stream, out),
                          request_id=request_id, adapter=request.adapter, salt=salt,
                          resume_output=request.resume_output.ids,
                          trace=tracing.context_of(stream.span), retain_s=retain_s_of(request))
        except BaseException as exc:
            if stream is not None:
                tracing.end(stream.span)
                self._running.remove(stream.request_id)
            self._stream_slots.release()
            if isinstance(exc, ValueError):
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            if isinstance(exc, LookupError):
                raise Rejected(grpc.StatusCode.NOT_FOUND, str(exc)) from None
            raise
        if not context.add_callback(lambda: self._on_rpc_done(stream)):
            self._on_rpc_done(stream)  # the client left before the callback was registered
        log.debug(kv("request_started", request=request_id, prompt_tokens=len(prompt),
                     max_tokens=sampling.max_tokens, adapter=request.adapter, salted=bool(salt),
                     peer=context.peer()))
        return stream

    def _sink(self, stream: RequestStream, out: Output) -> None:
        """Engine thread. Bookkeeping first, so that a client that saw the last message can reuse
        the request id and reads metrics that include its request."""
        if out.stats is None:
            if stream.cancel_requested:
                # Race-free here: the engine thread is between its queue updates and does not
                # hold its lock while it calls sinks.
                self.engine.abort(stream.request_id)
        else:
            s = out.stats
            self._running.remove(stream.request_id)
            self._metrics.request_finished(s)
            tracing.annotate(tracing.context_of(stream.span), **request_attributes(s))
            log.info(kv("request_finished", request=s.request_id, reason=s.finish_reason.value,
                        prompt_tokens=s.prompt_tokens, cached_device=s.cached_tokens_device,
                        cached_host=s.cached_tokens_host, cached_remote=s.cached_tokens_remote,
                        shared=s.shared_tokens_in_flight,
                        computed=s.computed_prompt_tokens, output_tokens=s.output_tokens,
                        ttft_s=s.ttft_s, total_s=s.total_s, preemptions=s.preemptions))
        stream.put(out)

    def _on_rpc_done(self, stream: RequestStream) -> None:
        """gRPC callback when the call ends for any reason: a request still running lost its
        client (cancelled, deadline, connection gone), so it is aborted."""
        if self._running.get(stream.request_id) is stream:
            log.info(kv("request_cancelled_by_client", request=stream.request_id))
            self.cancel(stream)

    def _unary(self, method: str, call: Callable[[], object], context: grpc.ServicerContext):
        code = grpc.StatusCode.OK
        try:
            if self.engine is None:
                raise Rejected(grpc.StatusCode.UNAVAILABLE,
                               "the model is still loading; retry later")
            return call()
        except Rejected as exc:
            code = exc.code
            log.info(kv("rpc_rejected", method=method, code=code.name, message=exc.message))
            context.abort(code, exc.message)
        except Exception:
            code = grpc.StatusCode.INTERNAL
            log.exception(kv("rpc_failed", method=method))
            context.abort(code, f"internal error in {method}; see the compute service log")
        finally:
            self._metrics.rpcs.labels(method, code.name).inc()


class ComputeServer(ShellPorts):
    """A running compute service: gRPC server, health, reflection and metrics over one engine."""

    def __init__(self, config: ServerConfig | None = None):
        self.config = cfg = config or ServerConfig()
        self.running = RunningRequests()
        self.metrics = ComputeMetrics(lambda: self._servicer.engine, lambda: len(self.running))
        auth, _ = interceptors(cfg.auth, SERVICE_NAME, COMPUTE_POLICY, self.metrics.registry)
        self._shell = ServiceShell(
            SERVICE_NAME, host=cfg.host, port=cfg.port, max_workers=cfg.max_workers,
            thread_name_prefix="compute-rpc", options=server_options(cfg.max_message_mb),
            registry=self.metrics.registry, metrics_port=cfg.metrics_port,
            health_port=cfg.health_port, tls=cfg.tls, interceptors=auth)
        self.health = self._shell.health
        self._draining = threading.Event()
        self._drain_started = False
        self._stopped = threading.Event()
        self._drain_lock = threading.Lock()
        self._servicer = ComputeServicer(self.metrics, self.running, cfg.max_streams,
                                         self._draining)
        pb_grpc.add_ComputeServiceServicer_to_server(self._servicer, self._shell.server)

    @property
    def engine(self) -> Engine | None:
        return self._servicer.engine

    def start(self) -> ComputeServer:
        """Binds and serves health (ready only once an engine is attached)."""
        cfg = self.config
        self._shell.start()
        log.info(kv("server_started", address=self.address, metrics_port=self.metrics_port,
                    health_port=self.health_port, tls=tls_mode(cfg.tls),
                    max_message_mb=cfg.max_message_mb, max_streams=cfg.max_streams))
        return self

    def attach(self, engine: Engine, defaults: SamplingDefaults | None = None) -> ComputeServer:
        """Starts serving `engine` (its pool is registered by its constructor): starts its loop
        thread and turns readiness SERVING. The server owns the loop from here; drain stops it.
        `defaults`: the checkpoint's sampling defaults (generation_config.json)."""
        self._servicer.defaults = defaults = defaults or SamplingDefaults()
        self._servicer.info = model_info(engine, defaults)
        self._servicer.engine = engine
        engine.start()
        self.health.set_ready(True)
        if engine.cfg.l3 is not None:  # health name "l3": SERVING while Redis answers
            engine.cfg.l3.on_change(lambda up: self.health.set_detail("l3", up))
        info = self._servicer.info
        log.info(kv("worker_ready", worker=info.worker, model=info.model_id,
                    architecture=info.architecture, max_context=info.max_context_tokens,
                    page_size=info.page_size,
                    tokenizer=info.tokenizer_fingerprint[:16] or "none",
                    eos=",".join(map(str, info.eos_token_ids))))
        return self

    def drain(self, grace_s: float | None = None) -> None:
        """Graceful stop; idempotent and safe from any thread. Returns once fully stopped."""
        with self._drain_lock:
            first, self._drain_started = not self._drain_started, True
        if not first:
            self._stopped.wait()
            return
        cfg = self.config
        grace = cfg.grace_s if grace_s is None else grace_s
        log.info(kv("drain_started", grace_s=grace, drain_delay_s=cfg.drain_delay_s,
                    open_requests=len(self.running)))
        # Readiness first, so load balancers stop sending work while it is still served.
        self.health.set_ready(False)
        if cfg.drain_delay_s > 0:
            time.sleep(cfg.drain_delay_s)
        self._draining.set()  # Generate answers UNAVAILABLE from here on
        # Queued requests (waiting, or still in the engine's inbox) would only wait behind the
        # running ones: hand them back now (one admitted meanwhile too: it has sent nothing).
        self._hand_back(self.running.unsent({r.id for r in list(self.engine.running)}
                                            if self.engine is not None else set()))
        if not self.running.wait_empty(grace):
            left = self.running.snapshot()
            log.info(kv("drain_aborting", requests=len(left)))
            # Those without a token sent are handed back (retried elsewhere), the rest end
            # with FINISH_REASON_ABORT and the tokens they have.
            self._hand_back(self.running.unsent())
            for stream in left:
                self._servicer.cancel(stream)
            if not self.running.wait_empty(cfg.abort_wait_s):
                log.warning(kv("drain_abort_timeout", requests=len(self.running)))
        self.health.shutdown()
        self._shell.stop(_FLUSH_S).wait()
        if self.engine is not None:
            # Every request has finished or been aborted: stop the loop, then the L3 writer
            # once it attempted what it queued (pages others may load).
            self.engine.close()
        self._shell.close()
        self._stopped.set()
        log.info(kv("server_stopped", address=self.address))

    def _hand_back(self, streams: list[RequestStream]) -> None:
        """Aborts requests whose clients saw nothing; their calls end UNAVAILABLE."""
        if streams:
            log.info(kv("drain_handing_back", requests=len(streams)))
        for stream in streams:
            stream.handed_back = True
            self._servicer.cancel(stream)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Blocks until drained; True when stopped."""
        return self._stopped.wait(timeout_s)


def serve(engine: Engine, config: ServerConfig | None = None,
          defaults: SamplingDefaults | None = None) -> ComputeServer:
    """Builds, starts and attaches a server over an engine (whose loop it then runs)."""
    return ComputeServer(config).start().attach(engine, defaults)
