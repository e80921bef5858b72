"""Tool calling at the HTTP API, as vLLM serves it.

- `tools` go to the model's chat template (transformers' `apply_chat_template(tools=...)`), and
  so do the messages of a tool conversation: role `tool` (with `tool_call_id`) and assistant
  turns with `tool_calls`, whose `arguments` (a JSON string in OpenAI's API) are handed to the
  template as an object, as vLLM does (templates write them with `tojson`).
- `tool_choice`: `none` (no calls parsed), `auto` (the default with tools: the model decides, its
  output parsed by the family's parser), `required` and a named function, both enforced by the
  structured-output engine: `required` by a JSON schema of a list of {name, parameters} (vLLM's
  `_get_json_schema_from_tool`), a named function by its parameters' schema (the whole output is
  the arguments).
- The parser of `auto` is chosen by the chat template: one that writes `<tool_call>` (Hermes,
  Qwen2.5/Qwen3, SmolLM3, ...) gets the Hermes parser (`<tool_call>{"name": ..., "arguments":
  ...}</tool_call>` blocks); a template without tool support (e.g. SmolLM2-135M-Instruct's
  ChatML) gets none: `auto` then returns the text as content, as vLLM does without a parser.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from gateway.http.errors import bad_request

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one request treats tools: `mode` is none, auto, required or named (`name` set)."""
    mode: str
    tools: list[dict[str, Any]]
    name: str | None = None
    parser: str | None = None  # "hermes" or None (auto without a parser: plain content)

    @property
    def calls_tools(self) -> bool:
        return self.mode in ("required", "named") or (self.mode == "auto"
                                                      and self.parser is not None)


def plan(tools: list[dict[str, Any]] | None, choice: Any, parallel: bool | None,
         template: str | None) -> ToolPlan | None:
    """The request's tool handling (None without tools); 400 naming the field when the tools or
    the choice are malformed (vLLM's checks)."""
    if tools is None:
        if choice not in (None, "none"):
            raise bad_request("tool_choice", "needs tools")
        return None
    if not tools:
        raise bad_request("tools", "must not be empty; omit it for no tools")
    names = [_check_tool(i, t) for i, t in enumerate(tools)]
    if choice is None:
        choice = "auto"
    parser = "hermes" if template is not None and HERMES_OPEN in template else None
    if choice in ("none", "auto", "required"):
        return ToolPlan(choice, tools, parser=parser)
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str) or not name:
            raise bad_request("tool_choice", 'a named choice is {"type": "function", '
                              '"function": {"name": "..."}}')
        if name not in names:
            raise bad_request("tool_choice.function.name", f"{json.dumps(name)[:80]} is not "
                              "one of the tools")
        return ToolPlan("named", tools, name=name, parser=parser)
    raise bad_request("tool_choice", 'must be "none", "auto", "required" or a named function')


def _check_tool(i: int, tool: Any) -> str:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise bad_request(f"tools[{i}].type", "only function tools are supported")
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad_request(f"tools[{i}].function.name", "is required (a non-empty string)")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad_request(f"tools[{i}].function.parameters", "must be a JSON Schema object")
    return fn["name"]


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def constraint_schema(p: ToolPlan, parallel: bool | None) -> dict[str, Any] | None:
    """The JSON schema that enforces `required` or a named choice (None otherwise)."""
    if p.mode == "named":
        tool = next(t for t in p.tools if t["function"]["name"] == p.name)
        return _parameters(tool)
    if p.mode != "required":
        return None
    items = {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                        "parameters": _parameters(t)},
         "required": ["name", "parameters"]} for t in p.tools]}
    schema = {"type": "array", "minItems": 1, "items": items}
    if parallel is False:
        schema["maxItems"] = 1
    return schema


def parse(p: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished output."""
    if p.mode == "named":
        return None, [ToolCall(p.name, text, call_id())]
    if p.mode == "required":
        try:
            calls = json.loads(text)
        except ValueError:  # cut by max_tokens: no call to report
            return text, []
        return None, [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False),
                               call_id()) for c in calls]
    if p.mode == "auto" and p.parser == "hermes" and HERMES_OPEN in text:
        return hermes(text)
    return text, []


def hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """vLLM's Hermes parser: the text before the first `<tool_call>` is content; each block's
    JSON {"name", "arguments"} is a call. A block that is not such JSON leaves the whole output
    as content (the model did not make a call we can report)."""
    content = text[:text.index(HERMES_OPEN)].strip() or None
    calls = []
    for block in _HERMES_BLOCK.findall(text):
        try:
            obj = json.loads(block.strip())
            name, args = obj["name"], obj.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            return text, []
        if not isinstance(name, str):
            return text, []
        calls.append(ToolCall(name, args if isinstance(args, str)
                              else json.dumps(args, ensure_ascii=False), call_id()))
    return content, calls


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant `tool_calls` with their `arguments` parsed to objects, for the template."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_template_call(c) for c in calls]}
        out.append(m)
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args)
        except ValueError:
            pass  # left as the text the client sent
    return {**call, "function": fn}
