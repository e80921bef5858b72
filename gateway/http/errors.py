"""Errors of the HTTP API as OpenAI returns them: `{"error": {"message", "type", "param",
"code"}}` with the matching HTTP status, whatever failed.

Invariants:
- Every failure reaches the client as that JSON, never as a traceback: request validation
  (400 naming the field), the gateway's own refusals and the workers' verdicts (`ProxyError`
  -> `from_proxy`), unknown routes (404/405), and anything unexpected (500 with a generic
  message; the exception goes to the log with the request's path).
- The status follows the gRPC code the gateway would answer on its gRPC port, so both front
  ends tell a client the same thing: INVALID_ARGUMENT/OUT_OF_RANGE -> 400, UNAUTHENTICATED ->
  401, NOT_FOUND -> 404 (an adapter no worker has), RESOURCE_EXHAUSTED -> 429 (every worker
  sheds load), UNAVAILABLE -> 503 (no worker ready, or the gateway draining), DEADLINE_EXCEEDED
  -> 504.
"""
from __future__ import annotations

import logging
import re
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.core.proxy import ProxyError
from gateway.http.schemas import SURROGATE_ERROR
from service_shell import kv

log = logging.getLogger("gateway.http")

# gRPC code -> (HTTP status, OpenAI error type)
_FROM_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
# Which workers' messages name a request field ("prompt.token_ids: ...", "sampling.top_p: ...").
_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\[\]]*): ")
# Worker field names -> the API's.
_PARAMS = {"sampling.temperature": "temperature", "sampling.top_p": "top_p",
           "sampling.top_k": "top_k", "sampling.max_tokens": "max_tokens",
           "sampling.min_tokens": "min_tokens", "sampling.seed": "seed",
           "sampling.stop_token_ids": "stop_token_ids", "adapter": "model",
           "sampling.presence_penalty": "presence_penalty",
           "sampling.frequency_penalty": "frequency_penalty",
           "sampling.repetition_penalty": "repetition_penalty", "sampling.min_p": "min_p",
           "sampling.logit_bias": "logit_bias", "sampling.logprobs": "logprobs",
           "prompt.token_ids": "prompt", "prompt.text": "prompt"}
# What a union-typed field accepts, for its validation message.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
_UNION_HINTS = {"prompt": "must be a string, a list of token ids, or a list of either",
                "stop": "must be a string or a list of strings",
                "content": "must be a string or a list of {\"type\": \"text\", \"text\": ...} parts"}


class ApiError(Exception):
    """An OpenAI error response: raise it anywhere in a route."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None):
        super().__init__(status, message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code = param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(param: str, message: str) -> ApiError:
    """400 naming the field, in the gRPC servicer's "field: what is wrong" form."""
    return ApiError(400, f"{param}: {message}", param=param)


def from_proxy(exc: ProxyError) -> ApiError:
    status, kind = _FROM_GRPC.get(exc.code, (500, "server_error"))
    match = _FIELD.match(exc.message)
    param = _PARAMS.get(match.group(1), match.group(1)) if match else None
    if exc.code == grpc.StatusCode.NOT_FOUND:
        return ApiError(404, exc.message, kind, "model", "model_not_found")
    if status == 500:
        log.error(kv("unexpected_worker_status", code=exc.code.name, message=exc.message))
        return ApiError(500, "internal error; the gateway log has the details", "server_error")
    return ApiError(status, exc.message, kind, param if status == 400 else None)


def _validation_param(loc: tuple[Any, ...]) -> tuple[str, bool]:
    """("body", "messages", 0, "content", "str") -> ("messages[0].content", True): the field,
    and whether the error is about one branch of a union-typed field (branch tags name types,
    not fields)."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[a-z_][a-z0-9_]*", part) and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
        else:
            return out or "body", True
    return out or "body", False


def validation_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    # A lone surrogate anywhere in the body: the schemas name the string's path themselves.
    surrogate = next((e for e in errors if e.get("type") == SURROGATE_ERROR), None)
    if surrogate is not None:
        path = surrogate["ctx"]["path"]
        return bad_request(path, surrogate["msg"].removeprefix(f"{path}: "))
    first = errors[0]
    param, union = _validation_param(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid" or param == "body":
        return bad_request("body", "must be a JSON object: " + first.get("msg", "invalid"))
    field = param.rsplit(".", 1)[-1].split("[", 1)[0]
    if first.get("type") == "missing":
        message = "is required"
    elif union and field in _UNION_HINTS:
        message = _UNION_HINTS[field]
    else:
        message = first.get("msg", "invalid").rstrip(".")
    return bad_request(param, message[0].lower() + message[1:])


def install(app: FastAPI) -> None:
    """The handlers above, on `app`, and the catch-all around it."""

    @app.exception_handler(ApiError)
    async def _api(_request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(ProxyError)
    async def _proxy(_request: Request, exc: ProxyError) -> JSONResponse:
        return from_proxy(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:  # FastAPI could not read the body (e.g. it is not UTF-8)
            return bad_request("body", "must be a UTF-8 JSON object: "
                               f"{str(exc.detail).lower()}").response()
        message = (f"{request.method} {request.url.path}: no such endpoint"
                   if exc.status_code in (404, 405) else str(exc.detail))
        return ApiError(exc.status_code, message, "invalid_request_error").response()

    app.add_middleware(CatchAll)


class CatchAll:
    """Anything a route did not handle: 500 with a generic message when the response has not
    started, the exception in the log; a stream already under way is just ended (its client
    sees no `[DONE]`). Pure ASGI, so streaming responses pass through untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            log.exception(kv("http_unhandled", method=scope.get("method"),
                             path=scope.get("path")))
            if not started:
                error = ApiError(500, "internal error; the gateway log has the details",
                                 "server_error")
                await error.response()(scope, receive, send)
