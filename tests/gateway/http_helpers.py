"""Helpers of the HTTP API tests: raw HTTP calls with a tenant's bearer token, and the `data:`
events of a Server-Sent Events body."""
from __future__ import annotations

import json
import secrets
import string
from collections.abc import Iterable

import httpx

_TAG_CHARS = string.ascii_letters + string.digits


def unique_tag(n: int = 12) -> str:
    """Random letters and digits to start a prompt no other test sends. The live stacks' pages
    are 4 tokens, so a prompt shares a cached page with another one as soon as their first 4
    tokens agree: eight hex digits put ~3 random tokens there, 1 chance in ~4,000 a pair (a CI
    run once found 4 of a new prompt's tokens cached). 62 symbols make it ~1 in 240,000."""
    return "".join(secrets.choice(_TAG_CHARS) for _ in range(n))


def auth(token: str | None = "tok-a") -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def post(base: str, path: str, body: dict, token: str | None = "tok-a",
         timeout: float = 60.0) -> httpx.Response:
    return httpx.post(base + path, json=body, headers=auth(token), timeout=timeout)


def events(lines: Iterable[str]) -> list:
    """The `data:` payloads of an SSE body, JSON decoded, `[DONE]` as the string."""
    out = []
    for line in lines:
        if line.startswith("data:"):
            data = line[len("data:"):].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def stream(base: str, path: str, body: dict, token: str | None = "tok-a") -> list:
    """The events of a streamed request (asserting a 200 and SSE)."""
    with httpx.stream("POST", base + path, json={**body, "stream": True}, headers=auth(token),
                      timeout=60.0) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return events(r.iter_lines())


def streamed_text(evts: list, chat: bool) -> dict[int, str]:
    """Each choice's text, joined from the chunks."""
    out: dict[int, str] = {}
    for e in evts:
        if e == "[DONE]" or "error" in e:
            continue
        for c in e["choices"]:
            piece = c["delta"].get("content", "") if chat else c["text"]
            out[c["index"]] = out.get(c["index"], "") + (piece or "")
    return out
