"""Token-exact conversation turns: a chat's earlier answers sent back as the token ids the model
generated, not re-encoded from their text.

Why: a model's answer re-encoded is often not the ids it generated (SmolLM2 generates "\\n\\n"
as one token, 1116, and encoding the text gives 198, 198), so the next turn's prompt differs from
the previous turn's prompt + answer right after the previous prompt, and every page from there
on is computed again although the worker holds them all (issue 30, part 3).

`TurnMemory` remembers, per tenant namespace (the tenant's salt with the request's cache_salt),
the ids of each chat answer the gateway returned, keyed by a digest of the answer's text; a later
chat of the same namespace whose assistant message equals one gets `spliced_chat_ids`: the chat
template rendered as always, the text around each remembered answer encoded piece by piece and
the answer's own ids put in between. Invariants:
- Bounded: at most `max_tokens` remembered ids over all tenants (least recently used dropped
  first), each entry for at most `ttl_s` after it was last stored or used.
- Isolation: an entry is only ever found under the namespace that stored it (and the tokenizer
  fingerprint it was made with): tenant B sending tenant A's answer text re-encodes it.
- Only what round-trips is remembered: the ids (without a trailing EOS) must decode to exactly
  the text the client received, so a stop string's cut, a tool call or a partial character is
  never remembered (choices calling tools are not offered at all: their text is not content).
- A splice happens only when the template writes each remembered content verbatim, once:
  rendered with a placeholder in its place and the content put back, the text must equal the
  plain rendering (a template that trims or rewrites content falls back to re-encoding).
- The ids are what the gateway routes on and what the worker runs (the chat route sends token
  ids), so page hashes and the worker's prompt stay the same ids.
"""
from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.core.expiring_lru import ExpiringLru
from prefixcache_client.tokenizer import Tokenizer

# Placeholders for the contents while locating them in the rendering: private-use characters,
# which a client's text is never expected to contain (a chat that does is not spliced).
_OPEN, _CLOSE = "\ue000", "\ue001"


@dataclass(frozen=True, slots=True)
class TurnMemoryConfig:
    # Remembered token ids over all tenants; 0 = off (every chat re-encodes its answers).
    max_tokens: int = 0
    # How long an answer is remembered after it was last stored or used.
    ttl_s: float = 600.0


