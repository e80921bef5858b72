"""The client side of service authentication (service_shell/auth.py): a process's service token,
read from --service-token-file (PREFIXCACHE_SERVICE_TOKEN_FILE), sent with every call of a
channel as `x-prefixcache-service-token` metadata (not `authorization`, which carries tenant
tokens at the gateway). grpc-only, so `tls.open_channel` and torch-free clients can use it."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

SERVICE_TOKEN_METADATA_KEY = "x-prefixcache-service-token"
TOKEN_FLAG = "--service-token-file (PREFIXCACHE_SERVICE_TOKEN_FILE)"


def read_token(path: str | Path | None) -> str | None:
    """The token in a token file (surrounding whitespace dropped); None for no file.
    ValueError naming the flag when it is unreadable or empty (never showing the token)."""
    if not path:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"{TOKEN_FLAG} {path}: {exc.strerror}") from None
    if not token:
        raise ValueError(f"{TOKEN_FLAG} {path}: the file is empty")
    return token


class _TokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                        grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the service token to every call of a channel."""

    def __init__(self, token: str) -> None:
        self._pair = (SERVICE_TOKEN_METADATA_KEY, token)

    def _with_token(self, details):
        metadata = [*(details.metadata or ()), self._pair]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)


@dataclass(frozen=True, slots=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: list | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


def with_service_token(channel: grpc.Channel, token: str | None) -> grpc.Channel:
    """`channel`, sending `token` as service-token metadata on every call (unchanged for None)."""
    if not token:
        return channel
    return grpc.intercept_channel(channel, _TokenInterceptor(token))
