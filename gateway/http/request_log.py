"""What every HTTP request gets before anything else runs (the outermost middleware, so a 413
or a 429 gets it too): a request id, a `gateway.http` span, and one access-log line.

- `X-Request-Id`: the client's, when it sends one that is printable ASCII of at most MAX_ID
  bytes (as vLLM does, it then names the request: `chatcmpl-<id>`, and the worker
  calls `<response id>-<choice>`, tenant-scoped like every request id), else a new one; echoed
  on the response either way. A header that does not qualify is replaced, not refused: the
  header is a correlation aid, not an input the API promises to keep.
- Tracing (service_shell.tracing, when on): a SERVER span joined to the caller's W3C
  `traceparent`; the proxy carries its context to the worker call.
- The access log (`--http-access-log`, on by default): logger `gateway.access`, one logfmt line
  per request when its response ends: method, path, status, duration_ms, tenant, request_id,
  and for a generation prompt_tokens, cached_tokens and completion_tokens (OpenAI's usage; for
  a stream, counted when it ends).
"""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

from prefixcache_client.limits import MAX_REQUEST_ID_BYTES
from service_shell import kv, tracing

log = logging.getLogger("gateway.access")
_TRACER = tracing.tracer("prefixcache.gateway")
HEADER = b"x-request-id"
# Room for what the routes add around it ("chatcmpl-" and "-<choice>") within the request ids'
# limit, so an accepted header never makes the worker calls' ids too long.
MAX_ID = MAX_REQUEST_ID_BYTES - 16


def request_id_of(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's X-Request-Id when usable (see the module docstring), else a new one."""
    for key, value in headers:
        if key == HEADER:
            text = value.decode("latin-1")
            if 0 < len(text) <= MAX_ID and text.isascii() and text.isprintable():
                return text
            break
    return uuid.uuid4().hex


class RequestLog:
    """Pure ASGI middleware (see the module docstring); `access_log` False keeps the request id
    and the span and writes no line."""

    def __init__(self, app, access_log: bool = True):
        self.app, self.access_log = app, access_log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        headers = scope.get("headers") or []
        rid = request_id_of(headers)
        method, path = scope.get("method", ""), scope.get("path", "")
        span = tracing.start(_TRACER, f"gateway.http {method} {path}", tracing.extract(
            (k.decode("latin-1"), v.decode("latin-1")) for k, v in headers),
            tracing.SpanKind.SERVER, **{"http.request.method": method, "url.path": path,
                                        "prefixcache.request_id": rid})
        # Request.state is this dict: the routes read the id and the trace, and leave the
        # tenant and the usage for the line.
        state = scope.setdefault("state", {})
        state.update(request_id=rid, trace=tracing.context_of(span))
        status = [500]  # what the client gets if the app raises before it answers

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (HEADER, rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if span is not None:
                span.set_attribute("http.response.status_code", status[0])
                if status[0] >= 500:
                    span.set_status(tracing.trace.Status(tracing.trace.StatusCode.ERROR))
                span.end()
            if self.access_log:
                log.info(access_line(method, path, status[0], time.perf_counter() - started,
                                     state))


def access_line(method: str, path: str, status: int, seconds: float, state: dict) -> str:
    fields: dict[str, object] = dict(method=method, path=path, status=status,
                                     duration_ms=round(seconds * 1000, 3),
                                     tenant=state.get("tenant", ""),
                                     request_id=state.get("request_id", ""))
    usage: Callable[[], tuple] | None = state.get("usage")
    if usage is not None:
        try:
            prompt, completion, cached, _ = usage()
        except Exception:  # a generation that failed before counting: the line still goes out
            pass
        else:
            fields.update(prompt_tokens=prompt, cached_tokens=cached,
                          completion_tokens=completion)
    return kv("http_request", **fields)
