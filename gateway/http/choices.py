"""One choice of a response, whole (`Choices.whole`) or as a streamed chunk (`Choices.chunk`):
its text (after the echoed prompt, for /v1/completions with `echo`), finish reason and the
logprobs it asked for (logprobs.py), in OpenAI's chat or completions shape."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.http import logprobs as lp
from gateway.http import schemas


@dataclass(slots=True)
class Choices:
    chat: bool
    # Top logprobs per token (0: the sampled token's only); None: no logprobs.
    logprobs: int | None = None
    name: Callable[[int], str] = field(default=lambda t: f"token_id:{t}")
    # The text of each prompt of the batch, echoed before its choices' text (completions).
    echo: Sequence[str] | None = None
    # Characters of each choice already streamed (the completions' text_offset).
    _sent: dict[int, int] = field(default_factory=dict)

    def prefix(self, sample) -> str:
        return self.echo[sample.job.prompt] if self.echo is not None else ""

    def whole(self, sample) -> dict[str, Any]:
        prefix = self.prefix(sample)
        text = prefix + "".join(sample.text)
        if self.chat:
            return schemas.chat_choice(sample.index, text, sample.finish,
                                       self._chat(sample.logprobs))
        return schemas.completion_choice(sample.index, text, sample.finish,
                                         self._completion(sample.logprobs, len(prefix)))

    def chunk(self, sample, delta: str, finish: str | None) -> dict[str, Any] | None:
        """The chunk of a message's delta, or None when it carries nothing."""
        entries = sample.fresh if self.logprobs is not None else []
        if not delta and finish is None and not entries:
            return None
        if self.chat:
            return schemas.chat_delta(sample.index, {"content": delta} if delta else {}, finish,
                                      self._chat(entries))
        offset = self._sent.get(sample.index, 0)
        self._sent[sample.index] = offset + len(delta)
        return schemas.completion_choice(sample.index, delta, finish,
                                         self._completion(entries, offset))

    def opening(self, sample) -> dict[str, Any] | None:
        """The first chunk of a streamed choice: the chat's role, or the echoed prompt."""
        if self.chat:
            return schemas.chat_delta(sample.index, {"role": "assistant", "content": ""}, None)
        prefix = self.prefix(sample)
        if not prefix:
            return None
        self._sent[sample.index] = len(prefix)
        return schemas.completion_choice(sample.index, prefix, None)

    def _chat(self, entries) -> list[dict[str, Any]] | None:
        return None if self.logprobs is None else lp.chat_content(entries, self.name)

    def _completion(self, entries, offset: int) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        return lp.completion(entries, self.name, offset, tops=self.logprobs > 0)
