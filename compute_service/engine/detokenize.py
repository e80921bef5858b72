"""Incremental detokenization for streaming: each token's text delta in O(1), not O(output).

Decoding the whole output again for every new token costs O(n^2) over a generation. This keeps
two offsets into the output ids (the scheme vLLM uses): `prefix` .. `read` is the last emitted
piece, kept as context (some tokenizers decode a token differently after another, e.g. a leading
space), and a new token's delta is decode(ids[prefix:]) minus decode(ids[prefix:read]). While
that decode ends in U+FFFD (an incomplete multi-byte character), nothing is emitted and the
offsets stay: the character goes out whole once its last byte arrives, or as U+FFFD at the end.

Invariant: the concatenation of every `next` delta and the final `flush` equals
tokenizer.decode(ids) of the whole output.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from compute_service.model import Tokenizer

_INCOMPLETE = "\ufffd"


@dataclass(slots=True)
class TextStream:
    prefix: int = 0
    read: int = 0

    def next(self, tokenizer: Tokenizer, ids: Sequence[int]) -> str:
        """The text that ids[-1] completes (possibly empty)."""
        before = tokenizer.decode(ids[self.prefix:self.read])
        text = tokenizer.decode(ids[self.prefix:])
        if len(text) <= len(before) or text.endswith(_INCOMPLETE):
            return ""
        self.prefix, self.read = self.read, len(ids)
        return text[len(before):]

    def flush(self, tokenizer: Tokenizer, ids: Sequence[int]) -> str:
        """Whatever is still held back (an incomplete character comes out as U+FFFD)."""
        before = tokenizer.decode(ids[self.prefix:self.read])
        text = tokenizer.decode(ids[self.prefix:])
        self.prefix = self.read = len(ids)
        return text[len(before):]
