"""How big a text prompt may be before anyone tokenizes it (design.md §8 "Bad input").

Tokenizing costs memory many times the text's size (a Python int per token, and the
tokenizer's own buffers), spent before anyone learns that the prompt does not fit; so the
gateway's two front ends and the worker refuse a text longer than
`text_limit_bytes(max_context_tokens)` UTF-8 bytes up front: `TEXT_BYTES_PER_TOKEN` bytes per
token of context. Real text averages 3 to 6 bytes per token
(English, code, CJK); 32 leaves room for runs of whitespace and long words, so a prompt refused
here would not have fit the context anyway in any practical case, and the refusal costs a length
check, not a tokenization. What is left is bounded by the gRPC max message size (and, on the
HTTP API, the same bound on the request body).

torch-free: the gateway and the compute service share it.
"""
from __future__ import annotations

TEXT_BYTES_PER_TOKEN = 32


def text_limit_bytes(max_context_tokens: int) -> int:
    return max(1, max_context_tokens) * TEXT_BYTES_PER_TOKEN


def text_too_long(text: str, max_context_tokens: int, field: str = "prompt.text") -> str | None:
    """Why `text` is refused unread ("prompt.text: 60000000 bytes exceed ..."), or None. The
    character count is a lower bound of the byte count and costs nothing: most oversized texts
    are caught without the encoding copy."""
    limit = text_limit_bytes(max_context_tokens)
    if len(text) <= limit // 4:  # at most 4 UTF-8 bytes per character: fits
        return None
    size = len(text) if len(text) > limit else len(text.encode("utf-8", "surrogatepass"))
    if size <= limit:
        return None
    shown = "at least " if len(text) > limit else ""
    return (f"{field}: {shown}{size} bytes exceed the limit of {limit} bytes for a context of "
            f"{max_context_tokens} tokens ({TEXT_BYTES_PER_TOKEN} bytes per token); such a "
            "prompt cannot fit, send a shorter one")


# ----- names, ids and stop sequences: one set of limits for every entry point ----------------
#
# A name or id sent by a client is hashed, logged, looked up and sometimes echoed in an error;
# unbounded, a 10 MB adapter name came back in a 10 MB error body, and over gRPC it overflowed
# the 16 KB trailing-metadata limit (RESOURCE_EXHAUSTED, which looked like load to retry). The
# gateway (gRPC Generate, RoutePreview and Abort, the HTTP API, the Endpoint Picker) and the
# worker refuse a longer one when they parse the request, with these limits and these messages.

MAX_NAME_BYTES = 256  # a namespace field's UTF-8 size (model id, adapter, salt): hash.py's too
MAX_REQUEST_ID_BYTES = 128  # a request id's UTF-8 size (ids are per tenant; a uuid is 32)
# Stop strings (HTTP API): OpenAI takes at most 4, vLLM does not bound them. 16 covers every
# chat template's end markers with room to spare; 256 characters covers any end marker or
# delimiter line. Bounded because every streamed delta is matched against them on the
# gateway's event loop (gateway/http/streaming.py matches in time independent of their number,
# but compiling and holding them back still costs their total size).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
# Stop token ids (gRPC SamplingParams and the HTTP API): every sampled token is looked up in
# them (a set); 1024 is far beyond any model's end tokens and still cheap to hold per request.
MAX_STOP_TOKEN_IDS = 1024
# How much of an untrusted string an error message or a log line shows (quote_untrusted).
QUOTE_LIMIT = 80


def quote_untrusted(value: str, limit: int = QUOTE_LIMIT) -> str:
    """`value` as an error message or log line may show it: quoted with repr (so control
    characters and quotes cannot forge a log field) and cut to `limit` characters, with the
    size it had: 'abc…' (+9999990 chars). Every message that echoes what a client sent uses it."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}… (+{len(value) - limit} chars)"


def name_too_long(value: str, field: str, limit: int = MAX_NAME_BYTES) -> str | None:
    """Why `value` (a name or id of `field`) is refused ("adapter: 10485760 bytes exceed the
    limit of 256 bytes"), or None. Checks the character count first, so a huge value is refused
    without the encoding copy."""
    if len(value) <= limit // 4:
        return None
    size = len(value) if len(value) > limit else len(value.encode("utf-8", "surrogatepass"))
    if size <= limit:
        return None
    shown = "at least " if len(value) > limit else ""
    return f"{field}: {shown}{size} UTF-8 bytes exceed the limit of {limit} bytes"


def request_id_too_long(value: str, field: str = "request_id") -> str | None:
    return name_too_long(value, field, MAX_REQUEST_ID_BYTES)


def stop_problem(stops: list[str], field: str = "stop") -> str | None:
    """Why the stop strings are refused (too many, one too long, one empty), or None."""
    if len(stops) > MAX_STOP_STRINGS:
        return f"{field}: {len(stops)} stop strings exceed the limit of {MAX_STOP_STRINGS}"
    for i, s in enumerate(stops):
        which = "" if len(stops) == 1 else f" ({i})"
        if not s:
            return f"{field}: stop strings must not be empty{which}"
        if len(s) > MAX_STOP_STRING_CHARS:
            return (f"{field}: a stop string{which} of {len(s)} characters exceeds the limit of "
                    f"{MAX_STOP_STRING_CHARS}")
    return None


def stop_token_ids_problem(count: int, field: str = "sampling.stop_token_ids") -> str | None:
    if count > MAX_STOP_TOKEN_IDS:
        return f"{field}: {count} stop token ids exceed the limit of {MAX_STOP_TOKEN_IDS}"
    return None


# OpenAI's prompt_cache_retention: seconds a request asks its prefix kept ("" = not given).
# "24h" is honoured within the cache service's retention budget (cache_service/retention.py).
PROMPT_CACHE_RETENTION_S = {"": 0.0, "in_memory": 0.0, "24h": 86400.0}


def prompt_cache_retention_problem(value: str) -> str | None:
    """Why a prompt_cache_retention is refused (gateway and worker alike), or None."""
    if value in PROMPT_CACHE_RETENTION_S:
        return None
    return (f"prompt_cache_retention: {quote_untrusted(value)} is not one of 'in_memory', "
            "'24h'")
