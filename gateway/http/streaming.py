"""Stop strings and Server-Sent Events for the HTTP API.

`StopMatcher` cuts a streamed text at the first stop string. Invariants:
- What it releases never contains a stop string, nor any part of one: it holds back the longest
  tail of the text that is the start of some stop string, until the next delta shows whether
  the stop string follows (so a stop string split across deltas is still found, and a streamed
  chunk never shows its first half).
- The concatenation of every release (and the final `flush`) is the text up to, not including,
  the earliest occurrence of any stop string, or the whole text when none occurs: the same cut
  whether the text came in one piece or token by token.
- It works on str, i.e. on whole characters: the workers' text deltas never split a multi-byte
  UTF-8 character (compute_service/engine/detokenize.py holds an incomplete one back), so a cut
  never splits one either.

The SSE generators turn a `Generation`'s events into OpenAI's chunks: `text_completion` chunks,
or `chat.completion.chunk`s that open each choice with `delta.role`, then `delta.content`, then
a chunk with `finish_reason`; with `stream_options.include_usage` every chunk has `usage: null`
and a last chunk with no choices carries the usage; then `data: [DONE]`. The framing is
sse-starlette's. A failure after the stream started is sent as an OpenAI error object in a
`data:` event (vLLM does the same), then `[DONE]`.
"""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from gateway.core.proxy import ProxyError
from gateway.http import schemas
from gateway.http.errors import ApiError, from_proxy
from service_shell import kv

log = logging.getLogger("gateway.http")


class StopMatcher:
    def __init__(self, stops: Sequence[str]):
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(stops)
        self._held = ""
        self.matched = False

    def feed(self, text: str) -> str:
        """The part of `text` (after what was held back) that can be shown now; sets `matched`
        when a stop string completed (everything after it is dropped, then and later)."""
        if self.matched:
            return ""
        if not self._stops:
            return text
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.matched, self._held = True, ""
            return buf[:min(hits)]
        keep = self._partial(buf)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """The text ended without a stop string: what was held back is output after all."""
        out, self._held = self._held, ""
        return "" if self.matched else out

    def _partial(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of a stop string."""
        longest = max(len(s) for s in self._stops) - 1
        for k in range(min(longest, len(buf)), 0, -1):
            tail = buf[len(buf) - k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0


def _data(payload: dict[str, Any]) -> dict[str, str]:
    return {"data": json.dumps(payload, ensure_ascii=False, separators=(",", ":"))}


async def sse_events(generation, chat: bool, rid: str, created: int, model: str,
                     include_usage: bool,
                     usage: Callable[[], dict[str, Any]]) -> AsyncIterator[dict[str, str]]:
    """The SSE events of one streamed request (`generation` already opened; closed here, so a
    client that leaves cancels its worker calls)."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    extra = {"usage": None} if include_usage else {}

    def chunk(choices: list[dict[str, Any]]) -> dict[str, str]:
        return _data(schemas.envelope(kind, rid, created, model, choices, **extra))

    try:
        if chat:  # every choice opens with the assistant role, as OpenAI's do
            for sample in generation.samples:
                yield chunk([schemas.chat_delta(sample.index,
                                                {"role": "assistant", "content": ""}, None)])
        async for sample, delta, finished in generation.events():
            if not delta and not finished:
                continue
            finish = sample.finish if finished else None
            if chat:
                choice = schemas.chat_delta(sample.index, {"content": delta} if delta else {},
                                            finish)
            else:
                choice = schemas.completion_choice(sample.index, delta, finish)
            yield chunk([choice])
        if include_usage:
            yield _data(schemas.envelope(kind, rid, created, model, [], usage=usage()))
    except (ProxyError, ApiError) as exc:
        error = from_proxy(exc) if isinstance(exc, ProxyError) else exc
        log.info(kv("http_stream_failed", id=rid, status=error.status, message=error.message))
        yield _data(error.body())
    finally:
        generation.close()
    yield {"data": "[DONE]"}
