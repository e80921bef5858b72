"""One choice of a response, whole (`Choices.whole`) or as a streamed chunk (`Choices.chunk`):
its text (after the echoed prompt, for /v1/completions with `echo`), finish reason and the
logprobs it asked for (logprobs.py), in OpenAI's chat or completions shape. A chat whose
`tool_plan` calls tools (tools.py) parses each whole choice's text into tool calls, and streams
each choice through a ToolStream (tool_stream.py)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.http import logprobs as lp
from gateway.http import schemas, tools
from gateway.http.tool_stream import ToolStream
from gateway.http.tools import ToolPlan


@dataclass(slots=True)
class Choices:
    chat: bool
    # Top logprobs per token (0: the sampled token's only); None: no logprobs.
    logprobs: int | None = None
    name: lp.TokenNames = field(default_factory=lambda: lp.TokenNames(None))
    # The text of each prompt of the batch, echoed before its choices' text (completions).
    echo: Sequence[str] | None = None
    # How a chat's text becomes tool calls; None (or one that calls none): plain content.
    tool_plan: ToolPlan | None = None
    # Characters of each choice already streamed (the completions' text_offset).
    _sent: dict[int, int] = field(default_factory=dict)
    # Each streamed choice's ToolStream, made at its first text.
    _tools: dict[int, ToolStream] = field(default_factory=dict)

    @property
    def calls_tools(self) -> bool:
        return self.chat and self.tool_plan is not None and self.tool_plan.calls_tools

    def prefix(self, sample) -> str:
        return self.echo[sample.job.prompt] if self.echo is not None else ""

    def whole(self, sample) -> dict[str, Any]:
        prefix = self.prefix(sample)
        text = prefix + "".join(sample.text)
        if self.calls_tools:
            content, calls = tools.parse(self.tool_plan, text)
            return schemas.chat_choice(sample.index, content, sample.finish,
                                       self._chat(sample.logprobs),
                                       [c.as_dict() for c in calls])
        if self.chat:
            return schemas.chat_choice(sample.index, text, sample.finish,
                                       self._chat(sample.logprobs))
        return schemas.completion_choice(sample.index, text, sample.finish,
                                         self._completion(sample.logprobs, len(prefix)))

    def chunks(self, sample, delta: str, finished: bool) -> list[dict[str, Any]]:
        """The chunks (one choice each) of a message's next delta; none when it carries
        nothing."""
        if self.calls_tools:
            return self._tool_chunks(sample, delta, finished)
        choice = self.chunk(sample, delta, sample.finish if finished else None)
        return [] if choice is None else [choice]

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

    def _tool_chunks(self, sample, delta: str, finished: bool) -> list[dict[str, Any]]:
        """The chunks a tool-calling choice's next text makes; the step's logprobs ride on the
        first of them."""
        stream = self._tools.setdefault(sample.index, ToolStream(self.tool_plan))
        entries = sample.fresh if self.logprobs is not None else []
        deltas = stream.feed(delta) if delta else []
        finish = None
        if finished:
            more, finish = stream.finish(sample.finish)
            deltas += more
        if not deltas:
            if not finished and not entries:
                return []
            deltas = [{}]
        last = len(deltas) - 1
        return [schemas.chat_delta(sample.index, d, finish if k == last else None,
                                   self._chat(entries) if k == 0 and entries else None)
                for k, d in enumerate(deltas)]
