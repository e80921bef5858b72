"""gateway/http/request_log.py as plain ASGI: the request id echoed (the client's, or a new one),
the route's view of it in request.state, one access-log line per request (none when off), and a
500 logged when the app raises before answering."""
from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.http.request_log import MAX_ID, RequestLog


def call(app, headers=()):
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(k.encode(), v.encode()) for k, v in headers]}
    asyncio.run(app(scope, receive, send))
    return scope, sent


def answering(status: int = 200, usage=None):
    async def app(scope, receive, send):
        scope["state"].update(tenant="acme", **({"usage": usage} if usage else {}))
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})
    return app


def test_the_clients_id_is_used_echoed_and_logged(caplog):
    with caplog.at_level(logging.INFO, logger="gateway.access"):
        scope, sent = call(RequestLog(answering(usage=lambda: (12, 3, 8, {}))),
                           [("x-request-id", "abc-1")])
    assert scope["state"]["request_id"] == "abc-1"
    assert (b"x-request-id", b"abc-1") in sent[0]["headers"]
    [line] = [r.getMessage() for r in caplog.records if r.name == "gateway.access"]
    for field in ("event=http_request", "method=POST", "path=/v1/completions", "status=200",
                  "tenant=acme", "request_id=abc-1", "prompt_tokens=12", "cached_tokens=8",
                  "completion_tokens=3", "duration_ms="):
        assert field in line, line


@pytest.mark.parametrize("header", [None, "x" * (MAX_ID + 1), "two words\t", ""])
def test_a_missing_or_unusable_id_is_replaced(header):
    scope, sent = call(RequestLog(answering()), [("x-request-id", header)] if header is not None
                       else [])
    rid = scope["state"]["request_id"]
    assert rid != header and len(rid) == 32
    assert (b"x-request-id", rid.encode()) in sent[0]["headers"]


def test_no_line_when_off_and_a_500_when_the_app_raises(caplog):
    async def broken(scope, receive, send):
        raise RuntimeError("boom")

    with caplog.at_level(logging.INFO, logger="gateway.access"):
        call(RequestLog(answering(), access_log=False))
        assert not [r for r in caplog.records if r.name == "gateway.access"]
        with pytest.raises(RuntimeError):
            call(RequestLog(broken))
    [line] = [r.getMessage() for r in caplog.records if r.name == "gateway.access"]
    assert "status=500" in line and "prompt_tokens" not in line
