"""Stop strings and Server-Sent Events for the HTTP API.

`StopMatcher` cuts a streamed text at the first stop string. Invariants:
- What it releases never contains a stop string, nor any part of one: it holds back the longest
  tail of the text that is the start of some stop string, until the next delta shows whether
  the stop string follows (so a stop string split across deltas is still found, and a streamed
  chunk never shows its first half).
- The concatenation of every release (and the final `flush`) is the text up to, not including,
  the earliest occurrence of any stop string, or the whole text when none occurs: the same cut
  whether the text came in one piece or token by token.
- It costs the same per delta however many stop strings there are (one compiled search, and a
  hold-back test per candidate tail by bisection); their number and length are bounded at parse
  (prefixcache_client.limits: 16 of at most 256 characters) on every entry point.
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

import bisect
import functools
import json
import logging
import re
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from gateway.core.proxy import ProxyError
from gateway.http import schemas
from gateway.http.choices import Choices
from gateway.http.errors import ApiError, from_proxy
from service_shell import kv

log = logging.getLogger("gateway.http")


class StopMatcher:
    def __init__(self, stops: Sequence[str]):
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self._pattern, self._sorted, self._firsts, self._longest = _compiled(tuple(stops))
        self._held = ""
        self.matched = False

    def feed(self, text: str) -> str:
        """The part of `text` (after what was held back) that can be shown now; sets `matched`
        when a stop string completed (everything after it is dropped, then and later).

        The work per delta does not grow with the number of stop strings (100,000 of them once
        cost seconds of event-loop time per request): one search of a compiled alternation over
        the held-back tail plus the delta (the leftmost match is the earliest occurrence, as the
        minimum of one `find` per stop string was), and the hold-back tests at most
        `longest - 1` tails, each by bisection in the sorted stop strings."""
        if self.matched:
            return ""
        if self._pattern is None:
            return text
        buf = self._held + text
        hit = self._pattern.search(buf)
        if hit is not None:
            self.matched, self._held = True, ""
            return buf[:hit.start()]
        keep = self._partial(buf)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """The text ended without a stop string: what was held back is output after all."""
        out, self._held = self._held, ""
        return "" if self.matched else out

    def _partial(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of a stop string: a tail
        is one when the first stop string not below it in sorted order starts with it; only
        tails that start with some stop string's first character are tried."""
        stops, n = self._sorted, len(buf)
        for k in range(min(self._longest - 1, n), 0, -1):
            if buf[n - k] not in self._firsts:
                continue
            tail = buf[n - k:]
            i = bisect.bisect_left(stops, tail)
            if i < len(stops) and stops[i].startswith(tail):
                return k
        return 0


@functools.lru_cache(maxsize=256)
def _compiled(stops: tuple[str, ...]) -> tuple[re.Pattern[str] | None, tuple[str, ...],
                                               frozenset[str], int]:
    """(one alternation of the stop strings, them sorted, their first characters, the longest
    length), shared by the samples of a request (and by requests with the same stops)."""
    if not stops:
        return None, (), frozenset(), 0
    pattern = re.compile("|".join(re.escape(s) for s in sorted(set(stops), key=len,
                                                                reverse=True)))
    return pattern, tuple(sorted(set(stops))), frozenset(s[0] for s in stops), max(map(len,
                                                                                     stops))


def _data(payload: dict[str, Any]) -> dict[str, str]:
    return {"data": json.dumps(payload, ensure_ascii=False, separators=(",", ":"))}


async def sse_events(generation, shape: Choices, rid: str, created: int, model: str,
                     include_usage: bool,
                     usage: Callable[[], dict[str, Any]]) -> AsyncIterator[dict[str, str]]:
    """The SSE events of one streamed request (`generation` already opened; closed here, so a
    client that leaves cancels its worker calls); `shape` builds each choice's chunks."""
    chat = shape.chat
    kind = "chat.completion.chunk" if chat else "text_completion"
    extra = {"usage": None} if include_usage else {}

    def chunk(choices: list[dict[str, Any]]) -> dict[str, str]:
        return _data(schemas.envelope(kind, rid, created, model, choices, **extra))

    try:
        # Every chat choice opens with the assistant role, as OpenAI's do; a completion with
        # echo opens with its prompt.
        for sample in generation.samples:
            opening = shape.opening(sample)
            if opening is not None:
                yield chunk([opening])
        async for sample, delta, finished in generation.events():
            for choice in shape.chunks(sample, delta, finished):
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