class TurnMemory:
    """Answers' token ids by (namespace, text digest), LRU under a token budget, with a TTL
    (thread-safe: chats tokenize in worker threads)."""

    def __init__(self, config: TurnMemoryConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if config.max_tokens < 0 or config.ttl_s <= 0:
            raise ValueError("turn memory: max_tokens must be >= 0 and ttl_s > 0")
        self.config = config
        self._lock = threading.Lock()
        self._entries: ExpiringLru[bytes, tuple[int, ...]] = ExpiringLru(
            config.max_tokens, config.ttl_s, clock, cost=len)
        self.used = 0  # answers found (and spliced or offered)

    @property
    def enabled(self) -> bool:
        return self.config.max_tokens > 0

    @property
    def tokens(self) -> int:
        """Remembered ids now."""
        return self._entries.size

    @property
    def dropped(self) -> int:
        """Entries dropped for the budget."""
        return self._entries.dropped

    @staticmethod
    def _key(namespace: str, text: str) -> bytes:
        return hashlib.sha256(namespace.encode() + b"\0" + text.encode()).digest()

    def remember(self, namespace: str, text: str, ids: Sequence[int]) -> None:
        """Stores `ids` as the tokens of answer `text` for `namespace` (ignored when off, empty,
        or larger than the whole budget)."""
        if not self.enabled or not text or not ids or len(ids) > self.config.max_tokens:
            return
        key = self._key(namespace, text)
        with self._lock:
            self._entries.put(key, tuple(ids))

    def recall(self, namespace: str, text: str) -> tuple[int, ...] | None:
        """The ids remembered for `text` in `namespace`, or None (unknown or expired); a hit
        refreshes the entry's recency and TTL."""
        if not self.enabled or not text:
            return None
        key = self._key(namespace, text)
        with self._lock:
            ids = self._entries.get(key, refresh=True)
            self.used += ids is not None
            return ids

    def __len__(self) -> int:
        return len(self._entries)


def namespace(tenant_name: str, tenant_salt: str, fingerprint: str) -> str:
    """Where a request's answers are remembered: its tenant and salt (cache_salt included) and
    the tokenizer the ids belong to."""
    return f"{tenant_name}\0{tenant_salt}\0{fingerprint}"


def answer_ids(tokenizer: Tokenizer, text: str, ids: Sequence[int]) -> list[int] | None:
    """The ids to remember for an answer the client received as `text`: the generated `ids`
    without a trailing EOS (the template writes its own end of turn) when they decode to
    exactly `text`, else all of them when those do (an EOS the worker sent as text, as a
    checkpoint whose EOS id is an ordinary token of its vocabulary does); else None."""
    whole = list(ids)
    bare = list(whole)
    while bare and bare[-1] in tokenizer.eos_token_ids:
        bare.pop()
    for candidate in (bare, whole):
        if candidate and tokenizer.decode(candidate, skip_special_tokens=False) == text:
            return candidate
    return None


def remembered_answers(memory: TurnMemory, space: str,
                       messages: Sequence[Mapping[str, Any]]) -> dict[int, tuple[int, ...]]:
    """Message index -> remembered ids, for the assistant messages with plain string content
    (no tool calls) that `space` remembers."""
    found: dict[int, tuple[int, ...]] = {}
    for i, m in enumerate(messages):
        content = m.get("content")
        if m.get("role") != "assistant" or m.get("tool_calls") or not isinstance(content, str):
            continue
        ids = memory.recall(space, content)
        if ids is not None:
            found[i] = ids
    return found


def spliced_chat_ids(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]],
                     answers: Mapping[int, Sequence[int]], add_generation_prompt: bool = True,
                     tools: Sequence[Mapping[str, Any]] | None = None) -> list[int] | None:
    """The chat's prompt ids with message i's content as `answers[i]` (see the module
    docstring), or None when the template does not write each such content verbatim once (the
    caller then encodes the plain rendering)."""
    if not answers:
        return None
    plain = tokenizer.render_chat(messages, add_generation_prompt, tools)
    marked = [dict(m) for m in messages]
    marks = {i: f"{_OPEN}{i}{_CLOSE}" for i in answers}
    for i, mark in marks.items():
        marked[i]["content"] = mark
    rendered = tokenizer.render_chat(marked, add_generation_prompt, tools)
    pieces, rest = [], rendered
    for i in sorted(answers):
        if rendered.count(marks[i]) != 1:
            return None
        before, rest = rest.split(marks[i], 1) if marks[i] in rest else (None, rest)
        if before is None:  # placeholders out of message order
            return None
        pieces.append((before, i))
    if "".join(b + messages[i]["content"] for b, i in pieces) + rest != plain:
        return None
    ids: list[int] = []
    for before, i in pieces:
        ids += tokenizer.encode(before) + list(answers[i])
    return ids + tokenizer.encode(rest)


def remember_answers(memory: TurnMemory, space: str, tokenizer: Tokenizer | None,
                     samples: Sequence[Any]) -> int:
    """Remembers each finished choice's answer (a generation.Sample: its `text` pieces, the
    `ids` it generated); returns how many were remembered. Every choice of `n` is remembered:
    the client continues with whichever it picks."""
    if not memory.enabled or tokenizer is None:
        return 0
    stored = 0
    for s in samples:
        if s.finish is None or s.stats is None:
            continue  # cut short (an error, a client that left): not an answer
        text = "".join(s.text)
        ids = answer_ids(tokenizer, text, s.ids)
        if ids is not None:
            memory.remember(space, text, ids)
            stored += 1
    return stored
