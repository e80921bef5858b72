"""The `logprobs` objects of OpenAI's responses, built from the workers' TokenLogprobs
(GenerateResponse.logprobs: the model's raw log-softmax, vLLM's default logprobs_mode).

- chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}]}`, one entry per output token;
- completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`,
  vLLM's shape (`top_logprobs` is null with logprobs 0).

A token's string is the tokenizer's decoding of that one id, as vLLM's is; without a tokenizer
it is vLLM's `token_id:N` form. Its `bytes` are the token's own bytes (OpenAI's meaning: a
character split over two tokens is whole again when their bytes are joined), where the token's
string has U+FFFD in place of the partial character.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from prefixcache.v1 import compute_service_pb2 as pb

Entry = tuple[int, pb.TokenLogprobs]  # (token id, its logprobs)


class TokenNames:
    """id -> the token's string (call) and its bytes (`raw`); `tokenizer`: a prefixcache_client
    Tokenizer, or None."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, t: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{t}"
        return self.tokenizer.decode([t], skip_special_tokens=False)

    def raw(self, t: int) -> bytes:
        if self.tokenizer is None:
            return self(t).encode()
        return self.tokenizer.token_bytes(t)


def _finite(x: float) -> float:
    # JSON has no -Infinity: a token the model gives probability 0 gets vLLM's -9999.0.
    return x if math.isfinite(x) else -9999.0


def chat_content(entries: Sequence[Entry], name: TokenNames) -> list[dict[str, Any]]:
    def item(t: int, lp: float) -> dict[str, Any]:
        return {"token": name(t), "logprob": _finite(lp), "bytes": list(name.raw(t))}

    return [{**item(t, e.logprob), "top_logprobs": [item(i, v) for i, v in
                                                     zip(e.top_ids, e.top_logprobs)]}
            for t, e in entries]


def completion(entries: Sequence[Entry], name: Callable[[int], str], offset: int,
               tops: bool) -> dict[str, Any]:
    """`offset`: the text offset of the first token (the characters already sent)."""
    tokens = [name(t) for t, _ in entries]
    offsets, at = [], offset
    for s in tokens:
        offsets.append(at)
        at += len(s)
    return {"tokens": tokens, "token_logprobs": [_finite(e.logprob) for _, e in entries],
            "top_logprobs": [_top(e, name) for _, e in entries] if tops else None,
            "text_offset": offsets}


def _top(e: pb.TokenLogprobs, name: Callable[[int], str]) -> dict[str, float]:
    """{token string: logprob}: two ids may decode to one string (a byte of a multi-byte
    character each); the likelier one's logprob is kept."""
    out: dict[str, float] = {}
    for i, v in zip(e.top_ids, e.top_logprobs):
        out.setdefault(name(i), _finite(v))
    return out
