"""Tool calling and structured output at the gateway, without workers: the plan a request's
tools and tool_choice make (and its 400s), the JSON schema that enforces `required` and named
choices, the Hermes parser, the streamed deltas of each mode, and the structured-output
field checks."""
from __future__ import annotations

import json

import jsonschema
import pytest

from gateway.http import structured, tools
from gateway.http.errors import ApiError
from gateway.http.tool_stream import ToolStream

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "noop"}}]
HERMES_TEMPLATE = "{% for m in messages %}...<tool_call>...{% endfor %}"
# HuggingFaceTB/SmolLM2-135M-Instruct's chat template (tokenizer_config.json, Apache-2.0), the
# demo model's: ChatML that ignores `tools`.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}")


def param_of(call) -> str:
    with pytest.raises(ApiError) as err:
        call()
    assert err.value.status == 400
    return err.value.param


def test_plans_and_their_refusals():
    assert tools.plan(None, None, None, None) is None
    p = tools.plan(TOOLS, None, None, HERMES_TEMPLATE)
    assert p.mode == "auto" and p.parser == "hermes" and p.calls_tools
    # SmolLM2's template knows no tools: no parser, `auto` answers with content (vLLM would
    # refuse `auto` without --tool-call-parser); required and named still call through the grammar.
    assert not tools.plan(TOOLS, "auto", None, SMOLLM2_TEMPLATE).calls_tools
    assert tools.plan(TOOLS, "required", None, SMOLLM2_TEMPLATE).calls_tools
    assert not tools.plan(TOOLS, "none", None, HERMES_TEMPLATE).calls_tools
    assert tools.plan(TOOLS, {"type": "function", "function": {"name": "noop"}}, None,
                      None).name == "noop"
    assert param_of(lambda: tools.plan(None, "required", None, None)) == "tool_choice"
    assert param_of(lambda: tools.plan([], None, None, None)) == "tools"
    assert param_of(lambda: tools.plan([{"type": "function", "function": {}}], None, None,
                                       None)) == "tools[0].function.name"
    assert param_of(lambda: tools.plan(TOOLS, {"type": "function", "function": {
        "name": "missing"}}, None, None)) == "tool_choice"


def test_required_schema_accepts_calls_of_the_tools_only():
    p = tools.plan(TOOLS, "required", None, None)
    schema = tools.constraint_schema(p, None)
    good = [{"name": "get_weather", "parameters": {"city": "Oslo"}},
            {"name": "noop", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}],
                [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert tools.constraint_schema(p, False)["maxItems"] == 1
    content, calls = tools.parse(p, json.dumps(good))
    assert content is None and [c.name for c in calls] == ["get_weather", "noop"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}


def test_hermes_parser():
    text = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n' \
           '</tool_call>\n<tool_call>{"name": "noop", "arguments": {}}</tool_call>'
    content, calls = tools.hermes(text)
    assert content == "Sure. " and [c.name for c in calls] == ["get_weather", "noop"]
    assert json.loads(calls[0].arguments) == {"city": "Lima"}
    assert tools.hermes("<tool_call>{not json</tool_call>") == ("<tool_call>{not json"
                                                                "</tool_call>", [])


def run(stream: ToolStream, pieces: list[str]):
    deltas = [d for p in pieces for d in stream.feed(p)]
    last, finish = stream.finish("stop")
    return deltas + last, finish


def test_streams_named_live_and_auto_content_before_the_tag():
    named = tools.plan(TOOLS, {"type": "function", "function": {"name": "get_weather"}},
                       None, None)
    deltas, finish = run(ToolStream(named), ['{"ci', 'ty": ', '"Rome"}'])
    assert finish == "tool_calls"
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == \
        '{"city": "Rome"}' and len(deltas) == 4
    auto = tools.plan(TOOLS, "auto", None, HERMES_TEMPLATE)
    deltas, finish = run(ToolStream(auto), ["Hi <", "tool", '_call>{"name": "noop", ',
                                            '"arguments": {}}</tool_call>'])
    assert deltas[0] == {"content": "Hi "} and finish == "tool_calls"
    assert deltas[1]["tool_calls"][0]["function"]["name"] == "noop"
    deltas, finish = run(ToolStream(auto), ["a <to", "ol> b"])  # not the tag after all
    assert "".join(d["content"] for d in deltas) == "a <tool> b" and finish == "stop"


@pytest.mark.parametrize("fmt,so,param", [
    ({"type": "json_schema"}, None, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}, None,
     "response_format.json_schema.schema"),
    ({"type": "xml"}, None, "response_format.type"),
    (None, {"json": "{bad"}, "structured_outputs.json"),
    (None, {"choice": []}, "structured_outputs.choice"),
    (None, {}, "structured_outputs"),
    (None, {"regex": "a", "whitespace_pattern": " "}, "structured_outputs.whitespace_pattern"),
    (None, {"regexp": "a"}, "structured_outputs.regexp"),
    ({"type": "json_object"}, {"regex": "a"}, "structured_outputs"),
])
def test_structured_output_fields_are_checked_by_name(fmt, so, param):
    assert param_of(lambda: structured.from_request(fmt, so)) == param


def test_structured_output_messages():
    assert structured.from_request({"type": "text"}, None) is None
    s = structured.from_request({"type": "json_schema", "json_schema": {"name": "w",
                                                                        "schema": WEATHER}}, None)
    assert json.loads(s.message.json_schema) == WEATHER
    s = structured.from_request(None, {"choice": ["a", "b"]})
    assert list(s.message.choice.values) == ["a", "b"] and s.field == "structured_outputs.choice"
    assert structured.http_field("sampling.structured_output.regex: invalid (x)", s) == (
        "structured_outputs.choice", "invalid (x)")
