"""Our tool calling against vLLM 0.33.0's own code (tests/data/vllm_tools_v0_33_0.py, copied
verbatim from the wheel by tests/data/vendor_vllm_tools.py), on the same inputs: the JSON schema
of `tool_choice: "required"` and of a named function, the tool-call `arguments` handed to the
chat template, and the Hermes parser. Each copy's text is checked against the sha256 taken from
the wheel, so a copy cannot drift from vLLM's code without this test failing."""
from __future__ import annotations

import ast
import copy
import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from gateway.http import tools
from gateway.http.errors import ApiError
from tests.data import vllm_tools_v0_33_0 as vllm

VENDORED = Path(vllm.__file__)
# The Hermes parser only checks that it was given a tokenizer (it never reads one).
NO_TOKENIZER = object()

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ADDRESS = {"type": "object", "properties": {"street": {"type": "string"}}}
SHIP = {"type": "object", "properties": {"to": {"$ref": "#/$defs/address"}},
        "$defs": {"address": ADDRESS}}
BILL = {"type": "object", "properties": {"from": {"$ref": "#/$defs/address"}},
        "$defs": {"address": ADDRESS}}
TOOLSETS = {
    "plain": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
              {"type": "function", "function": {"name": "noop"}}],
    "empty parameters": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "shared $defs": [{"type": "function", "function": {"name": "ship", "parameters": SHIP}},
                     {"type": "function", "function": {"name": "bill", "parameters": BILL}}],
}


def _texts(tree: ast.Module, source: str) -> dict[str, str]:
    """name (Class.name for class members) -> its exact text, as the vendoring script takes it."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):  # a class copied whole, too
            out[node.name] = ast.get_source_segment(source, node)
        members = node.body if isinstance(node, ast.ClassDef) else [node]
        prefix = f"{node.name}." if isinstance(node, ast.ClassDef) else ""
        for m in members:
            name = getattr(m, "name", None) or getattr(getattr(m, "target", None), "id", None) \
                or getattr((getattr(m, "targets", None) or [None])[0], "id", None)
            if name:
                out[prefix + name] = " " * m.col_offset + ast.get_source_segment(source, m)
    return out


def test_the_copies_are_the_wheels_text():
    source = VENDORED.read_text()
    texts = _texts(ast.parse(source), source)
    assert len(vllm.VENDORED_SHA256) == 88
    for name, digest in vllm.VENDORED_SHA256.items():
        assert hashlib.sha256(texts[name].encode()).hexdigest() == digest, name
    assert "SPDX-License-Identifier: Apache-2.0" in source.splitlines()[0]


@pytest.mark.parametrize("toolset", TOOLSETS)
@pytest.mark.parametrize("parallel", [None, True, False])
def test_required_schema_is_vllms(toolset, parallel):
    ours_tools = copy.deepcopy(TOOLSETS[toolset])
    theirs = vllm.get_json_schema_from_tools(
        "required", [vllm.ChatCompletionToolsParam(**t) for t in copy.deepcopy(ours_tools)],
        parallel)
    ours = tools.constraint_schema(tools.plan(ours_tools, "required", parallel, None), parallel)
    assert json.dumps(ours) == json.dumps(theirs)  # byte for byte, key order too
    assert ours_tools == TOOLSETS[toolset]  # the request's tools (for the template) untouched


@pytest.mark.parametrize("toolset", TOOLSETS)
def test_named_schema_is_vllms(toolset):
    for t in TOOLSETS[toolset]:
        name = t["function"]["name"]
        choice = {"type": "function", "function": {"name": name}}
        theirs = vllm.get_json_schema_from_tools(
            vllm.ChatCompletionNamedToolChoiceParam(**choice),
            [vllm.ChatCompletionToolsParam(**x) for x in copy.deepcopy(TOOLSETS[toolset])])
        ours = tools.constraint_schema(tools.plan(TOOLSETS[toolset], choice, None, None), None)
        assert json.dumps(ours) == json.dumps(theirs)


def test_conflicting_defs_are_refused_as_vllm_refuses_them():
    other = {**BILL, "$defs": {"address": {"type": "string"}}}
    toolset = [TOOLSETS["shared $defs"][0],
               {"type": "function", "function": {"name": "bill", "parameters": other}}]
    with pytest.raises(vllm.VLLMValidationError) as theirs:
        vllm.get_json_schema_from_tools(
            "required", [vllm.ChatCompletionToolsParam(**t) for t in copy.deepcopy(toolset)])
    with pytest.raises(ApiError) as ours:
        tools.constraint_schema(tools.plan(toolset, "required", None, None), None)
    assert theirs.value.parameter == ours.value.param == "tools"
    assert ours.value.status == 400


ARGUMENTS = ['{"city": "Oslo"}', '{"a": [1, {"b": null}]}', "", None, "not json", "[1, 2]",
             "42", '"text"', {"already": "an object"}, {}, [1]]


@pytest.mark.parametrize("arguments", ARGUMENTS)
def test_template_arguments_are_vllms(arguments):
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    theirs = copy.deepcopy(messages)
    vllm._postprocess_messages(theirs)
    assert tools.template_messages(copy.deepcopy(messages)) == theirs


def test_a_call_not_of_type_function_is_refused_as_vllm_refuses_it():
    messages = [{"role": "assistant", "tool_calls": [{"type": "custom", "function": {}}]}]
    with pytest.raises(vllm.VLLMValidationError) as theirs:
        vllm._postprocess_messages(copy.deepcopy(messages))
    with pytest.raises(ApiError) as ours:
        tools.template_messages(messages)
    assert theirs.value.parameter == ours.value.param == "tool_calls"


OUTPUTS = [
    "no call at all",
    'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>\n'
    '<tool_call>{"name": "noop", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "noop", "arguments": {}}</tool_call>',
    '  <tool_call>{"name": "f", "arguments": {"x": "é"}}',  # unclosed, the output cut
    '<tool_call>{"name": "f", "arguments": "already text"}</tool_call>',
    '<tool_call>{"name": "f"}</tool_call>',  # no arguments
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    "<tool_call>{not json</tool_call>",
    '<tool_call>{"name": "a", "arguments": {}}</tool_call> tail <tool_call>[1]</tool_call>',
]


@pytest.mark.parametrize("output", OUTPUTS)
def test_hermes_parser_is_vllms(output):
    theirs = vllm.Hermes2ProToolParser(NO_TOKENIZER).extract_tool_calls(output, None)
    content, calls = tools.hermes(output)
    assert content == theirs.content
    assert [(c.name, c.arguments) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in theirs.tool_calls]


@pytest.mark.parametrize("output", [*OUTPUTS, "", " \n ",
                                    ' \n <tool_call>{"name": "f", "arguments": {}}'])
def test_auto_answers_as_vllms_serving_layer(output):
    """The whole answer of `auto` with vLLM's Hermes parser: its serving layer
    (DelegatingParser._extract_tool_calls, with --enable-auto-tool-choice) runs the parser and
    drops content that is only whitespace before calls."""
    parser = object.__new__(vllm.DelegatingParser)
    parser._tool_parser, parser._engine_based = vllm.Hermes2ProToolParser(NO_TOKENIZER), False
    request = SimpleNamespace(tool_choice="auto")
    calls, content = parser._extract_tool_calls(output, request, enable_auto_tools=True)
    auto = tools.plan(TOOLSETS["plain"], "auto", None, "... <tool_call> ...")  # Hermes parser
    ours_content, ours = tools.parse(auto, output)
    assert ours_content == content
    assert [(c.name, c.arguments) for c in ours] == [(c.name, c.arguments) for c in calls or []]
