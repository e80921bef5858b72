"""A bound on HTTP request bodies, checked before anything parses them (design.md §8 "Bad
input"): a body over `max_bytes` is answered 413 with the OpenAI error JSON, from its
Content-Length when it sends one (nothing is read), else as soon as the bytes read pass the
bound (chunked uploads). The gateway sets the bound to its gRPC max message size, so the HTTP
API accepts what its gRPC port accepts; each text prompt is then bounded by the context
(prefixcache_client.limits) before it is tokenized.

Pure ASGI: the body is read here, at most `max_bytes` of it, and handed on unchanged; later
`receive()` calls (the app waits on them for the client's disconnect) pass through."""
from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.http.errors import ApiError


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, receive, send, f"{declared} bytes")
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                chunks_message = message
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, f"more than {self.max_bytes} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                chunks_message = None
                break
        body = b"".join(chunks)
        del chunks
        replayed = False

        async def replay() -> Message:
            nonlocal replayed, body
            if not replayed:
                replayed = True
                if chunks_message is not None:
                    return chunks_message
                message, body = {"type": "http.request", "body": body, "more_body": False}, b""
                return message
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, size: str) -> None:
        error = ApiError(413, f"body: {size} exceed the limit of {self.max_bytes} bytes per "
                              "request (the gateway's max message size); send a shorter prompt",
                         param="body", code="request_too_large")
        await error.response()(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for key, value in scope.get("headers", ()):
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
