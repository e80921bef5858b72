"""Tool calling at the HTTP API, as vLLM 0.33 serves it (each point marked "vLLM's" is compared
with vLLM's own code in tests/gateway/test_http_tools_vllm.py).

- `tools` go to the model's chat template (transformers' `apply_chat_template(tools=...)`), and
  so do the messages of a tool conversation: role `tool` (with `tool_call_id`) and assistant
  turns with `tool_calls`, whose `arguments` (a JSON string in OpenAI's API) are handed to the
  template as an object (vLLM's `_postprocess_messages`; templates write them with `tojson`).
- `tool_choice`: `none` (no calls parsed), `auto` (the default with tools: the model decides, its
  output parsed by the family's parser), `required` and a named function, both enforced by the
  structured-output engine: `required` by a JSON schema of a list of {name, parameters} (vLLM's
  `get_json_schema_from_tools`), a named function by its parameters' schema (the whole output is
  the arguments). vLLM does so for parsers without a structural tag; its Hermes parser, at its
  defaults, constrains to Hermes blocks instead (docs/structured_output.md, "Tools").
- The parser of `auto` is chosen by the chat template: one that writes `<tool_call>` (Hermes,
  Qwen2.5/Qwen3, SmolLM3, ...) gets the Hermes parser (vLLM's `Hermes2ProToolParser`); a
  template without tool support (e.g. SmolLM2-135M-Instruct's ChatML) gets none: `auto` then
  returns the text as content. Here we differ from vLLM, which has no parser unless started
  with `--tool-call-parser` and then refuses `auto` (and `required`, named) with a 400.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from gateway.http.errors import bad_request

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)  # vLLM's


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
    the choice are malformed (vLLM's checks and fields: tests/gateway/test_http_requests_vllm.py)."""
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
    if isinstance(choice, dict):  # each refusal names vLLM's field (its check_tool_usage)
        usage = 'a named choice is {"type": "function", "function": {"name": "..."}}'
        fn = choice.get("function")
        if not isinstance(fn, dict):
            raise bad_request("tool_choice.function", usage)
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("tool_choice.function.name", usage)
        if choice.get("type", "function") != "function":
            raise bad_request("tool_choice", usage)
        if name not in names:
            raise bad_request("tool_choice", f"{json.dumps(name)[:80]} is not one of the tools")
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
    """The JSON schema that enforces `required` or a named choice (None otherwise): vLLM's
    (tests/gateway/test_http_tools_vllm.py compares them), with the tools' `$defs` gathered at
    the top of the `required` list's schema, where their `#/$defs/...` references point."""
    if p.mode == "named":
        tool = next(t for t in p.tools if t["function"]["name"] == p.name)
        return _parameters(tool)
    if p.mode != "required":
        return None
    params = [dict(_parameters(t)) for t in p.tools]  # copies: `$defs` moves out of them
    defs: dict[str, Any] = {}
    for i, schema in enumerate(params):
        for name, definition in _tool_defs(i, schema.pop("$defs", {})).items():
            if defs.setdefault(name, definition) != definition:
                raise bad_request("tools", f"$defs {json.dumps(name)[:80]} has two different "
                                  "schemas in the tools")
    items = {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                        "parameters": schema},
         "required": ["name", "parameters"]} for t, schema in zip(p.tools, params)]}
    out = {"type": "array", "minItems": 1, "items": items}
    if parallel is False:
        out["maxItems"] = 1
    if defs:
        out["$defs"] = defs
    return out


def _tool_defs(i: int, defs: Any) -> dict[str, Any]:
    if not isinstance(defs, dict):
        raise bad_request(f"tools[{i}].function.parameters.$defs", "must be an object")
    return defs


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
    if p.mode == "auto" and p.parser == "hermes":
        content, calls = hermes(text)
        if calls and content is not None and not content.strip():
            content = None  # vLLM's serving layer (DelegatingParser._extract_tool_calls) too
        return content, calls
    return text, []


def hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """vLLM's Hermes parser (`Hermes2ProToolParser.extract_tool_calls`, compared in
    tests/gateway/test_http_tools_vllm.py): the text before the first `<tool_call>` is the
    content, as it is (None when empty; `parse` also drops whitespace, as vLLM's serving layer);
    each block (the last may be unclosed) is JSON with a string `name` and an `arguments`
    value, which becomes JSON text. A block that is not such
    JSON leaves the whole output as content (the model did not make a call we can report)."""
    if HERMES_OPEN not in text:
        return text, []
    calls = []
    for closed, unclosed in _HERMES_BLOCK.findall(text):
        try:
            obj = json.loads(closed or unclosed)
            name, args = obj["name"], obj["arguments"]
        except (ValueError, KeyError, TypeError):
            return text, []
        if not isinstance(name, str):
            return text, []
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False), call_id()))
    return text[:text.index(HERMES_OPEN)] or None, calls


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages for the chat template, as vLLM's `_postprocess_messages` makes them: an
    assistant turn's tool-call `arguments` (JSON text in OpenAI's API) become an object, and
    `{}` when they are empty, not JSON or not a JSON object (a bad turn in the history must
    not make every later turn fail). A call that is not of type `function` is a 400."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and calls:
            m = {**m, "tool_calls": [_template_call(c) for c in calls]}
        out.append(m)
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(fn, dict):
        raise bad_request("tool_calls", "assistant tool_calls must be of type function, "
                          'with a "function" object')
    args = fn.get("arguments")
    if isinstance(args, str) and args:
        try:
            args = json.loads(args)
        except ValueError:
            args = None
    return {**call, "function": {**fn, "arguments": args if isinstance(args, dict) else {}}}
