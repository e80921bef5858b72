"""Streamed tool calls: one choice's text deltas turned into chat deltas as OpenAI streams them.
Each call opens with a delta carrying its `index`, `id`, `type` and `function.name` (arguments
""), then `function.arguments` fragments follow under the same index; the choice's last chunk
has finish_reason "tool_calls".

- A named tool choice streams live: the whole output is the arguments (the grammar makes it
  so), so each text delta is an arguments fragment of call 0.
- `required`: the output is a JSON list of calls (tools.constraint_schema), reported when it
  is complete (a list cannot be split into calls before it is parsed).
- `auto` with the Hermes parser: text before `<tool_call>` streams as content, holding back a
  tail that could be the tag's start; from the tag on, the calls are reported at the end (so a
  block that turns out not to be a call is sent as content, not lost).
"""
from __future__ import annotations

from typing import Any

from gateway.http import tools
from gateway.http.tools import HERMES_OPEN, ToolCall, ToolPlan


class ToolStream:
    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self._text = ""
        self._sent = 0  # characters of _text sent as content
        self._in_calls = False  # auto: the tag was seen; the rest is held for the parser
        self._opened = False  # named: call 0's opening delta was sent
        self._id = tools.call_id()

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas `text` (the next piece of the output) makes visible now."""
        self._text += text
        if self.plan.mode == "named":
            out = self._open_named()
            if text:
                out.append(_args(0, text))
            return out
        if self.plan.mode != "auto" or self._in_calls:
            return []
        at = self._text.find(HERMES_OPEN, max(0, self._sent - len(HERMES_OPEN)))
        if at >= 0:
            self._in_calls = True
            return self._content(at)
        return self._content(len(self._text) - _held(self._text))

    def finish(self, reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """(the last deltas, the finish_reason) when the choice ended with `reason`."""
        if self.plan.mode == "named":
            return self._open_named(), _calls_reason(reason)
        if self.plan.mode == "required" or self._in_calls:
            # auto: the content before the tag has streamed already.
            _, calls = tools.parse(self.plan, self._text)
            if calls:
                return _call_deltas(calls), _calls_reason(reason)
        return self._content(len(self._text)), reason

    def _open_named(self) -> list[dict[str, Any]]:
        if self._opened:
            return []
        self._opened = True
        return [_opening(0, ToolCall(self.plan.name or "", "", self._id))]

    def _content(self, upto: int) -> list[dict[str, Any]]:
        piece, self._sent = self._text[self._sent:upto], max(self._sent, upto)
        return [{"content": piece}] if piece else []


def _held(text: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of the Hermes tag."""
    for k in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
        if HERMES_OPEN.startswith(text[-k:]):
            return k
    return 0


def _calls_reason(reason: str | None) -> str | None:
    return "tool_calls" if reason == "stop" else reason


def _opening(index: int, call: ToolCall) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": ""}}]}


def _args(index: int, fragment: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}


def _call_deltas(calls: list[ToolCall]) -> list[dict[str, Any]]:
    out = []
    for i, call in enumerate(calls):
        out.append(_opening(i, call))
        out.append(_args(i, call.arguments))
    return out
