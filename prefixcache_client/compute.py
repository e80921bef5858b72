"""Typed client of the compute service (the gateway serves the same API, so it talks to either).
It does not import torch, so the gateway can use it.

Every call has a deadline: unary calls `timeout_s`, a whole Generate stream `generate_timeout_s`
(the server aborts the request when it passes). A failed call raises `ComputeClientError` with
the server's status code and message.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc

from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache.v1 import compute_service_pb2_grpc as pb_grpc
from service_shell import (REQUEST_SCOPE_METADATA_KEY, SALT_METADATA_KEY, TlsConfig,
                           channel_options, open_channel)
from service_shell.retry import TRANSPORT_RETRY

_SERVICE = pb.DESCRIPTOR.services_by_name["ComputeService"].full_name
# Only the read-only calls are safe to repeat blindly: a retried Generate would run twice.
_SERVICE_CONFIG = {"methodConfig": [{
    "name": [{"service": _SERVICE, "method": "GetModelInfo"},
             {"service": _SERVICE, "method": "GetTokenizer"}],
    "retryPolicy": TRANSPORT_RETRY.grpc_retry_policy(max_attempts=3),
}]}


class ComputeClientError(Exception):
    """A call failed. `status` is the gRPC code, `message` the server's (it names the field)."""

    def __init__(self, method: str, status: grpc.StatusCode, message: str):
        Exception.__init__(self, method, status, message)
        self.method, self.status, self.message = method, status, message

    def __str__(self) -> str:
        return f"{self.method} failed: {self.status.name}: {self.message}"


def _error(method: str, err: grpc.RpcError) -> ComputeClientError:
    return ComputeClientError(method, err.code(), err.details() or "")


@dataclass(slots=True)
class Completion:
    token_ids: list[int]
    text: str
    stats: pb.GenerateStats


class GenerateStream(Iterator[pb.GenerateResponse]):
    """The messages of one Generate call. `cancel()` (from any thread) ends it and aborts the
    request on the server; `stats` is set once the last message arrived."""

    def __init__(self, call):
        self._call = call
        self.stats: pb.GenerateStats | None = None

    def __next__(self) -> pb.GenerateResponse:
        try:
            msg = next(self._call)
        except grpc.RpcError as err:
            raise _error("Generate", err) from None
        if msg.HasField("stats"):
            self.stats = msg.stats
        return msg

    def cancel(self) -> None:
        self._call.cancel()

    def result(self) -> Completion:
        """Reads the rest of the stream: all tokens, the whole text and the stats."""
        tokens: list[int] = []
        text: list[str] = []
        for msg in self:
            tokens += msg.token_ids
            text.append(msg.text)
        if self.stats is None:
            raise ComputeClientError("Generate", grpc.StatusCode.INTERNAL,
                                     "stream ended without stats")
        return Completion(tokens, "".join(text), self.stats)

    def __enter__(self) -> GenerateStream:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.cancel()  # no-op when the stream already ended


class ComputeClient:
    """Client of one compute worker (or the gateway). Thread-safe; close() it when done.

    `tls` (PEM files, e.g. `TlsConfig.from_env()`) or `credentials` make the channel TLS;
    plaintext without either. `auth_token` is sent as `authorization: Bearer TOKEN` on every call
    (the gateway maps it to a tenant); `service_token` as this process's service identity
    (`x-prefixcache-service-token`, for a worker's own port: service_shell/auth.py)."""

    def __init__(self, target: str, *, timeout_s: float = 10.0, generate_timeout_s: float = 600.0,
                 max_message_mb: int = 64, tls: TlsConfig | None = None,
                 credentials: grpc.ChannelCredentials | None = None, auth_token: str | None = None,
                 service_token: str | None = None):
        self.target = target
        self._auth = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        self.timeout_s = timeout_s
        self.generate_timeout_s = generate_timeout_s
        self._channel = open_channel(target, channel_options(max_message_mb, _SERVICE_CONFIG),
                                     tls=tls, credentials=credentials, service_token=service_token)
        self._stub = pb_grpc.ComputeServiceStub(self._channel)

    def wait_until_ready(self, timeout_s: float | None = None) -> None:
        """Blocks until the channel is connected; raises ComputeClientError on timeout."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s or self.timeout_s)
        except grpc.FutureTimeoutError:
            raise ComputeClientError("connect", grpc.StatusCode.UNAVAILABLE,
                                     f"no connection to {self.target}") from None

    def generate(self, prompt: Sequence[int] | str, sampling: pb.SamplingParams | None = None, *,
                 request_id: str = "", adapter: str = "", salt: str | None = None,
                 timeout_s: float | None = None, resume_output: Sequence[int] = (),
                 scope: str | None = None,
                 trace_metadata: Sequence[tuple[str, str]] = (),
                 prompt_cache_retention: str = "") -> GenerateStream:
        """Starts a completion of `prompt` (token ids, or text the worker tokenizes).

        `salt` sets the tenant metadata, which only a trusted caller (the gateway) may send;
        `scope` the request-id scope (the tenant's, service_shell.request_scope) likewise.
        `resume_output`: output tokens already received from a worker that failed mid-stream
        (GenerateRequest.resume_output). `trace_metadata`: the W3C trace context (traceparent)
        the worker's spans join (service_shell.tracing.inject). `prompt_cache_retention`:
        "24h" asks the worker's cache service to keep the prefix on device (GenerateRequest).
        Errors are raised when the stream is read."""
        req = pb.GenerateRequest(request_id=request_id, adapter=adapter, sampling=sampling,
                                 prompt_cache_retention=prompt_cache_retention)
        req.resume_output.ids.extend(resume_output)
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
        metadata = self._auth + (((SALT_METADATA_KEY, salt),) if salt is not None else ()) \
            + _scope(scope) + tuple(trace_metadata)
        timeout = self.generate_timeout_s if timeout_s is None else timeout_s
        return GenerateStream(self._stub.Generate(req, timeout=timeout, metadata=metadata))

    def abort(self, request_id: str, *, timeout_s: float | None = None,
              scope: str | None = None) -> bool:
        """Aborts a running request (of that request-id `scope`, as `generate`'s); False when
        none by that id was running."""
        return self._unary("Abort", self._stub.Abort, pb.AbortRequest(request_id=request_id),
                           timeout_s, _scope(scope)).aborted

    def model_info(self, *, timeout_s: float | None = None) -> pb.GetModelInfoResponse:
        return self._unary("GetModelInfo", self._stub.GetModelInfo, pb.GetModelInfoRequest(),
                           timeout_s)

    def get_tokenizer(self, *, timeout_s: float | None = None) -> pb.GetTokenizerResponse:
        """The worker's tokenizer files and fingerprint (`prefixcache_client.tokenizer.
        from_files` rebuilds it); FAILED_PRECONDITION from a worker without a tokenizer."""
        return self._unary("GetTokenizer", self._stub.GetTokenizer, pb.GetTokenizerRequest(),
                           timeout_s)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ComputeClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _unary(self, method: str, stub_method, req, timeout_s: float | None,
               metadata: tuple = ()):
        try:
            return stub_method(req, timeout=self.timeout_s if timeout_s is None else timeout_s,
                               metadata=self._auth + metadata)
        except grpc.RpcError as err:
            raise _error(method, err) from None


def _scope(scope: str | None) -> tuple[tuple[str, str], ...]:
    return ((REQUEST_SCOPE_METADATA_KEY, scope),) if scope else ()
