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
